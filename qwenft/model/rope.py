"""Long context: ``model.rope_scaling`` applied to a transformers config, and the context it gives.

Qwen2 rotates queries and keys by position (RoPE, Su et al. 2021) with a base ``rope_theta`` (1e6 for Qwen2.5);
a model trained up to ``max_position_embeddings`` tokens (32,768) meets unseen rotation angles beyond that.
Scaling remaps the positions: ``linear`` divides them by ``factor`` (position interpolation, Chen et al. 2023),
``dynamic`` raises the base with the length (NTK-aware), ``yarn`` interpolates the low frequencies only and
rescales the attention logits (Peng et al. 2023, "YaRN"); Qwen2.5's model cards document YaRN with factor 4 and
``original_max_position_embeddings`` 32768 for inputs up to 131,072 tokens.

transformers 5 reads RoPE settings from ``config.rope_parameters`` (``rope_type``, ``rope_theta``, ``factor``,
``original_max_position_embeddings``, ...; modeling_rope_utils.py) and Qwen2's rotary embedding computes its
inverse frequencies and ``attention_scaling`` from them (models/qwen2/modeling_qwen2.py,
``Qwen2RotaryEmbedding``); the old ``rope_scaling`` attribute is a deprecated alias. :func:`apply_rope_scaling`
writes ``rope_parameters`` (keeping the checkpoint's ``rope_theta``) and, for ``linear`` and ``yarn``, sets
``max_position_embeddings`` to the scaled context, so ``config.json``, the model and ``qwenft plan`` agree on it
(YaRN then finds ``max_position_embeddings / original_max_position_embeddings == factor``, as transformers
checks). ``dynamic`` keeps ``max_position_embeddings``: its formula reads it as the original length.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

from qwenft.config import QwenftError, RopeScalingConfig


def original_positions(max_position_embeddings: int, rope: RopeScalingConfig) -> int:
    """The context the model was trained on: ``original_max_position_embeddings`` (yarn) or the config's."""
    return rope.original_max_position_embeddings or max_position_embeddings


def scaled_positions(max_position_embeddings: int, rope: RopeScalingConfig) -> int:
    """The context (tokens) a model with ``max_position_embeddings`` is meant for once ``rope`` is applied:
    ``original * factor`` (the unscaled value when no scaling is set)."""
    if rope.rope_type is None:
        return max_position_embeddings
    return int(original_positions(max_position_embeddings, rope) * rope.factor)


def rope_parameters(hf_config, rope: RopeScalingConfig) -> Dict[str, Any]:
    """The ``rope_parameters`` dict for ``hf_config`` with ``rope`` applied (``rope_theta`` kept from the config)."""
    base = dict(getattr(hf_config, "rope_parameters", None) or {})
    params = rope.as_dict()
    theta = base.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is not None:
        params["rope_theta"] = theta
    if "partial_rotary_factor" in base:
        params["partial_rotary_factor"] = base["partial_rotary_factor"]
    if rope.rope_type == "yarn":
        params.setdefault("original_max_position_embeddings",
                          base.get("original_max_position_embeddings") or hf_config.max_position_embeddings)
    return params


def apply_rope_scaling(hf_config, rope: RopeScalingConfig) -> None:
    """Write ``rope`` into a transformers config (in place), before the model is built from it.

    Raises:
        QwenftError: transformers refuses the parameters (the message names ``model.rope_scaling``).
    """
    if rope.rope_type is None:
        return
    params = rope_parameters(hf_config, rope)
    hf_config.rope_parameters = params
    if rope.rope_type in ("linear", "yarn"):
        original = params.get("original_max_position_embeddings") or hf_config.max_position_embeddings
        hf_config.max_position_embeddings = int(original * rope.factor)
    try:
        if hasattr(hf_config, "validate_rope"):
            hf_config.validate_rope()
    except (ValueError, KeyError, TypeError) as exc:
        raise QwenftError(f"model.rope_scaling={rope.as_dict()}: transformers refuses it ({exc})") from None


def context_warning(max_seq_len: int, max_position_embeddings: int, rope: RopeScalingConfig) -> Optional[str]:
    """A warning when ``data.max_seq_len`` goes beyond what the model (with ``rope``) is meant for, else None.

    Args:
        max_seq_len: tokens per training example (``data.max_seq_len``).
        max_position_embeddings: the model config's value, before scaling.
    """
    if rope.rope_type is None:
        if max_seq_len <= max_position_embeddings:
            return None
        factor = float(max(2, math.ceil(max_seq_len / max_position_embeddings)))
        return (f"data.max_seq_len={max_seq_len} exceeds the model's max_position_embeddings="
                f"{max_position_embeddings} and model.rope_scaling is not set: positions beyond "
                f"{max_position_embeddings} were never trained; set model.rope_scaling={{rope_type: yarn, factor: "
                f"{factor}, original_max_position_embeddings: {max_position_embeddings}}}")
    limit = scaled_positions(max_position_embeddings, rope)
    if max_seq_len <= limit:
        return None
    return (f"data.max_seq_len={max_seq_len} exceeds the scaled context of {limit} tokens "
            f"(model.rope_scaling: {rope.rope_type}, factor {rope.factor}); raise model.rope_scaling.factor")
