"""The verdict: intervals, flips, target and retention gates judged three ways, eval.score, the report's opening
section, the sweep specs' metric and exit codes 3 and 4.

Hand-made evaluation reports (the shape :func:`qwenft.evaluate.run.evaluate` returns) for the arithmetic; a real
tiny-random `train` / `eval` for the exit codes.
"""

from __future__ import annotations

import json
import random

import pytest
import yaml

from qwenft.config import Config, ConfigError, DataConfig, DataSource, EvalConfig, GatesFailed, GatesInconclusive
from qwenft.evaluate import intervals
from qwenft.evaluate.flips import find_flips, flip_counts, flip_lines
from qwenft.evaluate.verdict import SCORE_KEY, enforce, is_right, judge, primary_metric
from qwenft.evaluate.verdict_text import verdict_lines
from tests.conftest import ROOT

METRICS = ["contains_fact", "char_f1", "rouge_l"]


def make_config(gates=None, metrics=METRICS, threshold=0.5, fail_on_gate=False, benchmarks=("mmlu", "gsm8k"),
                sources=("domain", "general"), out_dir="out", min_n=1, targets=None,
                fail_on_inconclusive=False) -> Config:
    """A validated config with held-out sources ``sources`` and ``benchmarks``, without Hydra. ``min_n=1`` by
    default, so the small hand-made reports below are judged on their intervals alone."""
    return Config(command="eval", out_dir=str(out_dir), run_name="verdict-test",
                  data=DataConfig(sources=[DataSource(name=s, path=f"{s}.jsonl", eval_rows=4) for s in sources]),
                  eval=EvalConfig(gates={} if gates is None else gates, metrics=list(metrics),
                                  correct_threshold=threshold, fail_on_gate=fail_on_gate, benchmarks=list(benchmarks),
                                  min_n=min_n, targets=targets, fail_on_inconclusive=fail_on_inconclusive))


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


def by_side(rows, tuned: bool = True) -> dict:
    """``report["sources"][NAME]`` for ``rows``: summaries and the delta of the metrics both sides have."""
    by = {"base": summary(rows, "base")}
    if tuned:
        by["tuned"] = summary(rows, "tuned")
        by["delta"] = {k: by["tuned"][k] - by["base"][k] for k in by["base"]
                       if k != "rows" and by["base"][k] is not None and by["tuned"][k] is not None}
    return by


def bench_entry(rows, metric: str = "acc") -> dict:
    base = sum(r["base"]["correct"] for r in rows) / len(rows)
    entry = {"metric": metric, "n": len(rows), "base": base}
    if all("tuned" in r for r in rows):
        tuned = sum(r["tuned"]["correct"] for r in rows) / len(rows)
        entry.update(tuned=tuned, delta=tuned - base)
    return entry


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
    mmlu = [bench_row("mmlu", i, b, t if tuned else None)
            for i, (b, t) in enumerate([(True, False), (False, True), (False, True), (True, True)])]
    gsm8k = [bench_row("gsm8k", i, b, t if tuned else None) for i, (b, t) in enumerate([(True, True), (True, False)])]
    benchmarks = {"mmlu": bench_entry(mmlu), "gsm8k": bench_entry(gsm8k, "exact_match,strict-match")}
    return {"sources": {"domain": by_side(domain, tuned), "general": by_side(general, tuned)},
            "rows": {"domain": domain, "general": general}, "perplexity": {},
            "benchmarks": benchmarks, "bench_rows": {"mmlu": mmlu, "gsm8k": gsm8k}}


def paired_report(sources: dict = None, benchmarks: dict = None) -> dict:
    """A report from paired values: ``sources`` {name: (metric, [(base, tuned), ...])} (other metrics None),
    ``benchmarks`` {name: [(base right, tuned right), ...]}."""
    report = {"sources": {}, "rows": {}, "perplexity": {}, "benchmarks": {}, "bench_rows": {}}
    for name, (metric, pairs) in (sources or {}).items():
        rows = [row(name, i, side("b", **{metric: b}), side("t", **{metric: t})) for i, (b, t) in enumerate(pairs)]
        report["rows"][name], report["sources"][name] = rows, by_side(rows)
    for name, pairs in (benchmarks or {}).items():
        rows = [bench_row(name, i, b, t) for i, (b, t) in enumerate(pairs)]
        report["bench_rows"][name], report["benchmarks"][name] = rows, bench_entry(rows)
    return report


# --- intervals -----------------------------------------------------------------------------------------------------

def test_newcombe_and_wilson_match_published_values():
    """Newcombe's paired interval on the table [[59, 6], [16, 80]] (Fagerland, Lydersen & Laake 2017, "Statistical
    Analysis of Contingency Tables", ch. 8: estimate -0.0621, 95% CI -0.1186 to -0.0046, printed to 4 decimals);
    Wilson's interval of 0 of 20 reaches 0.1611 (z^2 / (n + z^2))."""
    low, high = intervals.newcombe_paired(59, 6, 16, 80)
    assert (low, high) == pytest.approx((-0.1186, -0.0046), abs=5e-5)
    assert intervals.wilson(0, 20) == pytest.approx((0.0, 1.959964 ** 2 / (20 + 1.959964 ** 2)), abs=1e-6)
    assert intervals.newcombe_paired(0, 9, 0, 3)[0] > 0  # the quickstart's 0/12 -> 9/12: a real improvement
    with pytest.raises(ValueError, match="at least one item"):
        intervals.newcombe_paired(0, 0, 0, 0)


def test_newcombe_covers_the_true_difference_about_95_percent_of_the_time():
    """Coverage over 2,000 simulated paired samples of 40 items (p_base 0.5, 20% flips each way half as often as
    the other way): at least 0.93 (Newcombe 1998 reports 0.94-0.96 for this method; 2,000 draws give +-0.01)."""
    rng = random.Random(0)
    cells = [(1, 1, 0.4), (0, 1, 0.15), (1, 0, 0.05), (0, 0, 0.4)]  # (base, tuned, probability)
    truth = 0.15 - 0.05
    covered = 0
    for _ in range(2000):
        pairs = [rng.choices([(b, t) for b, t, _ in cells], weights=[w for *_, w in cells])[0] for _ in range(40)]
        low, high = intervals.paired_interval([b for b, _ in pairs], [t for _, t in pairs])[0]
        covered += low <= truth <= high
    assert covered / 2000 >= 0.93


def test_graded_metrics_get_a_seeded_paired_bootstrap():
    base, tuned = [0.1, 0.5, 0.3, 0.8, 0.4], [0.3, 0.6, 0.3, 0.7, 0.9]
    (low, high), method = intervals.paired_interval(base, tuned, seed=3)
    assert method == intervals.BOOTSTRAP and low < sum(tuned) / 5 - sum(base) / 5 < high
    assert intervals.paired_interval(base, tuned, seed=3)[0] == (low, high)  # seeded: the same interval
    assert intervals.paired_interval([0.5] * 3, [0.7] * 3)[0] == pytest.approx((0.2, 0.2))  # every difference 0.2


def test_n_to_decide_scales_the_half_width():
    # delta 0.1, interval [-0.02, 0.22] at n 40, threshold 0: half-width 0.12 must shrink below 0.1
    assert intervals.n_to_decide(40, 0.1, (-0.02, 0.22), 0.0) == 58  # ceil(40 * 1.2^2) = 57.6 -> 58
    assert intervals.n_to_decide(40, -0.01, (-0.05, 0.03), -0.02) == 640  # 40 * (0.04 / 0.01)^2
    assert intervals.n_to_decide(40, 0.0, (-0.1, 0.1), 0.0) is None  # on the threshold: no n decides


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
    """general's primary metric is char_f1 (contains_fact applies to none of its rows): right when >=
    eval.correct_threshold."""
    config = make_config()
    report = make_report()
    assert primary_metric(config, "general", report["sources"]["general"], report["rows"]["general"]) == "char_f1"
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


def test_the_primary_metric_is_the_first_that_applies_to_min_n_rows():
    """domain: contains_fact applies to 3 of 4 rows, char_f1 to all 4. min_n 3: contains_fact (first with
    enough); min_n 4: char_f1; min_n 10: none has enough, the one applying to the most rows (char_f1)."""
    report = make_report()
    pick = {n: primary_metric(make_config(min_n=n), "domain", report["sources"]["domain"], report["rows"]["domain"])
            for n in (3, 4, 10)}
    assert pick == {3: "contains_fact", 4: "char_f1", 10: "char_f1"}


def test_right_at_the_threshold_and_float_tolerance():
    assert is_right("char_f1", 0.5, 0.5) is True and is_right("char_f1", 0.4999, 0.5) is False
    assert is_right("contains_fact", 1.0, 0.9) is True
    assert is_right("contains_fact", 0.0, 0.0) is False  # a 0/1 metric ignores eval.correct_threshold
    assert is_right("rouge_l", None, 0.5) is None
    # every row 0.55 -> 0.75: the interval is [0.2, 0.2] up to float rounding (0.19999999999999996)
    report = paired_report({"domain": ("char_f1", [(0.55, 0.75)] * 30)})
    config = make_config(gates={"domain": {"min_delta": 0.2}, "general": {"max_drop": 0.2}}, benchmarks=())
    checks = judge(config, report)["gates"]["domain"]["items"][0]["checks"]
    assert checks[0]["status"] == "fail"  # min_delta is strict: improved by 0.2, not by more than 0.2
    retained = paired_report({"general": ("char_f1", [(0.75, 0.55)] * 30)})
    assert judge(config, retained)["gates"]["general"]["status"] == "pass"  # max_drop 0.2 allows a 0.2 drop


def test_flip_section_shows_counts_and_the_first_five():
    report = make_report()
    report["bench_rows"]["mmlu"] = [bench_row("mmlu", i, False, True) for i in range(7)]
    lines = "\n".join(flip_lines(find_flips(make_config(), report)))
    assert "### mmlu (acc): 0 right -> wrong, 7 wrong -> right (of 7 judged)" in lines
    assert "`mmlu/4`" in lines and "`mmlu/5`" not in lines
    assert "### domain (contains_fact): 1 right -> wrong, 2 wrong -> right (of 3 judged)" in lines


# --- gates: three ways ---------------------------------------------------------------------------------------------

GATES = {"target": {"min_delta": 0.0}, "retention": {"max_drop": 0.02}}


def test_three_way_outcomes_on_constructed_paired_results():
    """30 paired rows each. domain improved on 20 (0 -> 1): the whole interval is above 0, PASS. general lost
    15 (1 -> 0): the whole interval is below -0.02, FAIL. mmlu gained 2 and lost 1 of 30: delta +0.033 meets
    delta >= -0.02, but its interval reaches below -0.02: INCONCLUSIVE, with about the n that would decide."""
    report = paired_report({"domain": ("contains_fact", [(0, 1)] * 20 + [(0, 0)] * 10),
                            "general": ("contains_fact", [(1, 0)] * 15 + [(1, 1)] * 15)},
                           {"mmlu": [(0, 1)] * 2 + [(1, 0)] + [(1, 1)] * 14 + [(0, 0)] * 13})
    config = make_config(gates=GATES, benchmarks=("mmlu",), min_n=20)
    verdict = judge(config, report)
    by_item = {i["name"]: i for g in verdict["gates"].values() for i in g["items"]}
    assert by_item["domain"]["role"] == "target" and by_item["domain"]["status"] == "pass"
    assert by_item["domain"]["ci95"][0] > 0 and by_item["domain"]["ci_method"] == intervals.NEWCOMBE
    assert by_item["general"]["role"] == "retention" and by_item["general"]["status"] == "fail"
    assert by_item["general"]["ci95"][1] < -0.02
    mmlu = by_item["mmlu"]
    assert mmlu["delta"] == pytest.approx(1 / 30) and mmlu["delta"] >= -0.02  # the delta alone would pass
    assert mmlu["ci95"][0] < -0.02 < mmlu["ci95"][1] and mmlu["status"] == "inconclusive"
    assert mmlu["n_to_decide"] > 30
    assert verdict["verdict"] == "FAIL" and verdict["failed"] == ["retention"]
    assert verdict["inconclusive"] == [] and verdict["passed"] is False
    # without general: no gate failed, one is undecided
    del report["sources"]["general"], report["rows"]["general"]
    undecided = judge(config, report)
    assert undecided["verdict"] == "INCONCLUSIVE" and undecided["inconclusive"] == ["retention"]
    # a target whose delta is above 0 but whose interval is not: INCONCLUSIVE, never PASS
    small = paired_report({"domain": ("contains_fact", [(0, 1)] * 3 + [(1, 0)] + [(0, 0)] * 26)})
    item = judge(make_config(gates=GATES, benchmarks=(), min_n=20), small)["gates"]["target"]["items"][0]
    assert item["delta"] > 0 and item["ci95"][0] < 0 and item["status"] == "inconclusive"


def test_a_medquad_shaped_run_never_passes_on_one_numeric_row():
    """The issue's case: a domain source of 20 QA rows with no number in any reference (exact_match_number n/a), a
    general source of 10 rows of which one has a numeric reference. domain is the target, judged on char_f1 over
    its 20 rows; general's exact_match_number applies to 1 row, so it is judged on char_f1 over 10 rows, fewer than
    eval.min_n = 20: INCONCLUSIVE, with the n that would decide; never PASS on n = 1."""
    rng = random.Random(1)
    domain = [row("domain", i, side("b", char_f1=0.15 + 0.02 * rng.random()), side("t", char_f1=0.25 + 0.02 * rng.random()))
              for i in range(20)]
    for r in domain:
        for s in ("base", "tuned"):
            r[s]["exact_match_number"] = None
    general = [row("general", i, side("b", char_f1=0.5), side("t", char_f1=0.5)) for i in range(10)]
    for i, r in enumerate(general):
        r["base"]["exact_match_number"] = r["tuned"]["exact_match_number"] = (0.0 if i == 0 else None)
    metrics = ["exact_match_number", "char_f1", "rouge_l"]
    for r in domain + general:
        for s in ("base", "tuned"):
            r[s]["contains_fact"] = None
    report = {"sources": {"domain": by_side(domain), "general": by_side(general)},
              "rows": {"domain": domain, "general": general}, "perplexity": {}}
    config = Config(command="eval", data=DataConfig(sources=[DataSource(name="domain", path="d.jsonl", eval_rows=20),
                                                             DataSource(name="general", path="g.jsonl", eval_rows=10)]),
                    eval=EvalConfig(metrics=metrics, gates={"retention": {"max_drop": 0.02}}))
    assert config.eval.min_n == 20 and config.eval.targets is None  # the defaults: the first source is the target
    config.eval.gates = dict(GATES)
    verdict = judge(config, report)
    target = verdict["gates"]["target"]["items"][0]
    assert (target["name"], target["metric"], target["n"], target["status"]) == ("domain", "char_f1", 20, "pass")
    general_item = verdict["gates"]["retention"]["items"][0]
    assert (general_item["name"], general_item["metric"], general_item["n"]) == ("general", "char_f1", 10)
    assert general_item["status"] == "inconclusive"
    assert general_item["reason"] == "n = 10 < eval.min_n = 20; on its interval alone: PASS"
    assert general_item["n_to_decide"] >= 20
    # judged on exact_match_number (a gate naming it): n = 1, still INCONCLUSIVE
    config.eval.gates = {**GATES, "general": {"metric": "exact_match_number", "max_drop": 0.02}}
    one = judge(config, report)["gates"]["general"]["items"][0]
    assert (one["n"], one["status"]) == (1, "inconclusive") and verdict["verdict"] == "INCONCLUSIVE"
    lines = "\n".join(verdict_lines(config, verdict))
    assert "| target: domain | better than base: delta > +0.000 | PASS | char_f1 | 20 |" in lines
    assert ("| retention: general | no worse than base by more than 0.020: delta >= -0.020 | INCONCLUSIVE: n = 10 "
            "< eval.min_n = 20; on its interval alone: PASS | char_f1 | 10 | 0.500 | 0.500 | +0.000 | "
            "[+0.000, +0.000] | n ≈ 20 |") in lines


def test_too_few_rows_decide_nothing_but_say_what_the_interval_would():
    """n < eval.min_n is INCONCLUSIVE even when the interval lies wholly on one side (found by a new user: a 16-row
    MMLU gate whose tuned interval was below `min`); the result names what the interval alone would say, and the
    n to decide is at least min_n, or none when the observed value is the threshold itself."""
    config = make_config(gates={"domain": {"min_delta": 0.0}, "general": {"min": 0.9}}, benchmarks=(), min_n=20)
    report = paired_report({"domain": ("contains_fact", [(0, 0)] * 16),  # no change: delta 0 on the threshold
                            "general": ("contains_fact", [(0, 0)] * 16)})  # tuned 0/16: Wilson [0, 0.19] < 0.9
    gates = judge(config, report)["gates"]
    general = gates["general"]["items"][0]
    assert general["status"] == "inconclusive" and general["checks"][0]["status"] == "fail"
    assert general["reason"] == "n = 16 < eval.min_n = 20; on its interval alone: FAIL"
    domain = gates["domain"]["items"][0]
    assert domain["status"] == "inconclusive" and domain["n_to_decide"] is None
    assert domain["reason"].startswith("n = 16 < eval.min_n = 20; the observed value is the threshold itself")
    lines = "\n".join(verdict_lines(config, judge(config, report)))
    assert "| domain (target, own gate) |" in lines and "no n (on the threshold)" in lines


def test_a_failed_condition_is_not_explained_by_another_conditions_threshold():
    """min fails (tuned 0/30 < 0.9) while min_delta sits on its threshold (delta 0): FAIL, with no reason about
    the threshold (which belongs to the undecided condition)."""
    config = make_config(gates={"target": {"min_delta": 0.0, "min": 0.9}}, benchmarks=(), sources=("domain",))
    item = judge(config, paired_report({"domain": ("contains_fact", [(0, 0)] * 30)}))["gates"]["target"]["items"][0]
    assert item["status"] == "fail" and item["reason"] is None
    assert [c["status"] for c in item["checks"]] == ["fail", "inconclusive"]


def test_items_no_gate_covers_are_named():
    config = make_config(gates={"target": {"min_delta": 0.0}}, targets=["general"])
    verdict = judge(config, make_report())
    assert verdict["ungated"] == ["domain", "mmlu", "gsm8k"]
    assert "Not judged, no gate covers them: domain, mmlu, gsm8k." in "\n".join(verdict_lines(config, verdict))


def test_targets_choose_what_is_judged_as_improvement():
    report = make_report()
    assert judge(make_config(gates=GATES), report)["targets"] == ["domain"]  # null: the first held-out source
    named = judge(make_config(gates=GATES, targets=["general", "mmlu"]), report)
    assert named["targets"] == ["general", "mmlu"]
    assert {i["name"] for i in named["gates"]["target"]["items"]} == {"general", "mmlu"}
    assert {i["name"] for i in named["gates"]["retention"]["items"]} == {"domain", "gsm8k"}
    none = judge(make_config(gates=GATES, targets=[]), report)
    assert none["gates"]["target"]["status"] == "not judged" and "nothing to judge" in none["gates"]["target"]["reason"]


def test_retention_covers_every_ungated_benchmark_and_source():
    config = make_config(gates={"domain": {"min_delta": 0.1}, "mmlu": {"min": 0.0}, "retention": {"max_drop": 0.2}})
    gate = judge(config, make_report())["gates"]["retention"]
    by_item = {i["name"]: i for i in gate["items"]}
    assert set(by_item) == {"general", "gsm8k"}  # domain and mmlu have gates of their own
    assert by_item["general"]["metric"] == "char_f1"
    assert by_item["general"]["delta"] == pytest.approx((0.4 + 0.55 + 0.9) / 3 - (0.6 + 0.4 + 0.9) / 3)
    assert by_item["gsm8k"]["checks"][0]["threshold"] == pytest.approx(-0.2)
    assert by_item["gsm8k"]["ci_method"] == intervals.NEWCOMBE and by_item["gsm8k"]["n"] == 2


def test_base_only_is_not_judged_and_never_fails(tmp_path):
    config = make_config(gates={"domain": {"min_delta": 0.1}, "retention": {"max_drop": 0.0}}, fail_on_gate=True,
                         fail_on_inconclusive=True)
    verdict = judge(config, make_report(tuned=False))
    assert {g["status"] for g in verdict["gates"].values()} == {"not judged"}
    assert {g["reason"] for g in verdict["gates"].values()} == {"no tuned side"}
    assert verdict["verdict"] == "not judged" and verdict["score"] is None
    enforce(config, {"eval": verdict}, tmp_path)  # neither exception


def test_score_formula_on_a_constructed_case():
    # T = the target's (domain) tuned contains_fact 2/3; R over general (-0.05 / 3), mmlu (0), gsm8k (-0.5)
    expected = 2 / 3 + (-0.05 / 3 + 0.0 - 0.5) / 3
    assert judge(make_config(), make_report())["score"] == pytest.approx(expected)
    # the score does not depend on gates (comparable across runs): the same with any gates
    assert judge(make_config(gates={"mmlu": {"min": 0.9}}), make_report())["score"] == pytest.approx(expected)
    # two targets: T = (2/3 + char_f1 1.85/3) / 2, R over mmlu and gsm8k
    both = make_config(targets=["domain", "general"])
    assert judge(both, make_report())["score"] == pytest.approx((2 / 3 + 1.85 / 3) / 2 + (0 - 0.5) / 2)


def test_enforce_exit_codes_fail_then_inconclusive(tmp_path):
    failing = paired_report({"domain": ("contains_fact", [(1, 0)] * 30)})
    undecided = paired_report({"domain": ("contains_fact", [(0, 1)] * 2 + [(0, 0)] * 28)})
    gates = {"target": {"min_delta": 0.0}}

    def config(**flags):
        return make_config(gates=gates, benchmarks=(), sources=("domain",), min_n=20, **flags)

    failed = {"eval": judge(config(), failing)}
    enforce(config(), failed, tmp_path)  # no flag: no exception
    with pytest.raises(GatesFailed) as info:
        enforce(config(fail_on_gate=True), failed, tmp_path)
    assert type(info.value) is GatesFailed and info.value.exit_code == 3
    assert str(info.value) == f"gates failed: target (domain); report: {tmp_path / 'report.md'}"
    with pytest.raises(GatesFailed) as info:  # the stricter flag stops on a FAIL too, with the FAIL's code
        enforce(config(fail_on_inconclusive=True), failed, tmp_path)
    assert type(info.value) is GatesFailed and info.value.exit_code == 3
    open_verdict = {"eval": judge(config(), undecided)}
    assert open_verdict["eval"]["verdict"] == "INCONCLUSIVE"
    enforce(config(fail_on_gate=True), open_verdict, tmp_path)  # undecided: fail_on_gate alone does not exit
    with pytest.raises(GatesInconclusive) as info:
        enforce(config(fail_on_inconclusive=True), open_verdict, tmp_path)
    assert info.value.exit_code == 4 and str(info.value).startswith("gates undecided: target (domain); report:")


def test_report_opens_with_the_verdict_and_writes_flips(tmp_path):
    from qwenft.evaluate.report import write_outputs

    config = make_config(gates={"domain": {"metric": "contains_fact", "min_delta": 0.2},
                                "retention": {"max_drop": 0.02}}, out_dir=tmp_path)
    metrics = write_outputs(config, tmp_path, make_report())
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# qwenft report: verdict-test\n\n## Verdict: INCONCLUSIVE (undecided: domain, "
                             "retention)\n\n| gate | asks | result | metric | n | base | tuned | delta | 95% CI | "
                             "to decide |\n")
    assert ("| domain (target, own gate) | better than base by more than 0.200: delta > +0.200 | INCONCLUSIVE | "
            "contains_fact | 3 | 0.333 | 0.667 | +0.333 | [") in report
    assert "| retention: gsm8k | no worse than base by more than 0.020: delta >= -0.020 | INCONCLUSIVE |" in report
    assert "Intervals: Newcombe paired score interval; paired bootstrap over items, 10,000 resamples." in report
    assert "| mmlu | acc | 4 | 0.500 | 0.750 | +0.250 |" in report  # the Benchmarks table
    assert "## Flips" in report and report.index("## Verdict") < report.index("## Benchmarks")
    saved = json.loads((tmp_path / "metrics.json").read_text())["eval"]
    assert saved["verdict"] == "INCONCLUSIVE" and saved["passed"] is False and saved["failed"] == []
    assert saved["inconclusive"] == ["domain", "retention"] == metrics["eval"]["inconclusive"]
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
    ({"target": {"metric": "char_f1", "min_delta": 0.1}}, "eval.gates.target.metric"),
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


@pytest.mark.parametrize("kwargs, key", [
    ({"targets": ["nosuch"]}, "eval.targets[0]"),
    ({"targets": ["domain", "perplexity_only"]}, "eval.targets[1]"),
    ({"min_n": 0}, "eval.min_n"),
    ({"min_n": 2.5}, "eval.min_n"),
])
def test_bad_targets_and_min_n_name_the_key(kwargs, key):
    with pytest.raises(ConfigError) as info:
        make_config(**kwargs)
    assert str(info.value).startswith(f"{key}="), str(info.value)


def test_gate_names_need_held_out_rows_and_group_gates_may_be_empty():
    with pytest.raises(ConfigError, match="holds out no rows"):
        Config(command="eval", data=DataConfig(sources=[DataSource(name="d", path="d.jsonl")]),
               eval=EvalConfig(gates={"d": {"min": 0.1}}))
    with pytest.raises(ConfigError, match="'target' names a data source"):
        make_config(sources=("target", "general"))
    with pytest.raises(ConfigError, match=r"^data.sources: 'mmlu' is both a data source and a benchmark"):
        make_config(sources=("domain", "mmlu"))  # with no gate naming it (found by a new user)
    # the default gates with nothing to retain: accepted, and the report says so
    config = make_config(gates=GATES, benchmarks=(), sources=("domain",))
    report = paired_report({"domain": ("contains_fact", [(0, 1)] * 30)})
    verdict = judge(config, report)
    assert verdict["verdict"] == "PASS" and verdict["gates"]["retention"]["status"] == "not judged"
    make_config(gates={"mmlu": {"min": 0.3}, "retention": {"max_drop": 0.05}})  # a benchmark gate: accepted
    make_config(gates={"mmlu": {"metric": "acc", "min": 0.3}})  # its own metric named: accepted
    assert EvalConfig().gates == GATES and EvalConfig().min_n == 20  # the defaults every run gets
    assert EvalConfig(gates={**GATES, "retention": None}).gates == {"target": {"min_delta": 0.0}}  # null drops one


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

    from qwenft.evaluate.verdict_text import log_wandb

    config = make_config(gates={"domain": {"min_delta": 0.9}})
    ev = {**judge(config, make_report()), "benchmarks": make_report()["benchmarks"]}
    log_wandb(FakeWandb, ev)
    assert FakeWandb.logged[SCORE_KEY] == pytest.approx(ev["score"]) == FakeWandb.run.summary[SCORE_KEY]
    assert FakeWandb.logged["eval/gates/domain"] == 0 and FakeWandb.logged["eval/passed"] == 0
    assert FakeWandb.logged["eval/benchmarks"].rows[0][:6] == ("mmlu", "acc", 4, 0.5, 0.75, 0.25)


@pytest.fixture(scope="module")
def gated_run(tmp_path_factory):
    """A tiny-random `train` whose gate cannot pass (char_f1 >= 2: the whole interval is below), with
    eval.fail_on_gate=true; eval.min_n=1 so its 4 held-out rows are judged."""
    from tests.conftest import run_train, train_overrides

    tmp = tmp_path_factory.mktemp("gates")
    run_dir = tmp / "run"
    args = [a for a in train_overrides(tmp, run_dir) if not a.startswith(("eval.after_train", "train.max_steps"))]
    result = run_train([*args, "train.max_steps=2", "eval.max_new_tokens=4", "eval.batch_size=4",
                      "eval.gates={toy: {metric: char_f1, min: 2.0}}", "eval.fail_on_gate=true", "eval.min_n=1"])
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
    assert "| toy (target, own gate) | tuned at least 2.000: tuned >= 2.000 | FAIL | char_f1 | 4 |" in report
    ev = json.loads((run_dir / "metrics.json").read_text())["eval"]
    assert ev["verdict"] == "FAIL" and ev["gates"]["toy"]["items"][0]["checks"][0]["status"] == "fail"
    assert "verdict: gates failed: toy" in (run_dir / "train.log").read_text()


@pytest.mark.slow  # the command line's exit codes: four eval processes
def test_eval_exit_codes(gated_run, tmp_path):
    """`eval` with the adapter: 3 with fail_on_gate; 4 with fail_on_inconclusive when 4 rows < eval.min_n = 20
    leave the gate undecided; the base alone: 0, not judged; a bad gate key: 2 before any model loads (no run
    directory)."""
    from tests.conftest import run_qwenft as run_any

    tmp, run_dir, _ = gated_run
    source = f"data.sources=[{{name: toy, path: '{tmp / 'rows.jsonl'}', format: alpaca, weight: 1.0, eval_rows: 4}}]"
    common = ["model=tiny-random", "quant=none", source, "eval.max_new_tokens=4",
              "eval.gates={toy: {metric: char_f1, min: 2.0}}"]
    failed = run_any("eval", *common, f"adapter={run_dir / 'adapter'}", "eval.fail_on_gate=true", "eval.min_n=1",
                     f"out_dir={tmp_path / 'a'}", timeout=300)
    assert failed.returncode == 3, failed.stderr[-3000:]
    assert f"gates failed: toy; report: {tmp_path / 'a' / 'report.md'}" in failed.stderr.splitlines()[-1]
    assert (tmp_path / "a" / "flips.jsonl").is_file()
    undecided = run_any("eval", *common, f"adapter={run_dir / 'adapter'}", "eval.min_n=20",
                        "eval.fail_on_inconclusive=true", f"out_dir={tmp_path / 'b'}", timeout=300)
    assert undecided.returncode == 4, undecided.stderr[-3000:]
    assert "qwenft: verdict INCONCLUSIVE: gates undecided: toy; report:" in undecided.stderr.splitlines()[-1]
    assert (tmp_path / "b" / "report.md").read_text().startswith("# qwenft report: eval\n\n## Verdict: "
                                                                 "INCONCLUSIVE (undecided: toy)")
    base = run_any("eval", *common, "eval.fail_on_gate=true", f"out_dir={tmp_path / 'c'}", timeout=300)
    assert base.returncode == 0, base.stderr[-3000:]
    assert "## Verdict: not judged (no tuned side)" in (tmp_path / "c" / "report.md").read_text()
    bad = run_any("eval", "model=tiny-random", source, "eval.gates.toy.min_dlta=0.1", f"out_dir={tmp_path / 'd'}")
    assert bad.returncode == 2 and "unknown key 'eval.gates.toy.min_dlta'" in bad.stderr
    assert not (tmp_path / "d").exists()
