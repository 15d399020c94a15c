"""FSDP on CPU processes (gloo) and a launch over two "nodes" (torchrun's c10d rendezvous on 127.0.0.1).

Both compare with the one-process references of tests/train/conftest.py (batch 2 = 2 ranks x batch 1, with its
tolerances; DDP and the NF4 run also bit for bit with one process of the same strategy at batch 1 x grad_accum 2:
:func:`tests.train.conftest.assert_same_training`).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import compose_config
from tests.conftest import write_rows
from tests.train.conftest import (KILL_AFTER_CHECKPOINT_2, LAUNCHER, assert_identical_adapters, assert_same_training,
                                  child_env, common_args, free_port, history, torchrun)

# one xdist group with the other file of several processes: the one-process references (tests/train/conftest.py)
# are built once, by one worker
pytestmark = pytest.mark.xdist_group("dist")

EVAL_ARGS = ["eval.after_train=true", "eval.max_eval_prompts=2", "eval.max_new_tokens=4", "eval.samples_in_report=1"]

# Checks, on each rank, at the first training step, that accelerate really shards (FSDP2 turns every parameter into
# a DTensor): accelerate drops the FSDP plugin on CPU processes unless qwenft makes it take it, and the run would
# then be plain DDP with the same numbers.
ASSERT_SHARDED = """
import transformers
_step = transformers.Trainer.training_step
def _checked_step(self, model, inputs, *args, **kwargs):
    if self.state.global_step == 0:
        from torch.distributed.tensor import DTensor
        params = list(model.parameters())
        assert self.is_fsdp_enabled and all(isinstance(p, DTensor) for p in params), "not sharded"
        print(f"sharded: {len(params)} DTensor parameters", flush=True)
    return _step(self, model, inputs, *args, **kwargs)
transformers.Trainer.training_step = _checked_step
"""


@pytest.mark.slow  # torchrun: FSDP on two ranks, killed and resumed
def test_fsdp_two_cpu_ranks_resume_after_sigkill_and_evaluate_equal_one_process(tmp_path, single_process_run):
    reference, rows = single_process_run
    run_dir = tmp_path / "run"
    args = [*common_args(rows), "train.batch_size=1", "dist=fsdp", f"out_dir={run_dir}"]
    result = torchrun(tmp_path, tmp_path, [*args, "eval.after_train=false"],
                      patch=ASSERT_SHARDED + KILL_AFTER_CHECKPOINT_2)
    assert result.returncode != 0
    assert result.stdout.count("sharded: ") == 2, result.stderr[-4000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["checkpoint-2"]
    assert not (run_dir / "adapter").exists()

    result = torchrun(tmp_path, tmp_path, [*args, "train.resume=auto", *EVAL_ARGS], patch=ASSERT_SHARDED)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Traceback" not in result.stderr
    out = result.stdout + result.stderr
    assert "resuming from" in out and "distributed: fsdp (dist=fsdp), 2 process(es)" in out
    # steps 1-2 from the killed run, 3-4 after the resume, and the adapter: as one process with batch 2
    assert_same_training(run_dir, reference, resumed=True)
    # the evaluation after training ran on rank 0 from the saved adapter (the ranks held shards only)
    assert out.count("evaluating the saved adapter") == 1
    assert (run_dir / "report.md").is_file() and (run_dir / "generations.jsonl").is_file()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["train"]["global_step"] == 4 and "memory" in metrics and "eval" in metrics["memory"], metrics.keys()


@pytest.mark.slow  # torchrun: FSDP QLoRA on two ranks
def test_fsdp_qlora_nf4_in_bfloat16_storage_trains_on_two_cpu_ranks(tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl", n=16)
    nf4 = [*common_args(rows), "quant=nf4"]
    run_dir = tmp_path / "run"
    result = torchrun(tmp_path, tmp_path, [*nf4, "train.batch_size=1", "dist=fsdp", f"out_dir={run_dir}",
                                           *EVAL_ARGS], patch=ASSERT_SHARDED)
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout + result.stderr
    assert result.stdout.count("sharded: ") == 2 and "NF4, compute torch.bfloat16" in out
    assert out.count("evaluating the saved adapter") == 1 and (run_dir / "report.md").is_file()
    # The reference: FSDP in one process, batch 1 x grad_accum 2 (the two ranks' global batch, row by row). Under
    # bf16 autocast one process at batch 2 without FSDP rounds otherwise (bf16 keeps 8 bits; Adam turns the rounding
    # of near-zero gradients into moves of up to lr): its step-2 loss was 2.6e-4 relative off on an AVX2-only CPU,
    # 1.7e-5 on an AVX-512 one. With the same sharded path and per-row shapes the ranks match it bit for bit
    # (measured on both CPUs); FSDP against the unsharded path is checked in float32 (the resume test above).
    reference = tmp_path / "one"
    one = torchrun(tmp_path, tmp_path, [*nf4, "train.batch_size=1", "train.grad_accum=2", "dist=fsdp",
                                        "eval.after_train=false", f"out_dir={reference}"], processes=1)
    assert one.returncode == 0, one.stderr[-4000:]
    ours, theirs = history(run_dir, 4), history(reference, 4)
    assert sorted(ours) == sorted(theirs) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert ours[step]["loss"] == theirs[step]["loss"], step
        # the norm of a sharded gradient: each rank's sum of squares, then their sum (float32, another order than
        # one shard's; seen one float32 step apart on an AVX2-only CPU); below max_grad_norm, so no clipping
        assert ours[step]["grad_norm"] == pytest.approx(theirs[step]["grad_norm"], rel=1e-6), step
    assert ours[4]["loss"] < ours[1]["loss"]  # it trains
    assert_identical_adapters(run_dir, reference)


@pytest.mark.slow  # torchrun: ZeRO-2/3 on two ranks
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
@pytest.mark.parametrize("preset", ["deepspeed_zero2", "deepspeed_zero3"])
def test_deepspeed_two_cpu_ranks_equal_one_process(preset, tmp_path, single_process_run):
    # DeepSpeed picks its CPU accelerator where no GPU is found (and JIT-builds its shm op the first time, ~60 s)
    reference, rows = single_process_run
    run_dir = tmp_path / "run"
    evaluate = EVAL_ARGS if preset == "deepspeed_zero3" else ["eval.after_train=false"]
    result = torchrun(tmp_path, tmp_path, [*common_args(rows), "train.batch_size=1", f"dist={preset}",
                                           f"out_dir={run_dir}", *evaluate])
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout + result.stderr
    assert f"distributed: deepspeed (dist={preset}), 2 process(es)" in out
    assert_same_training(run_dir, reference)
    if preset == "deepspeed_zero3":  # weights partitioned: rank 0 evaluates the saved adapter
        assert out.count("evaluating the saved adapter") == 1 and (run_dir / "report.md").is_file()


def two_nodes(tmp_path: Path, cwd: Path, args: list, timeout: int = 900) -> list:
    """Two ``torchrun --nnodes=2 --nproc_per_node=1 --node_rank=N --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:P``
    commands, as on two machines, started together in ``cwd``; returns both CompletedProcess-like results."""
    launcher = tmp_path / "launch_qwenft.py"
    launcher.write_text(LAUNCHER.format(patch=""))
    cwd.mkdir(parents=True, exist_ok=True)
    port = free_port()
    nodes = []
    for node_rank in (0, 1):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                   f"--node_rank={node_rank}", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                   "--rdzv_id=qwenft-test", str(launcher), "train", *args]
        nodes.append(subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=child_env()))
    results = []
    for node in nodes:
        stdout, stderr = node.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(node.args, node.returncode, stdout, stderr))
    return results


@pytest.mark.slow  # torchrun: two nodes' rendezvous, one process each
@pytest.mark.parametrize("dist", ["ddp", "fsdp"])
def test_two_nodes_one_process_each_equal_one_process(dist, tmp_path, single_process_run, one_rank_ddp_run):
    reference, rows = single_process_run
    work = tmp_path / "work"
    # No out_dir: rank 0's default outputs/train/<time>_<pid> is broadcast to the other node's process.
    results = two_nodes(tmp_path, work, [*common_args(rows), "train.batch_size=1", "eval.after_train=false",
                                         f"dist={dist}"])
    for result in results:
        assert result.returncode == 0, result.stderr[-4000:]
    out = "".join(r.stdout + r.stderr for r in results)
    assert f"distributed: {dist} (dist={dist}), 2 process(es)" in out
    runs = list((work / "outputs" / "train").iterdir())
    assert len(runs) == 1, runs  # one run directory
    adapters = [p for p in work.rglob("adapter_model.safetensors") if "checkpoints" not in p.parts]
    assert adapters == [runs[0] / "adapter" / "adapter_model.safetensors"]  # one adapter
    assert out.count("run directory:") == 1
    assert_same_training(runs[0], reference, same_arithmetic=one_rank_ddp_run if dist == "ddp" else None)


# --- bad setups: one line each ---------------------------------------------------------------------------------


@pytest.mark.slow  # torchrun: several processes, each stopping with one line
def test_more_processes_than_the_examples_can_feed_is_one_line_per_rank(tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl", n=16)
    run_dir = tmp_path / "run"
    # 14 training rows, 2 processes x batch 8 = 16 per step: accelerate would repeat 2 rows to fill the batch
    result = torchrun(tmp_path, tmp_path, [*common_args(rows), "train.batch_size=8", "eval.after_train=false",
                                           f"out_dir={run_dir}"], timeout=300)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("qwenft: error:")]
    assert len(errors) == 2, result.stderr[-4000:]  # each rank's one line
    assert "14 training example(s) cannot feed 2 processes x train.batch_size=8 (16 per step" in errors[0]
    assert "Traceback (most recent call last)" not in result.stdout
    assert not (run_dir / "adapter").exists() and not (run_dir / "config.yaml").exists()


@pytest.mark.parametrize("preset", ["fsdp", "deepspeed_zero3"])
def test_sharded_nf4_in_uint8_storage_is_one_line(preset, monkeypatch):
    import importlib.util

    from qwenft.config import QwenftError
    from qwenft.train import dist
    from qwenft.train.dist import check_strategy

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # as if deepspeed were installed: the check after it runs
                        lambda name, *args: object() if name == "deepspeed" else real_find_spec(name, *args))
    monkeypatch.setattr(dist, "check_zero_keys", lambda zero: None)  # it imports deepspeed's own ZeRO config
    monkeypatch.setenv("LOCAL_RANK", "0")  # as under a launcher (one process: no process group is made)
    config = compose_config("model=tiny-random", f"dist={preset}", "quant=nf4", "dist.quant_storage=uint8")
    with pytest.raises(QwenftError, match=f"^dist={preset} with quant=nf4 needs dist.quant_storage=bfloat16: FSDP "
                                          "and ZeRO-3 shard only floating-point tensors$"):
        check_strategy(config, cuda=True)
    check_strategy(compose_config("model=tiny-random", f"dist={preset}", "quant=nf4"), cuda=True)  # the preset's


def test_fsdp_nf4_in_uint8_storage_stops_at_start_exit_2(tmp_path, monkeypatch, capsys):
    from qwenft.cli import main

    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "model=tiny-random", "dist=fsdp", "quant=nf4", "dist.quant_storage=uint8",
              f"out_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and "dist.quant_storage=bfloat16" in err, err
    assert not (tmp_path / "run").exists()


def test_a_typo_in_the_zero_settings_is_one_line_before_the_model_loads(monkeypatch):
    # DeepSpeed refuses an unknown zero_optimization key only when its engine starts: a pydantic traceback on every
    # rank, after each has loaded the model
    pytest.importorskip("deepspeed")
    from qwenft.config import QwenftError
    from qwenft.train.dist import check_strategy

    monkeypatch.setenv("LOCAL_RANK", "0")
    config = compose_config("model=tiny-random", "dist=deepspeed_zero3",
                            "++dist.deepspeed.zero_optimization.stage3_prefetch_bucket_sise=auto")
    with pytest.raises(QwenftError, match=r"^unknown key 'dist.deepspeed.zero_optimization.stage3_prefetch_bucket_sise' "
                                          r"\(did you mean dist.deepspeed.zero_optimization.stage3_prefetch_bucket_size\?\)"):
        check_strategy(config, cuda=False)
    for preset in ("deepspeed_zero2", "deepspeed_zero3"):  # the presets' own keys are DeepSpeed's
        check_strategy(compose_config("model=tiny-random", f"dist={preset}"), cuda=False)
