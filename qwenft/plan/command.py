"""``python -m qwenft plan``: parameters, weight bytes, LoRA size, training-step memory, the evaluation's peak, KV
cache and what fits.

Everything comes from the model's config.json numbers (:mod:`qwenft.plan.arch`) and the formulas of
:mod:`qwenft.plan.memory`; no weight is downloaded or loaded.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Dict

from qwenft.config import Config
from qwenft.files import atomic_write_text
from qwenft.logfilter import result_console
from qwenft.plan.arch import Architecture, lora_parameter_count, parameter_counts, resolve_architecture
from qwenft.plan.evaluation import evaluation_memory
from qwenft.plan.gpus import gpu_figures, long_context, render_gpus
from qwenft.plan.memory import TrainSetup, kv_cache_bytes, training_weight_bytes, weight_bytes
from qwenft.plan.preference import SEQUENCES_PER_PAIR, step_memory

GIB = 1 << 30
SEQ_CANDIDATES = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
MAX_BATCH = 4096


def write_json(path: str, obj: Any) -> Path:
    """Write ``obj`` as UTF-8 JSON to ``path`` atomically (temp name in the same folder, then ``os.replace``)."""
    return atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def _largest_batch(arch: Architecture, setup: TrainSetup, seq: int, budget: int) -> int:
    """The largest batch size (pairs for a preference objective) whose steady-state peak fits ``budget`` bytes at
    ``seq`` tokens (0: none)."""
    def fits(batch: int) -> bool:
        return step_memory(arch, setup, batch, seq)["peak"] <= budget

    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= MAX_BATCH and fits(high):
        low, high = high, high * 2
    high = min(high, MAX_BATCH + 1)
    while high - low > 1:  # peak grows with the batch: bisect
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def _largest_seq(arch: Architecture, setup: TrainSetup, batch: int, budget: int) -> int:
    """The longest sequence (tokens, up to max_position_embeddings) that fits at ``batch`` (0: none)."""
    low, high = 0, arch.max_position_embeddings + 1
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if step_memory(arch, setup, batch, mid)["peak"] <= budget else (low, mid)
    return low


SHARDED_ROWS = {
    "zero1": "AdamW states divided by the processes; weights, LoRA weights and gradients whole",
    "zero2": "gradients and AdamW states divided by the processes (ZeRO-2); weights and LoRA weights whole; plus "
             "DeepSpeed's gradient buckets (reduce_bucket_size fp32 elements, two with overlap_comm)",
    "zero3": "weights, LoRA weights, gradients and AdamW states divided by the processes (ZeRO-3), plus the "
             "gathered weights: the lm_head qwenft's loss gathers (2 copies at its all-gather with gloo on CPU "
             "processes) and in backward the running decoder layer; none kept or prefetched (DeepSpeed's trace "
             "never completes: qwenft's loss does not run the root module's forward)",
    "fsdp": "weights, LoRA weights, gradients and AdamW states divided by the processes (FSDP2 full shard), plus the "
            "gathered weights: lm_head and final norm (accelerate's tail group, kept from the loss to the end of "
            "backward; 2 copies at its all-gather, 3 with gloo on CPU processes) and in backward the running and the "
            "prefetched decoder layer",
    "fsdp_no_reshard": "gradients and AdamW states divided by the processes, weights sharded but all gathered from "
                       "forward to backward (FSDP2, reshard_after_forward=false)",
}


def _scope(mode: str, processes: int) -> str:
    """What the training rows mean: ``"<scope>; <what is divided and gathered>"`` (see :mod:`qwenft.plan.sharding`)."""
    if mode == "none":
        return "per process; every process holds all of it"
    if processes == 1:
        return (f"per process, one process: {mode} shards nothing over one process; set plan.processes to the "
                "number of processes for the per-process numbers")
    return (f"per process after sharding over {processes} processes; {SHARDED_ROWS[mode]}; activations are per "
            "process (each has its own micro-batch); collective buffers not counted")


def _preference(config: Config, setup: TrainSetup, pairs: int) -> Dict[str, Any]:
    """The preference step's layout in the plan's ``training`` (none for SFT): sequences, padding-free, whether the
    reference forward is counted and why (:mod:`qwenft.plan.preference`)."""
    if setup.objective == "sft":
        return {}
    objective = setup.objective
    if setup.reference:
        why = "counted: a no-grad forward of the same sequences, adapter off, before the policy's backward"
    elif config.pref.precompute_ref:
        why = "not counted: pref.precompute_ref computes the reference log-probs once before training"
    else:
        why = f"not counted: {objective} is reference-free"
    return {"sequences_per_pair": SEQUENCES_PER_PAIR, "sequences": SEQUENCES_PER_PAIR * pairs,
            "padding_free": setup.padding_free, "reference_forward": setup.reference, "reference_note": why}


def _preference_warnings(config: Config, arch: Architecture, setup: TrainSetup, pairs: int, seq: int) -> list:
    """Warnings about a preference step: KTO with ``pref.precompute_ref`` (the run refuses it), and a padding-free
    layout whose packed-sequence mask (``[tokens, tokens]`` per layer under SDPA) costs more than padding."""
    if setup.objective == "sft":
        return []
    out = []
    if config.pref.precompute_ref and setup.objective == "kto":
        out.append("pref.precompute_ref=true with train.objective=kto: training refuses it (KTO's mismatched pairs are "
                   "drawn per batch); planned with the reference forward in every step")
    if setup.padding_free and setup.attn == "sdpa":
        packed = step_memory(arch, setup, pairs, seq)["peak"]
        padded = step_memory(arch, dataclasses.replace(setup, padding_free=False), pairs, seq)["peak"]
        if packed > 1.1 * padded:
            out.append(f"pref.padding_free: the packed row's attention mask ({SEQUENCES_PER_PAIR * pairs * seq:,} x "
                       f"{SEQUENCES_PER_PAIR * pairs * seq:,}) is kept by SDPA in every layer: peak {_size(packed)} "
                       f"against {_size(padded)} padded; set pref.padding_free=false (or use flash_attention_2)")
    return out


def make_plan(config: Config) -> Dict[str, Any]:
    """The whole plan for ``config`` as a JSON-ready dict (all sizes in bytes, counts in parameters).

    Keys: ``model`` (name, source of the numbers, architecture with ``max_position_embeddings`` scaled by
    ``model.rope_scaling``, the scaling and the original context), ``warnings`` (e.g. ``data.max_seq_len``
    beyond the context without scaling), ``parameters`` (by component),
    ``weights`` (16-bit, as loaded, during training), ``lora``, ``training`` (the configured batch x seq with
    and without gradient checkpointing, per process: after sharding over ``plan.processes`` under FSDP / ZeRO,
    ``sharding`` naming the mode of :mod:`qwenft.plan.sharding` and ``scope`` what it divides), ``evaluation`` (the evaluation's peak and its parts,
    :func:`qwenft.plan.evaluation.evaluation_memory`), ``kv_cache``, ``inference``, ``budget`` (fits, largest
    batch per sequence length, longest sequence at the configured batch), ``gpus`` (which GPU sizes fit, one GPU
    and sharded: :func:`qwenft.plan.gpus.gpu_figures`; None with ``plan.device=cpu``) and ``long_context``
    (:func:`qwenft.plan.gpus.long_context`, from ``data.max_seq_len`` 8,192 or with ``model.rope_scaling``).

    Raises:
        QwenftError: the architecture cannot be read (see :func:`qwenft.plan.arch.resolve_architecture`).

    Example:
        >>> from qwenft.cli.compose import register_resolvers, validate
        >>> register_resolvers()
        >>> config = validate("plan", ["model=qwen2.5-7b-instruct", "lora.r=64", "plan.gpu_gb=24"])[0]
        >>> plan = make_plan(config)
        >>> plan["budget"]["fits"], plan["budget"]["peak"], plan["evaluation"]["peak"]
    """
    from qwenft.model.rope import context_warning, original_positions, scaled_positions

    unscaled = resolve_architecture(config.model)
    rope = config.model.rope_scaling
    # model.rope_scaling stretches the usable context: plan up to the scaled max_position_embeddings
    arch = dataclasses.replace(unscaled, max_position_embeddings=scaled_positions(unscaled.max_position_embeddings,
                                                                                 rope))
    warning = context_warning(config.data.max_seq_len, unscaled.max_position_embeddings, rope)
    strategy = config.dist.strategy
    pcfg = config.plan
    setup = TrainSetup.from_config(config, device=pcfg.device)
    scope = _scope(setup.sharding, pcfg.processes)
    nf4 = setup.nf4
    counts = parameter_counts(arch)
    batch, seq = config.train.batch_size, config.data.max_seq_len
    n_lora = lora_parameter_count(arch, config.lora)
    runs = {}
    for name, ckpt in (("with_checkpointing", True), ("without_checkpointing", False)):
        variant = dataclasses.replace(setup, gradient_checkpointing=ckpt)
        runs[name] = step_memory(arch, variant, batch, seq)
    chosen = runs["with_checkpointing" if setup.gradient_checkpointing else "without_checkpointing"]
    infer_bytes = setup.compute_bytes if nf4 else setup.model_bytes
    context = pcfg.context_len or seq
    # load_model reads the dense weights of an NF4 model in the compute dtype
    loaded = weight_bytes(arch, nf4, setup.double_quant, setup.compute_bytes if nf4 else setup.model_bytes)
    budget = int(pcfg.gpu_gb * GIB - pcfg.reserve_gb * GIB)
    seqs = sorted({s for s in SEQ_CANDIDATES if s <= arch.max_position_embeddings} | {seq})
    return {
        "model": {"name": config.model.name, "numbers_from": arch.source,
                  "architecture": {k: v for k, v in dataclasses.asdict(arch).items() if k != "source"},
                  "rope_scaling": rope.as_dict() or None,
                  "original_max_position_embeddings": original_positions(unscaled.max_position_embeddings, rope)},
        "warnings": ([warning] if warning else []) + _preference_warnings(config, arch, setup, batch, seq),
        "parameters": counts,
        "weights": {
            "bf16": weight_bytes(arch, False, False, 2),
            "nf4": weight_bytes(arch, True, config.quant.double_quant, 2),
            "loaded": loaded,
            "training": training_weight_bytes(arch, setup),
        },
        "lora": {"r": config.lora.r, "target_modules": list(config.lora.target_modules), "trainable": n_lora,
                 "percent_of_base": 100.0 * n_lora / counts["total"]},
        "training": {"device": setup.device, "quant": config.quant.method, "autocast": setup.amp,
                     "dist_strategy": strategy, "sharding": setup.sharding, "processes": pcfg.processes,
                     "scope": scope,
                     "optimizer": setup.optim, "kernels": setup.kernels, "attn_implementation": setup.attn,
                     "batch_size": batch,
                     "supervised_fraction": setup.supervised,
                     "seq_len": seq, "tokens": batch * seq * (1 if setup.objective == "sft" else SEQUENCES_PER_PAIR),
                     "gradient_checkpointing": setup.gradient_checkpointing, "objective": setup.objective,
                     **_preference(config, setup, batch), **runs},
        "evaluation": evaluation_memory(arch, config, setup.device, setup.compute_bytes, setup.model_bytes, budget),
        "kv_cache": {"bytes_per_token": kv_cache_bytes(arch, 1, infer_bytes), "dtype_bytes": infer_bytes,
                     "context_len": context, "bytes": kv_cache_bytes(arch, context, infer_bytes)},
        "inference": {"weights": loaded["total"], "kv_cache": kv_cache_bytes(arch, context, infer_bytes),
                      "total": loaded["total"] + kv_cache_bytes(arch, context, infer_bytes)},
        "budget": {"gpu_gb": pcfg.gpu_gb, "reserve_gb": pcfg.reserve_gb, "usable_bytes": budget,
                   "peak": chosen["peak"], "fits": chosen["peak"] <= budget,
                   "largest_batch": [{"seq_len": s, "batch_size": _largest_batch(arch, setup, s, budget)}
                                     for s in seqs],
                   "longest_seq_at_batch": _largest_seq(arch, setup, batch, budget)},
        "gpus": gpu_figures(config, arch) if pcfg.device == "cuda" else None,
        "long_context": long_context(config, unscaled) if seq >= 8192 or rope.rope_type else [],
    }


def _size(nbytes: float) -> str:
    """Bytes as a short human string in binary units (GiB/MiB/KiB)."""
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:,.2f} {unit}"
    return f"{int(nbytes):,} B"


def render(plan: Dict[str, Any], console=None) -> None:
    """Print ``plan`` (from :func:`make_plan`) as rich tables."""
    from rich.table import Table

    console = console or result_console()
    arch, counts, w = plan["model"]["architecture"], plan["parameters"], plan["weights"]
    console.print(f"[bold]{plan['model']['name']}[/bold]  (numbers from {plan['model']['numbers_from']})")
    console.print(f"hidden {arch['hidden_size']}, intermediate {arch['intermediate_size']}, "
                  f"{arch['num_hidden_layers']} layers, {arch['num_attention_heads']} heads / "
                  f"{arch['num_key_value_heads']} KV heads x {arch['head_dim']}, vocab {arch['vocab_size']}, "
                  f"lm_head {'tied' if arch['tie_word_embeddings'] else 'untied'}")
    table = Table(title="Parameters and weight bytes")
    for col in ("component", "parameters", "bf16", "NF4 (rest 16-bit)", "during training"):
        table.add_column(col, justify="left" if col == "component" else "right", overflow="fold")
    rows = [("embeddings", "embeddings"), ("attention (q/k/v/o)", "attention"), ("attention bias", "attention_bias"),
            ("MLP", "mlp"), ("norms", "norms"), ("lm_head", "lm_head")]
    for label, key in rows:
        table.add_row(label, f"{counts[key]:,}", _size(w["bf16"][key]), _size(w["nf4"][key]),
                      _size(w["training"][key]))
    table.add_row("[bold]total", f"[bold]{counts['total']:,}", _size(w["bf16"]["total"]),
                  _size(w["nf4"]["total"]), _size(w["training"]["total"]))
    console.print(table)
    rope = plan["model"].get("rope_scaling")
    if rope:
        console.print(f"RoPE scaling {rope['rope_type']} x{rope['factor']:g}: context "
                      f"{plan['model']['original_max_position_embeddings']:,} -> "
                      f"{arch['max_position_embeddings']:,} tokens")
    for warning in plan.get("warnings", []):
        console.print(f"[yellow]warning:[/yellow] {warning}")
    lora, t = plan["lora"], plan["training"]
    console.print(f"LoRA r={lora['r']} on {', '.join(lora['target_modules'])}: {lora['trainable']:,} trainable "
                  f"parameters ({lora['percent_of_base']:.3f}% of the base)")
    pref = t.get("objective", "sft") != "sft"
    shape = (f"objective {t['objective']}, batch {t['batch_size']} pairs x {t['sequences_per_pair']} sequences per "
             f"pair ({t['sequences']} sequences) x {t['seq_len']} tokens"
             f"{', padding-free' if t['padding_free'] else ', padded'}" if pref else
             f"batch {t['batch_size']} x {t['seq_len']} tokens")
    table = Table(title=f"Training step on {t['device']} ({t['scope'].split(';')[0].split(':')[0]}): {shape}, "
                        f"quant={t['quant']}, autocast={'bf16' if t['autocast'] else 'off'}, {t['optimizer']}, "
                        f"kernels={t['kernels']}")
    table.add_column("", overflow="fold")
    for name in ("with_checkpointing", "without_checkpointing"):
        mark = " (config)" if (name == "with_checkpointing") == t["gradient_checkpointing"] else ""
        table.add_column(name.replace("_", " ") + mark, justify="right", overflow="fold")
    labels = [("weights", "weights"), ("LoRA weights (fp32)", "lora_weights"), ("gradients", "gradients"),
              ("optimizer states", "optimizer_states")]
    if t.get("sharding", "none") in ("zero3", "fsdp", "fsdp_no_reshard"):
        labels.append(("gathered weights (most at once)", "gathered_weights"))
    if t.get("sharding") in ("zero1", "zero2"):
        labels.append(("gradient buckets (DeepSpeed)", "reduce_buffers"))
    labels += [("activations held at the loss", "held_at_loss"),
               ("loss (chunked, no logits tensor)", "loss"), ("layer backward phase", "layer_phase"), ("peak", "peak")]
    if pref:
        labels.insert(-3, ("reference forward (no-grad transient)", "reference"))
    for label, key in labels:
        table.add_row(label, *(_size(t[name][key]) for name in ("with_checkpointing", "without_checkpointing")))
    console.print(table)
    if t.get("sharding", "none") != "none":
        console.print(f"[yellow]{t['sharding']}:[/yellow] {t['scope']}")
    if pref:
        console.print(f"Preference step ({t['objective']}): 2 sequences per pair; the reference forward is "
                      f"{t['reference_note']}")
    ev = plan["evaluation"]
    console.print(f"Evaluation peak on {ev['device']}: {_size(ev['peak'])} = weights {_size(ev['weights'])}"
                  f"{' (NF4 dequantized)' if ev['dequantized'] else ''} + LoRA {_size(ev['lora_weights'])}"
                  f" + baseline {_size(ev['baseline'])} + the largest of generation {_size(ev['generation'])}, "
                  f"perplexity {_size(ev['perplexity'])}, benchmarks {_size(ev['benchmarks'])} "
                  f"(batch {ev['batch_size']}, chunked vocabulary projection)")
    kv, inf, b = plan["kv_cache"], plan["inference"], plan["budget"]
    console.print(f"KV cache: {kv['bytes_per_token']:,} B per token ({kv['dtype_bytes'] * 8}-bit); "
                  f"{_size(kv['bytes'])} for {kv['context_len']:,} tokens. Inference: weights "
                  f"{_size(inf['weights'])} + KV {_size(inf['kv_cache'])} = {_size(inf['total'])}")
    verdict = "[green]fits[/green]" if b["fits"] else "[red]does not fit[/red]"
    console.print(f"Budget {b['gpu_gb']} GiB - reserve {b['reserve_gb']} GiB: peak {_size(b['peak'])} {verdict}; "
                  f"longest sequence at batch {t['batch_size']}{' pairs' if pref else ''}: "
                  f"{b['longest_seq_at_batch']:,} tokens")
    table = Table(title="Largest batch that fits" + (" (pairs)" if pref else ""))
    table.add_column("seq len", justify="right", overflow="fold")
    table.add_column("batch", justify="right", overflow="fold")
    for row in b["largest_batch"]:
        table.add_row(f"{row['seq_len']:,}", str(row["batch_size"]) if row["batch_size"] else "[red]none")
    console.print(table)
    render_gpus(plan, console)


def plan_command(config: Config) -> Dict[str, Any]:
    """Entry point of ``python -m qwenft plan``: print the plan, write ``plan.out`` (JSON) when set.

    Returns:
        The plan dict of :func:`make_plan`.
    """
    plan = make_plan(config)
    render(plan)
    if config.plan.out:
        path = write_json(config.plan.out, plan)
        print(f"plan written to {path}")
    return plan

