"""report.md's verdict and benchmark sections and the verdict's W&B log, rendered from what
:func:`qwenft.evaluate.verdict.judge` and the benchmark runner put in metrics.json's ``eval``."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from qwenft.config import Config
from qwenft.config.gates import GROUPS
from qwenft.evaluate.verdict import FAIL, INCONCLUSIVE, NO_GATES, NOT_JUDGED, PASS, SCORE_KEY, TOLERANCE

CONDITION_TEXT = {"min": "tuned >= {t:.3f}", "min_delta": "delta > {t:+.3f}", "max_drop": "delta >= {t:+.3f}"}


def _num(value: Any, signed: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value:+.3f}" if signed else f"{value:.3f}"


def _ci(ci95: Any) -> str:
    return f"[{ci95[0]:+.3f}, {ci95[1]:+.3f}]" if ci95 else ""


def condition_text(checks: List[Dict[str, Any]]) -> str:
    """The conditions as inequalities: ``delta > +0.000; tuned >= 0.500``."""
    return "; ".join(CONDITION_TEXT[c["condition"]].format(t=c["threshold"]) for c in checks)


def asks(checks: List[Dict[str, Any]]) -> str:
    """What a gate asks of an item, in words: ``better than base`` (min_delta 0), ``better than base by more than
    0.050``, ``no worse than base by more than 0.020`` (max_drop), ``tuned at least 0.500`` (min)."""
    words = []
    for c in checks:
        if c["condition"] == "min_delta":
            words.append("better than base" if abs(c["threshold"]) < TOLERANCE
                         else f"better than base by more than {c['threshold']:.3f}" if c["threshold"] > 0
                         else f"no worse than base by {-c['threshold']:.3f} or more")
        elif c["condition"] == "max_drop":
            words.append("no worse than base" if abs(c["threshold"]) < TOLERANCE
                         else f"no worse than base by more than {-c['threshold']:.3f}")
        else:
            words.append(f"tuned at least {c['threshold']:.3f}")
    return ", ".join(words)


def _decide_text(item: Dict[str, Any]) -> str:
    if item["status"] != INCONCLUSIVE:
        return ""
    if item["n_to_decide"] is None:
        return "no n (on the threshold)" if "threshold" in (item["reason"] or "") else ""
    return f"n ≈ {item['n_to_decide']:,}"


def _result_text(item: Dict[str, Any]) -> str:
    result = item["status"].upper() if item["status"] != NOT_JUDGED else NOT_JUDGED
    return result + (f": {item['reason']}" if item["reason"] else "")


def verdict_lines(config: Config, ev: Dict[str, Any]) -> List[str]:
    """report.md's opening section, rendered from metrics.json's ``eval`` (``verdict``, ``gates``, ``score``).

    Shape: ``## Verdict: PASS`` (or ``FAIL (gates failed: a, b)``, ``INCONCLUSIVE (undecided: a)``, ``not judged
    (no tuned side)``, ``no gates (eval.gates is empty)``), a table ``| gate | asks | result | metric | n | base |
    tuned | delta | 95% CI | to decide |`` with one row per judged item (``target: NAME`` / ``retention: NAME`` for
    the items a group gate covers), the rules in two lines, then the score line.
    """
    gates = ev.get("gates") or {}
    verdict = ev.get("verdict") or (NO_GATES if not gates else FAIL.upper() if ev.get("failed") else PASS.upper())
    if verdict == NO_GATES:
        head = "no gates (eval.gates is empty)"
    elif verdict == FAIL.upper():
        head = f"FAIL (gates failed: {', '.join(ev['failed'])})"
    elif verdict == INCONCLUSIVE.upper():
        head = f"INCONCLUSIVE (undecided: {', '.join(ev.get('inconclusive') or [])})"
    elif verdict == NOT_JUDGED:
        covering = [g for g in gates.values() if g["items"]] or list(gates.values())  # "no tuned side" first
        head = f"{NOT_JUDGED} (" + "; ".join(sorted({g['reason'] for g in covering if g['reason']})) + ")"
    else:
        head = verdict
    lines = [f"## Verdict: {head}", ""]
    if gates:
        lines += ["| gate | asks | result | metric | n | base | tuned | delta | 95% CI | to decide |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for name, gate in gates.items():
            if not gate["items"]:
                lines.append(f"| {name} |  | {gate['status']}: {gate['reason']} |  |  |  |  |  |  |  |")
            for item in gate["items"]:
                label = (f"{name}: {item['name']}" if name in GROUPS else
                         f"{name} ({item['role']}, own gate)" if item["role"] else f"{name} (own gate)")
                ci = _ci(item.get("ci95"))
                if any(c["condition"] == "min" for c in item["checks"]) and item.get("tuned_ci95"):
                    ci = (ci + "; " if ci else "") + f"tuned {_ci(item['tuned_ci95'])}"
                lines.append(f"| {label} | {asks(item['checks'])}: {condition_text(item['checks'])} "
                             f"| {_result_text(item)} | {item['metric']} | {item['n']} | {_num(item['base'])} | "
                             f"{_num(item['tuned'])} | {_num(item['delta'], signed=True)} | {ci} | "
                             f"{_decide_text(item)} |")
        methods = sorted({i["ci_method"] for g in gates.values() for i in g["items"] if i.get("ci_method")})
        min_n = ev.get("min_n", config.eval.min_n)
        lines += ["", f"PASS: the whole 95% interval meets the condition; FAIL: none of it does; INCONCLUSIVE: it "
                      f"straddles the threshold, or fewer than eval.min_n = {min_n} rows were judged, whatever the "
                      f"interval (to decide: about the n that would decide at the observed effect). Targets: "
                      f"{', '.join(ev.get('targets') or []) or 'none'} (eval.targets); the rest is retention."]
        if ev.get("ungated"):
            lines.append(f"Not judged, no gate covers them: {', '.join(ev['ungated'])}.")
        if methods:
            lines.append(f"Intervals: {'; '.join(methods)}.")
        lines.append("")
        exits = []
        if config.eval.fail_on_gate:
            exits.append("a FAIL makes `train` / `eval` exit with code 3 (eval.fail_on_gate=true)")
        if config.eval.fail_on_inconclusive:
            exits.append("an INCONCLUSIVE verdict exits with code 4 (eval.fail_on_inconclusive=true)")
        if exits:
            lines += ["; ".join(exits).capitalize() + ".", ""]
    lines += [f"Score (eval.score = T + R): {_num(ev.get('score'))}", ""]
    return lines


def _cost(bench: Dict[str, Any]) -> str:
    """``0.41 s`` (the sides' mean seconds a question, ``seconds_per_question``) or empty."""
    per = bench.get("seconds_per_question") or {}
    return f"{sum(per.values()) / len(per):.2f} s" if per else ""


def benchmark_lines(benchmarks: Optional[Dict[str, Dict[str, Any]]],
                    skipped: Optional[Dict[str, str]] = None) -> List[str]:
    """report.md's "Benchmarks" section from ``report["benchmarks"]``; no lines when there are none.

    Table ``| benchmark | metric | n | base | tuned | delta | 95% CI | s / question |`` (the CI of the paired
    difference tuned - base; the seconds a question cost per side, measured), then the CI methods used; without a
    tuned side (``eval`` without ``adapter=``) ``| benchmark | metric | n | base | s / question |``. ``skipped``
    (``{name: reason}``, ``eval.bench_missing=skip``) adds a line per benchmark left out for want of data.
    """
    gone = [f"- {name}: skipped, {reason}" for name, reason in (skipped or {}).items()]
    if not benchmarks:
        return ["## Benchmarks", "", *gone, ""] if gone else []
    if gone:
        return [*benchmark_lines(benchmarks), *gone, ""]
    if not any("tuned" in b for b in benchmarks.values()):  # the base alone: no empty tuned / delta / CI columns
        return ["## Benchmarks", "", "| benchmark | metric | n | base | s / question |", "|---|---|---|---|---|",
                *(f"| {name} | {b.get('metric')} | {b.get('n')} | {_num(b.get('base'))} | {_cost(b)} |"
                  for name, b in benchmarks.items()), ""]
    lines = ["## Benchmarks", "", "| benchmark | metric | n | base | tuned | delta | 95% CI | s / question |",
             "|---|---|---|---|---|---|---|---|"]
    for name, b in benchmarks.items():
        tuned = "tuned" in b
        lines.append(f"| {name} | {b.get('metric')} | {b.get('n')} | {_num(b.get('base'))} | "
                     f"{_num(b.get('tuned')) if tuned else ''} | {_num(b.get('delta'), signed=True) if tuned else ''} "
                     f"| {_ci(b.get('ci95'))} | {_cost(b)} |")
    methods = sorted({b["ci_method"] for b in benchmarks.values() if b.get("ci_method") and b.get("ci95")})
    lines += [""] + ([f"95% CI of the paired difference (same questions on both sides): {', '.join(methods)}; "
                      "s / question: the wall time of a side over its questions (blocks per subject share their "
                      "5-shot prefix).", ""] if methods else [])
    return lines


def summary_line(ev: Dict[str, Any]) -> str:
    """The verdict in one line for the console: ``verdict: FAIL (gates failed: a); INCONCLUSIVE: b``."""
    parts = [f"gates failed: {', '.join(ev['failed'])}"] if ev.get("failed") else []
    if ev.get("inconclusive"):
        parts.append(f"undecided: {', '.join(ev['inconclusive'])}")
    verdict = ev.get("verdict") or NO_GATES
    line = f"verdict: {verdict}" + (f" ({'; '.join(parts)})" if parts else "")
    judged = ev.get("judge") or {}
    comparisons = judged.get("comparisons") or {}
    first = comparisons.get("base") or next(iter(comparisons.values()), None)
    if first is not None:  # the judge's win rate beside it, with its sanity check
        sanity = judged.get("sanity") or {}
        trust = ("" if sanity.get("trusted") else "; judge NOT TRUSTED" if sanity.get("trusted") is False
                 else "; judge sanity not checked")
        label = "judge win rate" + ("" if first["y"] == "base" else f" vs {first['y']}")
        if first.get("win_rate") is not None:
            line += (f"; {label} {first['win_rate']:.1%} [{first['ci95'][0]:.1%}, {first['ci95'][1]:.1%}] "
                     f"(n = {first['n']}){trust}")
        else:
            line += (f"; judge: no verdict ({first['unparsed']} unparsed, {first['errors']} failed){trust}")
    elif judged.get("failed"):
        line += "; judge: not completed"
    return line


def log_wandb(wandb, ev: Dict[str, Any]) -> None:
    """Log the verdict to the live W&B run: :data:`SCORE_KEY` (also in the run summary, what a sweep reads),
    ``eval/passed`` (1 when the verdict is PASS), the judge's ``eval/judge/win_rate`` / ``position_bias`` /
    ``sanity_accuracy`` (and ``eval/judge_reference/...``), ``eval/gates/NAME`` (1 pass, 0.5 inconclusive, 0 fail), and the
    tables ``eval/benchmarks`` and ``eval/gates``."""
    payload: Dict[str, Any] = {"eval/passed": int(bool(ev.get("passed")))}
    judged = ev.get("judge") or {}
    for kind, comparison in (judged.get("comparisons") or {}).items():  # eval/judge/win_rate, .../position_bias
        for key in ("win_rate", "position_bias"):
            if comparison.get(key) is not None:
                payload[f"eval/{comparison['item']}/{key}"] = comparison[key]
    if (judged.get("sanity") or {}).get("accuracy") is not None:
        payload["eval/judge/sanity_accuracy"] = judged["sanity"]["accuracy"]
    if ev.get("score") is not None:
        payload[SCORE_KEY] = ev["score"]
    values = {PASS: 1.0, INCONCLUSIVE: 0.5, FAIL: 0.0}
    for name, gate in (ev.get("gates") or {}).items():
        if gate["status"] in values:
            payload[f"eval/gates/{name}"] = values[gate["status"]]
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
        table = wandb.Table(columns=["gate", "item", "role", "status", "metric", "n", "base", "tuned", "delta",
                                     "ci95_lo", "ci95_hi", "condition", "n_to_decide"])
        for name, gate in ev["gates"].items():
            for item in gate["items"]:
                ci = item.get("ci95") or [None, None]
                table.add_data(name, item["name"], item["role"], item["status"], item["metric"], item["n"],
                               item["base"], item["tuned"], item["delta"], *ci, condition_text(item["checks"]),
                               item.get("n_to_decide"))
        payload["eval/gates"] = table
    wandb.log(payload)
    if ev.get("score") is not None:
        wandb.run.summary[SCORE_KEY] = ev["score"]
