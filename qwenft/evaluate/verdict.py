"""The verdict of an evaluation: ``eval.gates`` judged on 95% intervals, and ``eval.score``, the one number W&B sweeps
maximise.

An *item* is a held-out source or a benchmark. Its *role* is ``target`` (``eval.targets``: what the run exists to
improve; null, the first held-out source) or ``retention`` (every other source and every benchmark: what must not
get worse). It is judged on its *primary metric*:

- a benchmark: the metric it reports (``acc``, ``exact_match,strict-match``, ...), over its questions;
- the judge's win rate (``judge``, ``judge_reference``: :mod:`qwenft.evaluate.judging`): wins + ties / 2 over
  the judged prompts against 0.5, a side against itself; a judge that failed its sanity check leaves it
  INCONCLUSIVE;
- a source: its gate's ``metric``, else the first of ``eval.metrics`` that applies to at least ``eval.min_n`` of its
  rows (a metric applies to a row where it is defined: ``exact_match_number`` where the reference states a number,
  ``contains_fact`` where the row gives a fact), else the one that applies to the most rows. n counts the rows it
  applies to; the others are not judged by it.

A gate ``{metric, min, min_delta, max_drop}`` asks tuned >= min, delta > min_delta (improved by more than),
delta >= -max_drop (dropped no more than), with delta = tuned - base over the same rows. ``target`` is the gate of
every target without a gate of its own, ``retention`` that of every other item without one. Each condition is
judged on its value's 95% interval (:mod:`qwenft.evaluate.intervals`: Newcombe's paired interval for right/wrong
rows, Wilson's for a right/wrong mean, a bootstrap over rows for char_f1 / rouge_l):

- PASS: the whole interval meets the condition; FAIL: none of it does; INCONCLUSIVE: it straddles the threshold,
  with about the n that would decide at the observed effect (:func:`qwenft.evaluate.intervals.n_to_decide`);
- an item judged on fewer than ``eval.min_n`` rows is INCONCLUSIVE, never PASS; no tuned side: not judged.

An item's result is FAIL if a condition fails, else INCONCLUSIVE if one is, else PASS; a gate's is the same over its
items, and the verdict's over the gates (no gates: "no gates"; none judged: "not judged").

Score (``eval.score``, logged to W&B as :data:`SCORE_KEY`)::

    score = T + R
    T = mean over the target items of the tuned primary metric's mean
    R = mean over the retention items of min(0, delta)

a point estimate over fixed rows (no interval, no gate enters it), so runs of one sweep on the same held-out data
compare; it rewards learning the targets and is lowered only by drops elsewhere. An empty T or R counts 0; no tuned
value anywhere (base only): null.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from qwenft.config import Config, GatesFailed, GatesInconclusive
from qwenft.config.gates import CONDITIONS, GROUPS, RETENTION, TARGET, target_names
import qwenft.evaluate.intervals as intervals

log = logging.getLogger(__name__)

SCORE_KEY = "eval/score"  # the W&B key of eval.score: recipes/sweeps/*.yaml maximise exactly this
BINARY_METRICS = ("contains_fact", "exact_match_number", "pref_accuracy")  # 0/1 per row; the others are right at a threshold
TOLERANCE = 1e-9  # 0.75 - 0.55 meets a threshold of 0.2
PASS, FAIL, INCONCLUSIVE, NOT_JUDGED = "pass", "fail", "inconclusive", "not judged"
NO_GATES = "no gates"


def _sides(row: Dict[str, Any]) -> List[str]:
    return [s for s in ("base", "tuned") if s in row]


def metric_counts(config: Config, rows: Sequence[Dict[str, Any]]) -> Dict[str, int]:
    """Per metric of ``eval.metrics``, the rows it applies to: a value (not None) on every side the row has."""
    return {m: sum(bool(_sides(row)) and all((row[s] or {}).get(m) is not None for s in _sides(row)) for row in rows)
            for m in config.eval.metrics}


def primary_metric(config: Config, source: str, by_side: Dict[str, Dict[str, Any]],
                   rows: Optional[Sequence[Dict[str, Any]]] = None) -> Optional[str]:
    """A held-out source's primary metric (module docstring): its gate's ``metric``, else the first of
    ``eval.metrics`` applying to at least ``eval.min_n`` of ``rows`` (``report["rows"][source]``), else the one
    applying to the most; None when none applies to any row. Without ``rows``, the first metric whose mean
    (``by_side``: ``report["sources"][source]``) is not None on a side."""
    gate = config.eval.gates.get(source) or {}
    if gate.get("metric"):
        return gate["metric"]
    if rows:
        counts = metric_counts(config, rows)
        enough = [m for m in config.eval.metrics if counts[m] >= config.eval.min_n]
        if enough:
            return enough[0]
        best = max(config.eval.metrics, key=lambda m: counts[m], default=None)  # the first of the largest
        return best if best is not None and counts[best] > 0 else None
    return next((m for m in config.eval.metrics
                 if any((by_side.get(side) or {}).get(m) is not None for side in ("base", "tuned"))), None)


def is_right(metric: str, value: Optional[float], threshold: float) -> Optional[bool]:
    """Whether one row's ``value`` of ``metric`` counts as right: 1 for the 0/1 metrics, >= ``threshold``
    (``eval.correct_threshold``) for char_f1 / rouge_l; None when the value is None (n/a for the row)."""
    if value is None:
        return None
    if metric in BINARY_METRICS:
        return value >= 1.0 - TOLERANCE
    return value >= threshold - TOLERANCE


def _mean(values: Sequence[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def _paired(base: List[float], tuned: List[float], has_tuned: bool, seed: int) -> Dict[str, Any]:
    """Means, delta and the intervals of paired per-row values (``tuned`` empty when there is no tuned side)."""
    out: Dict[str, Any] = {"n": len(base), "base": _mean(base), "tuned": None, "delta": None, "ci95": None,
                           "ci_method": None, "tuned_ci95": None}
    if has_tuned and tuned:
        (low, high), method = intervals.paired_interval(base, tuned, seed)
        (t_low, t_high), _ = intervals.mean_interval(tuned, seed)
        out.update(tuned=_mean(tuned), delta=_mean(tuned) - _mean(base), ci95=[low, high], ci_method=method,
                   tuned_ci95=[t_low, t_high])
    return out


def items(config: Config, report: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every held-out source and benchmark of ``report`` (what :func:`qwenft.evaluate.run.evaluate` returns) on its
    primary metric: ``{"name", "kind": "source" | "benchmark", "role": "target" | "retention", "metric", "n",
    "base", "tuned", "delta", "ci95" (delta's), "ci_method", "tuned_ci95", "has_tuned"}``. ``n`` counts the rows
    (questions) the metric applies to on every side; base / tuned / delta are means over those rows; values are
    None where missing (a side that did not run, a metric no row has)."""
    targets = set(target_names(config.eval.targets, config.data.sources))
    seed = config.eval.bench_seed
    out: List[Dict[str, Any]] = []
    for name, by_side in report.get("sources", {}).items():
        rows = report.get("rows", {}).get(name) or []
        metric = primary_metric(config, name, by_side, rows)
        has_tuned = "tuned" in by_side
        if rows and metric:
            both = [r for r in rows if _sides(r) and all((r[s] or {}).get(metric) is not None for s in _sides(r))]
            values = _paired([r["base"][metric] for r in both if "base" in r],
                             [r["tuned"][metric] for r in both if "tuned" in r], has_tuned, seed)
        else:  # no per-row results: the summary's means, without an interval
            values = {"n": 0 if not metric else (next(iter(by_side.values()), {}) or {}).get("rows", 0),
                      "base": (by_side.get("base") or {}).get(metric), "tuned": (by_side.get("tuned") or {}).get(metric),
                      "delta": (by_side.get("delta") or {}).get(metric), "ci95": None, "ci_method": None,
                      "tuned_ci95": None}
        out.append({"name": name, "kind": "source", "role": TARGET if name in targets else RETENTION,
                    "metric": metric, **values, "has_tuned": has_tuned})
    for name, bench in (report.get("benchmarks") or {}).items():
        rows = (report.get("bench_rows") or {}).get(name) or []
        has_tuned = "tuned" in bench
        paired = [r for r in rows if "base" in r and (not has_tuned or "tuned" in r)]
        if paired:
            values = _paired([float(bool(r["base"].get("correct"))) for r in paired],
                             [float(bool(r["tuned"].get("correct"))) for r in paired if "tuned" in r], has_tuned, seed)
        else:
            values = {"n": bench.get("n"), "base": bench.get("base"), "tuned": bench.get("tuned"),
                      "delta": bench.get("delta"), "ci95": bench.get("ci95"), "ci_method": bench.get("ci_method"),
                      "tuned_ci95": None}
        out.append({"name": name, "kind": "benchmark", "role": TARGET if name in targets else RETENTION,
                    "metric": bench.get("metric"), **values, "has_tuned": has_tuned})
    judged = report.get("judge") or {}
    for comparison in (judged.get("comparisons") or {}).values():  # the judge's win rates (qwenft.evaluate.judging)
        from qwenft.evaluate.judging import judge_item

        item = judge_item(comparison["item"], comparison, judged.get("sanity"))
        # no role unless a target: only a gate of its own (eval.gates.judge) judges it, so adding a judge does not
        # change the verdict of gates the run already had (tuned vs the reference is below 0.5 as a rule)
        role = TARGET if item["name"] in targets else None
        out.append({**item, "role": role})
    return out


def _judge_condition(item: Dict[str, Any], key: str, limit: float) -> Dict[str, Any]:
    """One condition of a gate on one item: its value, interval, threshold, status and (inconclusive) n to decide."""
    if key == "min":
        value, interval, threshold = item["tuned"], item.get("tuned_ci95"), float(limit)
    else:
        value, interval = item["delta"], item.get("ci95")
        threshold = float(limit) if key == "min_delta" else -float(limit)
    check: Dict[str, Any] = {"condition": key, "limit": limit, "threshold": threshold, "value": value,
                             "interval": interval, "status": INCONCLUSIVE, "n_to_decide": None}
    if value is None:
        return check
    low, high = interval if interval else (value, value)
    if key == "min_delta":  # strictly above: an interval [0, 0] has not improved
        passed, failed = low > threshold + TOLERANCE, high <= threshold + TOLERANCE
    else:
        passed, failed = low >= threshold - TOLERANCE, high < threshold - TOLERANCE
    check["status"] = PASS if passed else FAIL if failed else INCONCLUSIVE
    if check["status"] == INCONCLUSIVE and item.get("n"):
        check["n_to_decide"] = intervals.n_to_decide(item["n"], value, (low, high), threshold)
    return check


def _combine(statuses: Sequence[str]) -> str:
    """FAIL if any failed, else INCONCLUSIVE if any was, else PASS if any passed, else not judged."""
    for status in (FAIL, INCONCLUSIVE, PASS):
        if status in statuses:
            return status
    return NOT_JUDGED


def _judge_item(item: Dict[str, Any], gate: Dict[str, Any], min_n: int) -> Dict[str, Any]:
    """One item against one gate: the item plus ``checks``, ``status``, ``reason`` and ``n_to_decide``."""
    checks = [_judge_condition(item, key, gate[key]) for key in CONDITIONS if gate.get(key) is not None]
    reason, n_to_decide = None, None
    if not item["has_tuned"]:
        status, reason = NOT_JUDGED, "no tuned side"
    elif gate.get("metric") and item["kind"] == "benchmark" and gate["metric"] != item["metric"]:
        status, reason = FAIL, f"the benchmark reports {item['metric']}, not {gate['metric']}"
    elif item.get("distrust"):  # a judge that failed its sanity check decides nothing
        status, reason = INCONCLUSIVE, item["distrust"]
    elif not item["n"] or item["delta"] is None:  # no row to judge: more rows of the same kind would not help
        status, reason = INCONCLUSIVE, (f"no row has a value of {item['metric']}" if item["metric"]
                                        else "no metric of eval.metrics applies to any row")
    else:
        status = _combine([c["status"] for c in checks])
        open_checks = [c for c in checks if c["status"] == INCONCLUSIVE]
        known = [c["n_to_decide"] for c in open_checks]
        n_to_decide = None if None in known else max(known, default=None)
        if status == INCONCLUSIVE and n_to_decide is None:
            reason = "the observed value is the threshold itself: more rows would not decide"
        if item["n"] < min_n:  # too few rows to decide either way, whatever the interval says
            reason = f"n = {item['n']} < eval.min_n = {min_n}" + (
                f"; on its interval alone: {status.upper()}" if status in (PASS, FAIL) else
                f"; {reason}" if reason else "")
            status = INCONCLUSIVE
            n_to_decide = None if (open_checks and None in known) else max([min_n, *(k for k in known if k)])
    return {**item, "checks": checks, "status": status, "reason": reason, "n_to_decide": n_to_decide}


def judge(config: Config, report: Dict[str, Any]) -> Dict[str, Any]:
    """The verdict of ``report``: ``{"verdict": "PASS" | "FAIL" | "INCONCLUSIVE" | "not judged" | "no gates",
    "gates": {name: gate}, "passed": bool (verdict PASS), "failed": [names], "inconclusive": [names], "ungated":
    [items no gate covers], "min_n", "targets": [names], "score": float | None}``.

    A gate is ``{"role", "conditions": {...}, "status": "pass" | "fail" | "inconclusive" | "not judged", "reason",
    "items": [item + checks]}``: a source or benchmark gate has one item, ``target`` / ``retention`` one per item of
    that role without a gate of its own. See the module docstring for the rules and the score.
    """
    found = items(config, report)
    min_n = config.eval.min_n
    gates: Dict[str, Any] = {}
    for name, gate in config.eval.gates.items():
        conditions = {k: gate[k] for k in ("metric", *CONDITIONS) if gate.get(k) is not None}
        if name in GROUPS:
            covered = [i for i in found if i["role"] == name and i["name"] not in config.eval.gates]
            role = name
        else:
            covered = [i for i in found if i["name"] == name][:1]
            role = covered[0]["role"] if covered else None
        judged = [_judge_item(item, gate, min_n) for item in covered]
        status = _combine([j["status"] for j in judged])
        reason = None
        if status == NOT_JUDGED:
            reason = "no tuned side" if judged else _nothing_to_judge(name)
        gates[name] = {"role": role, "conditions": conditions, "status": status, "reason": reason, "items": judged}
    gated = {i["name"] for gate in gates.values() for i in gate["items"]}
    ungated = [i["name"] for i in found if i["name"] not in gated]  # no gate covers them: said under the table
    failed = [name for name, gate in gates.items() if gate["status"] == FAIL]
    undecided = [name for name, gate in gates.items() if gate["status"] == INCONCLUSIVE]
    overall = _combine([g["status"] for g in gates.values()])
    verdict = NO_GATES if not gates else overall.upper() if overall != NOT_JUDGED else NOT_JUDGED
    return {"verdict": verdict, "gates": gates, "passed": verdict == PASS.upper(), "failed": failed,
            "inconclusive": undecided, "ungated": ungated, "min_n": min_n,
            "targets": [i["name"] for i in found if i["role"] == TARGET], "score": score(found)}


def _nothing_to_judge(name: str) -> str:
    if name == TARGET:
        return "nothing to judge: no target without a gate of its own (eval.targets)"
    if name == RETENTION:
        return "nothing to judge: no other held-out source or benchmark without a gate of its own"
    return f"nothing to judge: no {name} results in this evaluation"


def score(found: List[Dict[str, Any]]) -> Optional[float]:
    """``eval.score = T + R`` over :func:`items` (formula in the module docstring); None when no item has a tuned
    value."""
    if not any(i["tuned"] is not None for i in found):
        return None
    tuned = [i["tuned"] for i in found if i["role"] == TARGET and i["tuned"] is not None]
    drops = [min(0.0, i["delta"]) for i in found if i["role"] == RETENTION and i["delta"] is not None]
    return (sum(tuned) / len(tuned) if tuned else 0.0) + (sum(drops) / len(drops) if drops else 0.0)


def enforce(config: Config, metrics: Optional[Dict[str, Any]], out_dir: Path) -> None:
    """Raise when the verdict of ``metrics["eval"]`` asks for a non-zero exit: :class:`GatesFailed` (exit 3) when a
    gate failed and ``eval.fail_on_gate`` or ``eval.fail_on_inconclusive`` is set (the stricter flag stops on a FAIL
    too); :class:`GatesInconclusive` (exit 4) when none failed, one is inconclusive and ``eval.fail_on_inconclusive``
    is set.

    Called after everything is written (metrics.json, report.md, flips.jsonl, the adapter); the CLI turns it into
    one line on stderr. ``metrics`` None: read ``out_dir/metrics.json`` (none there, or no ``eval`` in it: nothing
    was judged). A gate not judged (base only) never raises.
    """
    if not (config.eval.fail_on_gate or config.eval.fail_on_inconclusive):  # the stricter flag implies the other
        return
    if metrics is None:
        path = Path(out_dir) / "metrics.json"
        metrics = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    ev = metrics.get("eval") or {}
    report = Path(out_dir) / "report.md"
    if ev.get("failed"):
        raise GatesFailed(f"gates failed: {_named(ev, ev['failed'], FAIL)}; report: {report}")
    if config.eval.fail_on_inconclusive and not ev.get("failed") and ev.get("inconclusive"):
        raise GatesInconclusive(f"gates undecided: {_named(ev, ev['inconclusive'], INCONCLUSIVE)}; report: {report}")


def _named(ev: Dict[str, Any], names: Sequence[str], status: str) -> str:
    """``a, target (domain), retention (mmlu, general)``: a group gate names its items of that status."""
    parts = []
    for name in names:
        bad = [i["name"] for i in ev["gates"][name]["items"] if i["status"] == status]
        parts.append(f"{name} ({', '.join(bad)})" if name in GROUPS else name)
    return ", ".join(parts)
