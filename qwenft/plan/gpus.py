"""Which GPUs a training step fits: one GPU in QLoRA and LoRA, several under FSDP and ZeRO-3, and long contexts.

Every figure is :func:`qwenft.plan.preference.step_memory`'s peak (bytes) for a variant of the configured run that
changes one thing (``quant.method``, ``dist`` with ``plan.processes``, or ``data.max_seq_len``), planned for CUDA.

The rule for "fits": a card sold as ``N`` GB fits when the planned peak is at most ``N`` GiB minus
``plan.reserve_gb`` (the rule ``plan.gpu_gb`` follows). Cards report about ``N`` GiB (an 80 GB H100: 81,559 MiB;
a 141 GB H200: 143,771 MiB; a 24 GB RTX 4090: 24,564 MiB; ``nvidia-smi``), and the reserve (1 GiB by default)
stands for what the tensor count does not see: the CUDA context, cuBLAS workspaces, allocator slack.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

from qwenft.config import Config, DistConfig, RopeScalingConfig
from qwenft.plan.arch import Architecture, parameter_counts

GIB = 1 << 30
GPU_SIZES_GB = (16, 24, 40, 48, 80, 141)  # T4 / A4000, RTX 4090 / L4, A100-40G, L40S / A6000, A100 / H100, H200
SHARDED_DISTS = ("fsdp", "deepspeed_zero3")  # conf/dist presets that divide the weights over the processes
SHARDED_PROCESSES = (2, 4, 8)
SHARDED_MIN_PARAMETERS = 20e9  # the per-GPU figures are shown for the 32B and 72B (20 B parameters and up)
LONG_CONTEXT = (8192, 32768, 131072)  # tokens; beyond the original 32,768 with YaRN factor 4 (the model cards')
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def fitting_gpus(peak: int, reserve_gb: float) -> List[int]:
    """The sizes of :data:`GPU_SIZES_GB` (GB, as sold) whose ``N GiB - reserve_gb`` holds ``peak`` bytes."""
    return [n for n in GPU_SIZES_GB if peak <= (n - reserve_gb) * GIB]


def dist_preset(name: str) -> DistConfig:
    """The ``dist`` section of ``conf/dist/<name>.yaml`` (what ``dist=<name>`` composes), without Hydra.

    Raises:
        QwenftError: the preset is missing or does not validate (:class:`qwenft.config.DistConfig`).
    """
    import yaml

    from qwenft.config import QwenftError
    from qwenft.resources import conf_dir

    path = conf_dir() / "dist" / f"{name}.yaml"
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise QwenftError(f"{path}: not readable as a dist preset ({exc})") from None
    return DistConfig(**{k: v for k, v in data.items() if not str(k).startswith("_")})


def variant(config: Config, quant: Optional[str] = None, dist: Optional[DistConfig] = None,
            processes: Optional[int] = None, seq: Optional[int] = None, batch: Optional[int] = None,
            rope: Optional[dict] = None, packed: Optional[bool] = None, attn: Optional[str] = None,
            checkpointing: Optional[bool] = None) -> Config:
    """``config`` with the given settings replaced (``quant.method``, ``dist``, ``plan.processes``,
    ``data.max_seq_len``, ``train.batch_size``, ``model.rope_scaling``, ``data.packing``,
    ``model.attn_implementation``, ``train.gradient_checkpointing``); the others as configured. Each replaced
    section is validated again (its ``__post_init__``)."""
    rep = dataclasses.replace
    out = config
    if quant is not None:
        out = rep(out, quant=rep(out.quant, method=quant))
    if dist is not None:
        out = rep(out, dist=dist)
    if processes is not None:
        out = rep(out, plan=rep(out.plan, processes=processes))
    if seq is not None or packed is not None:
        out = rep(out, data=rep(out.data, max_seq_len=seq or out.data.max_seq_len,
                                packing=out.data.packing if packed is None else packed))
    if batch is not None or checkpointing is not None:
        out = rep(out, train=rep(out.train, batch_size=batch or out.train.batch_size,
                                 gradient_checkpointing=out.train.gradient_checkpointing if checkpointing is None
                                 else checkpointing))
    if rope is not None or attn is not None:
        scaling = RopeScalingConfig(**rope) if rope is not None else out.model.rope_scaling
        out = rep(out, model=rep(out.model, rope_scaling=scaling, attn_implementation=attn or
                                 out.model.attn_implementation))
    return out


def step_peak(config: Config, arch: Architecture) -> Dict[str, int]:
    """:func:`~qwenft.plan.preference.step_memory` of ``config`` (``train.batch_size`` x ``data.max_seq_len``) on
    CUDA, with gradient checkpointing as configured: ``peak`` and the parts, in bytes."""
    from qwenft.plan.memory import TrainSetup
    from qwenft.plan.preference import step_memory

    setup = TrainSetup.from_config(config, device="cuda")
    return step_memory(arch, setup, config.train.batch_size, config.data.max_seq_len)


def gpu_figures(config: Config, arch: Architecture) -> Dict[str, Any]:
    """The configured step's peak on one GPU with ``quant=nf4`` (QLoRA) and ``quant=none`` (LoRA on 16-bit
    weights), and for models of :data:`SHARDED_MIN_PARAMETERS` and more the per-GPU peak under each of
    :data:`SHARDED_DISTS` over :data:`SHARDED_PROCESSES` GPUs; each with the :data:`GPU_SIZES_GB` that fit.

    Returns:
        ``{"sizes_gb", "reserve_gb", "rule", "one_gpu": [{quant, peak, fits}], "sharded": [{dist, processes,
        quant, peak, fits}]}`` (bytes; ``fits`` in GB as sold).

    Raises:
        QwenftError: a dist preset cannot be read (:func:`dist_preset`).
    """
    reserve = config.plan.reserve_gb
    single = variant(config, dist=DistConfig(), processes=1)
    one_gpu = []
    for quant in ("nf4", "none"):
        peak = step_peak(variant(single, quant=quant), arch)["peak"]
        one_gpu.append({"quant": quant, "peak": peak, "fits": fitting_gpus(peak, reserve)})
    sharded = []
    if parameter_counts(arch)["total"] >= SHARDED_MIN_PARAMETERS:
        for name in SHARDED_DISTS:
            dist = dist_preset(name)
            for processes in SHARDED_PROCESSES:
                for quant in ("nf4", "none"):
                    peak = step_peak(variant(config, quant=quant, dist=dist, processes=processes), arch)["peak"]
                    sharded.append({"dist": name, "processes": processes, "quant": quant, "peak": peak,
                                    "fits": fitting_gpus(peak, reserve)})
    return {"sizes_gb": list(GPU_SIZES_GB), "reserve_gb": reserve, "one_gpu": one_gpu, "sharded": sharded,
            "rule": f"a card of N GB fits when the peak is at most N GiB - plan.reserve_gb ({reserve:g} GiB)"}


def long_context(config: Config, arch: Architecture) -> List[Dict[str, Any]]:
    """One training step of one packed row at each :data:`LONG_CONTEXT` length the model can reach (with
    ``model.rope_scaling`` = :data:`YARN` beyond ``max_position_embeddings``), gradient checkpointing and
    qwenft's chunked loss, on ``flash_attention_2`` (no ``[tokens, tokens]`` mask), QLoRA and LoRA; plus the
    KV cache of one sequence that long in 16-bit (what evaluation and generation hold at batch 1).

    ``arch``: the unscaled architecture (config.json's ``max_position_embeddings``).

    Returns:
        ``[{seq_len, rope_scaling, quant, peak, checkpoints, layer_phase, kv_cache, fits}]`` (bytes).
    """
    from qwenft.plan.memory import kv_cache_bytes

    rows = []
    for seq in LONG_CONTEXT:
        rope = None if seq <= arch.max_position_embeddings else YARN
        if rope is not None and seq > YARN["original_max_position_embeddings"] * YARN["factor"]:
            continue
        if rope is not None and arch.max_position_embeddings != YARN["original_max_position_embeddings"]:
            continue  # YaRN x4 is documented for the 32,768-token models only (not Qwen2.5-Math's 4,096)
        base = variant(config, dist=DistConfig(), processes=1, seq=seq, batch=1, packed=True,
                       attn="flash_attention_2", rope=rope or {}, checkpointing=True)
        for quant in ("nf4", "none"):
            step = step_peak(variant(base, quant=quant), arch)
            rows.append({"seq_len": seq, "rope_scaling": dict(rope) if rope else None, "quant": quant,
                         "peak": step["peak"], "checkpoints": step["held_at_loss"], "layer_phase": step["layer_phase"],
                         "kv_cache": kv_cache_bytes(arch, seq, 2),
                         "fits": fitting_gpus(step["peak"], config.plan.reserve_gb)})
    return rows


def longest_context(config: Config, arch: Architecture, quant: str, gpu_gb: float) -> int:
    """The longest ``data.max_seq_len`` (tokens, a multiple of 1,024) whose one-row step, planned as in
    :func:`long_context`, fits a ``gpu_gb`` GB card by the module's rule (0: none); at most the model's context,
    or 4 times 32,768 with YaRN for a model of 32,768 positions."""
    native = arch.max_position_embeddings
    top = native * 4 if native == YARN["original_max_position_embeddings"] else native

    def fits(seq: int) -> bool:
        base = variant(config, dist=DistConfig(), processes=1, seq=seq, batch=1, packed=True, quant=quant,
                       attn="flash_attention_2", rope=YARN if seq > native else {}, checkpointing=True)
        return step_peak(base, arch)["peak"] <= (gpu_gb - config.plan.reserve_gb) * GIB

    low, high = 0, top // 1024 + 1  # in units of 1,024 tokens: bisect on the monotone peak
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid * 1024) else (low, mid)
    return low * 1024


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:,.1f} GiB"


def render_gpus(plan: Dict[str, Any], console) -> None:
    """Print the ``gpus`` and ``long_context`` parts of a plan (:func:`qwenft.plan.command.make_plan`)."""
    from rich.table import Table

    g = plan.get("gpus")
    if not g:
        return
    t = plan["training"]

    def fits(sizes: List[int]) -> str:
        return ", ".join(f"{n} GB" for n in sizes) if sizes else "[red]none of " + "/".join(map(str, g["sizes_gb"]))

    table = Table(title=f"Which GPUs fit (batch {t['batch_size']} x {t['seq_len']:,} tokens, gradient checkpointing "
                        f"{'on' if t['gradient_checkpointing'] else 'off'}; {g['rule']})")
    for col in ("setup", "peak per GPU", "fits"):
        table.add_column(col, justify="right" if col == "peak per GPU" else "left", overflow="fold")
    for row in g["one_gpu"]:
        label = "1 GPU, QLoRA (quant=nf4)" if row["quant"] == "nf4" else "1 GPU, LoRA (quant=none)"
        table.add_row(label, _size(row["peak"]), fits(row["fits"]))
    for row in g["sharded"]:
        table.add_row(f"dist={row['dist']} plan.processes={row['processes']} quant={row['quant']}",
                      _size(row["peak"]), fits(row["fits"]))
    console.print(table)
    rows = plan.get("long_context") or []
    if rows:
        table = Table(title="Long context: one packed row, batch 1, gradient checkpointing, flash_attention_2")
        for col in ("seq len", "rope_scaling", "quant", "peak", "layer inputs kept", "KV cache (1 seq)", "fits"):
            table.add_column(col, justify="left" if col in ("rope_scaling", "quant", "fits") else "right",
                             overflow="fold")
        for row in rows:
            table.add_row(f"{row['seq_len']:,}", "yarn x4" if row["rope_scaling"] else "-", row["quant"],
                          _size(row["peak"]), _size(row["checkpoints"]), _size(row["kv_cache"]), fits(row["fits"]))
        console.print(table)
