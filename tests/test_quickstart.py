"""The main job on the real embedded model: the quickstart recipe, shrunk, writes a complete run directory;
the domain recipe runs on real shared files (GSM8K question/answer and Chinese legal input/output)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import SHARED_DATA
from tests.conftest import run_train

pytestmark = pytest.mark.slow  # the real 0.5B trained end to end by the recipes, in new processes

RUN_FILES = ("config.yaml", "metrics.json", "generations.jsonl", "report.md", "loss_curve.png", "metrics.png",
             "train.log", ".hydra/config.yaml", ".hydra/overrides.yaml", "adapter/adapter_config.json",
             "adapter/adapter_model.safetensors", "adapter/tokenizer_config.json", "adapter/generation_config.json",
             "adapter/qwenft.json")


def check_run_dir(run_dir: Path, sources: set, steps: int) -> dict:
    """Every file of a finished run is there and consistent; returns metrics.json."""
    for name in RUN_FILES:
        assert (run_dir / name).is_file() and (run_dir / name).stat().st_size > 0, name
    adapter_config = json.loads((run_dir / "adapter/adapter_config.json").read_text())
    assert set(adapter_config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                     "up_proj", "down_proj"}
    generation = json.loads((run_dir / "adapter/generation_config.json").read_text())
    assert set(generation["eos_token_id"]) == {151645, 151643}  # <|im_end|>, <|endoftext|>
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["train"]["global_step"] == steps
    assert set(metrics["eval"]["sources"]) == sources
    for by_side in metrics["eval"]["sources"].values():
        assert {"base", "tuned", "delta"} <= set(by_side)
    rows = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text(encoding="utf-8").splitlines()]
    assert rows and all({"source", "prompt", "reference", "base", "tuned"} <= set(row) for row in rows)
    report = (run_dir / "report.md").read_text(encoding="utf-8")
    assert "| metric | base | tuned | delta |" in report and "loss_curve.png" in report
    return metrics


def test_quickstart_shrunk_writes_the_whole_run_directory(tmp_path, embedded_dir):
    """With MMLU's published CSVs (../shared/data/bench here, through $QWENFT_BENCH_DATA as a user would give them)
    the recipe's retention set runs on both sides; without them (a user's fresh clone: qwenft ships no benchmark
    data) it is skipped and report.md says so."""
    run_dir = tmp_path / "quickstart"
    bench = SHARED_DATA / "bench"
    result = run_train(["+recipe=quickstart", f"out_dir={run_dir}", "train.max_steps=2", "train.save_steps=1",
                      "eval.max_eval_prompts=2", "eval.max_new_tokens=6", "eval.bench_limit=4",
                      "eval.bench_subtasks=2"], timeout=900,
                     env={"QWENFT_BENCH_DATA": str(bench)} if (bench / "mmlu").is_dir() else None)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"report: {run_dir / 'report.md'}" in result.stdout
    metrics = check_run_dir(run_dir, {"domain", "general"}, steps=2)
    assert "contains_fact" in metrics["eval"]["sources"]["domain"]["base"]
    assert {"answers:domain", "answers:general"} <= set(metrics["eval"]["perplexity"])
    if (bench / "mmlu").is_dir():
        mmlu = metrics["eval"]["benchmarks"]["mmlu"]  # the recipe's retention set, shrunk: same questions both sides
        assert mmlu["n"] == 4 and {"base", "tuned", "delta", "ci95"} <= set(mmlu)
        assert mmlu["source"] == str(bench / "mmlu")
    else:
        assert set(metrics["eval"]["benchmarks_skipped"]) == {"mmlu"}
        assert "- mmlu: skipped, no data directory" in (run_dir / "report.md").read_text(encoding="utf-8")
    assert "## Verdict" in (run_dir / "report.md").read_text(encoding="utf-8")
    # save_total_limit keeps the newest checkpoints, each complete (no staging directory left behind)
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert "checkpoint-2" in checkpoints and not any(".tmp" in name or "staging" in name for name in checkpoints)


@pytest.mark.parametrize("source", [
    ("domain/gsm8k/train.jsonl", "{instruction: question, output: answer}"),
    ("domain/legal_zh/fakao_gpt4.json", "{instruction: input, output: output}"),
], ids=["gsm8k", "legal_zh"])
def test_domain_recipe_on_real_files(tmp_path, embedded_dir, shared_data, source):
    path, columns = source
    run_dir = tmp_path / "domain"
    result = run_train(["+recipe=domain", "model=qwen2.5-coder-0.5b-embedded", f"out_dir={run_dir}",
                      f"data.sources.0.path={shared_data / path}", f"data.sources.0.columns={columns}",
                      "data.sources.0.max_rows=12", "data.sources.0.eval_rows=2", "data.sources.1.eval_rows=1",
                      "data.max_seq_len=192", "train.max_steps=1", "train.batch_size=1", "train.grad_accum=1",
                      "train.gradient_checkpointing=false", "eval.max_new_tokens=4", "eval.ppl_sources=[]",
                      "eval.bench_limit=2", "eval.bench_subtasks=1"],
                     timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    check_run_dir(run_dir, {"domain", "general"}, steps=1)
