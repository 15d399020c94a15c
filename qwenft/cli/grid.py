"""The index of a ``-m`` grid (Hydra multirun) of ``train`` or ``eval``, at the grid's root (``out_dir``).

Hydra writes ``multirun.yaml`` there (the composed config with the sweep as typed, ``lora.r=4,8``) and runs point N
in ``out_dir/N``; which values point N got, and how the points compare, it does not say. After each point (done,
failed, interrupted) the CLI calls :func:`record_point`, which rewrites beside it:

- ``grid.json``: ``{"points": [{"num", "dir", "overrides", "status", "metrics"}, ...]}``, one entry per point in
  job order; ``overrides`` are the ones Hydra gave that point, ``metrics`` the main numbers of its metrics.json
  (:func:`point_metrics`).
- ``grid.md``: the same as one comparison table, a row per point: the overrides that differ between points, the
  status, then each metric.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from qwenft.files import atomic_write_text

INDEX_JSON, INDEX_MD = "grid.json", "grid.md"


def point_metrics(run_dir: Path, metric_names: Sequence[str] = ()) -> Dict[str, Any]:
    """The main numbers of one point's ``metrics.json`` (``{}`` when it has none): ``final_loss`` and ``eval_loss``
    (the last held-out loss) of training, ``eval.score`` and ``passed`` of the verdict, and the tuned side's value
    of each of ``metric_names`` per held-out source (``SOURCE.METRIC``) and of each benchmark (``bench.NAME``)."""
    path = Path(run_dir) / "metrics.json"
    try:
        metrics = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    out: Dict[str, Any] = {}
    train = metrics.get("train") or {}
    if "final_loss" in train:
        out["final_loss"] = train["final_loss"]
    if train.get("eval_curve"):
        out["eval_loss"] = train["eval_curve"][-1]["eval_loss"]
    evaluation = metrics.get("eval") or {}
    for key in ("score", "passed"):
        if key in evaluation:
            out["eval.score" if key == "score" else key] = evaluation[key]
    for source, sides in (evaluation.get("sources") or {}).items():
        for name in metric_names:
            if (sides.get("tuned") or {}).get(name) is not None:
                out[f"{source}.{name}"] = sides["tuned"][name]
    for name, result in (evaluation.get("benchmarks") or {}).items():
        if isinstance(result, dict) and result.get("tuned") is not None:
            out[f"bench.{name}"] = result["tuned"]
    return out


def record_point(root: Path, num: int, overrides: Sequence[str], status: str,
                 metric_names: Sequence[str] = ()) -> Path:
    """Add (or replace) point ``num`` in ``root/grid.json`` and rewrite ``root/grid.md`` (both atomically).

    Args:
        root: the grid's root, ``out_dir``; point ``num`` ran in ``root/num``.
        overrides: the overrides Hydra gave the point (``lora.r=8``, ...).
        status: ``done``, ``gate failed``, ``error: ...`` or ``interrupted``.
        metric_names: the held-out metrics to compare (``eval.metrics``).

    Returns:
        The path of grid.json.
    """
    root = Path(root)
    index = root / INDEX_JSON
    try:
        points: List[Dict[str, Any]] = json.loads(index.read_text(encoding="utf-8"))["points"]
    except (OSError, ValueError, KeyError, TypeError):
        points = []
    entry = {"num": num, "dir": str(root / str(num)), "overrides": list(overrides), "status": status,
             "metrics": point_metrics(root / str(num), metric_names)}
    points = sorted([p for p in points if p.get("num") != num] + [entry], key=lambda p: p["num"])
    atomic_write_text(index, json.dumps({"points": points}, indent=2, ensure_ascii=False) + "\n")
    atomic_write_text(root / INDEX_MD, comparison_table(points))
    return index


def _cell(value: Optional[Any]) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|")


def comparison_table(points: Sequence[Dict[str, Any]]) -> str:
    """grid.md: a Markdown table, one row per point: its number, the overrides whose value differs between points
    (the ones every point shares are listed above the table), its status and its metrics."""
    settings = [dict(o.split("=", 1) for o in p["overrides"] if "=" in o) for p in points]
    keys = list(dict.fromkeys(k for s in settings for k in s))
    varying = [k for k in keys if len({s.get(k) for s in settings}) > 1]
    shared = [f"`{k}={settings[0][k]}`" for k in keys if k not in varying and k in settings[0]]
    metrics = list(dict.fromkeys(m for p in points for m in p["metrics"]))
    header = ["point", *varying, "status", *metrics]
    lines = [f"# grid: {len(points)} point(s)", ""]
    if shared:
        lines += ["every point: " + ", ".join(shared), ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for point, setting in zip(points, settings):
        row = [str(point["num"]), *(setting.get(k, "") for k in varying), point["status"],
               *(_cell(point["metrics"].get(m)) for m in metrics)]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return "\n".join(lines) + "\n"
