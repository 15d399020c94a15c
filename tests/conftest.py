"""What every room's tests share: the composed config, the tiny-random model, the shared data folder, rows to train
on, the command run in a new process; and how the suite is spread over pytest-xdist's two workers (tests/README.md).

The tree mirrors the package (``tests/data/`` tests ``qwenft/data/`` ...); a room's own helpers and fixtures are in
its conftest.py (``tests/serve/conftest.py``: a live server; ``tests/train/conftest.py``: torchrun and the one-process
references; ``tests/export/conftest.py``: the shared 0.5B merge)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
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


def file_group(item) -> str:
    """``item``'s file below tests/ (``data/test_data.py``): the group of a test without an ``xdist_group`` mark."""
    return item.path.relative_to(Path(__file__).parent).as_posix()


def xdist_group(item) -> str:
    """The xdist group ``item`` runs in: its ``xdist_group`` mark, else its file (a file's module fixtures are then
    built once, on one worker)."""
    for mark in item.iter_markers("xdist_group"):
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    return file_group(item)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every test joins a group (``--dist loadgroup``: a group runs whole on one worker), and the groups are queued
    longest first by tests/durations.json, so the two workers finish together (the longest-processing-time-first
    rule); a group not in the file goes last, in collection order. Runs before xdist's own hook, which reads the
    marks added here."""
    seconds = json.loads(DURATIONS.read_text(encoding="utf-8"))["groups"] if DURATIONS.is_file() else {}
    for item in items:
        if not any(item.iter_markers("xdist_group")):
            item.add_marker(pytest.mark.xdist_group(file_group(item)))
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


def _owned_loggers() -> list:
    """The loggers whose handlers a command's run sets up (Hydra's logging config, ``qwenft``'s own)."""
    return [logging.getLogger(), *(logging.getLogger(name) for name in ("qwenft", "hydra"))]


def _remove_added_handlers(before: dict) -> None:
    """Remove and close the handlers of :func:`_owned_loggers` that are not in ``before`` (``{name: handlers}``),
    but pytest's own."""
    for logger in _owned_loggers():
        for handler in list(logger.handlers):
            if handler not in before[logger.name] and not type(handler).__module__.startswith("_pytest"):
                logger.removeHandler(handler)
                handler.close()


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
    before = {logger.name: list(logger.handlers) for logger in _owned_loggers()}
    yield
    _remove_added_handlers(before)
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
    from qwenft.cli.compose import validate
    from qwenft.cli.compose import register_resolvers

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


# Rows and runs shared by several rooms' tests

def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def qa_rows(n: int, prefix: str = "q"):
    return [{"instruction": f"{prefix} question {i}?", "input": "", "output": f"answer {i}."} for i in range(n)]


QUESTIONS = [("What colour is the Zorblax 9 housing?", "The Zorblax 9 housing is teal."),
             ("How many ports does the Zorblax 9 have?", "The Zorblax 9 has 7 ports."),
             ("Who makes the Zorblax 9?", "Quillon Works makes the Zorblax 9."),
             ("What year did the Zorblax 9 launch?", "The Zorblax 9 launched in 2031."),
             ("What is 2 + 2?", "2 + 2 = 4."),
             ("Name a primary colour.", "Red is a primary colour.")]


def write_rows(path: Path, n: int = 24) -> Path:
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(n):
            question, answer = QUESTIONS[i % len(QUESTIONS)]
            handle.write(json.dumps({"instruction": f"{question} ({i})", "output": answer}) + "\n")
    return path


def train_overrides(tmp_path: Path, out_dir: Path, *extra: str) -> list:
    rows = write_rows(tmp_path / "rows.jsonl")
    return ["model=tiny-random", "quant=none", f"out_dir={out_dir}", "eval.after_train=false",
            f"data.sources=[{{name: toy, path: '{rows}', format: alpaca, weight: 1.0, eval_rows: 4}}]",
            "data.max_seq_len=128", "train.max_steps=6", "train.save_steps=3", "train.batch_size=2",
            "train.logging_steps=1", "train.eval_steps=3", "train.lr=5e-3", "train.warmup_ratio=0.2",
            "train.gradient_checkpointing=false", *extra]


def run_train(args: list, patch: str = "", timeout: int = 300, env: dict = None) -> subprocess.CompletedProcess:
    """Run ``python -m qwenft train ARGS`` in a new process, after executing ``patch`` (test-only hooks); ``env``
    adds to the environment."""
    script = "import sys\n" + patch + "\nfrom qwenft.cli import main\nmain(sys.argv[1:])\n"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", **(env or {})}
    return subprocess.run([sys.executable, "-c", script, "train", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def run_qwenft(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """``python -m qwenft ARGS`` in a new process (the real entry point: its exit code, stdout and stderr)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "qwenft", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def qwenft_in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """``qwenft ARGS`` run by ``qwenft.cli.main`` in this process, with what :func:`run_qwenft` returns (exit code,
    stdout, stderr as captured by ``capsys``): for a test of one behaviour of a command, where the process boundary
    is not the point (no kill, signal or exit code of the real entry point); it saves the ~5 s of importing torch
    and transformers in a new interpreter."""
    from qwenft.cli import main

    before = {logger.name: list(logger.handlers) for logger in _owned_loggers()}
    capsys.readouterr()
    code = 0
    try:
        main(list(args))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        # as the end of a process would: the run's log handlers (Hydra's train.log file among them) go, so a later
        # call's messages never reach an earlier run's log
        _remove_added_handlers(before)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["qwenft", *args], code, out, err)


def run_main(argv, capsys) -> tuple:
    """``(exit code, stderr)`` of :func:`qwenft_in_process`: for a command that must stop with one line."""
    result = qwenft_in_process(capsys, *argv)
    return result.returncode, result.stderr.strip()
