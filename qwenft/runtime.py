"""Where and how things run: the device, dtypes, the cache directory and the process ranks.

One home for these facts, imported by every room that needs them (it imports nothing from qwenft): the
device (``cuda:LOCAL_RANK`` or ``cpu``), whether bf16 is native there, what ``auto`` dtypes resolve to, where
converted models are cached (``$QWENFT_CACHE``), and the rank / world size of a distributed launch (``torchrun`` /
``accelerate launch`` set them in the environment). Memory measurement and release live in :mod:`qwenft.memory`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def cache_dir() -> Path:
    """Where converted models live: ``$QWENFT_CACHE`` or ``~/.cache/qwenft``."""
    return Path(os.environ.get("QWENFT_CACHE", Path.home() / ".cache" / "qwenft")).expanduser()


def native_bf16(device: Optional[str] = None) -> bool:
    """Whether bfloat16 matmuls run natively on ``device`` (default: :func:`default_device`).

    True on CUDA with bf16 support and on CPUs with AVX512-BF16 / AMX (oneDNN); elsewhere torch falls back
    to a scalar bf16 GEMM that is one to two orders of magnitude slower than float32.
    """
    import torch

    device = device or default_device()
    if device.startswith("cuda"):
        return torch.cuda.is_bf16_supported()
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_dtype(name: str, device: Optional[str] = None) -> str:
    """``auto`` -> ``bfloat16`` where :func:`native_bf16`, else ``float32``; other names unchanged."""
    if name != "auto":
        return name
    return "bfloat16" if native_bf16(device) else "float32"


def torch_dtype(name: str, device: Optional[str] = None):
    """The torch dtype for a config dtype name (``auto`` resolved with :func:`resolve_dtype`)."""
    import torch

    name = resolve_dtype(name, device)
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def default_device() -> str:
    """``cuda:<LOCAL_RANK>`` when CUDA is available, else ``cpu``."""
    import torch

    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"


def world_size() -> int:
    """Number of processes of the launch (``WORLD_SIZE``; 1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """Global rank of this process (``RANK``; 0 without a launcher)."""
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    """Rank on this machine (``LOCAL_RANK``): the GPU index this process trains on."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main_process() -> bool:
    """True on rank 0, the only process that writes qwenft's files."""
    return rank() == 0


def launched() -> bool:
    """Whether a distributed launcher started this process (``LOCAL_RANK`` is set, even with one process)."""
    return "LOCAL_RANK" in os.environ


def resolve_precision(choice: str, compute_dtype: str, native: bool) -> str:
    """``train.precision`` resolved: ``auto`` is ``bf16`` when the compute dtype (resolved, e.g. by
    :func:`resolve_dtype`) is ``bfloat16`` and bf16 is native on the device (``native``), else ``fp32`` (bf16
    autocast where bf16 is not native is far slower than fp32). Other choices are returned as they are.

    Read by training (``qwenft.train.trainer``) and by the planner (``qwenft.plan``), so both see the same run.
    """
    if choice != "auto":
        return choice
    return "bf16" if compute_dtype == "bfloat16" and native else "fp32"


def resolve_optim(choice: str, strategy: str, cuda: bool) -> str:
    """``train.optim`` resolved: ``auto`` is ``paged_adamw_8bit`` on CUDA and ``adamw_torch`` on a CPU, and
    ``adamw_torch`` under FSDP / DeepSpeed (``dist.strategy``), whose sharding does not cover bitsandbytes' paged
    states (peft's caveats). Read by training and by the planner."""
    if choice != "auto":
        return choice
    if strategy in ("fsdp", "deepspeed"):
        return "adamw_torch"
    return "paged_adamw_8bit" if cuda else "adamw_torch"
