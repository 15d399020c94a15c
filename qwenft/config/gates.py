"""Checks of ``eval.gates``, the verdict's thresholds (judged by :mod:`qwenft.evaluate.verdict`), at the entry.

A gate is ``NAME: {metric: M, min: X, min_delta: D, max_drop: P}`` (at least one of min / min_delta / max_drop).
``NAME`` is a held-out source (``data.sources[*].name`` with ``eval_rows > 0``), a benchmark (``eval.benchmarks``),
``target`` (every target, ``eval.targets``, without a gate of its own) or ``retention`` (every other held-out source
and benchmark without a gate of its own). The checks run while the config is validated, so a bad gate or target
stops the run before any model loads (exit 2).
"""

from __future__ import annotations

import difflib
import math
from typing import Any, Dict, List, Optional, Sequence

from qwenft.config.base import ConfigError, _check

TARGET = "target"
RETENTION = "retention"
GROUPS = (TARGET, RETENTION)  # the gates that cover every item without a gate of its own, by role
CONDITIONS = ("min", "min_delta", "max_drop")  # tuned >= min; delta > min_delta; delta >= -max_drop
GATE_KEYS = ("metric", *CONDITIONS)
# The built-in benchmarks' metric and lm-eval filter (lm-eval's task YAMLs: mmlu, ceval-valid, gsm8k); a gate's
# metric on one of them must be the name the report uses: the metric, with ",FILTER" unless the filter is "none".
# The judge's items (eval.judge.compare -> the item's name): the tuned side's win rate against base / the reference
JUDGE_ITEMS = {"base": "judge", "reference": "judge_reference"}
BUILTIN_BENCHMARKS = {"mmlu": ("acc", "none"), "ceval": ("acc", "none"), "gsm8k": ("exact_match", "strict-match")}


def metric_label(metric: str, filter_name: str) -> str:
    """The name report.md and metrics.json give a benchmark's metric: lm-eval's ``METRIC,FILTER``, the filter
    dropped when it is ``none`` (``acc``, ``exact_match,strict-match``)."""
    return metric if filter_name == "none" else f"{metric},{filter_name}"


def benchmark_metric(name: str) -> str:
    """:func:`metric_label` of a built-in benchmark."""
    return metric_label(*BUILTIN_BENCHMARKS[name])


def check_gate_values(gates: Dict[str, Any]) -> None:
    """Each gate's keys and values: a mapping of ``metric`` (text) and at least one finite condition.

    Raises:
        ConfigError: naming ``eval.gates.NAME`` or ``eval.gates.NAME.KEY``.
    """
    for name, gate in gates.items():
        where = f"eval.gates.{name}"
        _check(isinstance(gate, dict), where, gate,
               "must be a mapping of metric / min / min_delta / max_drop, e.g. {metric: contains_fact, min_delta: 0.2}")
        for key in gate:
            if key not in GATE_KEYS:
                guess = difflib.get_close_matches(str(key), GATE_KEYS, n=1, cutoff=0.6)
                hint = f" (did you mean {where}.{guess[0]}?)" if guess else ""
                raise ConfigError(f"unknown key '{where}.{key}'{hint}; accepted keys in {where}: "
                                  f"{', '.join(GATE_KEYS)}")
        conditions = [key for key in CONDITIONS if gate.get(key) is not None]
        _check(bool(conditions), where, gate, "needs at least one of min (tuned >= min), min_delta "
               "(tuned - base > min_delta) or max_drop (tuned - base >= -max_drop)")
        for key in conditions:
            value = gate[key]
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                   f"{where}.{key}", value, "must be a finite number")
        if gate.get("max_drop") is not None:
            _check(gate["max_drop"] >= 0, f"{where}.max_drop", gate["max_drop"],
                   "must be >= 0 (the largest drop of tuned below base allowed)")
        if gate.get("metric") is not None:
            _check(name not in GROUPS, f"{where}.metric", gate["metric"],
                   f"{name} holds each source and benchmark to its own primary metric; drop metric")
            _check(isinstance(gate["metric"], str) and bool(gate["metric"]), f"{where}.metric", gate["metric"],
                   "must be a metric name")


def held_out_sources(sources: Sequence[Any]) -> List[str]:
    """The names of the sources that hold out answers to generate (``eval_rows > 0``, not plain text)."""
    return [s.name for s in sources if s.eval_rows > 0 and s.format != "text"]


def target_names(targets: Optional[Sequence[str]], sources: Sequence[Any]) -> List[str]:
    """``eval.targets`` resolved: the names listed, or (null) the first held-out source: what the run exists to
    improve; every other held-out source and every benchmark is retention."""
    if targets is not None:
        return list(targets)
    held_out = held_out_sources(sources)
    return held_out[:1]


def judge_items(judge: Any) -> List[str]:
    """The names of the judge's items this config evaluates (:data:`JUDGE_ITEMS`; none without a judge)."""
    return [JUDGE_ITEMS[name] for name in judge.compare] if judge is not None and judge.enabled else []


def check_gate_names(gates: Dict[str, Any], sources: Sequence[Any], benchmarks: Sequence[str],
                     metrics: Sequence[str], targets: Optional[Sequence[str]] = None, judge: Any = None) -> None:
    """Each gate and each of ``eval.targets`` names something this run evaluates; a source gate's metric is one of
    ``eval.metrics``.

    Args:
        sources: the ``data.sources`` (``DataSource``: name, format, eval_rows).
        benchmarks: ``eval.benchmarks``.
        metrics: ``eval.metrics``.
        targets: ``eval.targets`` (null: the first held-out source).
        judge: ``eval.judge`` (its items, ``judge`` / ``judge_reference``, are gated by ``win_rate``).

    Raises:
        ConfigError: an unknown name, a source that holds out no generation rows, a name that is both a source and
            a benchmark, a source or benchmark named ``target`` / ``retention``, or a source gate's metric that is
            not computed.
    """
    by_name = {s.name: s for s in sources}
    held_out = held_out_sources(sources)
    for name in (*by_name, *benchmarks):
        if name in GROUPS:
            raise ConfigError(f"'{name}' names a data source or benchmark, but eval.gates.{name} is the gate of "
                              f"every {name} item: rename the source")
    for name in by_name:
        if name in benchmarks:
            raise ConfigError(f"data.sources: '{name}' is both a data source and a benchmark (eval.benchmarks); "
                              "rename the source")
    judged = judge_items(judge)
    for name in by_name:
        if name in JUDGE_ITEMS.values():
            raise ConfigError(f"data.sources: '{name}' is the name of the judge's win rate (eval.gates.{name}); "
                              "rename the source")
    for i, name in enumerate(getattr(judge, "sources", None) or []):
        _check(name in held_out, f"eval.judge.sources[{i}]", name,
               f"the judge reads held-out sources: {', '.join(held_out) or 'none'}")
    for i, name in enumerate(targets or []):
        _check(name in held_out or name in benchmarks or name in judged, f"eval.targets[{i}]", name,
               f"a target is a held-out source ({', '.join(held_out) or 'none'}), a benchmark "
               f"({', '.join(benchmarks) or 'none'}) or the judge's win rate ({', '.join(judged) or 'no eval.judge'})")
    for name, gate in gates.items():
        if name in GROUPS:
            continue
        if name in JUDGE_ITEMS.values():
            _check(name in judged, f"eval.gates.{name}", gate,
                   "gates the judge's win rate: set eval.judge.url (or eval.judge.local)"
                   + ("" if name == "judge" else " with reference in eval.judge.compare"))
            _check(gate.get("metric") in (None, "win_rate"), f"eval.gates.{name}.metric", gate.get("metric"),
                   "the judge reports win_rate (drop metric, or set it to that)")
            continue
        where = f"eval.gates.{name}"
        if name in by_name and name in benchmarks:
            raise ConfigError(f"{where}: '{name}' is both a data source and a benchmark; rename the source")
        if name in by_name:
            source = by_name[name]
            _check(source.format != "text", where, gate,
                   f"source '{name}' is plain text, scored by perplexity only: a gate needs held-out answers")
            _check(source.eval_rows > 0, where, gate,
                   f"source '{name}' holds out no rows to judge: set data.sources[{name}].eval_rows > 0")
            metric = gate.get("metric")
            _check(metric is None or metric in metrics, f"{where}.metric", metric,
                   f"a source is judged on one of eval.metrics: {', '.join(metrics)}")
        elif name in benchmarks:
            metric = gate.get("metric")
            if metric is not None and name in BUILTIN_BENCHMARKS:
                _check(metric == benchmark_metric(name), f"{where}.metric", metric,
                       f"benchmark {name} reports {benchmark_metric(name)} (drop metric, or set it to that)")
        else:
            raise ConfigError(f"{where}: no held-out source or benchmark named '{name}'; held-out sources: "
                              f"{', '.join(held_out) or '(none)'}; benchmarks: {', '.join(benchmarks) or '(none)'}; "
                              f"or {TARGET} / {RETENTION}; or {' / '.join(JUDGE_ITEMS.values())} with eval.judge")
