"""What one sampler call returns: :class:`SequenceResult` per prompt, :class:`GenerationStats`, and the
:class:`GenerationOutput` holding both."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch


@dataclass
class SequenceResult:
    """One generated sequence.

    Attributes:
        text: the generated text; without the stop token, cut before a matched stop string.
        token_ids: every generated token, the final stop token included (so ``len(token_ids) == len(logprobs)``).
        stop_reason: ``eos`` (a stop token), ``stop_string`` (a stop string or stop sequence) or ``length``.
        logprobs: per step, log-probability (nats) of the chosen token under the distribution it was
            chosen from (the softmax of the processed scores).
        entropies: per step, entropy (nats) of that distribution.
        prompt_tokens: tokens of the prompt (padding excluded).
    """

    text: str
    token_ids: List[int]
    stop_reason: str
    logprobs: List[float]
    entropies: List[float]
    prompt_tokens: int


@dataclass
class GenerationStats:
    """Speed and memory of one call. ``prefill_s`` is the prompt forward; ``decode_s`` everything after it.

    ``decode_tokens`` counts tokens chosen from decode-step logits (each row's first token comes from the
    prefill logits and is not counted).
    """

    batch_size: int
    prompt_tokens: int
    generated_tokens: int
    decode_tokens: int
    prefill_s: float
    decode_s: float
    kv_cache_bytes: int
    steps: int

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class GenerationOutput:
    """Result of one call: ``sequences`` in prompt order, ``stats`` and, when asked for, ``logits``
    (per step ``[batch, vocab]`` fp32 raw next-token logits, before any processor)."""

    sequences: List[SequenceResult]
    stats: GenerationStats
    logits: Optional[List[torch.Tensor]] = field(default=None, repr=False)
