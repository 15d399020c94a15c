"""Errors, the command names, the LoRA target names and the value checks every config section uses."""

from __future__ import annotations

from typing import Any


ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


COMMANDS = ("train", "eval", "generate", "merge", "data", "inspect", "plan", "serve")


class QwenftError(Exception):
    """A user-facing error (bad config, bad data, missing file): the CLI prints it as one line, exit 2."""


class ConfigError(QwenftError, ValueError):
    """A configuration error; the message names the key and what is accepted."""


class GatesFailed(Exception):
    """A gate of the verdict failed under ``eval.fail_on_gate=true`` (:mod:`qwenft.evaluate.verdict`), raised after
    every output of the run was written: the CLI prints the message (the failed gates, where report.md is) as one
    line and exits 3. Not a :class:`QwenftError`: nothing was wrong with the input, and the run directory stays."""

    exit_code = 3
    label = "verdict FAIL"


class GatesInconclusive(GatesFailed):
    """No gate failed but one is INCONCLUSIVE under ``eval.fail_on_inconclusive=true``: raised, like
    :class:`GatesFailed`, after every output was written; the CLI prints one line and exits 4."""

    exit_code = 4
    label = "verdict INCONCLUSIVE"


def _check_choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not accepted; choose one of: {', '.join(map(str, choices))}")


def _check(cond: bool, key: str, value: Any, accepted: str) -> None:
    if not cond:
        raise ConfigError(f"{key}={value!r} is not accepted; {accepted}")
