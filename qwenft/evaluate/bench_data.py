"""Where the built-in benchmarks' files are: ``eval.bench_data``, then ``$QWENFT_BENCH_DATA``.

qwenft ships no benchmark data (MMLU, C-Eval and GSM8K keep their own licenses; C-Eval is non-commercial). The
built-in ``mmlu``, ``ceval`` and ``gsm8k`` read the published files from the first directory that holds ``NAME/``,
searched in this order: each entry of ``eval.bench_data``, then each entry of the environment variable
``QWENFT_BENCH_DATA`` (directories joined by ``os.pathsep``, ``:`` on Linux), so one export serves every run.

When none holds ``NAME/``: ``eval.bench_missing=error`` (the default) refuses the run before any model loads;
``eval.bench_missing=skip`` (the quickstart and domain recipes) logs a warning, runs the rest of the evaluation and
says in report.md and metrics.json (``eval.benchmarks_skipped``) which benchmarks were skipped and why.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Dict, List

from qwenft.config import Config, ConfigError
from qwenft.config.gates import BUILTIN_BENCHMARKS

log = logging.getLogger(__name__)

ENV = "QWENFT_BENCH_DATA"


def search_dirs(configured: List[str]) -> List[str]:
    """``eval.bench_data``'s directories, then those of ``$QWENFT_BENCH_DATA`` (empty entries dropped)."""
    extra = [d for d in os.environ.get(ENV, "").split(os.pathsep) if d.strip()]
    return [*configured, *extra]


def find_folder(name: str, configured: List[str]) -> tuple:
    """``(folder or None, tried)``: the first ``DIR/name`` that is a directory, and every path tried."""
    from qwenft.data import resolve_path

    tried = [resolve_path(d) / name for d in search_dirs(configured)]
    return next((f for f in tried if f.is_dir()), None), tried


def _why_not(folder: Path, name: str) -> str:
    """Why ``folder`` (``DIR/name``) is not a benchmark folder, when the reason is ``DIR`` itself: it does not exist,
    it is a file, or it is (or holds the files of) the benchmark folder, one level too deep; else empty."""
    parent = folder.parent
    if not parent.exists():
        return f" ({parent} does not exist)"
    if not parent.is_dir():
        return f" ({parent} is a file, not a directory)"
    if parent.name == name:
        return f" ({parent} is {name}/ itself: point at {parent.parent})"
    if (parent / "dev").is_dir() or (parent / "test").is_dir() or (parent / "test.jsonl").is_file():
        return f" ({parent} holds a benchmark's files themselves: they go in {folder}/)"
    return ""


def _missing(name: str, tried: List[Path]) -> str:
    where = ", ".join(f"{t}{_why_not(t, name)}" for t in tried) \
        or f"nothing (eval.bench_data is empty and ${ENV} is unset)"
    return (f"eval.benchmarks: {name}: no data directory; tried {where}. Point eval.bench_data=[DIR] (or ${ENV}) "
            f"at a directory holding {name}/ (the published files; qwenft ships none)")


def data_folder(name: str, configured: List[str]) -> Path:
    """The folder of built-in benchmark ``name``.

    Raises:
        ConfigError: no searched directory holds ``name/`` (naming each path tried and how to point at one).
    """
    folder, tried = find_folder(name, configured)
    if folder is None:
        raise ConfigError(_missing(name, tried))
    return folder


def skipped(config: Config) -> Dict[str, str]:
    """``{name: reason}`` for the built-in benchmarks ``eval.bench_missing=skip`` leaves out (no data found);
    empty under ``eval.bench_missing=error`` (those runs are refused instead)."""
    if config.eval.bench_missing != "skip":
        return {}
    out = {}
    for name in config.eval.benchmarks:
        if name in BUILTIN_BENCHMARKS:
            folder, tried = find_folder(name, config.eval.bench_data)
            if folder is None:
                out[name] = _missing(name, tried).removeprefix(f"eval.benchmarks: {name}: ")
    return out


def warn_skipped(config: Config) -> Dict[str, str]:
    """Log one warning per skipped benchmark (see :func:`skipped`); returns them."""
    out = skipped(config)
    for name, reason in out.items():
        log.warning("benchmark %s skipped (eval.bench_missing=skip): %s", name, reason)
    return out
