"""What one sampler call returns: :class:`SequenceResult` per prompt, :class:`GenerationStats`, and the
:class:`GenerationOutput` holding both."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Tuple

import torch


@dataclass
class SequenceResult:
    """One generated sequence.

    Attributes:
        text: the generated text; without the stop token, cut before a matched stop string.
        token_ids: every generated token, the final stop token included (so ``len(token_ids) == len(logprobs)``).
        stop_reason: ``eos`` (a stop token), ``stop_string`` (a stop string or stop sequence), ``length`` or
            ``cancelled`` (its :class:`RowControl` ended it).
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


class RowControl:
    """What a caller steers per row of one sampler call (the server's batches: requests with their own
    ``max_tokens`` share a batch, and a client that leaves stops its row). This base class changes nothing.

    Attributes:
        logprobs: -1: no raw log-probabilities; k >= 0: every token comes with its log-probability under the
            model's raw distribution (``log_softmax`` of the fp32 logits, before any processor) and the k most
            likely tokens' (:func:`qwenft.generation.sampling.raw_logprobs`).
    """

    logprobs: int = -1

    def token(self, row: int, token: int, entropy: float,
              logprobs: Optional[Tuple[float, Sequence[Tuple[int, float]]]]) -> None:
        """Called once per generated token of ``row`` (stop tokens included), before its text is pushed.

        Args:
            entropy: of the distribution it was chosen from (nats).
            logprobs: ``(its raw logprob, [(id, raw logprob)] of the k most likely)`` when ``logprobs >= 0``.
        """

    def finish(self, row: int, generated: int) -> Optional[str]:
        """After ``row``'s ``generated``-th token (and no stop): a stop reason to end the row now (``length``,
        ``cancelled``), or None to go on."""
        return None


class TextStream:
    """Iterator over one prompt's text deltas; ``result`` (a :class:`SequenceResult`) and ``stats`` are set
    once the iteration is over."""

    def __init__(self, run):
        self._run = run
        self.output: Optional[GenerationOutput] = None

    def __iter__(self) -> Iterator[str]:
        while True:
            try:
                _, delta = next(self._run)
            except StopIteration as done:
                self.output = done.value
                return
            yield delta

    @property
    def result(self) -> SequenceResult:
        if self.output is None:
            raise RuntimeError("iterate the stream to the end before reading its result")
        return self.output.sequences[0]

    @property
    def stats(self) -> GenerationStats:
        if self.output is None:
            raise RuntimeError("iterate the stream to the end before reading its stats")
        return self.output.stats
