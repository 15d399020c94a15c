"""``python -m qwenft train``: the run (:mod:`qwenft.train.run`), then the verdict enforced."""

from __future__ import annotations

from qwenft.config import Config
from qwenft.runtime import is_main_process
from qwenft.train.run import run


def train_command(config: Config) -> None:
    """``python -m qwenft train``: :func:`qwenft.train.run.run`, then the verdict's gates enforced.

    Raises:
        GatesFailed: a gate of the evaluation after training failed with ``eval.fail_on_gate=true`` (or
            ``eval.fail_on_inconclusive=true``), or ``GatesInconclusive``: the verdict is INCONCLUSIVE with
            ``eval.fail_on_inconclusive=true``; raised on the main process after everything is written (the CLI
            exits 3 or 4).
    """
    out_dir = run(config)
    if (config.eval.fail_on_gate or config.eval.fail_on_inconclusive) and is_main_process():
        from qwenft.evaluate.verdict import enforce

        enforce(config, None, out_dir)
