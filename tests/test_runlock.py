"""Two runs never share a directory: unique default run directories, the run directory's lock, quiet imports."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import qwenft.runlock as runlock
from qwenft.config import QwenftError
from qwenft.runlock import LOCK_NAME, PID_NAME, RunLock, RunLocked, new_run_stamp
from tests.conftest import ROOT, compose_config, run_main
from tests.conftest import write_rows

# Test hooks run in the child before the CLI: every default run directory gets the same time (two launches in the
# same second), and a process that took its lock writes <sync>/locked-<pid> and waits for <sync>/go, so the test
# knows which processes hold a lock at the same time and lets them go on only once it has seen what it needs.
HOOKS = """
import os, pathlib, sys, time, types
import qwenft.runlock as runlock
runlock.time = types.SimpleNamespace(strftime=lambda fmt: "2026-11-29_10-00-00", monotonic=time.monotonic,
                                     sleep=time.sleep)
_acquire = runlock.RunLock.acquire
def _acquire_then_wait(self):
    _acquire(self)
    sync = pathlib.Path(os.environ["QWENFT_TEST_SYNC"])
    (sync / f"locked-{os.getpid()}").write_text(str(self.directory))
    deadline = time.monotonic() + 300  # a hang guard: the test creates go within seconds
    while not (sync / "go").exists():
        if time.monotonic() > deadline:
            sys.exit("test hook: no go file")
        time.sleep(0.05)
    return self
runlock.RunLock.acquire = _acquire_then_wait
from qwenft.cli import main
main(sys.argv[1:])
"""
TIMEOUT_S = 300  # hang guards only


def train_args(rows: Path, rank: int, steps: int, *extra: str) -> list:
    # The two processes of a test differ in LoRA rank and steps, so each file in a run directory tells whose it is.
    return ["train", "model=tiny-random", "quant=none", "eval.after_train=false", "logger=none", "data.cache=false",
            f"data.sources=[{{name: toy, path: '{rows}', format: alpaca, weight: 1.0, eval_rows: 4}}]",
            "data.max_seq_len=64", f"train.max_steps={steps}", f"train.save_steps={steps}", "train.batch_size=2",
            "train.eval_steps=100", "train.gradient_checkpointing=false", f"lora.r={rank}", *extra]


def env(sync: Path) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT), "QWENFT_TEST_SYNC": str(sync)}


def start(args: list, cwd: Path, sync: Path, hooks: bool = True) -> subprocess.Popen:
    command = [sys.executable, "-c", HOOKS, *args] if hooks else [sys.executable, "-m", "qwenft", *args]
    return subprocess.Popen(command, cwd=cwd, env=env(sync), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def finish(proc: subprocess.Popen):
    out, err = proc.communicate(timeout=TIMEOUT_S)
    return proc.returncode, out, err


def check_run(run_dir: Path, rank: int, steps: int) -> None:
    """Every file of the run directory comes from the one run that owns it."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert Path(config["out_dir"]).resolve() == run_dir.resolve()
    assert config["lora"]["r"] == rank and config["train"]["max_steps"] == steps
    assert f"lora.r={rank}" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert json.loads((run_dir / "metrics.json").read_text())["train"]["global_step"] == steps
    assert json.loads((run_dir / "adapter" / "adapter_config.json").read_text())["r"] == rank
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"checkpoint-{steps}"]
    assert not (run_dir / PID_NAME).exists()  # the lock was let go at the end


def test_default_run_dir_is_the_start_time_and_the_process(monkeypatch):
    monkeypatch.delenv("WANDB_SWEEP_ID", raising=False)
    new_run_stamp()
    out_dir = compose_config("model=tiny-random").out_dir
    assert re.fullmatch(rf"outputs/train/\d{{4}}-\d\d-\d\d_\d\d-\d\d-\d\d_{os.getpid()}", out_dir), out_dir
    assert compose_config("model=tiny-random").out_dir == out_dir  # fixed for the command (composed twice)
    monkeypatch.setenv("WANDB_RUN_ID", "abc123")
    assert new_run_stamp().endswith(f"_{os.getpid()}")  # a run id alone (not a sweep agent) is not used
    monkeypatch.setenv("WANDB_SWEEP_ID", "sweep9")
    assert compose_config("model=tiny-random").out_dir.endswith(f"_{os.getpid()}")  # until a new stamp
    new_run_stamp()
    assert compose_config("+recipe=quickstart").out_dir.startswith("outputs/quickstart/")
    assert compose_config("+recipe=quickstart").out_dir.endswith("_abc123")  # the W&B run id of a sweep agent
    monkeypatch.undo()
    new_run_stamp()  # the other tests of this process get its own again


def test_the_lock_refuses_a_second_holder_and_names_the_directory_and_pid(tmp_path):
    run_dir = tmp_path / "new" / "run"
    first = RunLock(run_dir).acquire()
    assert (run_dir / PID_NAME).read_text().strip() == str(os.getpid())
    with pytest.raises(RunLocked) as refused:
        RunLock(run_dir).acquire()  # another handle, as another process would have: the same refusal
    message = str(refused.value)
    assert f"out_dir={run_dir}" in message and f"process {os.getpid()}" in message and "\n" not in message
    first.release()
    assert not (tmp_path / "new").exists()  # the folders the lock made, unused, are gone with it
    (run_dir / "adapter").mkdir(parents=True)
    second = RunLock(run_dir).acquire()
    second.release()
    second.release()  # idempotent
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_NAME, "adapter"]  # a used directory stays


def test_the_holder_is_told_by_the_lock_on_its_pid_file_not_by_the_pid(tmp_path):
    lock = RunLock(tmp_path)
    (tmp_path / PID_NAME).write_text("999999\n")  # left by a killed holder: nobody holds its lock
    assert lock.holder() is None
    (tmp_path / PID_NAME).write_text(f"{os.getpid()}\n")  # even naming a live process: still not a holder's
    assert lock.holder() is None
    first = RunLock(tmp_path).acquire()
    assert lock.holder() == os.getpid()  # the pid file the holder keeps locked
    first.release()
    assert lock.holder() is None and not (tmp_path / PID_NAME).exists()


def test_a_lock_file_the_os_refuses_is_its_reason_never_in_use(tmp_path, monkeypatch, capsys):
    """Only a live holder is "in use": a folder that takes no new files (/proc: filelock times out as if the lock
    were held), a lock filelock will not take though no process holds it, and a pid file the OS refuses are one line
    naming the path and why (found by a new-user pass: out=/proc/x said "in use by another process")."""
    from filelock import FileLock, Timeout

    with pytest.raises(QwenftError) as refused:
        RunLock("/proc/qwenft-test", key="out", beside=True).acquire()
    message = str(refused.value)
    assert not isinstance(refused.value, RunLocked) and "in use" not in message and "\n" not in message
    assert message.startswith("out=/proc/qwenft-test: cannot lock /proc/.qwenft-test.qwenft.lock: No such file or "
                              "directory (the folder /proc exists but takes no new files there)"), message
    code, err = run_main(["merge", f"adapter={tmp_path}", "out=/proc/qwenft-test/merged"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "in use" not in err and "cannot lock" in err, err

    def refuse(self, *args, **kwargs):
        raise Timeout(str(self.lock_file))

    monkeypatch.setattr(runlock, "HOLDER_WAIT_S", 0.3)
    with monkeypatch.context() as patch:
        patch.setattr(FileLock, "acquire", refuse)
        with pytest.raises(QwenftError) as refused:
            RunLock(tmp_path / "run").acquire()
    assert not isinstance(refused.value, RunLocked), refused.value
    assert str(refused.value) == f"out_dir={tmp_path / 'run'}: cannot lock {tmp_path / 'run' / LOCK_NAME}, though no " \
                                 "process holds it"
    assert not (tmp_path / "run").exists()  # the folder the refused lock made is gone

    def no_permission(path, text):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(runlock, "write_locked", no_permission)
    with pytest.raises(QwenftError) as refused:
        RunLock(tmp_path / "run").acquire()
    assert str(refused.value) == (f"out_dir={tmp_path / 'run'}: cannot write {tmp_path / 'run' / PID_NAME}: "
                                  "Permission denied")
    monkeypatch.undo()
    RunLock(tmp_path / "run").acquire().release()  # nothing stayed locked


def test_eval_and_merge_refuse_a_directory_in_use(tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "report.md").parent.mkdir()
    (run_dir / "report.md").write_text("theirs")
    held = RunLock(run_dir).acquire()
    try:
        code, err = run_main(["eval", "model=tiny-random", f"out_dir={run_dir}"], capsys)
    finally:
        held.release()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"out_dir={run_dir} is in use by process {os.getpid()}" in err
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_NAME, "report.md"]  # no .hydra/, no eval.log

    out = tmp_path / "models" / "merged"
    held = RunLock(out, key="out", beside=True).acquire()
    assert held.path == out.parent / f".merged{LOCK_NAME}"  # beside: out appears only once verified
    try:
        code, err = run_main(["merge", f"adapter={run_dir}/adapter", f"out={out}"], capsys)
    finally:
        held.release()
    assert code == 2 and len(err.splitlines()) == 1 and f"out={out} is in use by process {os.getpid()}" in err, err
    assert not (tmp_path / "models").exists()
    # Not held: merge goes on to its own checks (in a process of its own: it runs Hydra, which configures logging);
    # the refused command leaves no folder or lock behind.
    proc = subprocess.run([sys.executable, "-m", "qwenft", "merge", f"adapter={run_dir}/adapter", f"out={out}"],
                          cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 2 and f"{run_dir}/adapter does not exist" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "models").exists(), sorted(str(p) for p in tmp_path.rglob("*"))


@pytest.mark.slow  # two training processes at once
def test_two_trains_in_the_same_second_get_two_complete_run_directories(tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl")
    sync, work = tmp_path / "sync", tmp_path / "work"
    sync.mkdir()
    work.mkdir()
    procs = {(4, 1): start(train_args(rows, 4, 1), work, sync), (8, 2): start(train_args(rows, 8, 2), work, sync)}
    # Both hold their lock at the same time before either writes anything: they chose two directories.
    wait_for(lambda: len(list(sync.glob("locked-*"))) == 2 or any(p.poll() is not None for p in procs.values()),
             "both processes to take their lock")
    (sync / "go").touch()
    results = {key: finish(proc) for key, proc in procs.items()}
    for code, _, err in results.values():
        assert code == 0, err[-3000:]
    runs = sorted(p.name for p in (work / "outputs" / "train").iterdir())
    assert runs == sorted(f"2026-11-29_10-00-00_{p.pid}" for p in procs.values())  # same second, two directories
    for (rank, steps), proc in procs.items():
        run_dir = work / "outputs" / "train" / f"2026-11-29_10-00-00_{proc.pid}"
        check_run(run_dir, rank, steps)
        assert f"run directory: {run_dir}" in results[rank, steps][1]


@pytest.mark.slow  # two training processes at once
def test_two_trains_into_one_out_dir_one_is_refused_the_other_intact(tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl")
    sync, run_dir = tmp_path / "sync", tmp_path / "run"
    sync.mkdir()
    procs = {(4, 1): start(train_args(rows, 4, 1, f"out_dir={run_dir}"), tmp_path, sync),
             (8, 2): start(train_args(rows, 8, 2, f"out_dir={run_dir}"), tmp_path, sync)}
    # The loser is refused while the winner holds the lock (the winner waits for go until then).
    wait_for(lambda: any(p.poll() is not None for p in procs.values()), "one process to be refused")
    (key_lost, lost), = [(k, p) for k, p in procs.items() if p.poll() is not None]
    (key_won, won), = [(k, p) for k, p in procs.items() if p is not lost]
    code, _, err = finish(lost)
    assert code == 2 and [p.name for p in sync.iterdir()] == [f"locked-{won.pid}"], err
    assert err.strip() == (f"qwenft: error: out_dir={run_dir} is in use by process {won.pid} (it holds "
                           f"{run_dir / LOCK_NAME}); wait for it to end or choose another out_dir")
    (sync / "go").touch()
    code, _, err = finish(won)
    assert code == 0, err[-3000:]
    check_run(run_dir, *key_won)
    assert f"lora.r={key_lost[0]}" not in (run_dir / ".hydra" / "overrides.yaml").read_text()


@pytest.mark.slow  # a holder killed by SIGKILL, then processes that meet its lock
def test_a_killed_holder_never_blocks_and_a_live_one_refuses_a_resume(tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl")
    sync, run_dir = tmp_path / "sync", tmp_path / "run"
    sync.mkdir()
    holder = start(train_args(rows, 4, 1, f"out_dir={run_dir}"), tmp_path, sync)
    wait_for(lambda: (sync / f"locked-{holder.pid}").exists() or holder.poll() is not None, "the lock")
    resume = start(train_args(rows, 4, 1, f"out_dir={run_dir}", "train.resume=auto"), tmp_path, sync, hooks=False)
    code, _, err = finish(resume)
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"is in use by process {holder.pid}" in err, err
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=TIMEOUT_S)
    assert (run_dir / PID_NAME).read_text().strip() == str(holder.pid)  # what the killed holder left behind
    code, out, err = finish(start(train_args(rows, 4, 1, f"out_dir={run_dir}"), tmp_path, sync, hooks=False))
    assert code == 0, err[-3000:]
    check_run(run_dir, 4, 1)


def test_bitsandbytes_optional_kernel_warning_is_not_printed():
    # bitsandbytes logs it while it is imported (on CPUs with AVX512-BF16, when the `kernels` package is absent).
    script = "import sys, qwenft, bitsandbytes\nfrom qwenft.cli import main\nmain(sys.argv[1:])\n"
    result = subprocess.run([sys.executable, "-c", script, "plan", "model=tiny-random"], cwd=ROOT,
                            capture_output=True, text=True, timeout=TIMEOUT_S, env=env(ROOT))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "gemm_4bit_forward" not in result.stderr and "kernels-community" not in result.stderr, result.stderr[-2000:]


def test_only_the_missing_kernels_package_is_demoted():
    from qwenft.logfilter import BNB_CPU_LOGGER, KERNELS_MISSING

    logger, records = logging.getLogger(BNB_CPU_LOGGER), []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.propagate = False  # this test's handler only (Hydra's handlers of other tests may still be on the root)
    try:
        logger.setLevel(logging.INFO)
        logger.warning("%s. Please make sure you already `pip install kernels`", KERNELS_MISSING)
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s", "HTTP 404 for the kernel")
        logger.error("a real bitsandbytes error")
        assert [(r.levelname, r.getMessage()) for r in records] == [
            ("WARNING", "Failed to load CPU gemm_4bit_forward from kernels-community: HTTP 404 for the kernel"),
            ("ERROR", "a real bitsandbytes error")]
        records.clear()
        logger.setLevel(logging.DEBUG)
        logger.warning("%s.", KERNELS_MISSING)
        assert [r.levelname for r in records] == ["DEBUG"]  # still there for whoever asks for debug logs
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
