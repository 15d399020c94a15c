"""The ``plan`` section: the memory budget ``qwenft plan`` plans against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from qwenft.config.base import _check, _check_choice


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
