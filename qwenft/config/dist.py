"""The ``dist`` section: training on several processes (DDP, FSDP, DeepSpeed), with the ``dist.fsdp`` keys
transformers reads."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Dict

from qwenft.config.base import ConfigError, _check, _check_choice


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
