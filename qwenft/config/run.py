"""Config sections of a run (``train``, ``generate``, ``eval``, ``inspect``, ``plan``, ``wandb``, ``dist``; ``merge``
in :mod:`qwenft.config.export`, ``serve`` in :mod:`qwenft.config.serve`) and :class:`Config`, the whole validated config."""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from qwenft.config.base import COMMANDS, ConfigError, _check, _check_choice
from qwenft.config.data import DataConfig
from qwenft.config.export import MergeConfig
from qwenft.config.gates import check_gate_names, check_gate_values
from qwenft.config.model import LoraConfig, ModelConfig, QuantConfig
from qwenft.config.serve import ServeConfig


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


@dataclass
class EvalConfig:
    """Evaluation after training (and ``qwenft eval``): perplexity and generation metrics."""

    after_train: bool = True
    ppl_sources: List[str] = field(default_factory=list)
    ppl_window: int = 1024
    ppl_stride: int = 512
    ppl_max_tokens: int = 4096
    # Prompts per generation batch (and windows per perplexity batch): a number, or auto = sized from the KV-cache
    # and logits bytes for the free GPU memory on CUDA (qwenft.generation.engine.auto_batch_sizes), 8 on a CPU.
    batch_size: Any = "auto"
    max_eval_prompts: int = 50
    metrics: List[str] = field(default_factory=lambda: ["exact_match_number", "char_f1", "rouge_l"])
    generate: str = "precise"
    max_new_tokens: Optional[int] = None
    samples_in_report: int = 5
    # Benchmarks (qwenft.evaluate.bench): lm-evaluation-harness tasks scored base vs tuned in the same process.
    # Built in and offline: mmlu, ceval (5-shot, the answer letter's log-likelihood), gsm8k (5-shot, greedy, final
    # number), read from the first directory of bench_data (then of $QWENFT_BENCH_DATA) holding NAME/: qwenft ships
    # no benchmark data. bench_missing: error (refuse the run) or skip (warn, say so in report.md) when none holds it.
    # Any other lm-eval task name loads its own data (online), and bench_tasks=DIR adds a directory of task YAMLs.
    benchmarks: List[str] = field(default_factory=list)
    bench_data: List[str] = field(default_factory=list)
    bench_missing: str = "error"
    bench_tasks: Optional[str] = None
    bench_limit: Optional[int] = None   # questions per benchmark, sampled across subjects (seeded), same both sides
    bench_subtasks: Optional[int] = None  # draw the questions from this many subtasks (subjects; seeded) at most:
    # a subject's 5 shots are computed once for all its questions, so fewer subjects cost less per question
    bench_seed: int = 0
    bench_chat_template: bool = False   # render benchmark prompts through the chat template (lm-eval's option)
    bench_max_gen_tokens: Optional[int] = None  # cap on generated tokens for generative tasks (null: the task's)
    # The verdict (qwenft.evaluate.verdict): gates per source / benchmark / retention, e.g.
    # {domain: {metric: contains_fact, min_delta: 0.2}, retention: {max_drop: 0.02}}; fail_on_gate: exit 3 after
    # writing everything when a gate fails. A held-out row is right when its primary metric is 1 (contains_fact,
    # exact_match_number) or >= correct_threshold (char_f1, rouge_l).
    gates: Dict[str, Any] = field(default_factory=dict)
    fail_on_gate: bool = False
    correct_threshold: float = 0.5

    def __post_init__(self) -> None:
        _check(self.bench_limit is None or self.bench_limit >= 1, "eval.bench_limit", self.bench_limit,
               "must be null (every question) or >= 1")
        _check(self.bench_subtasks is None or self.bench_subtasks >= 1, "eval.bench_subtasks", self.bench_subtasks,
               "must be null (every subtask) or >= 1")
        _check(self.bench_max_gen_tokens is None or self.bench_max_gen_tokens >= 1, "eval.bench_max_gen_tokens",
               self.bench_max_gen_tokens, "must be null (the task's) or >= 1")
        _check_choice("eval.bench_missing", self.bench_missing, ("error", "skip"))
        _check(0.0 <= self.correct_threshold <= 1.0, "eval.correct_threshold", self.correct_threshold,
               "must be in [0, 1]")
        check_gate_values(self.gates)
        for name in self.metrics:
            _check_choice("eval.metrics", name, ("exact_match_number", "char_f1", "rouge_l", "contains_fact"))
        _check(self.max_new_tokens is None or self.max_new_tokens >= 1, "eval.max_new_tokens", self.max_new_tokens,
               "must be null (the preset's) or >= 1")
        _check(self.ppl_max_tokens >= 2, "eval.ppl_max_tokens", self.ppl_max_tokens, "must be >= 2 tokens")
        _check(self.ppl_window >= 2, "eval.ppl_window", self.ppl_window, "must be >= 2 tokens")
        _check(1 <= self.ppl_stride <= self.ppl_window, "eval.ppl_stride", self.ppl_stride,
               "must be in [1, eval.ppl_window]")
        if isinstance(self.batch_size, str) and self.batch_size.isdigit():
            self.batch_size = int(self.batch_size)
        _check(self.batch_size == "auto" or (isinstance(self.batch_size, int) and not isinstance(self.batch_size, bool)
                                             and self.batch_size >= 1),
               "eval.batch_size", self.batch_size, "must be auto or an integer >= 1")
        _check(self.max_eval_prompts >= 0, "eval.max_eval_prompts", self.max_eval_prompts, "must be >= 0")
        _check(self.samples_in_report >= 0, "eval.samples_in_report", self.samples_in_report, "must be >= 0")


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
    ``processes``: how many processes train together (``torchrun --nproc_per_node`` x nodes); under FSDP / DeepSpeed
    ZeRO the training rows are one process's share after sharding (:mod:`qwenft.plan.sharding`).
    ``out``: a JSON file for the whole plan.
    """

    gpu_gb: float = 24.0
    processes: int = 1
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
        _check(self.processes >= 1, "plan.processes", self.processes,
               "must be >= 1 (the processes training together, e.g. torchrun --nproc_per_node)")


@dataclass
class WandbConfig:
    """Weights & Biases logging; offline unless the user is logged in or WANDB_MODE says otherwise."""

    project: str = "qwenft"
    entity: Optional[str] = None
    mode: Optional[str] = None
    tags: List[str] = field(default_factory=list)


DIST_STRATEGIES = ("none", "ddp", "fsdp", "deepspeed")


QUANT_STORAGE = ("uint8", "bfloat16", "float16", "float32")


# The ``fsdp_config`` keys transformers 5.24's TrainingArguments reads (``_process_fsdp_args``; an ``fsdp_`` prefix is
# stripped there): any other key is silently ignored by it, so a typo such as ``reshard_after_forwad`` would train
# with the default.
FSDP_KEYS = ("version", "auto_wrap_policy", "transformer_layer_cls_to_wrap", "min_num_params", "reshard_after_forward",
             "state_dict_type", "cpu_ram_efficient_loading", "cpu_offload", "activation_checkpointing",
             "forward_prefetch", "backward_prefetch", "use_orig_params", "sync_module_states", "limit_all_gathers",
             "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "xla_fsdp_settings")


def _check_fsdp_keys(fsdp: Dict[str, Any]) -> None:
    for key in fsdp:
        name = str(key)[5:] if str(key).startswith("fsdp_") else str(key)
        if name not in FSDP_KEYS:
            guess = difflib.get_close_matches(name, FSDP_KEYS, n=1, cutoff=0.6)
            hint = f" (did you mean dist.fsdp.{guess[0]}?)" if guess else ""
            raise ConfigError(f"unknown key 'dist.fsdp.{key}'{hint}; transformers reads only: {', '.join(FSDP_KEYS)}")


@dataclass
class DistConfig:
    """Training on several processes (``torchrun`` / ``accelerate launch``); see :mod:`qwenft.train.dist`.

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
        _check_fsdp_keys(self.fsdp)
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
    serve: ServeConfig = field(default_factory=ServeConfig)

    def __post_init__(self) -> None:
        _check_choice("command", self.command, COMMANDS)
        _check_choice("logger", self.logger, ("none", "wandb"))
        if self.command in ("train", "eval"):  # a gate names a held-out source or benchmark of this run
            check_gate_names(self.eval.gates, self.data.sources, self.eval.benchmarks, self.eval.metrics)
        if self.command == "train" and self.data.sources:  # eval may use evaluation-only (weight 0) sources
            _check(sum(s.weight for s in self.data.sources) > 0, "data.sources.weight",
                   [s.weight for s in self.data.sources], "at least one weight must be > 0 to train")
