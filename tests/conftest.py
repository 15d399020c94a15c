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


@pytest.fixture(scope="session")
def embedded_merge(tmp_path_factory, embedded_dir) -> Path:
    """One merge of the 0.5B with a seeded random r=8 adapter, shared by the slow export tests of test_export,
    test_gguf_check and test_quantize (each merge of the 0.5B is 1-2 minutes on 2 cores): float32 (the strict
    check), and where llama-cpp-python is installed also an f16 GGUF run by llama.cpp and a Q4_K_M made from it
    with its cost rows. Returns the merge's directory; its adapter is ``<dir>/../run/adapter``."""
    import importlib.util

    from qwenft.export import merge
    from tests.test_export import make_adapter, merge_config

    root = tmp_path_factory.mktemp("embedded_merge")
    adapter = root / "run" / "adapter"
    make_adapter(adapter, "quant=none", "lora.r=8", "lora.lora_alpha=16", std=0.01, model_args=())
    gguf = ("merge.gguf=f16", "merge.verify_gguf=true", "merge.quantize=[gguf-q4_k_m]",
            "eval.max_new_tokens=8", "eval.max_eval_prompts=3") if importlib.util.find_spec("llama_cpp") else ()
    merge(merge_config(adapter, root / "merged", "merge.dtype=float32", *gguf), device="cpu")
    return root / "merged"
