"""Checks of ``eval.gates``, the verdict's thresholds (judged by :mod:`qwenft.evaluate.verdict`), at the entry.

A gate is ``NAME: {metric: M, min: X, min_delta: D, max_drop: P}`` (at least one of min / min_delta / max_drop).
``NAME`` is a held-out source (``data.sources[*].name`` with ``eval_rows > 0``), a benchmark (``eval.benchmarks``)
or ``retention`` (every benchmark and held-out source without a gate of its own). Both checks run while the
config is validated, so a bad gate stops the run before any model loads (exit 2).
"""

from __future__ import annotations

import difflib
import math
from typing import Any, Dict, List, Sequence

from qwenft.config.base import ConfigError, _check

RETENTION = "retention"
CONDITIONS = ("min", "min_delta", "max_drop")  # tuned >= min; delta >= min_delta; delta >= -max_drop
GATE_KEYS = ("metric", *CONDITIONS)
# The built-in benchmarks' metric and lm-eval filter (lm-eval's task YAMLs: mmlu, ceval-valid, gsm8k); a gate's
# metric on one of them must be the name the report uses: the metric, with ",FILTER" unless the filter is "none".
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
               "(tuned - base >= min_delta) or max_drop (tuned - base >= -max_drop)")
        for key in conditions:
            value = gate[key]
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                   f"{where}.{key}", value, "must be a finite number")
        if gate.get("max_drop") is not None:
            _check(gate["max_drop"] >= 0, f"{where}.max_drop", gate["max_drop"],
                   "must be >= 0 (the largest drop of tuned below base allowed)")
        if gate.get("metric") is not None:
            _check(name != RETENTION, f"{where}.metric", gate["metric"],
                   "retention holds each source and benchmark to its own primary metric; drop metric")
            _check(isinstance(gate["metric"], str) and bool(gate["metric"]), f"{where}.metric", gate["metric"],
                   "must be a metric name")


def check_gate_names(gates: Dict[str, Any], sources: Sequence[Any], benchmarks: Sequence[str],
                     metrics: Sequence[str]) -> None:
    """Each gate names something this run evaluates; a source gate's metric is one of ``eval.metrics``.

    Args:
        sources: the ``data.sources`` (``DataSource``: name, format, eval_rows).
        benchmarks: ``eval.benchmarks``.
        metrics: ``eval.metrics``.

    Raises:
        ConfigError: an unknown name, a source that holds out no generation rows, a name that is both a source and
            a benchmark, a source gate's metric that is not computed, or a retention gate with nothing to retain.
    """
    by_name = {s.name: s for s in sources}
    held_out = [s.name for s in sources if s.eval_rows > 0 and s.format != "text"]
    for name, gate in gates.items():
        if name == RETENTION:
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
                              f"or {RETENTION}")
    if RETENTION in gates:
        retained: List[str] = [*benchmarks, *(s for s in held_out if s not in gates)]
        _check(bool(retained), f"eval.gates.{RETENTION}", gates[RETENTION],
               "has nothing to judge: every held-out source has a gate of its own and eval.benchmarks is empty")
