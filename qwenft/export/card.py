"""The model card (README.md) of a merged directory: base, recipe, data, LoRA settings, checks, eval table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

MAX_METRIC_ROWS = 40


def eval_table(run_dir: Path) -> Optional[str]:
    """The evaluation table of the training run, if it has one.

    The first Markdown table of ``report.md`` when present; else the numeric entries of ``metrics.json``
    flattened to ``key.path | value`` rows (at most ``MAX_METRIC_ROWS``). None when neither exists.
    """
    report = run_dir / "report.md"
    if report.is_file():
        lines, table = report.read_text(encoding="utf-8").splitlines(), []
        for line in lines:
            if line.lstrip().startswith("|"):
                table.append(line.strip())
            elif table:
                break
        if table:
            return "\n".join(table)
    metrics = run_dir / "metrics.json"
    if metrics.is_file():
        try:
            data = json.loads(metrics.read_text(encoding="utf-8"))
        except ValueError:
            return None
        rows: List[str] = []

        def walk(node, prefix: str) -> None:
            if isinstance(node, dict):
                for key, value in node.items():
                    walk(value, f"{prefix}.{key}" if prefix else str(key))
            elif isinstance(node, (int, float)) and not isinstance(node, bool):
                rows.append(f"| {prefix} | {node:.4g} |")

        walk(data, "")
        if rows:
            return "\n".join(["| metric | value |", "|---|---|", *rows[:MAX_METRIC_ROWS]])
    return None


def model_card(out_name: str, base: dict, meta: Optional[dict], merge: dict, verification: dict,
               run_dir: Optional[Path], gguf: Optional[dict]) -> str:
    """README.md text for the merged directory.

    Args:
        out_name: The directory name (used as the model's name).
        base: :func:`qwenft.export.build.describe_base`.
        meta: The adapter's ``qwenft.json`` (None when it has none).
        merge: The merge settings (dtype, base, max_shard_size, gguf).
        verification: ``{"merge": {...}, "gguf": {...} or None}`` as recorded in ``qwenft_merge.json``.
        run_dir: The training run directory (the adapter's parent), for the eval table.
        gguf: The GGUF file record, or None.
    """
    lines = [f"# {out_name}", "",
             f"A standalone model: the LoRA adapter merged into **{base['name']}** ({base['source']}: "
             f"`{base['path']}`) by `python -m qwenft merge`. Load it with plain transformers:", "",
             "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
             f'model = AutoModelForCausalLM.from_pretrained("{out_name}", dtype="auto")',
             f'tokenizer = AutoTokenizer.from_pretrained("{out_name}")', "```", "",
             "## Base and merge", "",
             f"- trained on: {base['trained_on']} base; merged into: {base['merged_into']}",
             f"- merged weights: {merge['dtype']}, safetensors shards of at most {merge['max_shard_size']}",
             "- generation_config stops on every end token (`<|im_end|>` and `<|endoftext|>`)"]
    if gguf:
        lines.append(f"- GGUF for llama.cpp: `{gguf['file']}` ({gguf['type']}, {gguf['bytes'] / 1e6:.1f} MB)")
    if meta:
        lora = meta.get("lora", {})
        lines += ["", "## Recipe", "", f"- run: `{meta.get('run_name', '?')}`"]
        train = meta.get("train") or {}
        if train:
            lines.append(f"- lr {train.get('lr')} ({train.get('lr_scheduler')}), epochs {train.get('epochs')}, "
                         f"max_steps {train.get('max_steps')}, batch {train.get('batch_size')} x grad_accum "
                         f"{train.get('grad_accum')}, seed {train.get('seed')}")
        lines.append(f"- LoRA: r={lora.get('r')}, lora_alpha={lora.get('lora_alpha')}, "
                     f"lora_dropout={lora.get('lora_dropout')}, target_modules={lora.get('target_modules')}, "
                     f"use_rslora={lora.get('use_rslora')}, use_dora={lora.get('use_dora')}")
        sources = meta.get("data_sources") or []
        if sources:
            lines += ["", "## Data", ""] + [f"- {s.get('name')}: `{s.get('path')}`" for s in sources]
    check = verification["merge"]
    lines += ["", "## Verification", "",
              "Reloaded with plain transformers (no qwenft) and compared with the adapter on its base on fixed "
              "chat prompts:", "",
              f"- max |delta logit| = {check['max_abs_logit_delta']:.3g} (tolerance {check['tolerance']:g} "
              f"for {merge['dtype']})",
              f"- greedy generations: {', '.join(check['greedy'])}"]
    if verification.get("gguf"):
        g = verification["gguf"]
        lines.append(f"- GGUF loaded back through transformers vs this directory: max |delta logit| = "
                     f"{g['max_abs_logit_delta']:.3g} (tolerance {g['tolerance']:g}); greedy: {', '.join(g['greedy'])}")
    table = eval_table(run_dir) if run_dir is not None else None
    if table:
        lines += ["", "## Evaluation (from the training run)", "", table]
    return "\n".join(lines) + "\n"
