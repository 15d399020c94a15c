"""The ``train`` section (optimisation settings, passed to transformers' Trainer) and the ``wandb`` section (its
Weights & Biases logging)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List, Optional

from qwenft.config.base import _check, _check_choice


OBJECTIVES = ("sft", "dpo", "ipo", "simpo", "orpo", "kto")
REFERENCE_FREE = ("simpo", "orpo")  # objectives without a reference model (qwenft.preference.loss)


def uses_reference_forward(objective: str, precompute_ref: bool) -> bool:
    """Whether a training step of ``objective`` runs a reference forward: dpo, ipo and kto have a reference model,
    and compute its log-probs in each step unless ``pref.precompute_ref`` computed them before training (not for
    KTO, whose mismatched pairs depend on the batch)."""
    return objective not in ("sft", *REFERENCE_FREE) and not (precompute_ref and objective != "kto")


def padding_free(objective: str, padding_free_setting, attn_implementation: str) -> bool:
    """``pref.padding_free`` resolved for a preference step: ``auto`` is padding-free on ``flash_attention_2``
    only, whose varlen kernel reads the boundaries from ``position_ids`` at no cost; sdpa and eager would need a
    ``[tokens, tokens]`` mask over the whole batch (transformers builds one), quadratic in the batch's tokens, so
    they run padded unless ``pref.padding_free=true``."""
    if objective == "sft":
        return False
    if padding_free_setting == "auto":
        return attn_implementation == "flash_attention_2"
    return bool(padding_free_setting)


@dataclass
class TrainConfig:
    """Optimisation settings, passed to transformers' Trainer.

    ``objective``: ``sft`` (next-token loss on the answers) or a preference objective on preference sources
    (:mod:`qwenft.preference.loss`; its settings in the ``pref`` section, :class:`PrefConfig`).
    """

    objective: str = "sft"
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
        _check_choice("train.objective", self.objective, OBJECTIVES)
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
class PrefConfig:
    """Preference training settings (``train.objective`` other than ``sft``; formulas in :mod:`qwenft.preference.loss`).

    ``beta``: DPO's beta (the KL strength; IPO's tau, ORPO's lambda, SimPO's beta; TRL's default 0.1 for each; the
    SimPO paper used 2.0 - 2.5). ``label_smoothing``: conservative DPO / SimPO's epsilon, the assumed share of
    flipped labels.
    ``gamma_beta_ratio``: SimPO's margin gamma / beta. ``rpo_alpha``: weight of an NLL term on the chosen answers
    (RPO) for dpo / ipo / simpo; 0: none (ORPO's own NLL term always has weight 1). ``desirable_weight`` /
    ``undesirable_weight``: KTO's lambda_D / lambda_U. ``reference``: the model the rewards are measured against:
    ``auto`` is the base with the adapter disabled, or, with ``init_adapter``, that adapter frozen (a second copy
    of the adapter weights only, switched by peft); reference-free objectives (simpo, orpo) run none.
    ``precompute_ref``: compute the reference log-probs of every training pair once before training (one
    no-grad pass) instead of a reference forward in each step. ``padding_free``: chosen and rejected of a batch in
    one row without padding (``position_ids`` restart per sequence; transformers 5 derives each sequence's causal
    mask from them): ``auto`` on flash_attention_2 only (:func:`padding_free`), ``true`` / ``false`` forced.
    """

    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma_beta_ratio: float = 0.5
    rpo_alpha: float = 0.0
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    precompute_ref: bool = False
    padding_free: Any = "auto"

    def __post_init__(self) -> None:
        for name in ("beta", "label_smoothing", "gamma_beta_ratio", "rpo_alpha", "desirable_weight",
                     "undesirable_weight"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and math.isfinite(value), f"pref.{name}", value,
                   "must be a finite number")
        _check(self.beta > 0, "pref.beta", self.beta, "must be > 0")
        _check(0.0 <= self.label_smoothing < 0.5, "pref.label_smoothing", self.label_smoothing, "must be in [0, 0.5)")
        for name in ("rpo_alpha", "desirable_weight", "undesirable_weight", "gamma_beta_ratio"):
            _check(getattr(self, name) >= 0, f"pref.{name}", getattr(self, name), "must be >= 0")
        if isinstance(self.padding_free, str) and self.padding_free.lower() in ("true", "false"):
            self.padding_free = self.padding_free.lower() == "true"
        _check(self.padding_free in ("auto", True, False), "pref.padding_free", self.padding_free,
               "must be auto, true or false")


@dataclass
class WandbConfig:
    """Weights & Biases logging; offline unless the user is logged in or WANDB_MODE says otherwise."""

    project: str = "qwenft"
    entity: Optional[str] = None
    mode: Optional[str] = None
    tags: List[str] = field(default_factory=list)
