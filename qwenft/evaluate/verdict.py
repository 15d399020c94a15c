"""The verdict of an evaluation: ``eval.gates`` judged, and ``eval.score``, the one number W&B sweeps maximise.

An *item* is a held-out source or a benchmark, judged on its *primary metric*:

- a benchmark: the metric it reports (``acc``, ``exact_match,strict-match``, ...);
- a source: its gate's ``metric``, else the first of ``eval.metrics`` with a value (not n/a) for the source. A row
  is right when that metric is 1 (contains_fact, exact_match_number) or >= ``eval.correct_threshold`` (char_f1,
  rouge_l); :mod:`qwenft.evaluate.flips` lists the rows that changed.

A gate ``NAME: {metric, min, min_delta, max_drop}`` holds the item NAME to: tuned >= min, delta >= min_delta,
delta >= -max_drop (delta = tuned - base of the primary metric's mean; compared with a 1e-9 tolerance). The gate
``retention`` holds every benchmark and every held-out source without a gate of its own to its conditions. A
base-only evaluation (no adapter) judges nothing ("not judged: no tuned side") and never fails.

Score (``eval.score``, logged to W&B as :data:`SCORE_KEY`)::

    score = T + R
    T = mean over the target sources of the tuned primary metric's mean
        (target sources: the held-out sources with a gate of their own; none gated: every held-out source)
    R = mean over the retention items (every benchmark, every held-out source not in T) of min(0, delta)

so the score rewards learning the target data and is lowered only by drops elsewhere. An empty T or R counts 0; no
tuned value anywhere (base only): null.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional

from qwenft.config import Config, GatesFailed
from qwenft.config.gates import CONDITIONS, RETENTION

log = logging.getLogger(__name__)

SCORE_KEY = "eval/score"  # the W&B key of eval.score: recipes/sweeps/*.yaml maximise exactly this
BINARY_METRICS = ("contains_fact", "exact_match_number")  # 0/1 per row; the others are right at a threshold
TOLERANCE = 1e-9  # 0.75 - 0.55 must pass min_delta 0.2
NOT_JUDGED = "not judged"


def primary_metric(config: Config, source: str, by_side: Dict[str, Dict[str, Any]]) -> Optional[str]:
    """A held-out source's primary metric: its gate's ``metric``, else the first of ``eval.metrics`` whose mean is
    not None on a side (``by_side``: ``report["sources"][source]``); None when every metric is n/a."""
    gate = config.eval.gates.get(source) or {}
    if gate.get("metric"):
        return gate["metric"]
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


def items(config: Config, report: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every held-out source and benchmark of ``report`` (what :func:`qwenft.evaluate.run.evaluate` returns) on its
    primary metric: ``{"name", "kind": "source" | "benchmark", "metric", "n", "base", "tuned", "delta", "ci95",
    "ci_method", "has_tuned"}``; ``n`` counts the rows (questions) the metric was scored on; values are None where
    missing (a side that did not run, a metric that is n/a)."""
    out: List[Dict[str, Any]] = []
    for name, by_side in report.get("sources", {}).items():
        metric = primary_metric(config, name, by_side)
        rows = report.get("rows", {}).get(name) or []
        first = next((by_side[s] for s in ("base", "tuned") if s in by_side), {})
        n = (sum(any((row.get(s) or {}).get(metric) is not None for s in ("base", "tuned")) for row in rows)
             if rows else first.get("rows", 0))
        out.append({"name": name, "kind": "source", "metric": metric, "n": n,
                    "base": (by_side.get("base") or {}).get(metric), "tuned": (by_side.get("tuned") or {}).get(metric),
                    "delta": (by_side.get("delta") or {}).get(metric), "ci95": None, "ci_method": None,
                    "has_tuned": "tuned" in by_side})
    for name, bench in (report.get("benchmarks") or {}).items():
        out.append({"name": name, "kind": "benchmark", "metric": bench.get("metric"), "n": bench.get("n"),
                    "base": bench.get("base"), "tuned": bench.get("tuned"), "delta": bench.get("delta"),
                    "ci95": bench.get("ci95"), "ci_method": bench.get("ci_method"), "has_tuned": "tuned" in bench})
    return out


def _judge_item(item: Dict[str, Any], gate: Dict[str, Any]) -> Dict[str, Any]:
    """One item against one gate's conditions: the item plus ``checks`` and ``status`` (pass / fail / not judged)."""
    checks, reason = [], None
    for key in CONDITIONS:
        if gate.get(key) is None:
            continue
        threshold = -float(gate[key]) if key == "max_drop" else float(gate[key])
        value = item["tuned"] if key == "min" else item["delta"]
        passed = None if value is None else value >= threshold - TOLERANCE
        checks.append({"condition": key, "limit": gate[key], "value": value, "threshold": threshold,
                       "passed": passed})
    if not item["has_tuned"]:
        status, reason = NOT_JUDGED, "no tuned side"
    elif gate.get("metric") and item["kind"] == "benchmark" and gate["metric"] != item["metric"]:
        status, reason = "fail", f"the benchmark reports {item['metric']}, not {gate['metric']}"
    elif any(c["passed"] is None for c in checks):
        status, reason = "fail", f"{item['metric']} has no value on both sides (n/a)"
    else:
        status = "pass" if all(c["passed"] for c in checks) else "fail"
    return {**item, "checks": checks, "status": status, "reason": reason}


def judge(config: Config, report: Dict[str, Any]) -> Dict[str, Any]:
    """The verdict of ``report``: ``{"gates": {name: gate}, "passed": bool, "failed": [names], "score": float|None}``.

    A gate is ``{"conditions": {...}, "status": "pass" | "fail" | "not judged", "reason", "items": [item +
    checks]}``: a source or benchmark gate has one item, ``retention`` one per item it covers. ``passed`` is False
    when a gate failed (a gate not judged fails nothing). See the module docstring for the score.
    """
    found = items(config, report)
    gates: Dict[str, Any] = {}
    for name, gate in config.eval.gates.items():
        conditions = {k: gate[k] for k in ("metric", *CONDITIONS) if gate.get(k) is not None}
        if name == RETENTION:
            covered = [i for i in found if i["name"] not in config.eval.gates]
        else:
            covered = [i for i in found if i["name"] == name][:1]
        judged = [_judge_item(item, gate) for item in covered]
        statuses = {j["status"] for j in judged}
        status = "fail" if "fail" in statuses else "pass" if "pass" in statuses else NOT_JUDGED
        reason = None
        if status == NOT_JUDGED:
            reason = "no tuned side" if judged else f"nothing to judge: no {name} results in this evaluation"
        gates[name] = {"conditions": conditions, "status": status, "reason": reason, "items": judged}
    failed = [name for name, gate in gates.items() if gate["status"] == "fail"]
    return {"gates": gates, "passed": not failed, "failed": failed, "score": score(config, found)}


def score(config: Config, found: List[Dict[str, Any]]) -> Optional[float]:
    """``eval.score = T + R`` over :func:`items` (formula in the module docstring); None when no item has a tuned
    value."""
    if not any(i["tuned"] is not None for i in found):
        return None
    sources = [i for i in found if i["kind"] == "source"]
    targets = [i for i in sources if i["name"] in config.eval.gates and i["name"] != RETENTION] or sources
    tuned = [i["tuned"] for i in targets if i["tuned"] is not None]
    in_t = {id(i) for i in targets}
    drops = [min(0.0, i["delta"]) for i in found if id(i) not in in_t and i["delta"] is not None]
    return (sum(tuned) / len(tuned) if tuned else 0.0) + (sum(drops) / len(drops) if drops else 0.0)


def _num(value: Any, signed: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value:+.3f}" if signed else f"{value:.3f}"


def _ci(ci95: Any) -> str:
    return f"[{ci95[0]:+.3f}, {ci95[1]:+.3f}]" if ci95 else ""


def _threshold_text(checks: List[Dict[str, Any]]) -> str:
    words = {"min": "tuned", "min_delta": "delta", "max_drop": "delta"}
    return "; ".join(f"{words[c['condition']]} >= {_num(c['threshold'], signed=c['condition'] != 'min')}"
                     for c in checks)


def verdict_lines(config: Config, ev: Dict[str, Any]) -> List[str]:
    """report.md's opening section, rendered from metrics.json's ``eval`` (``gates``, ``passed``, ``score``).

    Shape: ``## Verdict: PASS`` (or ``FAIL (gates failed: a, b)``, ``not judged (no tuned side)``, ``no gates``),
    then a table ``| gate | result | metric | n | base | tuned | delta | condition | 95% CI |`` with one row per
    judged item (``retention: NAME`` for the items retention covers), then the score line.
    """
    gates = ev.get("gates") or {}
    if not gates:
        head = "no gates (eval.gates is empty)"
    elif ev.get("failed"):
        head = f"FAIL (gates failed: {', '.join(ev['failed'])})"
    elif all(g["status"] == NOT_JUDGED for g in gates.values()):
        head = f"{NOT_JUDGED} (" + "; ".join(sorted({g['reason'] for g in gates.values()})) + ")"
    else:
        head = "PASS"
    lines = [f"## Verdict: {head}", ""]
    if gates:
        lines += ["| gate | result | metric | n | base | tuned | delta | condition | 95% CI |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, gate in gates.items():
            if not gate["items"]:
                lines.append(f"| {name} | {gate['status']}: {gate['reason']} |  |  |  |  |  |  |  |")
            for item in gate["items"]:
                label = f"{name}: {item['name']}" if name == RETENTION else name
                result = item["status"].upper() if item["status"] != NOT_JUDGED else NOT_JUDGED
                result += f": {item['reason']}" if item["reason"] else ""
                lines.append(f"| {label} | {result} | {item['metric']} | {item['n']} | {_num(item['base'])} | "
                             f"{_num(item['tuned'])} | {_num(item['delta'], signed=True)} | "
                             f"{_threshold_text(item['checks'])} | {_ci(item.get('ci95'))} |")
        lines.append("")
        if config.eval.fail_on_gate:
            lines += ["eval.fail_on_gate=true: a failed gate makes `train` / `eval` exit with code 3.", ""]
    lines += [f"Score (eval.score = T + R): {_num(ev.get('score'))}", ""]
    return lines


def benchmark_lines(benchmarks: Optional[Dict[str, Dict[str, Any]]],
                    skipped: Optional[Dict[str, str]] = None) -> List[str]:
    """report.md's "Benchmarks" section from ``report["benchmarks"]``; no lines when there are none.

    Table ``| benchmark | n | base | tuned | delta | 95% CI |`` (the CI of the paired difference tuned - base), then
    the CI methods used; without a tuned side (``eval`` without ``adapter=``) ``| benchmark | metric | n | base |``.
    ``skipped`` (``{name: reason}``, ``eval.bench_missing=skip``) adds a line per benchmark left out for want of data.
    """
    gone = [f"- {name}: skipped, {reason}" for name, reason in (skipped or {}).items()]
    if not benchmarks:
        return ["## Benchmarks", "", *gone, ""] if gone else []
    if gone:
        return [*benchmark_lines(benchmarks), *gone, ""]
    if not any("tuned" in b for b in benchmarks.values()):  # the base alone: no empty tuned / delta / CI columns
        return ["## Benchmarks", "", "| benchmark | metric | n | base |", "|---|---|---|---|",
                *(f"| {name} | {b.get('metric')} | {b.get('n')} | {_num(b.get('base'))} |"
                  for name, b in benchmarks.items()), ""]
    lines = ["## Benchmarks", "", "| benchmark | metric | n | base | tuned | delta | 95% CI |",
             "|---|---|---|---|---|---|---|"]
    for name, b in benchmarks.items():
        tuned = "tuned" in b
        lines.append(f"| {name} | {b.get('metric')} | {b.get('n')} | {_num(b.get('base'))} | "
                     f"{_num(b.get('tuned')) if tuned else ''} | {_num(b.get('delta'), signed=True) if tuned else ''} "
                     f"| {_ci(b.get('ci95'))} |")
    methods = sorted({b["ci_method"] for b in benchmarks.values() if b.get("ci_method") and b.get("ci95")})
    lines += [""] + ([f"95% CI of the paired difference (same questions on both sides): {', '.join(methods)}.", ""]
                     if methods else [])
    return lines


def log_wandb(wandb, ev: Dict[str, Any]) -> None:
    """Log the verdict to the live W&B run: :data:`SCORE_KEY` (also in the run summary, what a sweep reads),
    ``eval/passed``, ``eval/gates/NAME`` (1 pass, 0 fail), and the tables ``eval/benchmarks`` and ``eval/gates``."""
    payload: Dict[str, Any] = {"eval/passed": int(bool(ev.get("passed")))}
    if ev.get("score") is not None:
        payload[SCORE_KEY] = ev["score"]
    for name, gate in (ev.get("gates") or {}).items():
        if gate["status"] != NOT_JUDGED:
            payload[f"eval/gates/{name}"] = int(gate["status"] == "pass")
    benchmarks = ev.get("benchmarks") or {}
    if benchmarks:
        table = wandb.Table(columns=["benchmark", "metric", "n", "base", "tuned", "delta", "ci95_lo", "ci95_hi",
                                     "ci_method"])
        for name, b in benchmarks.items():
            ci = b.get("ci95") or [None, None]
            table.add_data(name, b.get("metric"), b.get("n"), b.get("base"), b.get("tuned"), b.get("delta"), *ci,
                           b.get("ci_method"))
        payload["eval/benchmarks"] = table
    if ev.get("gates"):
        table = wandb.Table(columns=["gate", "item", "status", "metric", "n", "base", "tuned", "delta", "condition"])
        for name, gate in ev["gates"].items():
            for item in gate["items"]:
                table.add_data(name, item["name"], item["status"], item["metric"], item["n"], item["base"],
                               item["tuned"], item["delta"], _threshold_text(item["checks"]))
        payload["eval/gates"] = table
    wandb.log(payload)
    if ev.get("score") is not None:
        wandb.run.summary[SCORE_KEY] = ev["score"]


def enforce(config: Config, metrics: Optional[Dict[str, Any]], out_dir: Path) -> None:
    """Raise :class:`GatesFailed` when ``eval.fail_on_gate`` is set and a gate of ``metrics["eval"]`` failed.

    Called after everything is written (metrics.json, report.md, flips.jsonl, the adapter); the CLI turns it into
    one line on stderr and exit code 3. ``metrics`` None: read ``out_dir/metrics.json`` (none there, or no
    ``eval`` in it: nothing was judged). A gate not judged (base only) never raises.
    """
    if not config.eval.fail_on_gate:
        return
    if metrics is None:
        path = Path(out_dir) / "metrics.json"
        metrics = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    ev = metrics.get("eval") or {}
    if not config.eval.fail_on_gate or not ev.get("failed"):
        return
    parts = []
    for name in ev["failed"]:
        bad = [i["name"] for i in ev["gates"][name]["items"] if i["status"] == "fail"]
        parts.append(f"{name} ({', '.join(bad)})" if name == RETENTION else name)
    raise GatesFailed(f"gates failed: {', '.join(parts)}; report: {Path(out_dir) / 'report.md'}")
