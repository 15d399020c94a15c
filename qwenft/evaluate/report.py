"""Evaluation outputs in the run directory: metrics.json, generations.jsonl, report.md and PNG plots.

Every file is written under a temporary name and renamed, so an interrupted evaluation never leaves a
half-written report. metrics.json keeps what training wrote (``train``, ``data``) and adds ``eval``;
report.md's tables are rendered from exactly those numbers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional

from qwenft.config import Config
from qwenft.evaluate.preference import preference_lines
from qwenft.evaluate.judge_text import judge_lines
from qwenft.evaluate.flips import find_flips, flip_counts, flip_lines, write_flips
from qwenft.evaluate.verdict import judge
from qwenft.evaluate.verdict_text import benchmark_lines, verdict_lines
from qwenft.evaluate.verdict_text import log_wandb as log_verdict
from qwenft.files import atomic_write_text, publish_mode, temp_path

log = logging.getLogger(__name__)

SIDES = ("base", "tuned", "delta")


def _fmt(value: Any, signed: bool = False) -> str:
    if not isinstance(value, (int, float)):
        return "" if value is None else str(value)
    if isinstance(value, int) and not signed:
        return str(value)
    return f"{value:+.3f}" if signed else f"{value:.3f}"


def metric_table(by_side: Dict[str, Dict[str, float]]) -> List[str]:
    """Markdown rows ``| metric | base | tuned | delta |`` for one source (missing sides left blank).

    A metric that is None on a side (no row could be scored) shows ``n/a`` there, and its delta is blank.
    """
    sides = [s for s in SIDES if s in by_side]
    names = [k for k in next(iter(by_side.values())) if k != "rows"]
    lines = ["| metric | " + " | ".join(sides) + " |", "|---|" + "---|" * len(sides)]
    for name in names:
        cells = ["n/a" if s != "delta" and name in by_side[s] and by_side[s][name] is None
                 else _fmt(by_side[s].get(name), signed=s == "delta") for s in sides]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _plot_loss(train: Dict[str, Any], path: Path) -> Optional[Path]:
    curve = train.get("loss_curve") or []
    if not curve:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([p["step"] for p in curve], [p["loss"] for p in curve], label="train loss")
    evals = train.get("eval_curve") or []
    if evals:
        ax.plot([p["step"] for p in evals], [p["eval_loss"] for p in evals], "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats / token)")
    ax.legend()
    ax.grid(alpha=0.3)
    return _save_figure(fig, path)


def _plot_metrics(sources: Dict[str, Dict[str, Dict[str, float]]], metrics: List[str], path: Path) -> Optional[Path]:
    bars = [(f"{src}\n{m}", by.get("base", {}).get(m), by.get("tuned", {}).get(m))
            for src, by in sources.items() for m in metrics
            if any(by.get(side, {}).get(m) is not None for side in ("base", "tuned"))]  # n/a metrics: no bar
    if not bars:
        return None
    sides = [s for s in ("base", "tuned") if any(s in by for by in sources.values())]  # base-only: one bar each
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(bars)), 3.5))
    xs = range(len(bars))
    width = 0.8 / len(sides)
    for k, side in enumerate(sides):
        offset = (k - (len(sides) - 1) / 2) * width
        ax.bar([x + offset for x in xs], [b[1 + ("base", "tuned").index(side)] or 0 for b in bars], width=width,
               label=side)
    ax.set_xticks(list(xs), [b[0] for b in bars], fontsize=8)
    ax.set_ylim(0, 1)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return _save_figure(fig, path)


def _save_figure(fig, path: Path) -> Path:
    import os

    import matplotlib.pyplot as plt

    tmp = temp_path(path, ".png")
    try:
        fig.tight_layout()
        fig.savefig(tmp, dpi=110)
        publish_mode(tmp)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path


def _json_file(path: Path) -> Dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def adapter_line(config: Config, adapter_dir: Path) -> str:
    """The report's LoRA line, from what the run recorded beside the adapter, not from the live config.

    LoRA settings come from PEFT's ``adapter_config.json`` (r, lora_alpha, target modules), the base and its
    quantization from qwenft's ``qwenft.json``; ``config.lora`` / ``config.model`` / ``config.quant`` fill in
    only what neither file holds (an adapter written by another tool).
    """
    from qwenft.model.adapter import recorded_lora
    from qwenft.model.vllm_lora import read_adapter_config

    lora = {"r": config.lora.r, "lora_alpha": config.lora.lora_alpha, "target_modules": config.lora.target_modules,
            **recorded_lora(adapter_dir)}
    targets = lora["target_modules"]
    targets = ",".join(sorted(targets)) if isinstance(targets, (list, tuple)) else str(targets)
    meta = _json_file(adapter_dir / "qwenft.json")
    model = meta.get("model") if isinstance(meta.get("model"), dict) else {}
    quant = meta.get("quant") if isinstance(meta.get("quant"), dict) else {}
    base = model.get("name") or read_adapter_config(adapter_dir).get("base_model_name_or_path") or config.model.name
    trained = f"; trained on `{base}`" + (f" with quant={quant['method']}" if quant.get("method") else "")
    return f"- LoRA: r={lora['r']}, lora_alpha={lora['lora_alpha']}, targets={targets}{trained}"


def settings_from(config: Config) -> Dict[str, Any]:
    """metrics.json's ``eval.settings_from``: where this evaluation's eval settings came from (the run's own config
    after ``train``; for ``eval``, the settings the adapter's run recorded with the keys typed on top, or this
    command's and why), by the rule :func:`qwenft.model.eval_record.restore_eval` applied
    (:func:`qwenft.model.eval_record.settings_origin`)."""
    from qwenft.model.adapter import ADAPTER_META, typed_keys, typed_overrides
    from qwenft.model.eval_record import settings_origin

    source = Path(config.adapter).expanduser() / ADAPTER_META if config.adapter else None
    meta = _json_file(source) if source is not None and source.is_file() else None
    typed = typed_overrides()
    return settings_origin(config, meta, source, typed_keys(typed) if typed is not None else None)


def settings_line(origin: Optional[Dict[str, Any]]) -> str:
    """report.md's line on where the eval settings came from (``eval.settings_from``, :func:`settings_from`)."""
    if not origin:
        return "- eval settings: not recorded"
    if origin["from"] == "run":
        return (f"- eval settings: this run's, recorded in `{origin['file']}` (a later `qwenft eval adapter=...` "
                "starts from them)")
    if origin["from"] == "adapter":
        typed = ", ".join(f"`{k}`" for k in origin["typed"])
        line = (f"- eval settings: the adapter's run's (recorded in `{origin['file']}`); "
                + (f"typed on top: {typed}" if typed else "nothing typed on top"))
        if origin.get("not_recorded"):
            line += f"; not recorded by that run, so this command's: {', '.join(origin['not_recorded'])}"
        return line
    line = f"- eval settings: this command's ({origin['why']})"
    if origin.get("differs"):
        line += f"; they differ from the recorded ones in {', '.join(origin['differs'])}"
    return line


def sampler_line(config: Config) -> str:
    """report.md's line on the sampler the held-out answers were generated with: the preset's name, its values that
    are set, and the answer length (``eval.max_new_tokens``, else the preset's: as
    :func:`qwenft.evaluate.run.generate_preset` applies it)."""
    preset = config.generate_presets.get(config.eval.generate)
    if preset is None:  # refused before the evaluation ran (check_settings); the line never fails the report
        return f"- sampler for evaluation: preset `{config.eval.generate}`"
    shown = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")
    values = [f"{k}={getattr(preset, k)}" for k in shown if getattr(preset, k) is not None]
    values.append(f"max_new_tokens={config.eval.max_new_tokens or preset.max_new_tokens}")
    return f"- sampler for evaluation: preset `{config.eval.generate}` ({', '.join(values)})"


def final_loss_text(train: Dict[str, Any]) -> str:
    """``final train loss X (step N)``: the loss logged at the last step (the trainer logs it,
    :class:`qwenft.train.callbacks.LogLastStep`), the mean over the steps since the log before it when more than
    one (``steps A-N``); nats per supervised token."""
    loss, step, first = train.get("final_loss"), train.get("final_loss_step"), train.get("final_loss_from_step")
    if loss is None:
        return "final train loss n/a (no step logged)"
    if step is None:  # metrics.json of an older run
        return f"final train loss {_fmt(loss)}"
    where = f"steps {first}-{step}, their mean" if isinstance(first, int) and first < step else f"step {step}"
    return f"final train loss {_fmt(loss)} ({where})"


def render_report(config: Config, metrics: Dict[str, Any], rows: Dict[str, List[dict]], plots: Dict[str, Path],
                  flips: Optional[Dict[str, Dict[str, Any]]] = None) -> str:
    """report.md as text: the verdict first (:func:`qwenft.evaluate.verdict.verdict_lines`), model, tables per
    source, benchmarks, perplexity, plots, the flips (:func:`qwenft.evaluate.flips.flip_lines`) and side-by-side
    samples.

    The model line is what this evaluation ran; the adapter's LoRA settings and the base and quantization it was
    trained on are read from the adapter directory (:func:`adapter_line`); the sampler line gives the preset's
    values (:func:`sampler_line`), the next where the eval settings came from (:func:`settings_line`).
    """
    ev = metrics["eval"]
    tuned = config.adapter or metrics.get("train")  # an adapter was evaluated (given, or trained by this run)
    lines = [f"# qwenft report: {config.run_name}", "", *verdict_lines(config, ev),
             f"- model: `{config.model.name}` ({config.model.source}, quant={config.quant.method})"]
    if tuned:
        adapter_dir = Path(config.adapter).expanduser() if config.adapter else Path(config.out_dir) / "adapter"
        lines += [f"- adapter: `{config.adapter or adapter_dir}`", adapter_line(config, adapter_dir)]
        started = (_json_file(adapter_dir / "qwenft.json") or {}).get("init_adapter")
        if started:  # a second stage: its base side is the base model, not the adapter it started from
            lines.append(f"- trained on from `{started}` (init_adapter); \"base\" below is the base model without "
                         "any adapter: `qwenft eval adapter=` that adapter for its own numbers")
        from qwenft.model.adapter import data_mismatch

        trained = data_mismatch(config, _json_file(adapter_dir / "qwenft.json"))
        if trained:  # data.sources / +recipe typed for `eval`: say so where the numbers are read
            lines.append(f"- **held-out data is not the adapter's training data**: this evaluation read "
                         f"{', '.join(f'{s.name} ({s.path})' for s in config.data.sources)}; the adapter was "
                         f"trained on {trained}")
    else:
        lines += ["- adapter: none (the base model alone)"]
    if metrics.get("memory"):  # each phase's peak (qwenft.memory.peak_memory)
        from qwenft.memory import describe_peaks

        lines.append(describe_peaks(metrics["memory"]))
    lines += [sampler_line(config), settings_line(ev.get("settings_from")), ""]
    train = metrics.get("train")
    if train:
        lines += ["## Training", "",
                  f"{train['global_step']} steps, {final_loss_text(train)}, "
                  f"{train.get('train_tokens')} tokens in {train.get('train_seconds')} s "
                  f"({train.get('tokens_per_s')} tokens/s).", ""]
        if "loss" in plots:
            lines += [f"![loss curve]({plots['loss'].name})", ""]
    lines += ["## Generation metrics (held-out prompts)", ""]
    for source, by_side in ev["sources"].items():
        lines += [f"### {source} ({next(iter(by_side.values())).get('rows', 0)} prompts)", ""]
        lines += metric_table(by_side) + [""]
    if "metrics" in plots:
        lines += [f"![metrics]({plots['metrics'].name})", ""]
    lines += preference_lines(ev.get("preference") or {}, ev["sources"])
    lines += judge_lines(ev.get("judge"))
    lines += benchmark_lines(ev.get("benchmarks"), ev.get("benchmarks_skipped"))
    if ev["perplexity"]:
        both = any("ratio" in by_side for by_side in ev["perplexity"].values())
        sides = ["base", "tuned"] if both else [s for s in ("base", "tuned")
                                                  if any(s in by for by in ev["perplexity"].values())]
        header = ["text", "tokens", *sides, *(["tuned / base"] if both else [])]
        lines += ["## Perplexity (lower is better; answers: supervised tokens only)", "",
                  "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for name, by_side in ev["perplexity"].items():
            tokens = next(iter(v for k, v in by_side.items() if k != "ratio"))["tokens"]
            cells = [name, str(tokens), *(_fmt(by_side.get(s, {}).get("perplexity")) for s in sides),
                     *([_fmt(by_side.get("ratio"))] if both else [])]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += flip_lines(flips)
    n = config.eval.samples_in_report
    if n:
        lines += ["## Samples", ""]
        for source, source_rows in rows.items():
            for row in source_rows[:n]:
                lines += [f"**{source} row {row.get('row')}**: {_one_line(row['prompt'])}", "",
                          f"- {'chosen' if 'rejected' in row else 'reference'}: {_one_line(row['reference'])}"]
                if "rejected" in row:
                    lines.append(f"- rejected: {_one_line(row['rejected'])}")
                for side in ("base", "tuned"):
                    if side in row:
                        lines.append(f"- {side} ({row[side]['stop_reason']}): {_one_line(row[side]['text'])}")
                lines.append("")
    return "\n".join(lines) + "\n"


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + " …"


def write_outputs(config: Config, out_dir: Path, report: Dict[str, Any], log_wandb: bool = True) -> Dict[str, Any]:
    """Write metrics.json (merged with training's), generations.jsonl, benchmarks.jsonl, flips.jsonl, report.md and
    PNGs into ``out_dir`` (``log_wandb``: log the tables to W&B too). metrics.json's ``eval`` adds ``judge`` (when judged), ``settings_from`` (:func:`settings_from`), ``benchmarks`` (when run),
    the verdict (``gates``, ``passed``, ``failed``, ``score``: :func:`qwenft.evaluate.verdict.judge`) and ``flips``
    (counts; both sides only).

    Returns:
        The full metrics dict written to metrics.json.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "metrics.json"
    metrics = json.loads(path.read_text()) if path.is_file() else {}
    metrics["eval"] = {"sources": report["sources"], "perplexity": report["perplexity"],
                       **({"engine": report["engine"]} if "engine" in report else {}),
                       "settings_from": settings_from(config)}
    metrics["memory"] = {**metrics.get("memory", {}), **report.get("memory", {})}  # each phase's peak: train, eval
    if report.get("preference"):
        metrics["eval"]["preference"] = report["preference"]
    if report.get("benchmarks"):
        metrics["eval"]["benchmarks"] = report["benchmarks"]
    if report.get("bench_skipped"):
        metrics["eval"]["benchmarks_skipped"] = report["bench_skipped"]
    if report.get("judge"):
        metrics["eval"]["judge"] = report["judge"]
    metrics["eval"].update(judge(config, report))
    both = any("tuned" in by for by in [*report["sources"].values(), *(report.get("benchmarks") or {}).values()])
    flips = find_flips(config, report) if both else None
    if flips is not None:
        metrics["eval"]["flips"] = flip_counts(flips)
    atomic_write_text(path, json.dumps(metrics, indent=2, ensure_ascii=False))
    write_flips(out_dir / "flips.jsonl", flips)
    lines = [json.dumps(row, ensure_ascii=False) for rows in report["rows"].values() for row in rows]
    atomic_write_text(out_dir / "generations.jsonl", "".join(line + "\n" for line in lines))
    bench_rows = [{"benchmark": name, **row} for name, rows in (report.get("bench_rows") or {}).items() for row in rows]
    if bench_rows:  # every benchmark question: id, question, reference, each side's answer and whether it was right
        atomic_write_text(out_dir / "benchmarks.jsonl",
                          "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in bench_rows))
    plots = {}
    if metrics.get("train") and _plot_loss(metrics["train"], out_dir / "loss_curve.png"):
        plots["loss"] = out_dir / "loss_curve.png"
    if _plot_metrics(report["sources"], config.eval.metrics, out_dir / "metrics.png"):
        plots["metrics"] = out_dir / "metrics.png"
    atomic_write_text(out_dir / "report.md", render_report(config, metrics, report["rows"], plots, flips))
    if log_wandb:
        _log_wandb(config, metrics, report)
    log.info("evaluation written to %s", out_dir / "report.md")
    return metrics


def _log_wandb(config: Config, metrics: Dict[str, Any], report: Dict[str, Any]) -> None:
    if config.logger != "wandb":
        return
    import wandb

    if wandb.run is None:
        return
    sides = [s for s in SIDES if any(s in by for by in report["sources"].values())]  # base-only: no tuned column
    table = wandb.Table(columns=["source", "metric", *sides])
    for source, by_side in report["sources"].items():
        for name in by_side.get("base", by_side.get("tuned", {})):
            table.add_data(source, name, *(by_side.get(s, {}).get(name) for s in sides))
    wandb.log({"eval/report": table})
    log_verdict(wandb, metrics["eval"])
