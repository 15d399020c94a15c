"""The Qwen2.5 family tables of docs/plan.md, rendered from the family table and the planner (so they cannot go stale).

    python -m tests.plan.family_table            # print the tables
    python -m tests.plan.family_table --write    # rewrite them in docs/plan.md (between the marker comments)

tests/plan/test_family_table.py fails when docs/plan.md's tables differ from what this renders.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import List

DOC = Path(__file__).resolve().parents[2] / "docs" / "plan.md"
MARKERS = {"family": ("<!-- family-table: start (python -m tests.plan.family_table --write) -->",
                      "<!-- family-table: end -->"),
           "long": ("<!-- long-context-table: start (python -m tests.plan.family_table --write) -->",
                    "<!-- long-context-table: end -->")}
# the run every figure plans: one sequence of 2,048 tokens, LoRA r=16 on the seven projections, checkpointing
REFERENCE = ("data.max_seq_len=2048", "train.batch_size=1", "train.gradient_checkpointing=true", "lora.r=16",
             "train.kernels=none", "plan.device=cuda", "plan.reserve_gb=1.0")
LONG_CONTEXT_MODELS = ("qwen2.5-7b-instruct", "qwen2.5-14b-instruct")
GIB = 1 << 30


def _base():
    from qwenft.cli.compose import register_resolvers, validate

    register_resolvers()
    return validate("plan", list(REFERENCE))[0]


def _for(base, member):
    """The reference config with ``model=<member.preset>``, and the member's architecture (family numbers)."""
    from qwenft.plan.arch import Architecture

    model = dataclasses.replace(base.model, name=member.preset, source="hub", path=member.repo_id)
    return dataclasses.replace(base, model=model), Architecture.from_config_dict(dict(member.config), member.repo_id)


def _cell(row) -> str:
    """``peak GiB (smallest card that fits)``."""
    smallest = f"{row['fits'][0]} GB" if row["fits"] else "none"
    return f"{row['peak'] / GIB:.1f} ({smallest})"


def family_rows() -> List[str]:
    """The presets' table: parameters, context, one-GPU QLoRA / LoRA peaks; then the 32B / 72B sharded table."""
    from qwenft.model.family import MEMBERS
    from qwenft.plan.arch import parameter_counts
    from qwenft.plan.gpus import gpu_figures

    base = _base()
    lines = ["| preset | parameters | context (tokens) | QLoRA, 1 GPU: GiB (smallest card) | "
             "LoRA 16-bit, 1 GPU: GiB (smallest card) |", "|---|---:|---:|---:|---:|"]
    sharded = []
    for member in MEMBERS.values():
        config, arch = _for(base, member)
        figures = gpu_figures(config, arch)
        by_quant = {row["quant"]: row for row in figures["one_gpu"]}
        mark = " *" if any(not key.startswith("generation.") for key in member.unverified) else ""
        lines.append(f"| {member.preset}{mark} | {parameter_counts(arch)['total'] / 1e9:.2f} B | "
                     f"{arch.max_position_embeddings:,} | {_cell(by_quant['nf4'])} | {_cell(by_quant['none'])} |")
        rows = {(r["dist"], r["processes"], r["quant"]): r for r in figures["sharded"]}
        for dist, processes in sorted({(d, p) for d, p, _ in rows}, key=lambda k: (k[0] != "fsdp", k[1])):
            if member.instruct and member.line == "Qwen2.5":
                sharded.append(f"| {member.preset} | {dist} | {processes} | {_cell(rows[dist, processes, 'nf4'])} | "
                               f"{_cell(rows[dist, processes, 'none'])} |")
    lines += ["", "Per GPU under sharding (the base models and the Coder / Math variants of a size plan alike):", "",
              "| preset | dist | GPUs | QLoRA: GiB per GPU (smallest card) | LoRA 16-bit: GiB per GPU (smallest card) |",
              "|---|---|---:|---:|---:|", *sharded]
    return lines


def long_rows() -> List[str]:
    """The long-context table of the 7B and 14B Instruct models (:func:`qwenft.plan.gpus.long_context`)."""
    from qwenft.model.family import by_preset
    from qwenft.plan.gpus import long_context, longest_context

    base = _base()
    lines = ["| preset | data.max_seq_len | rope_scaling | quant | peak GiB (smallest card) | layer inputs kept GiB | "
             "KV cache of 1 sequence GiB |", "|---|---:|---|---|---:|---:|---:|"]
    longest = []
    for preset in LONG_CONTEXT_MODELS:
        config, arch = _for(base, by_preset(preset))
        for row in long_context(config, arch):
            lines.append(f"| {preset} | {row['seq_len']:,} | {'yarn x4' if row['rope_scaling'] else '-'} | "
                         f"{row['quant']} | {_cell(row)} | {row['checkpoints'] / GIB:.1f} | "
                         f"{row['kv_cache'] / GIB:.1f} |")
        longest.append(f"{preset} {longest_context(config, arch, 'none', 80):,} tokens with LoRA 16-bit, "
                       f"{longest_context(config, arch, 'nf4', 80):,} with QLoRA")
    return lines + ["", "The longest row one 80 GB GPU takes this way (planned): " + "; ".join(longest) + "."]


def render() -> dict:
    """``{marker name: the block's lines}``."""
    return {"family": family_rows(), "long": long_rows()}


def current(text: str, name: str) -> List[str]:
    """The lines between the ``name`` markers of ``text`` (the doc's block).

    Raises:
        ValueError: a marker is missing.
    """
    start, end = MARKERS[name]
    if start not in text or end not in text:
        raise ValueError(f"{DOC}: the markers {start!r} / {end!r} are missing")
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n").splitlines()


def write(blocks: dict) -> None:
    """Replace every block of docs/plan.md between its markers by ``blocks``."""
    text = DOC.read_text(encoding="utf-8")
    for name, lines in blocks.items():
        start, end = MARKERS[name]
        current(text, name)
        head, rest = text.split(start, 1)
        text = head + start + "\n" + "\n".join(lines) + "\n" + end + rest.split(end, 1)[1]
    DOC.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    rendered = render()
    if "--write" in sys.argv[1:]:
        write(rendered)
        print(f"{DOC}: tables rewritten")
    else:
        for block in rendered.values():
            print("\n".join(block), end="\n\n")
