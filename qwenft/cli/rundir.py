"""The run directory as the command line leaves it: which commands write one, a refused command's directory
removed when it holds only what Hydra wrote or its ``.hydra/`` put back as it was, and why a run stopped written to
its log files."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Dict

from qwenft.files import atomic_write_bytes
from qwenft.runlock import LOCK_FILES


# Commands that write a run directory (out_dir); the others print and write only what they are told to.
RUN_DIR_COMMANDS = ("train", "eval")


def discard_untouched_run_dir(run_dir: Path, command: str) -> bool:
    """Remove ``run_dir`` when it holds nothing but what Hydra wrote before the command ran.

    A run refused with a user error before it wrote anything (bad data, a missing adapter or model) then leaves
    no empty run directory behind. Anything else in it (config.yaml, checkpoints, an adapter) keeps it.

    Returns:
        Whether the directory was removed.
    """
    hydra_only = {".hydra", f"{command}.log", *LOCK_FILES}  # and the lock this command holds
    if not run_dir.is_dir() or not {p.name for p in run_dir.iterdir()} <= hydra_only:
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    return True

def hydra_snapshot(run_dir: Path) -> Dict[str, bytes]:
    """The files of ``run_dir/.hydra`` (Hydra's config snapshot of the run), by name; empty when there are none."""
    folder = run_dir / ".hydra"
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} if folder.is_dir() else {}

def restore_hydra_snapshot(run_dir: Path, snapshot: Dict[str, bytes]) -> None:
    """Put back ``run_dir/.hydra`` as :func:`hydra_snapshot` found it (each file written atomically), so that a
    refused command in an existing run directory leaves that run's record of how it was run unchanged."""
    folder = run_dir / ".hydra"
    if not snapshot:  # the directory had no .hydra/ before this command
        shutil.rmtree(folder, ignore_errors=True)
        return
    for path in folder.iterdir() if folder.is_dir() else ():
        if path.is_file() and path.name not in snapshot:
            path.unlink()
    for name, data in snapshot.items():
        atomic_write_bytes(folder / name, data)


def log_to_files(message: str) -> None:
    """Write ``message`` to the run's log file(s) only (the terminal gets it once, from :func:`qwenft.cli.dispatch.fail`), so a
    run's log ends with why it stopped."""
    record = logging.LogRecord("qwenft", logging.ERROR, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            try:
                handler.handle(record)
            except OSError:  # the log's folder is gone: nothing to complete
                pass
