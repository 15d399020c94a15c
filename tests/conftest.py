"""Shared fixtures: an isolated cache, the composed config, the tiny-random model, the shared data folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never reach a network.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "offline"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("QWENFT_BENCH_DATA", None)  # a developer's export must not change what a test reads

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


def compose_config(*overrides: str, command: str = "train"):
    """Compose conf/config.yaml with ``overrides`` exactly as the CLI does and validate it."""
    from qwenft.hydra_app import validate
    from qwenft.hydra_app import register_resolvers

    register_resolvers()
    return validate(command, list(overrides))[0]


@pytest.fixture(autouse=True)
def _no_inherited_width(monkeypatch):
    """A test sees the width a plain pipe has: no ``COLUMNS`` / ``LINES`` from the shell or from pytest-xdist, whose
    workers set ``COLUMNS=80`` (results printed off a terminal are then 80 columns wide and their lines wrap, where a
    serial run prints them whole). A test about the width sets ``COLUMNS`` itself."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)


@pytest.fixture(autouse=True)
def _restore_logging():
    """Remove the log handlers a test left behind: an in-process ``qwenft.cli.main`` lets Hydra configure logging
    with a handler on that test's captured stderr, which pytest closes afterwards; a later test's log line would
    then write to a closed file (a "Logging error" on stderr, and once a crash of the whole run)."""
    import logging

    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in ("qwenft", "hydra"))]
    before = {logger.name: list(logger.handlers) for logger in loggers}
    yield
    for logger in loggers:
        for handler in list(logger.handlers):
            if handler not in before[logger.name] and not type(handler).__module__.startswith("_pytest"):
                logger.removeHandler(handler)
                handler.close()


@pytest.fixture
def tiny_config(tmp_path):
    """A validated config for the tiny-random model, with its own run directory."""
    config = compose_config("model=tiny-random", f"out_dir={tmp_path / 'run'}")
    return config


@pytest.fixture(scope="session")
def bench_dir(tmp_path_factory) -> Path:
    """Invented MMLU and GSM8K files in the published layouts (tests/bench_files.py): qwenft ships no benchmark data."""
    from tests.bench_files import write_bench

    return write_bench(tmp_path_factory.mktemp("bench_data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data, or skip when it is absent (e.g. on a user's machine)."""
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present")
    return SHARED_DATA


@pytest.fixture(scope="session")
def embedded_dir():
    """The converted embedded model directory (slow: converts on first use)."""
    from qwenft.config import QwenftError
    from qwenft.model import embedded_model_dir

    try:
        return embedded_model_dir()
    except QwenftError as exc:
        pytest.skip(str(exc))
