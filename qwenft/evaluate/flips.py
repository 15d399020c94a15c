"""The questions that flipped: rows right for the base and wrong for the tuned model, and the other way round.

Per benchmark (``report["bench_rows"]``: each question's ``correct`` on both sides) and per held-out source
(``report["rows"]``: right = the source's primary metric, :func:`qwenft.evaluate.verdict.is_right`). Rows whose
metric is n/a on a side are left out. Written to ``flips.jsonl`` in the run directory, counted in metrics.json
(``eval.flips``) and shown in report.md; only when both sides ran.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from qwenft.config import Config
from qwenft.evaluate.verdict import is_right, primary_metric
from qwenft.files import atomic_write_text

RIGHT_TO_WRONG = "right_to_wrong"
WRONG_TO_RIGHT = "wrong_to_right"
DIRECTIONS = (RIGHT_TO_WRONG, WRONG_TO_RIGHT)
LABELS = {RIGHT_TO_WRONG: "right -> wrong", WRONG_TO_RIGHT: "wrong -> right"}


def find_flips(config: Config, report: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """The flips of ``report`` per benchmark and source, benchmarks first.

    Returns:
        ``{name: {"kind": "benchmark" | "source", "metric", "judged": rows right or wrong on both sides,
        "right_to_wrong": [flip], "wrong_to_right": [flip]}}`` with ``flip`` = ``{"kind", "name", "direction",
        "id", "question", "reference", "base", "tuned"}`` (answers as text; a source's flip adds ``metric``,
        ``base_value``, ``tuned_value``). Names whose rows lack a side are left out.
    """
    out: Dict[str, Dict[str, Any]] = {}
    for name, rows in (report.get("bench_rows") or {}).items():
        pairs = [(row, row["base"].get("correct"), row["tuned"].get("correct")) for row in rows
                 if "base" in row and "tuned" in row]
        if pairs:
            metric = ((report.get("benchmarks") or {}).get(name) or {}).get("metric")
            out[name] = _collect("benchmark", name, metric, pairs, lambda row: {
                "id": row.get("id"), "question": row.get("question"), "reference": row.get("reference"),
                "base": row["base"].get("answer"), "tuned": row["tuned"].get("answer")})
    for name, rows in (report.get("rows") or {}).items():
        metric = primary_metric(config, name, (report.get("sources") or {}).get(name) or {}, rows)
        threshold = config.eval.correct_threshold
        pairs = [(row, is_right(metric, row["base"].get(metric), threshold),
                  is_right(metric, row["tuned"].get(metric), threshold))
                 for row in rows if metric and "base" in row and "tuned" in row]
        if pairs:
            out[name] = _collect("source", name, metric, pairs, lambda row: {
                "id": f"{name}/{row.get('row')}", "question": row.get("prompt"), "reference": row.get("reference"),
                "base": row["base"].get("text"), "tuned": row["tuned"].get("text"), "metric": metric,
                "base_value": row["base"].get(metric), "tuned_value": row["tuned"].get(metric)})
    return out


def _collect(kind: str, name: str, metric: Optional[str], pairs, fields) -> Dict[str, Any]:
    entry: Dict[str, Any] = {"kind": kind, "metric": metric, "judged": 0, RIGHT_TO_WRONG: [], WRONG_TO_RIGHT: []}
    for row, base, tuned in pairs:
        if base is None or tuned is None:  # n/a for this row (no number in the reference, no fact)
            continue
        entry["judged"] += 1
        if base != tuned:
            direction = RIGHT_TO_WRONG if base else WRONG_TO_RIGHT
            entry[direction].append({"kind": kind, "name": name, "direction": direction, **fields(row)})
    return entry


def flip_counts(flips: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """metrics.json's ``eval.flips``: per name ``{"kind", "metric", "judged", "right_to_wrong": n,
    "wrong_to_right": n}``."""
    return {name: {**{k: v for k, v in entry.items() if k not in DIRECTIONS},
                   **{d: len(entry[d]) for d in DIRECTIONS}} for name, entry in flips.items()}


def write_flips(path: Path, flips: Optional[Dict[str, Dict[str, Any]]]) -> None:
    """Write every flip as one JSON line to ``path`` (atomically); with ``flips`` None (only one side ran) remove a
    ``path`` left by an earlier evaluation, so the run directory never shows flips this report does not."""
    if flips is None:
        path.unlink(missing_ok=True)
        return
    lines = [json.dumps(flip, ensure_ascii=False) for entry in flips.values() for d in DIRECTIONS for flip in entry[d]]
    atomic_write_text(path, "".join(line + "\n" for line in lines))


def _cell(text: Any, limit: int = 160) -> str:
    text = " ".join(str("" if text is None else text).split())
    return text if len(text) <= limit else text[:limit] + " …"


def flip_lines(flips: Optional[Dict[str, Dict[str, Any]]], shown: int = 5) -> List[str]:
    """report.md's "Flips" section: per benchmark / source the counts, then the first ``shown`` flips of each
    direction (id, question, reference, base answer, tuned answer); no lines when ``flips`` is None or empty."""
    if not flips:
        return []
    lines = ["## Flips (right -> wrong, wrong -> right)", "",
             "Every flip is in flips.jsonl; a held-out row is right by its source's primary metric.", ""]
    for name, entry in flips.items():
        lines += [f"### {name} ({entry['metric']}): {len(entry[RIGHT_TO_WRONG])} right -> wrong, "
                  f"{len(entry[WRONG_TO_RIGHT])} wrong -> right (of {entry['judged']} judged)", ""]
        for direction in DIRECTIONS:
            if not entry[direction]:
                continue
            lines += [f"{LABELS[direction]}:", ""]
            for flip in entry[direction][:shown]:
                lines.append(f"- `{flip['id']}` {_cell(flip['question'])} — reference: {_cell(flip['reference'], 80)}"
                             f"; base: {_cell(flip['base'], 80)}; tuned: {_cell(flip['tuned'], 80)}")
            lines.append("")
    return lines
