"""The base of an adapter made by another tool (a plain peft script, unsloth, axolotl ...): it has no ``qwenft.json``,
so the base is read from peft's own record of it, ``adapter_config.json``'s ``base_model_name_or_path``, and the
adapter goes onto that base's 16-bit weights, the ones peft's ``merge_and_unload`` merges into.

:func:`foreign_base` is the rule :func:`qwenft.model.adapter.resolve_base` applies to such an adapter (``merge``, and
``eval`` / ``generate`` / ``inspect`` / ``serve`` through :func:`qwenft.model.adapter.inference_config`).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Tuple

from qwenft.config import ModelConfig, QuantConfig, QwenftError
from qwenft.model.family import member
from qwenft.model.vllm_lora import read_adapter_config

log = logging.getLogger(__name__)

BASE_KEY = "base_model_name_or_path"
NO_META = "no qwenft.json beside the adapter"
# A Hugging Face id: ``name`` or ``owner/name`` (letters, digits, ``-``, ``_``, ``.``); anything else is a path.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def _how(quant: QuantConfig, quant_typed: bool) -> str:
    """The part of ``why`` that says which weights the adapter goes onto."""
    if quant_typed:
        return f"; quant={quant.method} as typed"
    return ("; merged into its 16-bit weights (quant=none), as peft's merge_and_unload does; if it was trained with "
            "QLoRA, pass quant=nf4 for the NF4-dequantized weights training saw")


def foreign_base(model: ModelConfig, quant: QuantConfig, adapter_dir: Path, model_typed: bool,
                 quant_typed: bool) -> Tuple[ModelConfig, QuantConfig, str]:
    """The base and quantization of an adapter without ``qwenft.json``, and why (for the log and the model card).

    The base: a typed ``model=...`` (``model_typed``); else ``base_model_name_or_path`` of its adapter_config.json:
    an existing local directory -> ``model.source=local``, ``model.path`` that directory; a Hugging Face id of the
    Qwen2.5 family table (:func:`qwenft.model.family.member`) -> that preset (``model=qwen2.5-7b-instruct``); another
    id -> ``model.source=hub``, ``model.path`` the id. Only the weights' identity (name, source, path, revision) is
    replaced: ``model.dtype``, ``attn_implementation`` and ``rope_scaling`` stay ``model``'s. Missing or empty: the
    given ``model``, with a warning naming the file and ``model=...``. The quantization: ``quant.method=none`` (the
    16-bit weights) unless ``quant_typed``. A directory with no adapter_config.json at all: ``model`` and ``quant``
    as given.

    Raises:
        QwenftError: ``base_model_name_or_path`` is a path that does not exist here.
    """
    config_file = Path(adapter_dir).expanduser() / "adapter_config.json"
    if not config_file.is_file():
        return model, quant, f"from the command line ({NO_META})"
    if not quant_typed:
        quant = dataclasses.replace(quant, method="none")
    how = _how(quant, quant_typed)
    if model_typed:
        return model, quant, f"model={model.name} typed on the command line ({NO_META}){how}"
    value = read_adapter_config(config_file.parent).get(BASE_KEY)
    if not isinstance(value, str) or not value.strip():
        log.warning("BASE UNKNOWN: %s names no %s and the adapter has no qwenft.json: running it on %s (%s), this "
                    "command's default; if it was trained on another model pass model=PRESET or model.source=local "
                    "model.path=DIR", config_file, BASE_KEY, model.name, model.source)
        return model, quant, f"from the command line: {config_file} names no {BASE_KEY} ({NO_META}){how}"
    value = value.strip()
    said = f"{BASE_KEY}={value} in {config_file} ({NO_META})"
    local = Path(value).expanduser()
    if local.is_dir():
        local = local.resolve()
        base = dataclasses.replace(model, name=local.name, source="local", path=str(local), revision="main")
        return base, quant, f"from {said}: a local directory{how}"
    if not HUB_ID.fullmatch(value):
        raise QwenftError(f"{config_file}: {BASE_KEY}={value} is a local directory that does not exist here (the "
                          "adapter has no qwenft.json); pass the base it was trained on: model.source=local "
                          "model.path=DIR, or model=PRESET")
    known = member(value)
    if known is not None:
        base = dataclasses.replace(model, name=known.preset, source="hub", path=known.repo_id, revision="main")
        return base, quant, f"from {said}: the family preset model={known.preset}{how}"
    base = dataclasses.replace(model, name=value, source="hub", path=value, revision="main")
    return base, quant, f"from {said}: a Hugging Face id{how}"
