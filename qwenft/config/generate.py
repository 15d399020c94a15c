"""The ``generate`` section: the sampler's settings and the decoding engine's (a ``conf/generate`` preset is one
of these)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

from qwenft.config.base import _check, _check_choice


@dataclass
class GenerateConfig:
    """Sampler settings. ``null`` means: take the value from the model's generation_config."""

    max_new_tokens: int = 256
    min_new_tokens: int = 0
    do_sample: Optional[bool] = None
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    stop_strings: List[str] = field(default_factory=list)
    stop_token_ids: Optional[List[int]] = None
    stop_sequences: List[List[int]] = field(default_factory=list)
    seed: Optional[int] = None
    batch_size: int = 8
    # The decoding engine (eval uses these too; its sampling settings come from the eval.generate preset).
    # static_cache: a transformers StaticCache of a bucketed length (fixed shapes; works anywhere).
    # compile: static cache + torch.compile of the decode step with CUDA graphs; auto = on CUDA when the base runs
    # in 16-bit (dequantized NF4 or quant=none), true = on CUDA always, false = never. Batch and cache length are
    # padded to a few sizes, so an evaluation compiles at most 3 times (qwenft.generation.batches).
    # fold_lora: fold the LoRA delta into the 16-bit base weights in memory for the tuned side (peft's merge
    # arithmetic, nothing written; qwenft.model.fold); auto = on CUDA when the base runs in 16-bit.
    static_cache: bool = False
    compile: str = "auto"
    fold_lora: str = "auto"

    def __post_init__(self) -> None:
        for name in ("compile", "fold_lora"):  # `generate.compile=true` arrives as a bool, or as "True" via a str node
            value = getattr(self, name)
            setattr(self, name, str(value).lower() if isinstance(value, (bool, str)) else value)
            _check_choice(f"generate.{name}", getattr(self, name), ("auto", "true", "false"))
        _check(self.max_new_tokens >= 1, "generate.max_new_tokens", self.max_new_tokens, "must be >= 1")
        _check(0 <= self.min_new_tokens <= self.max_new_tokens, "generate.min_new_tokens", self.min_new_tokens,
               "must be in [0, generate.max_new_tokens]")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            _check(value is None or math.isfinite(value), f"generate.{name}", value, "must be a finite number")
        _check(self.temperature is None or self.temperature >= 0, "generate.temperature", self.temperature,
               "must be >= 0 (0 means greedy)")
        _check(self.top_k is None or self.top_k >= 0, "generate.top_k", self.top_k, "must be >= 0 (0 disables)")
        _check(self.top_p is None or 0 < self.top_p <= 1, "generate.top_p", self.top_p, "must be in (0, 1]")
        _check(self.min_p is None or 0 <= self.min_p <= 1, "generate.min_p", self.min_p, "must be in [0, 1]")
        _check(self.repetition_penalty is None or self.repetition_penalty > 0, "generate.repetition_penalty",
               self.repetition_penalty, "must be > 0 (1.0 disables)")
        _check(self.batch_size >= 1, "generate.batch_size", self.batch_size, "must be >= 1")
        _check(all(len(seq) > 0 for seq in self.stop_sequences), "generate.stop_sequences", self.stop_sequences,
               "each stop sequence must list at least one token id")
        _check(self.stop_token_ids is None or all(t >= 0 for t in self.stop_token_ids), "generate.stop_token_ids",
               self.stop_token_ids, "token ids must be >= 0")
