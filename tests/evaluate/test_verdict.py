"""The verdict: flips, gates, eval.score, the report's opening section, the sweep specs' metric and exit code 3.

Hand-made evaluation reports (the shape :func:`qwenft.evaluate.run.evaluate` returns) for the arithmetic; a real
tiny-random `train` / `eval` for the exit codes.
"""

from __future__ import annotations

import json

import pytest
import yaml

from qwenft.config import Config, ConfigError, DataConfig, DataSource, EvalConfig, GatesFailed
from qwenft.evaluate.flips import find_flips, flip_counts, flip_lines
from qwenft.evaluate.verdict import SCORE_KEY, enforce, is_right, judge, primary_metric
from tests.conftest import ROOT

METRICS = ["contains_fact", "char_f1", "rouge_l"]


def make_config(gates=None, metrics=METRICS, threshold=0.5, fail_on_gate=False, benchmarks=("mmlu", "gsm8k"),
                sources=("domain", "general"), out_dir="out") -> Config:
    """A validated config with held-out sources ``sources`` and ``benchmarks``, without Hydra."""
    return Config(command="eval", out_dir=str(out_dir), run_name="verdict-test",
                  data=DataConfig(sources=[DataSource(name=s, path=f"{s}.jsonl", eval_rows=4) for s in sources]),
                  eval=EvalConfig(gates=gates or {}, metrics=list(metrics), correct_threshold=threshold,
                                  fail_on_gate=fail_on_gate, benchmarks=list(benchmarks)))


def side(text: str, **values) -> dict:
    return {"text": text, "stop_reason": "eos", "tokens": 3, **{m: values.get(m) for m in METRICS}}


def row(source: str, i: int, base: dict, tuned: dict = None) -> dict:
    out = {"source": source, "row": i, "prompt": f"{source} question {i}?", "reference": f"answer {i}", "base": base}
    if tuned is not None:
        out["tuned"] = tuned
    return out


def summary(rows, which: str) -> dict:
    means = {}
    for m in METRICS:
        values = [r[which][m] for r in rows if r[which][m] is not None]
        means[m] = sum(values) / len(values) if values else None
    return {**means, "answer_tokens": 3.0, "stop_rate": 1.0, "distinct_2": 0.5, "rows": len(rows)}


def bench_row(name: str, i: int, base: bool, tuned: bool = None) -> dict:
    out = {"id": f"{name}/{i}", "task": name, "doc_id": i, "question": f"{name} q{i}", "reference": "B",
           "base": {"answer": "B" if base else "C", "correct": base}}
    if tuned is not None:
        out["tuned"] = {"answer": "B" if tuned else "D", "correct": tuned}
    return out


def make_report(tuned: bool = True) -> dict:
    """domain (contains_fact 0/1: 1 wrong->right, 1 right->wrong, 1 n/a), general (char_f1 only), mmlu, gsm8k."""
    domain = [row("domain", 0, side("x", contains_fact=0.0, char_f1=0.1, rouge_l=0.1),
                  side("y", contains_fact=1.0, char_f1=0.9, rouge_l=0.9)),
              row("domain", 1, side("x", contains_fact=1.0, char_f1=0.8, rouge_l=0.8),
                  side("y", contains_fact=0.0, char_f1=0.2, rouge_l=0.2)),
              row("domain", 2, side("x", contains_fact=None, char_f1=0.3, rouge_l=0.3),  # no fact: n/a
                  side("y", contains_fact=None, char_f1=0.7, rouge_l=0.7)),
              row("domain", 3, side("x", contains_fact=0.0, char_f1=0.0, rouge_l=0.0),
                  side("y", contains_fact=1.0, char_f1=1.0, rouge_l=1.0))]
    general = [row("general", 0, side("a", char_f1=0.6, rouge_l=0.6), side("b", char_f1=0.4, rouge_l=0.4)),  # r->w
               row("general", 1, side("a", char_f1=0.4, rouge_l=0.4), side("b", char_f1=0.55, rouge_l=0.45)),  # w->r
               row("general", 2, side("a", char_f1=0.9, rouge_l=0.9), side("b", char_f1=0.9, rouge_l=0.9))]
    if not tuned:
        for r in domain + general:
            del r["tuned"]
    sources = {}
    for name, rows in (("domain", domain), ("general", general)):
        by = {"base": summary(rows, "base")}
        if tuned:
            by["tuned"] = summary(rows, "tuned")
            by["delta"] = {k: by["tuned"][k] - by["base"][k] for k in by["base"]
                           if k != "rows" and by["base"][k] is not None}
        sources[name] = by
    mmlu = [bench_row("mmlu", i, b, t if tuned else None)
            for i, (b, t) in enumerate([(True, False), (False, True), (False, True), (True, True)])]
    gsm8k = [bench_row("gsm8k", i, b, t if tuned else None) for i, (b, t) in enumerate([(True, True), (True, False)])]
    benchmarks = {"mmlu": {"metric": "acc", "n": 4, "base": 0.5}, "gsm8k": {"metric": "exact_match,strict-match",
                                                                           "n": 2, "base": 1.0}}
    if tuned:
        benchmarks["mmlu"].update(tuned=0.75, delta=0.25, ci95=[-0.25, 0.75], ci_method="paired bootstrap")
        benchmarks["gsm8k"].update(tuned=0.5, delta=-0.5, ci95=[-1.0, 0.0], ci_method="paired bootstrap")
    return {"sources": sources, "rows": {"domain": domain, "general": general}, "perplexity": {},
            "benchmarks": benchmarks, "bench_rows": {"mmlu": mmlu, "gsm8k": gsm8k}}


# --- flips ---------------------------------------------------------------------------------------------------------

def test_flips_both_directions_and_na_rows_skipped():
    flips = find_flips(make_config(), make_report())
    domain = flips["domain"]
    assert domain["metric"] == "contains_fact" and domain["judged"] == 3  # row 2 has no fact: left out
    assert [f["id"] for f in domain["wrong_to_right"]] == ["domain/0", "domain/3"]
    assert [f["id"] for f in domain["right_to_wrong"]] == ["domain/1"]
    flip = domain["right_to_wrong"][0]
    assert (flip["question"], flip["reference"], flip["base"], flip["tuned"]) == ("domain question 1?", "answer 1",
                                                                                    "x", "y")
    assert (flip["base_value"], flip["tuned_value"]) == (1.0, 0.0)
    mmlu = flips["mmlu"]
    assert [f["id"] for f in mmlu["right_to_wrong"]] == ["mmlu/0"]
    assert [f["id"] for f in mmlu["wrong_to_right"]] == ["mmlu/1", "mmlu/2"]
    assert (mmlu["right_to_wrong"][0]["base"], mmlu["right_to_wrong"][0]["tuned"]) == ("B", "D")
    assert flip_counts(flips)["gsm8k"] == {"kind": "benchmark", "metric": "exact_match,strict-match", "judged": 2,
                                           "right_to_wrong": 1, "wrong_to_right": 0}


def test_char_f1_rows_are_right_at_the_threshold():
    """general's primary metric is char_f1 (contains_fact is n/a there): right when >= eval.correct_threshold."""
    config = make_config()
    report = make_report()
    assert primary_metric(config, "general", report["sources"]["general"]) == "char_f1"
    general = find_flips(config, report)["general"]
    assert [f["id"] for f in general["right_to_wrong"]] == ["general/0"]  # 0.6 -> 0.4
    assert [f["id"] for f in general["wrong_to_right"]] == ["general/1"]  # 0.4 -> 0.55
    lower = find_flips(make_config(threshold=0.3), report)["general"]  # 0.4 is right too: nothing flipped
    assert lower["right_to_wrong"] == [] and lower["wrong_to_right"] == [] and lower["judged"] == 3


def test_a_gate_metric_is_the_primary_metric():
    config = make_config(gates={"general": {"metric": "rouge_l", "min": 0.1}})
    general = find_flips(config, make_report())["general"]
    assert general["metric"] == "rouge_l"
    assert [f["id"] for f in general["right_to_wrong"]] == ["general/0"]
    assert general["wrong_to_right"] == []  # rouge_l 0.4 -> 0.45: wrong on both sides at 0.5
    general_f1 = find_flips(make_config(threshold=0.51), make_report())["general"]
    assert general_f1["wrong_to_right"][0]["id"] == "general/1"  # char_f1 0.55 >= 0.51


def test_right_at_the_threshold_and_float_tolerance():
    assert is_right("char_f1", 0.5, 0.5) is True and is_right("char_f1", 0.4999, 0.5) is False
    assert is_right("contains_fact", 1.0, 0.9) is True
    assert is_right("contains_fact", 0.0, 0.0) is False  # a 0/1 metric ignores eval.correct_threshold
    assert is_right("rouge_l", None, 0.5) is None
    report = make_report()  # 0.75 - 0.55 is 0.19999999999999996 in floats: it passes min_delta 0.2
    report["benchmarks"]["mmlu"].update(base=0.55, tuned=0.75, delta=0.75 - 0.55)
    assert judge(make_config(gates={"mmlu": {"min_delta": 0.2}}), report)["gates"]["mmlu"]["status"] == "pass"
    report["benchmarks"]["mmlu"].update(delta=0.199)
    assert judge(make_config(gates={"mmlu": {"min_delta": 0.2}}), report)["gates"]["mmlu"]["status"] == "fail"


def test_flip_section_shows_counts_and_the_first_five():
    report = make_report()
    report["bench_rows"]["mmlu"] = [bench_row("mmlu", i, False, True) for i in range(7)]
    lines = "\n".join(flip_lines(find_flips(make_config(), report)))
    assert "### mmlu (acc): 0 right -> wrong, 7 wrong -> right (of 7 judged)" in lines
    assert "`mmlu/4`" in lines and "`mmlu/5`" not in lines
    assert "### domain (contains_fact): 1 right -> wrong, 2 wrong -> right (of 3 judged)" in lines


# --- gates and score -----------------------------------------------------------------------------------------------

def test_gates_pass_and_fail_with_the_numbers():
    config = make_config(gates={"domain": {"min_delta": 0.6, "min": 0.6}, "mmlu": {"max_drop": 0.0}})
    verdict = judge(config, make_report())
    domain = verdict["gates"]["domain"]
    # contains_fact base (0 + 1 + 0) / 3, tuned (1 + 0 + 1) / 3: delta 1/3 < 0.6, tuned 2/3 >= 0.6
    assert domain["status"] == "fail"
    item = domain["items"][0]
    assert item["metric"] == "contains_fact" and item["n"] == 3
    assert item["delta"] == pytest.approx(1 / 3)
    assert {c["condition"]: c["passed"] for c in item["checks"]} == {"min": True, "min_delta": False}
    assert verdict["gates"]["mmlu"]["status"] == "pass"  # delta +0.25 >= -0
    assert verdict["gates"]["mmlu"]["items"][0]["ci95"] == [-0.25, 0.75]
    assert verdict["passed"] is False and verdict["failed"] == ["domain"]
    ok = judge(make_config(gates={"domain": {"min_delta": 0.3}}), make_report())
    assert ok["passed"] is True and ok["gates"]["domain"]["status"] == "pass"


def test_retention_covers_every_ungated_benchmark_and_source():
    config = make_config(gates={"domain": {"min_delta": 0.1}, "mmlu": {"min": 0.0}, "retention": {"max_drop": 0.2}})
    gate = judge(config, make_report())["gates"]["retention"]
    by_item = {i["name"]: i for i in gate["items"]}
    assert set(by_item) == {"general", "gsm8k"}  # domain and mmlu have gates of their own
    assert by_item["general"]["metric"] == "char_f1"
    assert by_item["general"]["delta"] == pytest.approx((0.4 + 0.55 + 0.9) / 3 - (0.6 + 0.4 + 0.9) / 3)
    assert by_item["general"]["status"] == "pass"  # -0.0167 >= -0.2
    assert by_item["gsm8k"]["status"] == "fail"  # -0.5 < -0.2
    assert gate["status"] == "fail"
    assert by_item["gsm8k"]["checks"][0]["threshold"] == pytest.approx(-0.2)


def test_base_only_is_not_judged_and_never_fails(tmp_path):
    config = make_config(gates={"domain": {"min_delta": 0.1}, "retention": {"max_drop": 0.0}}, fail_on_gate=True)
    verdict = judge(config, make_report(tuned=False))
    assert {g["status"] for g in verdict["gates"].values()} == {"not judged"}
    assert {g["reason"] for g in verdict["gates"].values()} == {"no tuned side"}
    assert verdict["passed"] is True and verdict["score"] is None
    enforce(config, {"eval": verdict}, tmp_path)  # no GatesFailed


def test_score_formula_on_a_constructed_case():
    # no gates: T = every source's tuned primary mean = (contains_fact 2/3 + char_f1 1.85/3) / 2;
    # R = benchmarks: (min(0, +0.25) + min(0, -0.5)) / 2 = -0.25
    assert judge(make_config(), make_report())["score"] == pytest.approx((2 / 3 + 1.85 / 3) / 2 - 0.25)
    # domain gated: T = 2/3; R over general (delta -0.05 / 3), mmlu (0), gsm8k (-0.5)
    gated = make_config(gates={"domain": {"min": 0.0}, "mmlu": {"min": 0.0}})
    expected = 2 / 3 + (-0.05 / 3 + 0.0 - 0.5) / 3
    assert judge(gated, make_report())["score"] == pytest.approx(expected)


def test_enforce_raises_only_with_fail_on_gate(tmp_path):
    gates = {"domain": {"min_delta": 0.9}, "retention": {"max_drop": 0.0}}
    verdict = judge(make_config(gates=gates), make_report())
    enforce(make_config(gates=gates), {"eval": verdict}, tmp_path)  # fail_on_gate=false: no exception
    with pytest.raises(GatesFailed) as info:
        enforce(make_config(gates=gates, fail_on_gate=True), {"eval": verdict}, tmp_path)
    assert str(info.value) == (f"gates failed: domain, retention (general, gsm8k); report: {tmp_path / 'report.md'}")


def test_report_opens_with_the_verdict_and_writes_flips(tmp_path):
    from qwenft.evaluate.report import write_outputs

    config = make_config(gates={"domain": {"metric": "contains_fact", "min_delta": 0.2},
                                "retention": {"max_drop": 0.02}}, out_dir=tmp_path)
    metrics = write_outputs(config, tmp_path, make_report())
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# qwenft report: verdict-test\n\n## Verdict: FAIL (gates failed: retention)\n\n"
                             "| gate | result | metric | n | base | tuned | delta | condition | 95% CI |\n")
    assert "| domain | PASS | contains_fact | 3 | 0.333 | 0.667 | +0.333 | delta >= +0.200 |  |" in report
    assert ("| retention: gsm8k | FAIL | exact_match,strict-match | 2 | 1.000 | 0.500 | -0.500 | delta >= -0.020 | "
            "[-1.000, +0.000] |") in report
    assert "| mmlu | acc | 4 | 0.500 | 0.750 | +0.250 | [-0.250, +0.750] |" in report  # the Benchmarks table
    assert "## Flips" in report and report.index("## Verdict") < report.index("## Benchmarks")
    saved = json.loads((tmp_path / "metrics.json").read_text())["eval"]
    assert saved["passed"] is False and saved["failed"] == ["retention"] == metrics["eval"]["failed"]
    assert saved["score"] == pytest.approx(metrics["eval"]["score"]) and saved["benchmarks"]["mmlu"]["n"] == 4
    assert saved["flips"]["mmlu"] == {"kind": "benchmark", "metric": "acc", "judged": 4, "right_to_wrong": 1,
                                      "wrong_to_right": 2}
    lines = [json.loads(line) for line in (tmp_path / "flips.jsonl").read_text().splitlines()]
    assert len(lines) == 3 + 1 + 2 + 3  # mmlu, gsm8k, general, domain
    assert {(f["name"], f["id"], f["direction"]) for f in lines} >= {("mmlu", "mmlu/0", "right_to_wrong"),
                                                                     ("domain", "domain/3", "wrong_to_right")}
    # base only into the same directory: no flips, the old flips.jsonl removed, the verdict not judged
    write_outputs(config, tmp_path, make_report(tuned=False))
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# qwenft report: verdict-test\n\n## Verdict: not judged (no tuned side)\n")
    assert not (tmp_path / "flips.jsonl").exists() and "## Flips" not in report


# --- config --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("gates, key", [
    ({"domain": {"min_dlta": 0.2}}, "eval.gates.domain.min_dlta"),
    ({"domain": {"min_delta": "high"}}, "eval.gates.domain.min_delta"),
    ({"domain": {"min": float("inf")}}, "eval.gates.domain.min"),
    ({"retention": {"max_drop": -0.1}}, "eval.gates.retention.max_drop"),
    ({"retention": {"metric": "char_f1", "max_drop": 0.1}}, "eval.gates.retention.metric"),
    ({"domain": {"metric": "char_f1"}}, "eval.gates.domain"),  # no condition
    ({"domain": 0.2}, "eval.gates.domain"),
    ({"nosuch": {"min": 0.1}}, "eval.gates.nosuch"),
    ({"domain": {"metric": "exact_match_number", "min": 0.1}}, "eval.gates.domain.metric"),  # not in eval.metrics
    ({"mmlu": {"metric": "acc_norm", "max_drop": 0.1}}, "eval.gates.mmlu.metric"),  # mmlu reports acc
])
def test_bad_gates_are_config_errors_naming_the_key(gates, key):
    with pytest.raises(ConfigError) as info:
        make_config(gates=gates)
    assert str(info.value).startswith((f"{key}=", f"{key}:", f"unknown key '{key}'")), str(info.value)


def test_gate_names_need_held_out_rows_and_something_to_retain():
    with pytest.raises(ConfigError, match="holds out no rows"):
        Config(command="eval", data=DataConfig(sources=[DataSource(name="d", path="d.jsonl")]),
               eval=EvalConfig(gates={"d": {"min": 0.1}}))
    with pytest.raises(ConfigError, match="eval.gates.retention.*nothing to judge"):
        make_config(gates={"domain": {"min": 0}, "general": {"min": 0}, "retention": {"max_drop": 0}}, benchmarks=())
    make_config(gates={"mmlu": {"min": 0.3}, "retention": {"max_drop": 0.05}})  # a benchmark gate: accepted
    make_config(gates={"mmlu": {"metric": "acc", "min": 0.3}})  # its own metric named: accepted


def test_a_gate_key_typo_gets_the_key_meant():
    with pytest.raises(ConfigError, match=r"unknown key 'eval.gates.mmlu.max_drp' \(did you mean "
                                          r"eval.gates.mmlu.max_drop\?\)"):
        make_config(gates={"mmlu": {"max_drp": 0.1}})


# --- sweep specs and the CLI ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", sorted((ROOT / "recipes" / "sweeps").glob("*.yaml")), ids=lambda p: p.name)
def test_sweep_specs_maximise_the_logged_score(path):
    spec = yaml.safe_load(path.read_text())
    assert spec["metric"] == {"name": SCORE_KEY, "goal": "maximize"}


def test_score_is_logged_under_the_sweep_key():
    class FakeWandb:
        class Table:
            def __init__(self, columns):
                self.columns, self.rows = columns, []

            def add_data(self, *values):
                self.rows.append(values)

        class run:
            summary = {}

        logged = {}

        @classmethod
        def log(cls, payload):
            cls.logged.update(payload)

    from qwenft.evaluate.verdict import log_wandb

    config = make_config(gates={"domain": {"min_delta": 0.9}})
    ev = {**judge(config, make_report()), "benchmarks": make_report()["benchmarks"]}
    log_wandb(FakeWandb, ev)
    assert FakeWandb.logged[SCORE_KEY] == pytest.approx(ev["score"]) == FakeWandb.run.summary[SCORE_KEY]
    assert FakeWandb.logged["eval/gates/domain"] == 0 and FakeWandb.logged["eval/passed"] == 0
    assert FakeWandb.logged["eval/benchmarks"].rows[0][:6] == ("mmlu", "acc", 4, 0.5, 0.75, 0.25)


@pytest.fixture(scope="module")
def gated_run(tmp_path_factory):
    """A tiny-random `train` whose gate cannot pass (char_f1 >= 2), with eval.fail_on_gate=true."""
    from tests.conftest import run_train, train_overrides

    tmp = tmp_path_factory.mktemp("gates")
    run_dir = tmp / "run"
    args = [a for a in train_overrides(tmp, run_dir) if not a.startswith(("eval.after_train", "train.max_steps"))]
    result = run_train([*args, "train.max_steps=2", "eval.max_new_tokens=4", "eval.batch_size=4",
                      "eval.gates={toy: {metric: char_f1, min: 2.0}}", "eval.fail_on_gate=true"])
    return tmp, run_dir, result


@pytest.mark.slow  # the command line's exit code 3 after a training run, in a new process
def test_train_exits_3_after_writing_everything(gated_run):
    _, run_dir, result = gated_run
    assert result.returncode == 3, result.stderr[-3000:]
    assert f"qwenft: verdict FAIL: gates failed: toy; report: {run_dir / 'report.md'}" in result.stderr
    for name in ("metrics.json", "report.md", "flips.jsonl", "generations.jsonl", "adapter/adapter_model.safetensors"):
        assert (run_dir / name).is_file(), name
    report = (run_dir / "report.md").read_text()
    assert report.startswith("# qwenft report: train\n\n## Verdict: FAIL (gates failed: toy)\n")
    assert "| toy | FAIL | char_f1 | 4 |" in report and "tuned >= 2.000" in report
    ev = json.loads((run_dir / "metrics.json").read_text())["eval"]
    assert ev["passed"] is False and ev["gates"]["toy"]["items"][0]["checks"][0]["passed"] is False
    assert "verdict: gates failed: toy" in (run_dir / "train.log").read_text()


@pytest.mark.slow  # the command line's exit codes: four eval processes
def test_eval_exit_codes(gated_run, tmp_path):
    """`eval` with the adapter: 3 with fail_on_gate, 0 without (report still FAIL); the base alone: 0, not judged;
    a bad gate key: 2 before any model loads (no run directory)."""
    from tests.conftest import run_qwenft as run_any

    tmp, run_dir, _ = gated_run
    source = f"data.sources=[{{name: toy, path: '{tmp / 'rows.jsonl'}', format: alpaca, weight: 1.0, eval_rows: 4}}]"
    common = ["model=tiny-random", "quant=none", source, "eval.max_new_tokens=4",
              "eval.gates={toy: {metric: char_f1, min: 2.0}}"]
    failed = run_any("eval", *common, f"adapter={run_dir / 'adapter'}", "eval.fail_on_gate=true",
                     f"out_dir={tmp_path / 'a'}", timeout=300)
    assert failed.returncode == 3, failed.stderr[-3000:]
    assert f"gates failed: toy; report: {tmp_path / 'a' / 'report.md'}" in failed.stderr.splitlines()[-1]
    assert (tmp_path / "a" / "flips.jsonl").is_file()
    kept = run_any("eval", *common, f"adapter={run_dir / 'adapter'}", f"out_dir={tmp_path / 'b'}", timeout=300)
    assert kept.returncode == 0, kept.stderr[-3000:]
    assert (tmp_path / "b" / "report.md").read_text().startswith("# qwenft report: eval\n\n## Verdict: FAIL")
    base = run_any("eval", *common, "eval.fail_on_gate=true", f"out_dir={tmp_path / 'c'}", timeout=300)
    assert base.returncode == 0, base.stderr[-3000:]
    assert "## Verdict: not judged (no tuned side)" in (tmp_path / "c" / "report.md").read_text()
    bad = run_any("eval", "model=tiny-random", source, "eval.gates.toy.min_dlta=0.1", f"out_dir={tmp_path / 'd'}")
    assert bad.returncode == 2 and "unknown key 'eval.gates.toy.min_dlta'" in bad.stderr
    assert not (tmp_path / "d").exists()
