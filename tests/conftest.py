"""Shared fixtures: an isolated cache, the composed config, the tiny-random model, the shared data folder; and how
the suite is spread over pytest-xdist's two workers (tests/README.md)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest

# Tests never reach a network.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "offline"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("QWENFT_BENCH_DATA", None)  # a developer's export must not change what a test reads

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
DURATIONS = Path(__file__).with_name("durations.json")  # seconds per xdist group, measured (tests/README.md)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: one thread each (torch, OpenMP, tokenizers), so neither worker's matmuls spin against
    # the other's; the subprocesses a test starts inherit it (set before anything imports torch).
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def xdist_group(item) -> str:
    """The xdist group ``item`` runs in: its ``xdist_group`` mark, else its file (a file's module fixtures are then
    built once, on one worker)."""
    for mark in item.iter_markers("xdist_group"):
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    return item.path.name


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every test joins a group (``--dist loadgroup``: a group runs whole on one worker), and the groups are queued
    longest first by tests/durations.json, so the two workers finish together (the longest-processing-time-first
    rule); a group not in the file goes last, in collection order. Runs before xdist's own hook, which reads the
    marks added here."""
    seconds = json.loads(DURATIONS.read_text(encoding="utf-8"))["groups"] if DURATIONS.is_file() else {}
    for item in items:
        if not any(item.iter_markers("xdist_group")):
            item.add_marker(pytest.mark.xdist_group(item.path.name))
    items.sort(key=lambda item: -seconds.get(xdist_group(item), 0.0))  # stable: a group's tests keep their order


class _CurrentStream:
    """Stands for ``sys.stdout`` / ``sys.stderr`` as they are at each write, not as they were when a library made its
    log handler: a handler made during a test that captures output (``capsys``) would keep that test's stream and
    write to it after pytest has closed it ("I/O operation on closed file")."""

    def __init__(self, name: str):
        self.name = name

    def write(self, text):
        return getattr(sys, self.name).write(text)

    def flush(self):
        getattr(sys, self.name).flush()


@pytest.fixture(autouse=True)
def _logging_left_clean():
    """After each test, no log handler writes to a stream pytest has closed ("I/O operation on closed file", a
    "Logging error" on stderr, once a crash of the whole run):

    - the handlers a test added to the root, ``qwenft`` and ``hydra`` loggers are removed (an in-process
      ``qwenft.cli.main`` lets Hydra configure logging with a handler on that test's captured stderr);
    - a handler anywhere else (transformers' library handler, DeepSpeed's, ...) left on a captured stream that is
      now closed writes to the current stream instead (they are made once per process, by whichever test first
      imports the library, so they cannot be removed).
    """
    owned = [logging.getLogger(), *(logging.getLogger(name) for name in ("qwenft", "hydra"))]
    before = {logger.name: list(logger.handlers) for logger in owned}
    yield
    for logger in owned:
        for handler in list(logger.handlers):
            if handler not in before[logger.name] and not type(handler).__module__.startswith("_pytest"):
                logger.removeHandler(handler)
                handler.close()
    loggers = [logging.getLogger(), *(logger for logger in logging.Logger.manager.loggerDict.values()
                                      if isinstance(logger, logging.Logger))]
    for logger in loggers:
        for handler in logger.handlers:
            stream = getattr(handler, "stream", None)
            if type(handler) is logging.StreamHandler and getattr(stream, "closed", False):
                name = "stdout" if "out" in repr(getattr(stream, "name", "")) else "stderr"
                handler.__dict__.pop("flush", None)  # transformers binds flush to the stderr of the moment
                handler.stream = _CurrentStream(name)  # not setStream: it flushes the closed stream first


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
