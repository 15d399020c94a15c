"""An adapter as ``qwenft doctor`` reads it, and the base it runs on.

The base is found, in order: adapter_config.json's ``base_model_name_or_path`` when it is a local directory; the
base ``qwenft.json`` records (``model.source``: the embedded model's converted directory when it exists, tiny-random's
cached directory, a local path, a hub id); a hub id's snapshot in the Hugging Face cache (no download); the family
table's numbers for a known hub id (:mod:`qwenft.model.family`: config and generation_config, no tokenizer). When
none is readable, the checks that need it are named as skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from qwenft.doctor.read import (ModelFiles, Tensor, Tokenizer, read_json, read_model_dir, read_tokenizer,
                                weight_headers)
from qwenft.model.family import member


@dataclass
class AdapterFiles:
    """An adapter directory: ``adapter_config`` (peft's), ``meta`` (qwenft.json, None when another tool made it),
    its weights' headers, its own generation_config / tokenizer (None when absent), the base (None: not readable)
    and ``base_note`` (how the base was found, or why it was not)."""

    path: Path
    adapter_config: dict
    meta: Optional[dict]
    tensors: Dict[str, Tensor]
    generation: Optional[dict]
    tokenizer: Optional[Tokenizer]
    base: Optional[ModelFiles]
    base_note: str


def read_adapter(path: Path) -> AdapterFiles:
    """Read an adapter directory and find its base.

    Raises:
        QwenftError: adapter_config.json, qwenft.json, generation_config.json or a tokenizer file corrupt, or a
            safetensors header unreadable (each named).
    """
    config = read_json(path / "adapter_config.json")
    meta = read_json(path / "qwenft.json", required=False)
    tensors = weight_headers(path, "adapter_model") or {}
    base, note = find_base(config, meta)
    return AdapterFiles(path, config, meta, tensors, read_json(path / "generation_config.json", required=False),
                        read_tokenizer(path), base, note)


def _local(value) -> Optional[Path]:
    if not isinstance(value, str) or not value:
        return None
    local = Path(value).expanduser()
    return local if (local / "config.json").is_file() else None


def _from_meta(meta: Optional[dict]) -> List[str]:
    """Where qwenft.json's ``model`` says the base is: local directories first, then a hub id."""
    model = (meta or {}).get("model")
    if not isinstance(model, dict):
        return []
    source, where = model.get("source"), model.get("path")
    if source == "embedded":
        from qwenft.model.sources import EMBEDDED_SHA256
        from qwenft.runtime import cache_dir

        return [str(cache_dir() / "embedded" / EMBEDDED_SHA256[:16]), "Qwen/Qwen2.5-Coder-0.5B-Instruct"]
    if source == "tiny-random" and isinstance(model.get("tiny"), dict):
        from dataclasses import fields

        from qwenft.config import TinyModelConfig
        from qwenft.model.tiny import tiny_model_dir

        known = {f.name for f in fields(TinyModelConfig)}
        return [str(tiny_model_dir(TinyModelConfig(**{k: v for k, v in model["tiny"].items() if k in known})))]
    return [where] if isinstance(where, str) else []


def _hub_cache(repo_id: str) -> Optional[Path]:
    """The snapshot directory of ``repo_id`` in the Hugging Face cache holding its config.json; None if absent."""
    if repo_id.count("/") != 1:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 -- an odd id or cache layout: treated as not cached
        return None
    return Path(found).parent if isinstance(found, str) else None


def find_base(adapter_config: dict, meta: Optional[dict]) -> tuple:
    """``(ModelFiles or None, note)`` for an adapter's base (the module docstring gives the order)."""
    named = adapter_config.get("base_model_name_or_path")
    candidates = [named] + _from_meta(meta)
    for value in candidates:
        local = _local(value)
        if local is not None:
            return read_model_dir(local), f"base read from {local}"
    for value in candidates:
        if isinstance(value, str) and value:
            cached = _hub_cache(value)
            if cached is not None:
                return read_model_dir(cached, "Hugging Face cache"), f"base {value} read from the Hugging Face cache"
    for value in candidates:
        known = member(value) if isinstance(value, str) else None
        if known is not None:
            files = ModelFiles(None, dict(known.config), dict(known.generation), None, None, [known.repo_id],
                               "family table")
            return files, (f"base {known.repo_id} is not on this machine: its config and generation_config from "
                           "qwenft's family table (no tokenizer: the template checks use the adapter's own)")
    shown = ", ".join(repr(v) for v in candidates if v) or "none recorded"
    return None, (f"base not readable ({shown}): not a local directory, not in the Hugging Face cache and not in "
                  "qwenft's family table")


LORA_NAME = re.compile(r"\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


def projection_shapes(config: dict) -> Dict[str, tuple]:
    """``{module: (in_features, out_features)}`` of a Qwen2 layer's projections from its config.json (the planner's
    :func:`qwenft.plan.arch.projection_shapes`); {} when the config lacks the sizes it needs."""
    from qwenft.config import QwenftError
    from qwenft.plan.arch import Architecture, projection_shapes as planned

    try:
        return planned(Architecture.from_config_dict(config, "config.json"))
    except (QwenftError, TypeError, ValueError, ZeroDivisionError):
        return {}


def shape_mismatches(tensors: Dict[str, Tensor], config: dict) -> List[tuple]:
    """``(tensor name, its shape, the shape the base needs)`` for each LoRA A/B matrix that does not fit the base's
    projection (A is [r, in_features], B is [out_features, r])."""
    shapes = projection_shapes(config)
    wrong = []
    for name, tensor in sorted(tensors.items()):
        found = LORA_NAME.search(name)
        if not found or found.group(1) not in shapes or len(tensor.shape) != 2:
            continue
        inputs, outputs = shapes[found.group(1)]
        rows, cols = tensor.shape
        need = [rows, inputs] if found.group(2) == "A" else [outputs, cols]
        if list(tensor.shape) != need:
            wrong.append((name, list(tensor.shape), need))
    return wrong


def _module_key(tensor_name: str) -> str:
    """The module a LoRA tensor belongs to, named as peft matches ``target_modules`` against it
    (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` -> ``model.layers.0.self_attn.q_proj``)."""
    key = LORA_NAME.sub(lambda m: "." + m.group(1), tensor_name)
    return key.removeprefix("base_model.model.")


def _targeted(key: str, targets) -> bool:
    """peft's rule (``check_target_module_exists``): a string is a regex the whole key must match (``all-linear``
    takes every linear layer); a list names modules by the key or its last dotted parts."""
    if isinstance(targets, str):
        return targets == "all-linear" or re.fullmatch(targets, key) is not None
    return any(key == t or key.endswith(f".{t}") for t in targets or [] if isinstance(t, str))


def weight_problems(adapter_config: dict, tensors: Dict[str, Tensor]) -> List[tuple]:
    """``(code, message, fix)`` for LoRA weights that adapter_config.json does not describe: matrices of modules its
    ``target_modules`` does not name (peft loads the adapter without an error and leaves them out), and a rank other
    than its ``r`` (or a ``rank_pattern`` value; peft refuses to load it, vLLM is told the wrong --max-lora-rank).

    Args:
        adapter_config: adapter_config.json as read.
        tensors: the adapter's safetensors headers (``{name: Tensor}``); LoRA A is ``[r, in]``, B ``[out, r]``.
    """
    problems: List[tuple] = []
    lora = {name: t for name, t in tensors.items() if LORA_NAME.search(name) and len(t.shape) == 2}
    targets = adapter_config.get("target_modules")
    if targets is not None and not adapter_config.get("layers_to_transform"):
        stray = sorted({_module_key(n) for n in lora if not _targeted(_module_key(n), targets)})
        if stray:
            leaves = sorted({s.rsplit(".", 1)[-1] for s in stray})
            problems.append(("adapter-targets-mismatch", f"the weights hold LoRA matrices of {len(stray)} module(s) "
                             f"({', '.join(leaves)}; e.g. {stray[0]}) that target_modules={targets!r} does not "
                             "name: peft loads the adapter without an error and drops them, so the model runs "
                             "without that part of the training", "restore adapter_config.json's target_modules "
                             f"to the modules trained (they include {', '.join(leaves)})"))
    ranks = {adapter_config.get("r")} | set((adapter_config.get("rank_pattern") or {}).values())
    if all(isinstance(r, int) for r in ranks):
        for name, tensor in sorted(lora.items()):
            rank = tensor.shape[0] if LORA_NAME.search(name).group(2) == "A" else tensor.shape[1]
            if rank not in ranks:
                problems.append(("adapter-rank-mismatch", f"{name} has rank {rank} (shape {list(tensor.shape)}) but "
                                 f"adapter_config.json says r={adapter_config.get('r')}: peft refuses to load it "
                                 "(size mismatch) and vLLM is given the wrong --max-lora-rank",
                                 f"set \"r\": {rank} in adapter_config.json (the rank the weights were trained "
                                 "with)"))
                break
    return problems
