"""Base-vs-tuned evaluation end to end on tiny-random: files written, metrics.json equals the report. One training
run in a new process (the real entry point); the eval commands on it run in this process."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import qwenft_in_process, run_train, train_overrides


def report_table(report: str, source: str) -> dict:
    """Parse the ``| metric | base | tuned | delta |`` table of ``source`` from report.md."""
    section = report.split(f"### {source} ")[1].split("\n\n", 2)[1]
    rows = {}
    for line in section.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = [None if c in ("n/a", "") else float(c) for c in cells[1:]]
    return rows


# The run's eval settings, none of them the default: a gate of its own, metrics in another order, a sampling preset
# with a seed typed for the run, max_new_tokens, batches of 3, a perplexity file (issue 44 item 6: a later eval
# without overrides must reproduce them). The loss is logged at step 1 (logging_first_step) and, with
# logging_steps=5 past the 3 steps, at the last step only because qwenft logs it (issue 44 item 8).
RUN_EVAL = ["eval.max_new_tokens=8", "eval.batch_size=3", "eval.samples_in_report=2", "eval.ppl_window=64",
            "eval.ppl_stride=32", "++eval.gates.toy={metric: char_f1, max_drop: 1.0}",
            "eval.metrics=[char_f1, exact_match_number, rouge_l]", "eval.generate=creative",
            "generate_presets.creative.seed=11", "eval.correct_threshold=0.3"]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    run_dir = tmp / "run"
    args = [a for a in train_overrides(tmp, run_dir) if not a.startswith(("eval.after_train", "train.max_steps",
                                                                           "train.logging_steps"))]
    result = run_train([*args, "train.max_steps=3", "train.logging_steps=5", *RUN_EVAL,
                        f"eval.ppl_sources=[{tmp / 'rows.jsonl'}]"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "report.md" in result.stdout
    return tmp, run_dir


def test_train_writes_the_full_run_directory(trained_run):
    _, run_dir = trained_run
    for name in ("config.yaml", "metrics.json", "generations.jsonl", "report.md", "loss_curve.png", "metrics.png",
                 "adapter/adapter_model.safetensors", ".hydra/config.yaml", "train.log"):
        assert (run_dir / name).is_file(), name
    rows = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert len(rows) == 4  # eval_rows: 4 held out
    for row in rows:
        assert {"source", "prompt", "reference", "base", "tuned"} <= set(row)
        assert row["base"]["stop_reason"] in ("eos", "stop_string", "length")


def test_the_final_train_loss_is_the_last_steps(trained_run):
    """issue 44 item 8: with train.logging_steps=5 over 3 steps, transformers logged step 1 only and report.md's
    "final train loss" was step 1's; the last step is logged too, and the report says which steps it averages."""
    _, run_dir = trained_run
    train = json.loads((run_dir / "metrics.json").read_text())["train"]
    assert [(p["step"], p["from_step"]) for p in train["loss_curve"]] == [(1, 1), (3, 2)]
    assert (train["final_loss"], train["final_loss_step"], train["final_loss_from_step"]) == \
        (train["loss_curve"][-1]["loss"], 3, 2)
    assert f"3 steps, final train loss {train['final_loss']:.3f} (steps 2-3, their mean), " in \
        (run_dir / "report.md").read_text()
    from qwenft.evaluate.report import final_loss_text

    assert final_loss_text({**train, "final_loss_from_step": 3}) == f"final train loss {train['final_loss']:.3f} " \
                                                                     "(step 3)"
    older = {k: v for k, v in train.items() if not k.startswith("final_loss_")}  # metrics.json of an older run
    assert final_loss_text(older) == f"final train loss {train['final_loss']:.3f}"


def test_metrics_json_matches_report(trained_run):
    _, run_dir = trained_run
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["train"]["global_step"] == 3
    toy = metrics["eval"]["sources"]["toy"]
    table = report_table((run_dir / "report.md").read_text(), "toy")
    for name, (base, tuned, delta) in table.items():
        if toy["base"][name] is None:  # n/a (e.g. exact_match_number on free-text answers): null, no delta
            assert (base, tuned, delta) == (None, None, None) and name not in toy["delta"]
            continue
        assert base == pytest.approx(toy["base"][name], abs=5e-4)  # the report prints 3 decimals
        assert tuned == pytest.approx(toy["tuned"][name], abs=5e-4)
        assert delta == pytest.approx(toy["tuned"][name] - toy["base"][name], abs=1e-3)
    ppl = metrics["eval"]["perplexity"]
    assert set(ppl) == {"text:rows.jsonl", "answers:toy"}
    for value in ppl.values():
        assert value["base"]["tokens"] == value["tuned"]["tokens"] > 0
        assert value["ratio"] == pytest.approx(value["tuned"]["perplexity"] / value["base"]["perplexity"])
    memory = metrics["memory"]  # each phase's peak (issue 26 item 7), and its line in report.md
    assert set(memory) == {"train", "eval"}
    for phase in memory.values():
        assert phase["bytes"] >= phase["start_bytes"] > 0 and phase["kind"] == "cpu_peak_rss" and phase["seconds"] > 0
    from qwenft.memory import describe_peaks

    assert describe_peaks(memory) in (run_dir / "report.md").read_text()


def test_eval_command_with_adapter(trained_run, capsys):
    tmp, run_dir = trained_run
    out = tmp / "eval-run"
    args = [a for a in train_overrides(tmp, out) if a.split("=")[0].split(".")[0] in ("model", "quant", "out_dir",
                                                                                        "data")]
    env_args = [*args, f"adapter={run_dir / 'adapter'}", "eval.max_new_tokens=8"]
    result = qwenft_in_process(capsys, "eval", *env_args)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics["eval"]["sources"]["toy"]) == {"base", "tuned", "delta"}
    assert set(metrics["memory"]) == {"eval"} and metrics["memory"]["eval"]["bytes"] > 0  # no train phase here
    assert re.search(r"\| exact_match_number \|", (out / "report.md").read_text())


def test_eval_with_a_recipe_runs_the_adapters_base_and_reports_its_lora(trained_run, capsys):
    """`eval +recipe=domain adapter=RUN/adapter` (the README's way): the recipe's 7B is a default, not typed, so the
    base the adapter records runs; report.md's LoRA line is the adapter's, not the live config's (lora.r=4 here)."""
    tmp, run_dir = trained_run
    out = tmp / "recipe-eval"
    result = qwenft_in_process(capsys, "eval", "+recipe=domain", f"adapter={run_dir / 'adapter'}",
                     f"data.sources.0.path={tmp / 'rows.jsonl'}", "data.sources.0.eval_rows=2",
                     "data.sources.1.eval_rows=1", "eval.max_new_tokens=2", "eval.max_eval_prompts=1", "lora.r=4",
                     "lora.lora_alpha=8", f"out_dir={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "from the adapter's qwenft.json" in result.stdout + result.stderr
    # typed +recipe: its data is evaluated, and the log and report.md say it is not what the adapter was trained on
    log = result.stdout + result.stderr
    warning = [line for line in log.splitlines() if "NOT THE ADAPTER'S DATA: it was trained on toy (" in line]
    assert len(warning) == 1 and "WARNING" in warning[0], log[-3000:]
    report = (out / "report.md").read_text()
    assert "- **held-out data is not the adapter's training data**: this evaluation read domain (" in report
    # and the recipe's eval settings, not the run's: warned, and said in report.md with the keys that differ
    assert any("NOT THE RUN'S EVAL SETTINGS: +recipe= typed" in line for line in log.splitlines()), log[-3000:]
    assert "- eval settings: this command's (+recipe= typed: that config's eval settings, not the ones the " \
           "adapter's run recorded); they differ from the recorded ones in " in report
    lora = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert lora["r"] != 4 and f"- LoRA: r={lora['r']}, lora_alpha={lora['lora_alpha']}, " in report
    assert "; trained on `tiny-random` with quant=none" in report
    assert "- model: `tiny-random` (tiny-random, quant=none)" in report  # what ran: the adapter's base


def test_a_later_eval_of_the_adapter_reproduces_the_runs_own_evaluation(trained_run, capsys):
    """issue 44 item 6: `eval adapter=RUN/adapter` with nothing typed starts from the eval settings the run recorded
    (gates, metrics, the sampling preset and its seed, max_new_tokens, batches): the same generations, metrics and
    gates as the run's own evaluation after training, and report.md and metrics.json say where they came from."""
    tmp, run_dir = trained_run
    out = tmp / "same-verdict"
    result = qwenft_in_process(capsys, "eval", f"adapter={run_dir / 'adapter'}", f"out_dir={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    trained = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    again = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert len(again) == len(trained) == 4
    for ours, theirs in zip(again, trained):
        for side in ("base", "tuned"):
            assert ours[side] == theirs[side], (side, ours["row"])  # text, stop reason, tokens and every metric
    run_eval = json.loads((run_dir / "metrics.json").read_text())["eval"]
    eval_ = json.loads((out / "metrics.json").read_text())["eval"]
    assert eval_["sources"] == run_eval["sources"]
    assert set(eval_["sources"]["toy"]["base"]) >= {"char_f1", "exact_match_number", "rouge_l"}
    assert "toy" in json.dumps(eval_["gates"])  # the run's own gate, not the defaults
    for key in set(run_eval) - {"settings_from", "engine", "perplexity"}:  # the verdict, its score, the flips
        assert eval_[key] == run_eval[key], key
    for name, by_side in run_eval["perplexity"].items():
        for side in ("base", "tuned"):
            assert eval_["perplexity"][name][side]["perplexity"] == pytest.approx(by_side[side]["perplexity"],
                                                                                 rel=1e-5)
    adapter_meta = run_dir / "adapter" / "qwenft.json"
    assert run_eval["settings_from"]["from"] == "run" and run_eval["settings_from"]["file"] == str(adapter_meta)
    assert eval_["settings_from"]["from"] == "adapter" and eval_["settings_from"]["typed"] == []
    report = (out / "report.md").read_text()
    assert f"- eval settings: the adapter's run's (recorded in `{adapter_meta}`); nothing typed on top" in report
    assert "- sampler for evaluation: preset `creative` (do_sample=True, " in report and "seed=11" in report
    assert f"- eval settings: this run's, recorded in `{adapter_meta}`" in (run_dir / "report.md").read_text()


def test_eval_refuses_a_missing_adapter(tmp_path, capsys):
    result = qwenft_in_process(capsys, "eval", "model=tiny-random", f"adapter={tmp_path}/none", f"out_dir={tmp_path}/x")
    assert result.returncode == 2 and f"{tmp_path}/none does not exist" in result.stderr, result.stderr[-2000:]


def test_base_only_report_names_no_adapter(tmp_path, capsys):
    """`qwenft eval` without an adapter: the report says so instead of naming a LoRA that was never used."""
    from tests.conftest import qa_rows, write_jsonl

    rows = write_jsonl(tmp_path / "held.jsonl", qa_rows(3))
    proc = qwenft_in_process(capsys, "eval", "model=tiny-random", "quant=none", f"out_dir={tmp_path / 'e'}",
                             "eval.max_new_tokens=4",
                             f"data.sources=[{{name: held, path: {rows}, weight: 0.0, eval_rows: 3}}]")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = (tmp_path / "e" / "report.md").read_text()
    assert "- adapter: none (the base model alone)" in report and "LoRA: r=" not in report
    assert "- eval settings: this command's (no adapter)" in report
    # issue 27 item 10: base-only columns, no empty tuned / ratio ones
    assert "| text | tokens | base |\n|---|---|---|\n| answers:held | " in report, report
    assert "tuned" not in report.split("## Generation metrics")[1]


def test_eval_with_only_the_run_directory_reads_the_adapters_data(trained_run, capsys):
    """issue 27 items 3 and 4: `eval adapter=<run dir>` (no recipe, no data): the run directory stands for its
    adapter/, and the held-out rows are the run's own (the custom source its qwenft.json records, same rows as the
    evaluation after training), not the project's default data."""
    tmp, run_dir = trained_run
    out = tmp / "only-adapter"
    result = qwenft_in_process(capsys, "eval", f"adapter={run_dir}", f"out_dir={out}", "eval.max_new_tokens=2")
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert f"adapter={run_dir} is a run directory: using its adapter {run_dir / 'adapter'}" in log
    assert f"eval data from the adapter's qwenft.json (what it was trained on): toy ({tmp / 'rows.jsonl'}, 4 rows " \
           "held out)" in log
    assert "NOT THE ADAPTER'S DATA" not in log
    rows = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    trained = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert [(r["source"], r["row"], r["prompt"]) for r in rows] == [(r["source"], r["row"], r["prompt"])
                                                                    for r in trained]
    report = (out / "report.md").read_text()
    assert "held-out data is not" not in report
    # issue 44 item 6: the typed eval.max_new_tokens is applied over the recorded 8, and named in the report
    assert all(r[side]["tokens"] <= 2 for r in rows for side in ("base", "tuned"))
    assert max(r["tuned"]["tokens"] for r in trained) > 2  # the run's own answers were longer
    assert "; typed on top: `eval.max_new_tokens`" in report and "max_new_tokens=2)" in report
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["eval"]["settings_from"]["typed"] == ["eval.max_new_tokens"]


def test_eval_runs_default_to_their_own_folder():
    """issue 27 item 10: eval's default run directory is outputs/eval/<recipe or eval>/..., never beside the
    recipe's training runs in outputs/<recipe>/; out_dir= still wins."""
    from tests.conftest import compose_config

    assert compose_config("+recipe=quickstart", command="eval").out_dir.startswith("outputs/eval/quickstart/")
    assert compose_config(command="eval").out_dir.startswith("outputs/eval/eval/")
    assert compose_config("+recipe=quickstart").out_dir.startswith("outputs/quickstart/")
    assert compose_config("out_dir=elsewhere", command="eval").out_dir == "elsewhere"


def test_base_only_benchmark_table_has_base_columns_only():
    """issue 27 item 10: a base-only benchmark table has no empty tuned / delta / CI columns."""
    from qwenft.evaluate.verdict_text import benchmark_lines

    lines = benchmark_lines({"mmlu": {"metric": "acc", "n": 32, "base": 0.25, "seconds_per_question": {"base": 0.4}}})
    assert lines[2:5] == ["| benchmark | metric | n | base | s / question |", "|---|---|---|---|---|",
                          "| mmlu | acc | 32 | 0.250 | 0.40 s |"]
