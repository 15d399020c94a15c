"""`qwenft plan` under FSDP / DeepSpeed ZeRO: per-process rows after sharding over ``plan.processes``."""

from __future__ import annotations

import math

import pytest

from qwenft.config import ConfigError
from qwenft.plan import make_plan
from tests.conftest import compose_config

SEVEN_B = ("model=qwen2.5-7b-instruct", "plan.device=cuda")
SHARDED = ("weights", "lora_weights", "gradients", "optimizer_states")
PER_PROCESS = ("held_at_loss", "loss", "saved_activations")  # each process runs its own micro-batch


def training(*overrides: str) -> dict:
    return make_plan(compose_config(*SEVEN_B, *overrides))["training"]


def halves(whole: int) -> int:
    return math.ceil(whole / 2)  # a shard is rounded up (FSDP2 pads the last dim-0 chunk)


@pytest.mark.parametrize("ckpt", ["with_checkpointing", "without_checkpointing"])
def test_fsdp_over_two_processes_halves_the_sharded_rows_and_leaves_activations(ckpt):
    one, two = training("dist=fsdp")[ckpt], training("dist=fsdp", "plan.processes=2")[ckpt]
    for key in SHARDED:
        assert two[key] == halves(one[key]) and one[key] > 0, key
    for key in PER_PROCESS:
        assert two[key] == one[key], key
    assert one["gathered_weights"] == 0 < two["gathered_weights"]
    # 2 x (lm_head + final norm) while the tail group's all-gather is copied out: the 7B's untied lm_head in bf16
    # (kept in the autocast dtype), the NF4 default's norm in fp32 (k-bit preparation)
    assert two["gathered_weights"] == 2 * (152064 * 3584 * 2 + 3584 * 4)
    # the weights fall by half of 15.2 GB, the gathered lm_head (2.2 GB at its gather) takes some of it back
    assert one["peak"] - two["peak"] > 0.25 * one["weights"]


@pytest.mark.parametrize("native", [True, False], ids=["cpu_with_bf16", "cpu_without_bf16"])
def test_fsdp_on_cpu_processes_plans_gloos_third_copy_at_a_gather(native, monkeypatch):
    """gloo's all-gather keeps its own flat output until the work is dropped (measured: +202 MiB peak for a 200 MiB
    all_gather_into_tensor; the 0.5B's tail gather took 3 x 545 MiB, benchmarks/results/dist_memory.json).

    A CPU plan asks the machine whether bf16 is native (``auto`` dtypes are bf16 there, float32 elsewhere): both
    answers are planned here, so the test holds on any CPU (an AVX2-only CI machine planned float32 weights)."""
    import qwenft.runtime

    monkeypatch.setattr(qwenft.runtime, "native_bf16", lambda device=None: native)
    cpu = make_plan(compose_config("model=qwen2.5-7b-instruct", "plan.device=cpu", "dist=fsdp",
                                   "plan.processes=2"))["training"]["without_checkpointing"]
    lm_head_bytes = 152064 * 3584 * (2 if native else 4)  # the autocast dtype where bf16 is native, else float32
    # three copies (the two of a CUDA plan and gloo's own) of the lm_head and the final norm (fp32)
    assert cpu["gathered_weights"] == 3 * (lm_head_bytes + 3584 * 4)
    if native:  # the same dtypes as on CUDA: exactly gloo's third copy more
        cuda = training("dist=fsdp", "plan.processes=2")["without_checkpointing"]
        assert cpu["gathered_weights"] * 2 == cuda["gathered_weights"] * 3


def test_unsharded_strategies_hold_everything_in_every_process():
    base = training()
    for dist in ("dist=ddp", "dist=none"):
        ddp = training(dist, "plan.processes=4")
        assert ddp["with_checkpointing"] == base["with_checkpointing"], dist
        assert ddp["scope"].startswith("per process; every process holds")
    # fsdp planned for one process: nothing divided, and the scope says to set plan.processes
    alone = training("dist=fsdp")
    assert alone["sharding"] == "fsdp" and "set plan.processes" in alone["scope"]
    assert alone["with_checkpointing"]["gathered_weights"] == 0


def test_zero2_shards_gradients_and_states_but_not_weights():
    one, two = (training("dist=deepspeed_zero2", *extra)["with_checkpointing"] for extra in ((), ("plan.processes=2",)))
    assert two["weights"] == one["weights"] and two["lora_weights"] == one["lora_weights"]
    assert two["gradients"] == halves(one["gradients"])
    assert two["optimizer_states"] == halves(one["optimizer_states"])
    assert two["gathered_weights"] == 0 and two["held_at_loss"] == one["held_at_loss"]
    # the preset's contiguous_gradients + overlap_comm: two fp32 buffers of reduce_bucket_size = 2e8 elements
    assert two["reduce_buffers"] == 2 * 200_000_000 * 4 and one["reduce_buffers"] == 0


def test_zero3_shards_everything_and_gathers_layers():
    one = training("dist=deepspeed_zero3")["without_checkpointing"]
    four = training("dist=deepspeed_zero3", "plan.processes=4")
    rows = four["without_checkpointing"]
    assert four["sharding"] == "zero3" and "over 4 processes" in four["scope"]
    for key in SHARDED:
        assert rows[key] == math.ceil(one[key] / 4), key
    assert rows["held_at_loss"] == one["held_at_loss"]
    # the lm_head qwenft's loss gathers (no layer kept: DeepSpeed's trace never completes), not the whole model
    assert 0 < rows["gathered_weights"] < one["weights"]


ZERO3_HALF_B = ("model=qwen2.5-coder-0.5b-embedded", "model.dtype=float32", "quant=none", "dist=deepspeed_zero3",
                "plan.processes=2")


@pytest.mark.parametrize("device,copies", [("cpu", 2), ("cuda", 1)])
@pytest.mark.parametrize("reuse", [None, 100_000_000])
def test_zero3_gathers_the_lm_head_at_the_loss_and_keeps_no_layer(device, copies, reuse):
    """qwenft's loss runs the body, not the root module's forward, so DeepSpeed's ``reset_step`` (the root's forward
    pre-hook) never runs and its trace never completes: every layer is released after use whatever
    ``stage3_max_reuse_distance`` says. Measured on 2 CPU processes (embedded 0.5B, fp32): no decoder-layer
    parameter gathered at the loss or at the last layer's backward in any of 3 steps; the peak is at the lm_head's
    gather, 1,038-1,039 MiB over the RSS before it: 2 x its 519 MiB (the parameter and gloo's output). The old rule
    kept all 24 layers (1,382 MiB) plus the lm_head: 1,901 MiB."""
    extra = (f"+dist.deepspeed.zero_optimization.stage3_max_reuse_distance={reuse}",) if reuse else ()
    rows = make_plan(compose_config(*ZERO3_HALF_B, f"plan.device={device}", *extra))["training"]
    lm_head = 4 * (151936 * 896 + 896)  # fp32, with the final norm
    got = rows["without_checkpointing"]
    assert got["gathered_weights"] == copies * lm_head
    if device == "cpu":  # 1,038.6 MiB planned at the peak, 1,038-1,039 MiB measured
        assert abs(got["gathered_weights"] / 2**20 - 1038.5) < 1.5
    # the loss phase is the activations at the loss plus the gathered copies (or the loss with one copy)
    assert got["loss_phase"] == max(got["held_at_loss"] + got["loss"] + lm_head,
                                    got["held_at_loss"] + copies * lm_head)


def test_fsdp_without_reshard_after_forward_gathers_everything():
    two = training("dist=fsdp", "plan.processes=2", "dist.fsdp.reshard_after_forward=false")
    rows = two["without_checkpointing"]
    assert two["sharding"] == "fsdp_no_reshard"
    assert rows["gathered_weights"] > rows["weights"]  # all of it gathered, besides the shards


def test_budget_and_largest_batch_follow_the_processes():
    """The fits / largest-batch answers use the per-process peak: 7B bf16 LoRA (15.9 GiB planned) does not fit a
    12 GiB GPU, and over 4 FSDP processes (6.2 GiB each) it does."""
    common = (*SEVEN_B, "quant=none", "dist=fsdp", "data.max_seq_len=512", "plan.gpu_gb=12")
    one = make_plan(compose_config(*common))["budget"]
    four = make_plan(compose_config(*common, "plan.processes=4"))["budget"]
    assert not one["fits"] and four["fits"] and four["peak"] < one["peak"]
    assert four["largest_batch"][0]["batch_size"] > one["largest_batch"][0]["batch_size"]


def test_processes_must_be_positive():
    for bad in ("0", "-2"):
        with pytest.raises(ConfigError, match="plan.processes") as info:
            compose_config(f"plan.processes={bad}")
        assert len(str(info.value).splitlines()) == 1


def test_rendered_plan_says_what_is_modelled(capsys):
    from qwenft.plan.command import render

    render(make_plan(compose_config(*SEVEN_B, "dist=fsdp", "plan.processes=2")))
    out = " ".join(capsys.readouterr().out.split())
    assert "after sharding over 2 processes" in out and "gathered weights" in out
    assert "divide those rows" not in out
