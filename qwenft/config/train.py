"""The ``train`` section (optimisation settings, passed to transformers' Trainer) and the ``wandb`` section (its
Weights & Biases logging)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

from qwenft.config.base import _check, _check_choice


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
class WandbConfig:
    """Weights & Biases logging; offline unless the user is logged in or WANDB_MODE says otherwise."""

    project: str = "qwenft"
    entity: Optional[str] = None
    mode: Optional[str] = None
    tags: List[str] = field(default_factory=list)
