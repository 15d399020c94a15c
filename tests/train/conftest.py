"""The train room's helpers for several processes: torchrun / accelerate launch of ``qwenft train`` on gloo CPU
ranks, a SIGKILL after a checkpoint, and the one-process references that tests/train/test_dist.py and
test_dist_launch.py compare with (session-scoped: both files are one xdist group, so one worker builds them once)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, compose_config, write_rows

# The two ranks' default run directory names differ (time and process id; rank 1 starts 1.5 s late): without the
# broadcast of rank 0's out_dir they would write two run directories.
LAUNCHER = """
import os, sys, time
if os.environ.get("RANK") == "1":
    time.sleep(1.5)
{patch}
from qwenft.cli import main
main(sys.argv[1:])
"""


def kill_after_checkpoint(step: int) -> str:
    """A test-only patch (the ``patch`` of :func:`tests.conftest.run_train` and :func:`torchrun`): the process kills
    itself by SIGKILL right after checkpoint-``step`` is in place (the on_save hook that renamed it has returned)."""
    return f"""
import os, signal
from qwenft.train.callbacks import AtomicCheckpoints
_on_save = AtomicCheckpoints.on_save
def _save_then_die(self, args, state, control, **kwargs):
    _on_save(self, args, state, control, **kwargs)
    if state.global_step == {step}:
        os.kill(os.getpid(), signal.SIGKILL)
AtomicCheckpoints.on_save = _save_then_die
"""


KILL_AFTER_CHECKPOINT_2 = kill_after_checkpoint(2)


def child_env() -> dict:
    # One thread per process: the two ranks share this machine's cores with the test runner.
    return {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(tmp_path: Path, cwd: Path, args: list, patch: str = "", timeout: int = 900, accelerate: bool = False,
             processes: int = 2):
    """``torchrun --standalone --nproc_per_node=PROCESSES <launcher> train ARGS`` in ``cwd`` (or ``accelerate
    launch`` with 2 processes).

    ``timeout`` is a hang guard, not a speed check: two gloo ranks on 2 cores take ~50 s alone, and several times
    that when another torch process shares the cores (they spin-wait on each other's threads).
    """
    launcher = tmp_path / "launch_qwenft.py"
    launcher.write_text(LAUNCHER.format(patch=patch))
    cwd.mkdir(parents=True, exist_ok=True)
    if accelerate:  # --multi_gpu: accelerate's torch-elastic launcher, which on a CPU runs gloo processes
        launch = ["accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                  "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]
    else:
        launch = ["torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    command = [sys.executable, "-m", *launch, str(launcher), "train", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=child_env())


def common_args(rows: Path) -> list:
    # 16 rows, 2 held out: 14 training rows = 7 global batches of 2; lr without warmup so every step moves.
    return ["model=tiny-random", "quant=none", "lora.lora_dropout=0.0", "train.gradient_checkpointing=false",
            f"data.sources=[{{name: toy, path: '{rows}', format: alpaca, weight: 1.0, eval_rows: 2}}]",
            "data.max_seq_len=128", "train.max_steps=4", "train.save_steps=2", "train.eval_steps=100",
            "train.logging_steps=1", "train.lr=5e-3", "train.warmup_ratio=0.0", "logger=none"]


@pytest.fixture(scope="session")
def single_process_run(tmp_path_factory):
    """The reference: one process, batch 2 (the global batch of 2 ranks x batch 1), in this process."""
    from qwenft.train.run import run

    tmp = tmp_path_factory.mktemp("single")
    rows = write_rows(tmp / "rows.jsonl", n=16)
    config = compose_config(*common_args(rows), "train.batch_size=2", "eval.after_train=false",
                            f"out_dir={tmp / 'run'}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs (OMP_NUM_THREADS=1); a shared machine is faster without spinning
    try:
        return run(config), rows
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def one_rank_ddp_run(single_process_run, tmp_path_factory):
    """The reference with the ranks' arithmetic: ``torchrun --nproc_per_node=1``, ``dist=ddp``, batch 1 x
    ``train.grad_accum=2``: the same global batch as two ranks x batch 1, fed row by row through the same kernels
    and the same loss scaling, so DDP's two ranks must match it bit for bit (measured: equal on an AVX-512 and an
    AVX2-only CPU; one process at batch 2, or at dist=none, differs by one float32 step in step 1's gradients)."""
    _, rows = single_process_run
    tmp = tmp_path_factory.mktemp("one_rank")
    args = [*common_args(rows), "train.batch_size=1", "train.grad_accum=2", "dist=ddp", "eval.after_train=false",
            f"out_dir={tmp / 'run'}"]
    result = torchrun(tmp, tmp, args, processes=1)
    assert result.returncode == 0, result.stderr[-4000:]
    return tmp / "run"


def history(run_dir: Path, step: int) -> dict:
    state = json.loads((run_dir / "checkpoints" / f"checkpoint-{step}" / "trainer_state.json").read_text())
    return {h["step"]: h for h in state["log_history"] if "loss" in h}


def assert_identical_adapters(run_dir: Path, reference: Path) -> None:
    """The two runs' saved adapters hold the same tensors bit for bit, and training moved lora_B off zero."""
    a = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(reference / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and len(a) > 0
    assert [name for name in a if not torch.equal(a[name], b[name])] == []
    assert any(w.abs().sum() > 0 for n, w in a.items() if "lora_B" in n)


def assert_same_training(run_dir: Path, reference: Path, resumed: bool = False,
                         same_arithmetic: Optional[Path] = None) -> None:
    """Same losses, gradient norms, token count and (within float noise) the same adapter as the one-process
    ``reference``; with ``same_arithmetic`` (:func:`one_rank_ddp_run`), the very same adapter, losses and gradient
    norms as that run, bit for bit.

    ``resumed``: metrics.json of a resumed run counts only the tokens trained since the resume.
    """
    ours, theirs = history(run_dir, 4), history(reference, 4)
    assert sorted(ours) == sorted(theirs) == [1, 2, 3, 4]
    for step in ours:
        # The logged loss is the token-weighted mean over the global batch in both runs (a missing x world_size
        # rescaling would halve it, other rows would change it); fp32 summation order only.
        assert ours[step]["loss"] == pytest.approx(theirs[step]["loss"], rel=1e-5)
        # The gradient norm before clipping sees the loss scale directly (Adam's update would hide a factor 2).
        assert ours[step]["grad_norm"] == pytest.approx(theirs[step]["grad_norm"], rel=1e-4)
    tokens = [json.loads((d / "metrics.json").read_text())["train"]["train_tokens"] for d in (run_dir, reference)]
    assert tokens[0] == tokens[1] > 0 or resumed  # summed over both ranks
    if same_arithmetic is not None:
        # Adam divides by sqrt(v): a one-step float32 difference in step 1's gradient grows to 1.6e-5 after 4 steps
        # at lr 5e-3 on one CPU (2e-6 on another), so against another arithmetic no element-wise bound holds on
        # every machine; against the same arithmetic nothing may differ.
        same = history(same_arithmetic, 4)
        for step, logged in ours.items():
            assert (logged["loss"], logged["grad_norm"]) == (same[step]["loss"], same[step]["grad_norm"]), step
        assert_identical_adapters(run_dir, same_arithmetic)
        return
    a = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(reference / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        # Two ranks sum their two rows' gradients in an all-reduce; one process sums them in its matmuls and pads
        # the shorter row: fp32 summation-order noise (~1e-7 relative). Adam divides by sqrt(v), so elements with
        # gradients near zero can move a little more; measured max 1.6e-7 after 4 steps at lr 5e-3 (weights up to
        # 0.13); over two nodes (ddp 3.5e-6), with fsdp and ZeRO-2 (5.7e-6) and ZeRO-3 (8.3e-6; their reductions
        # sum in other orders) 2 of the 32,768 elements, in layer 0's gate_proj lora_A, exceed 1e-6 (fsdp, ddp), the
        # rest stay below 6e-7.
        # 1e-5 is 0.2% of one step's largest move (lr); other rows or another loss scale move weights by
        # ~lr per step, far beyond it.
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5)
    assert any(w.abs().sum() > 0 for n, w in a.items() if "lora_B" in n)  # training moved B off zero
