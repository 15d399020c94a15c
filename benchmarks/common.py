"""Shared helpers for the benchmark scripts: environment record, a printed table, atomic JSON results."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Dict, Iterable, Sequence

from qwenft.files import atomic_write_text

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> Dict[str, Any]:
    """Machine and library versions, recorded with every result."""
    import torch
    import transformers

    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.machine(),
            "processor": platform.processor(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    for name in ("peft", "bitsandbytes"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    return info


def print_table(title: str, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """Print a plain fixed-width table."""
    rows = [[str(c) for c in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(str(h).ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def save_json(name: str, payload: Dict[str, Any], out_dir: Path | None = None) -> Path:
    """Write ``payload`` to ``<out_dir or benchmarks/results>/<name>.json`` atomically; returns the path."""
    out_dir = Path(out_dir or os.environ.get("OUT") or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    atomic_write_text(path, json.dumps(payload, indent=2, default=str))
    print(f"saved {path}")
    return path


def plain_lora(model, lora, gradient_checkpointing: bool):
    """The baseline arm's model: what a user writes by hand with peft (k-bit preparation for a 4-bit base,
    non-reentrant checkpointing, cache off, LoRA from ``lora``, a qwenft ``LoraConfig``)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if getattr(model, "is_loaded_in_4bit", False):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout,
                                            target_modules=list(lora.target_modules), task_type="CAUSAL_LM"))
