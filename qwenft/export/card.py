"""The model card (README.md) of a merged directory: base, recipe, data, LoRA settings, checks, eval table, and the
commands that serve it (also printed by ``qwenft merge``)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from qwenft.model.vllm_lora import read_adapter_config, vllm_max_lora_rank, vllm_support, vllm_warning

MAX_METRIC_ROWS = 40


def long_context(config: dict) -> Optional[dict]:
    """The RoPE scaling of a merged ``config.json`` as the card and the serve commands state it, or None without.

    Returns:
        ``{"rope_type", "factor", "original" (tokens the base was trained on), "context" (tokens the scaled model is
        for: ``max_position_embeddings``, which :func:`qwenft.model.rope.apply_rope_scaling` set to original x factor
        for linear and yarn; original x factor for dynamic, whose config keeps the original), "parameters"
        (``rope_parameters`` as written)}``.
    """
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default" or not rope.get("factor"):
        return None
    positions, factor = int(config["max_position_embeddings"]), float(rope["factor"])
    original = rope.get("original_max_position_embeddings") or (positions if kind == "dynamic"
                                                                 else round(positions / factor))
    return {"rope_type": kind, "factor": factor, "original": int(original),
            "context": positions if kind != "dynamic" else int(positions * factor), "parameters": dict(rope)}


def serve_commands(out: Path, gguf: Optional[dict], adapter_dir: Path, base_path: str,
                   lora_name: str, rope: Optional[dict] = None) -> Dict[str, Optional[str]]:
    """How to serve a merge, with the paths as written: ``merged`` (``vllm serve OUT``), ``gguf`` (``llama-server -m
    OUT/FILE.gguf``, None without a GGUF), ``ollama`` (``ollama create NAME -f OUT/FILE.Modelfile``, when the GGUF
    record names its Modelfile), and for the adapter itself either ``adapter`` (``vllm serve BASE
    --enable-lora --lora-modules NAME=ADAPTER --max-lora-rank N``, N the smallest value vLLM accepts >= r) or
    ``adapter_problem`` (the line saying why vLLM cannot serve it unmerged: :func:`qwenft.model.vllm_lora.vllm_support`).

    With ``rope`` (:func:`long_context` of the merged config.json) the vLLM commands carry the scaled context as
    ``--max-model-len`` (vLLM derives original x factor for yarn but ``max_position_embeddings`` x factor for linear
    and dynamic, vllm/config/model.py ``_get_and_verify_max_len``: too long for a linear merge, whose
    max_position_embeddings is already scaled), and the adapter's command, whose base config.json has no scaling,
    adds it with ``--hf-overrides '{"rope_scaling": {...}}'`` (the form Qwen documents for vLLM; ``rope_theta``
    inside, so transformers 5, which maps ``rope_scaling`` onto ``rope_parameters``, keeps the base's). The merged
    directory's config.json carries the scaling itself, and the GGUF llama.cpp's rope.scaling keys
    (:func:`qwenft.export.gguf_file.rope_scaling_keys`): llama-server needs no flag (its default context is the
    GGUF's context_length, the scaled one).

    Args:
        out: The merged directory (absolute, where ``qwenft merge`` writes it).
        gguf: The GGUF file record (``{"file": name, ...}``), or None.
        adapter_dir: The adapter directory that was merged.
        base_path: The base the adapter was trained on, as vLLM loads it (a Hub id or a directory).
        lora_name: The name requests use for the adapter (``"model": NAME``); made shell- and URL-safe here.
    """
    quote = shlex.quote
    length = f" --max-model-len {rope['context']}" if rope else ""
    commands: Dict[str, Optional[str]] = {
        "merged": f"vllm serve {quote(str(out))}{length}",
        "gguf": f"llama-server -m {quote(str(out / gguf['file']))}" if gguf else None,
        "ollama": _ollama_command(out, gguf["file"], gguf["modelfile"]) if gguf and gguf.get("modelfile") else None,
        "adapter": None, "adapter_problem": None}
    config = read_adapter_config(adapter_dir)
    reasons = vllm_support(config)
    if reasons:
        commands["adapter_problem"] = vllm_warning(adapter_dir, reasons, merged_dir=out)
    elif isinstance(config.get("r"), int):
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", lora_name).strip("-") or "adapter"
        commands["adapter"] = (f"vllm serve {quote(base_path)} --enable-lora --lora-modules "
                               f"{quote(f'{name}={adapter_dir}')} --max-lora-rank {vllm_max_lora_rank(config['r'])}")
        if rope:
            overrides = json.dumps({"rope_scaling": rope["parameters"]}, separators=(",", ":"))
            commands["adapter"] += f" --hf-overrides {quote(overrides)}{length}"
    return commands


def _long_context_section(rope: dict) -> List[str]:
    names = {"yarn": "YaRN", "linear": "linear (position interpolation)", "dynamic": "dynamic NTK"}
    return ["", "## Long context", "",
            f"- RoPE scaling: {names.get(rope['rope_type'], rope['rope_type'])}, factor {rope['factor']:g}, over the "
            f"base's original {rope['original']:,}-token window: a context of {rope['context']:,} tokens "
            "(config.json `rope_parameters`, and `rope_scaling` for readers on transformers 4; the GGUF carries "
            "llama.cpp's `rope.scaling` keys, so llama-server needs no flag).",
            "- The scaling is static: it applies to every input, short ones too, and static YaRN can hurt short "
            "texts (Qwen's model cards say to add it only where long inputs are expected). This model was fine-tuned "
            "with it applied, so serve it with it; for short inputs the base without scaling may do better."]


def _ollama_command(out: Path, gguf_file: str, modelfile: str) -> str:
    """``ollama create NAME -f OUT/FILE.Modelfile``, NAME the GGUF's stem in Ollama's spelling (lower case)."""
    name = re.sub(r"[^a-z0-9._-]+", "-", Path(gguf_file).stem.lower()).strip("-") or "qwenft"
    return f"ollama create {name} -f {shlex.quote(str(out / modelfile))}"


def _serve_section(out: Path, serve: Dict[str, Optional[str]], trained_on: str) -> List[str]:
    lines = ["", "## Serve", "",
             f"`python -m qwenft merge` wrote this directory to `{out}`; the commands use that path (after moving or "
             "uploading it, put the new path or the Hub id in its place):", "", "```bash", serve["merged"]]
    if serve["gguf"]:
        lines.append(serve["gguf"])
    if serve.get("ollama"):
        lines.append(serve["ollama"])
    lines.append("```")
    if serve["adapter"]:
        lines += ["", "The adapter unmerged, on its base (vLLM's `--max-lora-rank` must be >= the adapter's r and one "
                  "of the values vLLM accepts" + ("; it was trained on NF4, so on the 16-bit base it is close to this "
                                                  "merge, not equal" if trained_on.startswith("NF4") else "") + "):",
                  "", "```bash", serve["adapter"], "```"]
    elif serve["adapter_problem"]:
        lines += ["", serve["adapter_problem"]]
    return lines


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
               run_dir: Optional[Path], gguf: Optional[dict], out: Optional[Path] = None,
               serve: Optional[Dict[str, Optional[str]]] = None, rope: Optional[dict] = None) -> str:
    """README.md text for the merged directory.

    Args:
        out_name: The directory name (used as the model's name).
        base: :func:`qwenft.export.build.describe_base`.
        meta: The adapter's ``qwenft.json`` (None when it has none).
        merge: The merge settings (dtype, base, max_shard_size, gguf).
        verification: ``{"merge": {...}, "gguf": {...} or None}`` as recorded in ``qwenft_merge.json``.
        run_dir: The training run directory (the adapter's parent), for the eval table.
        gguf: The GGUF file record, or None.
        out: The directory's absolute path as written, and ``serve``: :func:`serve_commands` for it; with both, a
            "Serve" section.
        rope: :func:`long_context` of the merged config.json: a "Long context" section (None: no scaling).
    """
    lines = [f"# {out_name}", "",
             f"A standalone model: the LoRA adapter merged into **{base['name']}** ({base['source']}: "
             f"`{base['path']}`) by `python -m qwenft merge`. Load it with plain transformers:", "",
             "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
             f'model = AutoModelForCausalLM.from_pretrained("{out_name}", dtype="auto")',
             f'tokenizer = AutoTokenizer.from_pretrained("{out_name}")', "```"]
    if out is not None and serve is not None:
        lines += _serve_section(out, serve, base.get("trained_on", ""))
    if rope:
        lines += _long_context_section(rope)
    lines += ["", "## Base and merge", "",
             f"- trained on: {base['trained_on']} base; merged into: {base['merged_into']}",
             *([f"- base: {base['base_from']}"] if base.get("base_from") else []),
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
    if verification.get("llama_cpp"):
        c = verification["llama_cpp"]
        lines.append(f"- GGUF run by llama.cpp vs this directory: {c['identical']}/{c['compared']} greedy tokens "
                     f"identical ({c['required']:.0%} required for {c['type']}); the chat template, its tokens and "
                     "the EOS ids as in the HF tokenizer")
    table = eval_table(run_dir) if run_dir is not None else None
    if table:
        lines += ["", "## Evaluation (from the training run)", "", table]
    return "\n".join(lines) + "\n"


QUANTIZED_HEADING = "## Quantized artifacts and what they cost"


def _size(value: int) -> str:
    return f"{value / 1e6:,.1f} MB"


def _source_cell(entry: dict) -> str:
    """A source's primary metric on one artifact: mean, rows right and, against the 16-bit merge, rows kept."""
    text = f"{entry['mean']:.3f}" if isinstance(entry.get("mean"), (int, float)) else "n/a"
    text += f"; {entry['right']}/{entry['rows']} right"
    if "kept" in entry:
        text += f", {entry['kept']}/{entry['of']} kept"
    return text


def cost_table(artifacts: Dict[str, dict], reference: str) -> str:
    """The cost table (Markdown) of :mod:`qwenft.export.costs` entries, the 16-bit merge (``reference``) first: weights
    on disk, perplexity ratio to the 16-bit merge per group (the 16-bit perplexity itself in its row), each source's
    primary metric, greedy token agreement with the 16-bit merge, decode tokens/s and where it was measured; when the
    rows were measured in more than one run (a run that adds artifacts keeps the earlier rows), when each was: the
    quality columns are deterministic, tokens/s depends on the machine's load at the time."""
    order = [reference] + [k for k in artifacts if k != reference]
    first = artifacts[reference]
    groups = list(first["perplexity"])
    sources = list(first["sources"])
    mixed = len({entry.get("measured") for entry in artifacts.values()}) > 1
    head = (["artifact", "weights"] + [f"ppl ratio {g}" for g in groups]
            + [f"{s}: {first['sources'][s]['metric']}" for s in sources] + ["greedy agreement", "decode tok/s"]
            + (["measured"] if mixed else []))

    def when(entry: dict) -> List[str]:  # (a row recorded before rows carried their time: "an earlier run")
        return [entry.get("measured") or "an earlier run"] if mixed else []

    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in order:
        if label not in artifacts:
            continue
        entry = artifacts[label]
        if entry.get("error"):
            cells = [label, f"not measured: {entry['error']}"] + [""] * (len(head) - 2 - len(when(entry)))
            lines.append("| " + " | ".join(cells + when(entry)) + " |")
            continue
        cells = [label, _size(entry["bytes"])]
        for g in groups:
            value = entry["perplexity"].get(g)
            cells.append("n/a" if value is None else f"{value['ratio']:.3f}"
                         + (f" (ppl {value['perplexity']:.3f})" if label == reference else ""))
        cells += [_source_cell(entry["sources"][s]) if s in entry["sources"] else "n/a" for s in sources]
        agreement = entry["agreement"]
        cells.append("n/a" if agreement["share"] is None else
                     f"{agreement['share']:.1%} ({agreement['identical']}/{agreement['compared']})")
        speed = entry.get("decode_tokens_per_s")
        cells.append(f"{speed:.1f} ({entry['backend']})" if speed else f"n/a ({entry['backend']})")
        lines.append("| " + " | ".join(cells + when(entry)) + " |")
    return "\n".join(lines)


def handoff_lines(record: dict, out: Path) -> List[Tuple[str, str]]:
    """``(artifact, command)``: the command that serves each artifact: ``vllm serve`` for the 16-bit and
    compressed-tensors directories, ``llama-server -m`` and ``ollama create`` (its Modelfile) for each GGUF."""
    quote = shlex.quote
    lines = [("16-bit", (record.get("serve") or {}).get("merged") or f"vllm serve {quote(str(out))}")]
    ggufs = ([(f"gguf-{record['gguf']['type']}", record["gguf"]["file"], record["gguf"].get("modelfile"))]
             if record.get("gguf") else [])
    for method, entry in (record.get("quantized") or {}).items():
        if entry.get("modelfile"):
            ggufs.append((method, entry["path"], entry["modelfile"]))
        else:
            lines.append((method, f"vllm serve {quote(str(out / entry['path']))}"))
    for label, file, modelfile in ggufs:
        lines.append((label, f"llama-server -m {quote(str(out / file))}"))
        if modelfile:
            lines.append((label, _ollama_command(out, file, modelfile)))
    return lines


def quantized_section(record: dict, out: Path) -> str:
    """The model card's section on ``merge.quantize``: how each artifact was made, the cost table and the commands
    that serve each one."""
    from qwenft.export.costs import REFERENCE

    lines = [QUANTIZED_HEADING, "",
             "Made from this merge by `python -m qwenft merge ... merge.quantize=[...]` and measured against the "
             "16-bit merge on the training run's held-out data (greedy answers; agreement: the share of answer "
             "positions, along the 16-bit merge's greedy answers, where the artifact's argmax is the same):", ""]
    for method, entry in (record.get("quantized") or {}).items():
        settings = ", ".join(f"{k}={v}" for k, v in entry["settings"].items())
        if entry.get("tensor_types"):
            check = entry.get("llama_cpp") or {}
            detail = f"; tensor types {entry['tensor_types']}" + (
                f"; llama.cpp check: {check['identical']}/{check['compared']} greedy tokens of the 16-bit merge "
                f"({check['required']:.0%} required), chat template and EOS ids {check['chat']}" if check else "")
        else:
            calibration = entry.get("calibration") or {}
            detail = (f"; calibrated on {calibration['rows']} training rows ({calibration['tokens']} tokens)"
                      if calibration else "")
        lines.append(f"- `{entry['path']}` ({method}: {settings}{detail}; {entry['seconds']:.0f} s)")
    costs = (record.get("costs") or {}).get("artifacts")
    if costs:
        lines += ["", cost_table(costs, REFERENCE)]
    lines += ["", "```bash", *(f"{command}   # {label}" for label, command in handoff_lines(record, out)), "```"]
    return "\n".join(lines) + "\n"


def replace_section(card: str, section: str) -> str:
    """``card`` with its :data:`QUANTIZED_HEADING` section (up to the next ``## `` heading) replaced by ``section``,
    or ``section`` appended when it has none."""
    start = card.find(QUANTIZED_HEADING)
    if start < 0:
        return card.rstrip("\n") + "\n\n" + section
    end = card.find("\n## ", start + len(QUANTIZED_HEADING))
    rest = card[end + 1:] if end >= 0 else ""
    return card[:start] + section + ("\n" + rest if rest else "")
