"""The benchmark entry points cannot rot: the GPU script's tiny mode and the CPU suite's quick mode run here."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, SHARED_DATA


def _env(tmp_path):
    return dict(os.environ, OUT=str(tmp_path), HF_HUB_OFFLINE="1", WANDB_MODE="offline",
                TOKENIZERS_PARALLELISM="false")


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow  # the GPU check script in --tiny mode, in a new interpreter
def test_gpu_script_tiny_mode_writes_every_field(tmp_path):
    """`bash benchmarks/gpu/run.sh --tiny`: the 7B check's code path on a shape-reduced model on the CPU."""
    proc = subprocess.run(["bash", str(ROOT / "benchmarks/gpu/run.sh"), "--tiny"], cwd=ROOT, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_qlora_tiny.json").read_text())
    settings = result["settings"]
    assert result["mode"] == "tiny" and settings["device"] == "cpu"
    assert settings["train"] == {**settings["train"], "steps": 3, "block": 1, "blocks": 3, "timed_steps_per_arm": 2,
                                 "seq": 64, "batch": 1, "gradient_checkpointing": True}
    assert settings["lora"]["r"] == 16 and len(settings["lora"]["target_modules"]) == 7
    assert _positive(result["copy_bandwidth_bytes_per_s"]) and _positive(result["seconds_total"])
    assert [b["phase"] for b in result["build"]] == ["decode_nf4", "decode_dense", "decode_tuned_ref", "decode_folded",
                                                     "train_plain", "train_qwenft"]
    assert all(_positive(b["seconds"]) and _positive(b["tensor_bytes"]) for b in result["build"])
    assert result["liger_skipped"] == "no CUDA device"  # the liger arm needs CUDA and Triton

    train = result["train"]
    assert list(train) == ["plain", "qwenft"]
    for arm in ("qwenft", "plain"):
        t = train[arm]
        assert t["steps"] == 3 and all(_positive(s) for s in t["seconds_per_step"]), arm
        assert t["block_of_step"] == [0, 1, 2] and t["timed_steps"] == 2  # the first block is not timed
        assert t["median_s_per_step"] == pytest.approx(sum(t["seconds_per_step"][1:]) / 2)  # median of 2 timed
        assert t["min_s_per_step"] <= t["p25_s_per_step"] <= t["median_s_per_step"] <= t["max_s_per_step"]
        assert _positive(t["tokens_per_s"]) and t["peak_memory_bytes"] >= 0
        assert len(t["round_ratios_to_plain"]) == 2 and all(_positive(r) for r in t["round_ratios_to_plain"])
        assert len(t["losses"]) == 3 and all(math.isfinite(x) for x in t["losses"]), arm
        # A random model with weights of std 0.02 predicts nearly uniformly: loss ~ ln(vocab) = ln(512) = 6.24;
        # 0.5 nat covers the random logits' spread, a wrong label shift or an all-masked loss falls far outside.
        assert abs(t["losses"][0] - math.log(settings["shape"]["vocab_size"])) < 0.5, t["losses"]
    # Same seed, same rows, same LoRA init: the first loss differs only by the summation order of the two loss
    # implementations (qwenft's is chunked over the supervised positions) and by the arms' dropout draws from the
    # shared RNG, which alternate: well within the 1e-2 the benchmark requires of the final losses.
    assert train["qwenft"]["losses"][0] == pytest.approx(train["plain"]["losses"][0], rel=1e-2)
    assert result["losses_match_plain"] is True and train["qwenft"]["final_loss_rel_diff_to_plain"] <= 1e-2
    assert _positive(result["ratio_train_qwenft_over_plain"])

    decode = result["decode"]
    assert [row["batch"] for row in decode] == [1, 16]
    arms = ["nf4_dynamic", "nf4_compiled", "bf16_compiled", "tuned_folded_compiled", "hf_generate"]
    for row in decode:
        assert list(row["arms"]) == arms and row["generated_per_row"] == [8] * row["batch"]
        assert (row["long_tokens"], row["short_tokens"]) == (8, 2)
        for name, arm in row["arms"].items():
            # greedy on the same weights: every arm chooses its reference's tokens (the 16-bit arms read the NF4
            # values dequantized; the folded arm is compared with adapter-on-base)
            assert arm["same_tokens"] is True and arm["first_difference"] is None, (name, arm)
            assert len(arm["rounds"]) == 3 and all(_positive(r) for r in arm["rounds"]), name
            for key in ("tokens_per_s", "ceiling_tokens_per_s", "fraction_of_ceiling", "bytes_per_step",
                        "ratio_to_hf_generate"):
                assert _positive(arm[key]), (name, key, arm)
        # the 16-bit arms read more weight bytes per step than the NF4 ones (2 bytes per weight vs ~0.53)
        assert row["arms"]["bf16_compiled"]["bytes_per_step"] > row["arms"]["nf4_dynamic"]["bytes_per_step"]
        assert row["kv_cache_bytes"] == row["planned_kv_cache_bytes"]  # the planner's formula, byte for byte
    evaluation = result["eval"]
    assert evaluation["prompts"] == 12 and "LoRA folded" in evaluation["path"]
    assert set(evaluation["seconds"]) == {"base_first_pass", "base", "tuned"}

    plan = result["plan"]
    for key in ("weights_loaded_bytes", "train_peak_bytes", "kv_cache_bytes_per_token"):
        assert _positive(plan[key]), key
    assert plan["train_parts"]["peak"] == plan["train_peak_bytes"]
    # The planner leaves out the NF4 code tables (~1.1 KiB per layer) and the RoPE buffers: a few % of this toy
    # model's 0.3 MB; a wrong NF4 or dense-weight formula is off by 2x or more.
    assert abs(plan["weights_error"]) < 0.1, plan["weights_error"]
    assert plan["train_peak_error"] is None  # a CPU's process RSS is not comparable with the plan


@pytest.mark.slow  # every command of the smoke script, each in a new interpreter
def test_gpu_smoke_script_runs_every_command_on_this_device(tmp_path):
    """`bash benchmarks/gpu/smoke.sh` (what a lent GPU runs first): train killed after its first checkpoint and
    resumed, eval, generate and merge on tiny-random NF4, here on the CPU; each step's exit code and files checked."""
    proc = subprocess.run(["bash", str(ROOT / "benchmarks/gpu/smoke.sh")], cwd=ROOT, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_smoke.json").read_text())
    assert result["ok"] is True and result["device"] == "cpu"
    assert [s["step"] for s in result["steps"]] == ["train, killed after checkpoint-2", "train train.resume=auto",
                                                     "eval adapter=", "generate prompts_file=", "merge"]
    assert [s["exit"] for s in result["steps"]] == [-9, 0, 0, 0, 0] and all(s["ok"] for s in result["steps"])


@pytest.mark.slow  # the benchmark suite runs a benchmark script in a new interpreter
def test_suite_runs_a_benchmark_and_collects_its_ratio(tmp_path):
    """`python -m benchmarks --quick --only perplexity`: the child runs, its JSON is found and its ratio read."""
    if not (SHARED_DATA / "ppl" / "wiki.test.raw").is_file():
        pytest.skip("../shared/data/ppl/wiki.test.raw is not present")
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--only", "perplexity", "--quiet", "--out",
                           str(tmp_path)], cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    suite = json.loads((tmp_path / "suite.json").read_text())
    [entry] = suite["benchmarks"]
    assert entry["name"] == "perplexity" and entry["status"] == "ok" and _positive(entry["seconds"])
    assert Path(entry["json"]) == tmp_path.resolve() / "perplexity_quick.json"
    child = json.loads((tmp_path / "perplexity_quick.json").read_text())
    assert entry["ratios"] == {"batched_over_single": child["ratio_batched_over_single"]}
    assert child["perplexity"]["single"] == pytest.approx(child["perplexity"]["batched"], rel=child["tolerance"])
    assert "perplexity" in proc.stdout and "batched_over_single" in proc.stdout  # the summary table


@pytest.mark.slow  # a benchmark script in a new interpreter
def test_sampler_benchmark_pairs_steps_and_checks_the_forward_inputs(tmp_path):
    """benchmarks/sampler.py on tiny-random: both arms give the model the same inputs at every forward (so a
    forward-time difference between them is noise), and the paired ratios and their intervals are recorded."""
    proc = subprocess.run([sys.executable, "benchmarks/sampler.py", "--model", "tiny-random", "--quants", "none",
                           "--batches", "1,3", "--new-tokens", "5", "--repeats", "2"], cwd=ROOT, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "sampler.json").read_text())["results"]
    assert [row["batch"] for row in rows] == [1, 3]
    for row in rows:
        assert row["same_tokens"] is True and row["same_forward_inputs"] is True, row
        assert row["paired_steps"] == 2 * 4  # 2 repeats x (5 tokens - the first, chosen from the prefill logits)
        low, high = row["ratio_paired_steps_ci95"]
        assert low <= row["ratio_paired_steps"] <= high
        for key in ("ratio", "ratio_median_step", "forward_ratio_paired", "ratio_from_host_time", "median_forward_ms"):
            assert _positive(row[key]), (key, row)


@pytest.mark.slow  # a benchmark script in a new interpreter, both arms scored on every question
def test_bench_eval_quick_mode_compares_both_arms_per_question(tmp_path, bench_dir):
    """benchmarks/bench_eval.py --quick: qwenft's lm-eval model and lm-eval's HFLM on the same tiny-random model and
    MMLU questions (invented files in MMLU's layout), in ABBA order, float32 and bfloat16; the JSON has every field."""
    proc = subprocess.run([sys.executable, "benchmarks/bench_eval.py", "--quick", "--data", str(bench_dir)], cwd=ROOT,
                          env=_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench_eval_quick.json").read_text())
    settings = result["settings"]
    assert settings["model"] == "tiny-random" and settings["per_subject"] == 2 and len(settings["subjects"]) == 2
    assert all(len(ids) == 2 for ids in settings["questions"].values())
    assert [r["dtype"] for r in result["runs"]] == ["float32", "bfloat16"]
    assert set(result["ratio_qwenft_over_hflm"]) == {"float32", "bfloat16"}
    for run in result["runs"]:
        assert run["questions"] == 4 and run["order"] == ["qwenft", "hflm", "hflm", "qwenft"], run["order"]
        for arm in ("qwenft", "hflm"):
            assert _positive(run["seconds"][arm]) and _positive(run["questions_per_s"][arm])
            assert run["questions_per_s"][arm] == pytest.approx(4 / run["seconds"][arm])
            assert run["model_tokens"][arm]["tokens"] > 0 and run["model_tokens"][arm]["forwards"] > 0
            assert 0 <= run["accuracy"][arm] <= 1
        assert run["ratio_qwenft_over_hflm"] == pytest.approx(run["seconds"]["hflm"] / run["seconds"]["qwenft"])
        assert set(run["ratio_by_subject"]) == set(settings["subjects"])
        # qwenft runs each subject's shared shots once: fewer tokens through the model than HFLM's whole prompts
        assert run["token_ratio_hflm_over_qwenft"] > 1
        assert run["same_predictions"] + len(run["differing"]) == 4
        assert math.isfinite(run["max_abs_loglik_diff"]) and len(run["load_average"]) == 4
    fp32 = result["runs"][0]
    # fp32: only summation order separates the arms (a cached prefix vs one pass)
    assert fp32["max_abs_loglik_diff"] < result["fp32_tolerance"] and fp32["same_predictions"] == 4


@pytest.mark.slow  # a benchmark script in a new interpreter (both arms in it, --in-process), TRL's DPOTrainer
def test_dpo_step_quick_mode_trains_both_arms_on_the_same_tokens(tmp_path):
    """benchmarks/dpo_step.py --quick: qwenft's preference trainer and TRL's DPOTrainer + peft on tiny-random, the
    same pairs as the same tokens in the same order; both first losses ln 2 (the policy is the reference before
    the first update), the same first gradient; step times, peaks and ratios recorded."""
    pytest.importorskip("trl")
    proc = subprocess.run([sys.executable, "benchmarks/dpo_step.py", "--quick", "--in-process", "--rounds", "1"],
                          cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "dpo_step_quick.json").read_text())
    settings = result["settings"]
    assert settings["model"] == "tiny-random" and settings["objective"] == "dpo" and settings["beta"] == 0.1
    assert settings["order"] == ["qwenft", "trl"] and settings["pairs_per_step"] == 2
    assert settings["data_stats"]["truncated"] == 0 and settings["train_pairs"] == 80  # nothing cut, none held out
    assert settings["trl"]["projects_every_position"] is True  # TRL's log-prob head off Triton devices
    assert result["same_tokens"] is True and result["same_rows"] is True
    assert result["first_step_loss_is_ln2"] is True
    # Same LoRA init, pairs and loss: the first gradients agree to float rounding (5e-8 relative measured, fp32)
    assert result["first_grad_norm_rel_diff"] < 1e-4 and result["second_step_loss_abs_diff"] < 1e-3
    for arm in ("qwenft", "trl"):
        a = result["arms"][arm]
        assert a["timed_steps"] == 2 and a["first_step_losses"] == [pytest.approx(math.log(2), abs=1e-6)], arm
        assert a["min_s_per_step"] <= a["p25_s_per_step"] <= a["median_s_per_step"] <= a["max_s_per_step"]
        assert all(_positive(a[k]) for k in ("tokens_per_s", "peak_train_bytes", "peak_load_bytes")), a
        assert a["peak_train_bytes"] <= a["peak_train_call_bytes"] and len(a["losses"][0]) == 3, a
        [run] = result["runs"][arm]
        assert len(run["seconds_per_step"]) == len(run["batches"]) == len(run["step_peak_bytes"]) == 3
    q, t = result["runs"]["qwenft"][0]["batches"], result["runs"]["trl"][0]["batches"]
    # the same tokens and answers in every step; TRL pads the 2B sequences to the longest, qwenft as
    # pref.padding_free resolves (padding-free: one row, no padding)
    assert [(a["tokens"], a["answer_tokens"]) for a in q] == [(b["tokens"], b["answer_tokens"]) for b in t]
    assert all(a["tokens"] <= a["positions"] <= b["positions"] for a, b in zip(q, t))
    if settings["qwenft"]["padding_free"]:
        assert all(a["positions"] == a["tokens"] for a in q)
    assert result["ratio_qwenft_over_trl"] == pytest.approx(statistics.median(result["paired_ratios"]))
    assert _positive(result["memory_ratio_qwenft_over_trl"]) and result["targets"] == {"time": 1.0, "memory": 0.8}


@pytest.mark.slow  # a benchmark script: train, eval, plan in new interpreters
def test_eval_memory_quick_mode_measures_after_train_later_eval_and_plan(tmp_path):
    """benchmarks/eval_memory.py --quick: train (with its after-train evaluation), a later `qwenft eval` of the same
    adapter and `qwenft plan` on tiny-random, each a child process; the three evaluation peaks and their ratios."""
    proc = subprocess.run([sys.executable, "benchmarks/eval_memory.py", "--quick"], cwd=ROOT, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "eval_memory_quick.json").read_text())
    assert result["quick"] is True and result["targets"]["enforced"] is False
    assert result["settings"] == {**result["settings"], "steps": 2, "rows": 24, "seed": 0, "model": "tiny-random"}
    assert [c["name"] for c in result["commands"]] == ["train", "eval", "plan"]
    assert all(c["returncode"] == 0 and _positive(c["seconds"]) for c in result["commands"]), result["commands"]
    peaks = result["peak_bytes"]
    assert all(_positive(peaks[k]) for k in ("after_train", "later_eval", "plan")), peaks
    ratios = result["ratios"]
    assert ratios["after_train_over_later"] == pytest.approx(peaks["after_train"] / peaks["later_eval"])
    assert ratios["after_train_over_plan"] == pytest.approx(peaks["after_train"] / peaks["plan"])
    assert ratios["later_over_plan"] == pytest.approx(peaks["later_eval"] / peaks["plan"])
    assert set(result["targets_met"]) == set(ratios)
    assert all(isinstance(v, bool) for v in result["targets_met"].values())
    assert result["memory"]["train"]["bytes"] > 0 and result["plan_evaluation"]["peak"] == peaks["plan"]


@pytest.mark.slow  # a benchmark script on the real tokenizer, its arms in new interpreters
def test_data_scale_quick_mode_runs_both_arms_and_the_cache_hit(tmp_path, shared_data, embedded_dir):
    """benchmarks/data_scale.py --quick: 2,000 unique rows generated from the shared alpaca and GSM8K files;
    `qwenft data` (a cache miss), the plain load_dataset + map and `qwenft data` again (a hit), each a child process
    with its wall time and peak RSS; the cache entries it made are removed."""
    proc = subprocess.run([sys.executable, "benchmarks/data_scale.py", "--quick", "--shared", str(shared_data)],
                          cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "data_scale_quick.json").read_text())
    assert result["settings"]["sizes"] == [2000] and result["settings"]["base_rows"] > 2000
    [size] = result["results"]
    assert size["rows"] == 2000 and _positive(size["file_bytes"]) and _positive(size["qwenft_cache_bytes"])
    for arm in ("qwenft", "plain", "qwenft_cache_hit"):
        assert size[arm]["exit"] == 0 and _positive(size[arm]["seconds"]) and _positive(size[arm]["peak_rss_bytes"])
    assert (size["qwenft"]["cache_hits"], size["qwenft"]["cache_misses"]) == (0, 1)
    assert (size["qwenft_cache_hit"]["cache_hits"], size["qwenft_cache_hit"]["cache_misses"]) == (1, 0)
    assert size["qwenft"]["train_examples"] == size["plain"]["rows"] == 2000
    # ChatML with Qwen's default system turn: ~30 tokens of template per row around the instruction and answer
    assert size["plain"]["tokens"] > 2000 * 30 and _positive(size["plain"]["map_s"])
    assert size["ratio_wall_qwenft_over_plain"] == pytest.approx(size["qwenft"]["seconds"] / size["plain"]["seconds"])


def test_data_scale_skips_without_the_shared_data(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/data_scale.py", "--quick", "--shared", str(tmp_path / "none")],
                          cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("SKIPPED: ") and not list(tmp_path.glob("*.json"))


def test_bootstrap_interval_resamples_whole_repeats():
    sys.path.insert(0, str(ROOT))
    from benchmarks.sampler import bootstrap_median_ci

    assert bootstrap_median_ci([[1.0, 1.0], [1.0, 1.0]]) == [1.0, 1.0]
    # Two repeats whose steps agree within each but not between: resampling repeats (not steps) gives an interval
    # spanning both, as the repeat-to-repeat spread warrants.
    assert bootstrap_median_ci([[0.9] * 20, [1.1] * 20]) == [0.9, 1.1]


def test_suite_rejects_an_unknown_benchmark():
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--only", "nope"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "unknown benchmark(s) nope" in proc.stderr


@pytest.mark.slow  # the whole benchmark suite in quick mode (several minutes)
@pytest.mark.skipif(not os.environ.get("QWENFT_SUITE_TEST"),
                    reason="several minutes; QWENFT_SUITE_TEST=1 runs it (the runner itself is tested above)")
def test_cpu_suite_quick_mode(tmp_path):
    """`python -m benchmarks --quick`: every script in its quick mode, suite.json with a ratio per benchmark.

    Several minutes (six fresh interpreters, plan_accuracy's own children): longer than other slow tests.
    """
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present (data_tokenization and perplexity read it)")
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--quiet", "--out", str(tmp_path)], cwd=ROOT,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    suite = json.loads((tmp_path / "suite.json").read_text())
    assert suite["quick"] is True
    entries = {e["name"]: e for e in suite["benchmarks"]}
    assert list(entries) == ["sampler", "train_step", "data_tokenization", "perplexity", "plan_accuracy", "bench_eval",
                             "dpo_step"]
    for name, entry in entries.items():
        assert entry["status"] == "ok", entry
        assert _positive(entry["seconds"]) and entry["ratios"], entry
        assert all(_positive(v) for v in entry["ratios"].values()), entry
        assert Path(entry["json"]).parent == tmp_path.resolve()
        json.loads(Path(entry["json"]).read_text())
    assert set(entries["sampler"]["ratios"]) == {"bf16_batch1", "bf16_batch8", "nf4_batch1", "nf4_batch8"}


@pytest.mark.slow  # a benchmark script that starts a server process
def test_serve_benchmark_on_tiny_random(tmp_path):
    """benchmarks/serve.py --model tiny-random: a live server driven by 1 and 3 streaming clients; no failed request,
    the batched greedy answers equal the sequential ones (counted, not assumed), the server stopped with exit 0."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    proc = subprocess.run([sys.executable, "benchmarks/serve.py", "--model", "tiny-random", "--clients", "1,3",
                           "--prompts", "3", "--max-tokens", "4", "--rounds", "1", "--out", str(tmp_path)], cwd=ROOT,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "serve_tiny-random.json").read_text())
    assert result["server_exit_code"] == 0 and set(result["summary"]) == {"1", "3"}
    for summary in result["summary"].values():
        assert summary["failed"] == 0 and summary["requests"] == 3
        assert 0 <= summary["equal_to_sequential"] <= 3 and _positive(summary["tokens_per_s"])
        assert summary["ttft_p50_s"] <= summary["ttft_p95_s"]
    assert result["summary"]["1"]["ratio_to_baseline"] == 1.0
