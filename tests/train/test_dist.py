"""Several processes (torchrun, gloo on a CPU), the dist presets, RoPE scaling and the attention implementations."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from qwenft.config import QwenftError
from tests.conftest import ROOT, compose_config, run_main
from tests.train.conftest import KILL_AFTER_CHECKPOINT_2, assert_same_training, common_args, torchrun

# one xdist group with the other file of several processes: the one-process references (tests/train/conftest.py)
# are built once, by one worker
pytestmark = pytest.mark.xdist_group("dist")

DIST_PRESETS = sorted(p.stem for p in (ROOT / "conf" / "dist").glob("*.yaml"))

@pytest.mark.slow  # torchrun: two gloo ranks and a one-rank reference
def test_torchrun_two_ranks_equal_one_process_with_the_same_global_batch(tmp_path, single_process_run,
                                                                         one_rank_ddp_run):
    reference, rows = single_process_run
    work = tmp_path / "work"
    # No out_dir: the default outputs/train/<time>_<pid> is used, and rank 1 starts 1.5 s late (LAUNCHER).
    args = [*common_args(rows), "train.batch_size=1", "eval.after_train=true", "eval.max_eval_prompts=2",
            "eval.max_new_tokens=4", "eval.samples_in_report=1"]
    result = torchrun(tmp_path, work, args)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Traceback" not in result.stderr

    runs = list((work / "outputs" / "train").iterdir())
    assert len(runs) == 1, runs  # exactly one run directory
    assert [p.name for p in (work / "outputs").iterdir()] == ["train"]
    run_dir = runs[0]
    adapters = [p for p in work.rglob("adapter_model.safetensors") if "checkpoints" not in p.parts]
    assert adapters == [run_dir / "adapter" / "adapter_model.safetensors"]  # exactly one adapter
    for name in ("config.yaml", "metrics.json", "report.md", "train.log", ".hydra"):
        assert (run_dir / name).exists(), name  # the evaluation ran on rank 0 after training, no deadlock
    checkpoint = run_dir / "checkpoints" / "checkpoint-2"
    assert (checkpoint / "rng_state_0.pth").is_file() and (checkpoint / "rng_state_1.pth").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["checkpoint-2", "checkpoint-4"]
    log = (run_dir / "train.log").read_text()
    assert log.count("distributed: ddp") == 1  # rank 0 alone writes the log file
    assert result.stdout.count("run directory:") == 1
    assert_same_training(run_dir, reference, same_arithmetic=one_rank_ddp_run)


@pytest.mark.slow  # torchrun: two ranks, one killed by SIGKILL, then resumed
def test_torchrun_resume_after_sigkill_equals_one_process(tmp_path, single_process_run, one_rank_ddp_run):
    reference, rows = single_process_run
    run_dir = tmp_path / "run"
    args = [*common_args(rows), "train.batch_size=1", "eval.after_train=false", f"out_dir={run_dir}"]
    result = torchrun(tmp_path, tmp_path, args, patch=KILL_AFTER_CHECKPOINT_2)
    assert result.returncode != 0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["checkpoint-2"]
    assert not (run_dir / "adapter").exists()

    result = torchrun(tmp_path, tmp_path, [*args, "train.resume=auto"])
    assert result.returncode == 0, result.stderr[-4000:]
    assert "resuming from" in result.stderr + result.stdout
    assert_same_training(run_dir, reference, resumed=True, same_arithmetic=one_rank_ddp_run)


@pytest.mark.slow  # accelerate launch: two processes
def test_accelerate_launch_two_processes_equal_one_process(tmp_path, single_process_run, one_rank_ddp_run):
    reference, rows = single_process_run
    work = tmp_path / "work"
    result = torchrun(tmp_path, work, [*common_args(rows), "train.batch_size=1", "eval.after_train=false"],
                      accelerate=True)
    assert result.returncode == 0, result.stderr[-4000:]
    runs = list((work / "outputs" / "train").iterdir())
    assert len(runs) == 1, runs
    assert_same_training(runs[0], reference, same_arithmetic=one_rank_ddp_run)


# --- presets -------------------------------------------------------------------------------------------------


def test_the_five_presets_exist():
    assert DIST_PRESETS == ["ddp", "deepspeed_zero2", "deepspeed_zero3", "fsdp", "none"]
    assert compose_config().dist.name == "none"  # one process is the default


@pytest.mark.parametrize("preset", DIST_PRESETS)
def test_every_dist_preset_composes_validates_and_maps_to_training_arguments(preset, monkeypatch):
    from qwenft.train.dist import training_kwargs

    config = compose_config(f"dist={preset}", "model=qwen2.5-7b-instruct")
    dcfg = config.dist
    assert dcfg.name == preset
    kwargs = training_kwargs(config, cuda=True)
    assert kwargs["ddp_timeout"] == dcfg.timeout_s
    if preset == "fsdp":
        from transformers import TrainingArguments

        # QLoRA under FSDP: 4-bit weights packed into bf16, the rest of the base loaded in bf16
        assert dcfg.quant_storage == "bfloat16"
        assert kwargs["fsdp"] is True and kwargs["fsdp_config"]["transformer_layer_cls_to_wrap"] == ["Qwen2DecoderLayer"]
        monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")  # TrainingArguments sets it; restored after
        plugin = TrainingArguments(output_dir="unused", use_cpu=True, **kwargs).fsdp_plugin_args
        assert plugin["fsdp_version"] == 2 and plugin["state_dict_type"] == "FULL_STATE_DICT"
        assert plugin["transformer_cls_names_to_wrap"] == "Qwen2DecoderLayer" and plugin["reshard_after_forward"]
    elif preset.startswith("deepspeed"):
        stage = int(preset[-1])
        assert kwargs["deepspeed"]["zero_optimization"]["stage"] == stage
        assert dcfg.quant_storage == ("bfloat16" if stage == 3 else "uint8")
        assert "fsdp" not in kwargs
    else:
        assert "fsdp" not in kwargs and "deepspeed" not in kwargs
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets: the process-group backend is named
    assert training_kwargs(config, cuda=False)["ddp_backend"] == "gloo"
    assert training_kwargs(config, cuda=True)["ddp_backend"] == "nccl"


def test_dist_none_under_several_processes_is_ddp(monkeypatch):
    from qwenft.train.dist import resolve_strategy

    config = compose_config()
    assert resolve_strategy(config.dist) == "none"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resolve_strategy(config.dist) == "ddp"


@pytest.mark.parametrize("override, key", [
    ("dist.strategy=zero", "dist.strategy"),
    ("dist.backend=mpi", "dist.backend"),
    ("dist.quant_storage=int4", "dist.quant_storage"),
    ("dist.timeout_s=0", "dist.timeout_s"),
    ("dist.bogus=1", "dist.bogus"),
    ("dist=zero9", "dist=zero9"),
    ("dist.fsdp.version=2", "dist.fsdp"),  # fsdp settings with dist=none
])
def test_bad_dist_overrides_exit_2_naming_the_key(override, key, capsys):
    from qwenft.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train", override])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err, err


@pytest.mark.parametrize("command", ["train", "plan"])
def test_a_typo_in_the_fsdp_settings_exits_2_naming_the_key(command, capsys):
    # transformers ignores fsdp_config keys it does not read: the run would train fully sharded, not as asked
    from qwenft.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([command, "model=tiny-random", "dist=fsdp", "dist.fsdp.reshard_after_forwad=false", "plan.processes=2"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("qwenft: error: unknown key 'dist.fsdp.reshard_after_forwad' (did you mean "
                          "dist.fsdp.reshard_after_forward?)"), err
    config = compose_config("dist=fsdp", "++dist.fsdp.fsdp_cpu_offload=false")  # transformers strips an fsdp_ prefix
    assert config.dist.fsdp["fsdp_cpu_offload"] is False


@pytest.mark.parametrize("preset", ["deepspeed_zero2", "deepspeed_zero3"])
def test_deepspeed_preset_without_the_package_is_one_line_at_start(preset, tmp_path, capsys, monkeypatch):
    real_find_spec = importlib.util.find_spec  # as if deepspeed were not installed (CI installs it)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "deepspeed" else real_find_spec(name, *args))
    code, err = run_main(["train", "model=tiny-random", f"dist={preset}", f"out_dir={tmp_path / 'run'}"], capsys)
    assert code == 2
    assert len(err.splitlines()) == 1 and "deepspeed package" in err and f"dist={preset}" in err, err
    assert not (tmp_path / "run").exists()  # stopped before Hydra made the run directory


def test_other_commands_and_multirun_under_a_launch_are_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it; both stop before any process group is made
    code, err = run_main(["eval", "model=tiny-random", f"out_dir={tmp_path / 'run'}"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "qwenft eval runs in one process" in err, err
    code, err = run_main(["train", "-m", "model=tiny-random", "lora.r=4,8"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "multirun" in err, err
    assert not (tmp_path / "run").exists()


def test_fsdp_without_a_launch_is_one_line_at_start(tmp_path, capsys):
    # FSDP trains on CPU processes too (tests/train/test_dist_launch.py), but only under torchrun / accelerate launch
    code, err = run_main(["train", "model=tiny-random", "dist=fsdp", f"out_dir={tmp_path / 'run'}"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "dist=fsdp needs a distributed launch" in err, err
    assert not (tmp_path / "run").exists()


# --- RoPE scaling ----------------------------------------------------------------------------------------------


def tiny(tmp_path, *overrides):
    return compose_config("model=tiny-random", "quant=none", f"out_dir={tmp_path}", *overrides)


def test_rope_scaling_reaches_the_loaded_model(tmp_path):
    from qwenft.model import load_model

    yarn = "model.rope_scaling={rope_type: yarn, factor: 4.0, original_max_position_embeddings: 2048}"
    plain, _ = load_model(tiny(tmp_path), device="cpu")
    scaled, tokenizer = load_model(tiny(tmp_path, yarn), device="cpu")
    params = scaled.config.rope_parameters
    assert params["rope_type"] == "yarn" and params["factor"] == 4.0
    assert params["original_max_position_embeddings"] == 2048
    assert params["rope_theta"] == plain.config.rope_parameters["rope_theta"]  # the checkpoint's base is kept
    assert scaled.config.max_position_embeddings == 8192 and plain.config.max_position_embeddings == 2048
    rotary, plain_rotary = scaled.model.rotary_emb, plain.model.rotary_emb
    assert rotary.rope_type == "yarn" and plain_rotary.rope_type == "default"
    # YaRN's attention temperature, 0.1 ln(factor) + 1 (Peng et al. 2023, eq. 22; transformers get_mscale)
    assert rotary.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0)
    # the highest frequency is left alone, the lowest is interpolated by the factor
    assert rotary.inv_freq[0] == pytest.approx(plain_rotary.inv_freq[0].item())
    assert rotary.inv_freq[-1] == pytest.approx(plain_rotary.inv_freq[-1].item() / 4.0)
    ids = torch.tensor([tokenizer("a long enough input to rotate").input_ids])
    with torch.no_grad():
        assert not torch.allclose(scaled(ids).logits, plain(ids).logits)  # the model runs with it

    linear, _ = load_model(tiny(tmp_path, "model.rope_scaling={rope_type: linear, factor: 2.0}"), device="cpu")
    # linear interpolation divides every frequency by the factor (positions / factor); exact in fp32
    torch.testing.assert_close(linear.model.rotary_emb.inv_freq, plain_rotary.inv_freq / 2.0, rtol=0, atol=0)


def test_context_beyond_the_model_without_scaling_warns(tmp_path, caplog):
    from qwenft.model import load_model

    with caplog.at_level("WARNING", logger="qwenft.model"):
        load_model(tiny(tmp_path, "data.max_seq_len=4096"), device="cpu")
    assert any("exceeds the model's max_position_embeddings=2048" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="qwenft.model"):
        load_model(tiny(tmp_path, "data.max_seq_len=4096", "model.rope_scaling={rope_type: yarn, factor: 2.0}"),
                   device="cpu")
    assert not any("exceeds" in r.message for r in caplog.records)


@pytest.mark.parametrize("override, key", [
    ("model.rope_scaling={rope_type: su, factor: 2.0}", "model.rope_scaling.rope_type"),
    ("model.rope_scaling={rope_type: yarn, factor: 0.5}", "model.rope_scaling.factor"),
    ("model.rope_scaling={rope_type: yarn}", "model.rope_scaling.factor"),
    ("model.rope_scaling={rope_type: linear, factor: 2.0, beta_fast: 16.0}", "model.rope_scaling.beta_fast"),
    ("model.rope_scaling={factor: 2.0}", "model.rope_scaling.factor"),
    ("model.rope_scaling={rope_type: yarn, factor: 2.0, scale: 3}", "model.rope_scaling.scale"),
])
def test_bad_rope_scaling_names_the_key(override, key, capsys):
    code, err = run_main(["plan", "model=tiny-random", override], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and key in err, err


def test_plan_accounts_for_the_longer_context():
    from qwenft.plan import make_plan

    yarn = "model.rope_scaling={rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}"
    short = make_plan(compose_config("model=qwen2.5-7b-instruct", "data.max_seq_len=4096", command="plan"))
    long_ = make_plan(compose_config("model=qwen2.5-7b-instruct", "data.max_seq_len=65536", yarn, command="plan"))
    unscaled = make_plan(compose_config("model=qwen2.5-7b-instruct", "data.max_seq_len=65536", command="plan"))
    assert short["model"]["architecture"]["max_position_embeddings"] == 32768
    assert long_["model"]["architecture"]["max_position_embeddings"] == 131072
    assert long_["model"]["original_max_position_embeddings"] == 32768
    # KV cache: 57,344 B per token in bf16 (DESIGN.md), linear in the context
    assert short["kv_cache"]["bytes"] == 57344 * 4096 and long_["kv_cache"]["bytes"] == 57344 * 65536
    for name in ("with_checkpointing", "without_checkpointing"):
        assert long_["training"][name]["held_at_loss"] > 8 * short["training"][name]["held_at_loss"]
        assert long_["training"][name]["peak"] > short["training"][name]["peak"]
    assert max(r["seq_len"] for r in long_["budget"]["largest_batch"]) == 131072
    assert max(r["seq_len"] for r in short["budget"]["largest_batch"]) == 32768
    assert short["warnings"] == [] and long_["warnings"] == []
    assert len(unscaled["warnings"]) == 1 and "model.rope_scaling is not set" in unscaled["warnings"][0]


# --- attention implementations ---------------------------------------------------------------------------------


def test_eager_and_sdpa_give_the_same_logits(tmp_path):
    from qwenft.model import load_model

    eager, tokenizer = load_model(tiny(tmp_path, "model.attn_implementation=eager"), device="cpu")
    sdpa, _ = load_model(tiny(tmp_path, "model.attn_implementation=sdpa"), device="cpu")
    assert eager.config._attn_implementation == "eager" and sdpa.config._attn_implementation == "sdpa"
    batch = tokenizer(["a short one", "a somewhat longer input, so the first row is padded"], padding=True,
                      return_tensors="pt")
    with torch.no_grad():
        a = eager(**batch).logits
        b = sdpa(**batch).logits
    keep = batch["attention_mask"].bool()
    # fp32, same math: eager is matmul -> softmax -> matmul, sdpa a fused kernel that sums in another order;
    # measured max difference 1.8e-7 on logits up to 0.66. 1e-5 allows that rounding, yet a softmax scale off by
    # 1% moves these (nearly uniform, random-weight) logits by 7.9e-5 (measured), so a real difference fails.
    torch.testing.assert_close(a[keep], b[keep], rtol=0, atol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
def test_flash_attention_without_the_package_is_one_line(tmp_path, capsys):
    from qwenft.model import load_model

    code, err = run_main(["train", "model=tiny-random", "model.attn_implementation=flash_attention_2",
                          f"out_dir={tmp_path / 'run'}"], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "flash_attention_2 needs the flash-attn package" in err and "use sdpa" in err
    assert not (tmp_path / "run").exists()
    with pytest.raises(QwenftError, match="flash-attn package"):
        load_model(tiny(tmp_path, "model.attn_implementation=flash_attention_2"), device="cpu")
