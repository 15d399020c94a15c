"""The KV cache of one sampler call, and the prompt batch it starts from.

The cache is transformers' own :class:`~transformers.DynamicCache` (the one ``generate`` builds), passed
to the model as ``cache=``: each layer's keys and values are ``[batch, kv_heads, seq, head_dim]`` and grow
by one position per decode step. Prompts are left-padded, so every row's next token sits in the last
column; padded positions are masked out and position ids count only real tokens.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch


def new_cache(model):
    """An empty ``DynamicCache`` configured as ``model.generate`` configures it (per-layer types from the config)."""
    from transformers import DynamicCache

    config = model.config
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return DynamicCache(config=text_config)


def new_static_cache(model, max_cache_len: int):
    """An empty ``StaticCache`` of ``max_cache_len`` positions (prompt width + max_new_tokens).

    Its key/value buffers are allocated once at full length on the first forward, so every decode step has the
    same shapes (what ``torch.compile`` with CUDA graphs needs); masked positions are never attended to.
    """
    from transformers import StaticCache

    config = model.config
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return StaticCache(config=text_config, max_cache_len=max_cache_len)


def cache_bytes(cache) -> int:
    """Bytes held by the keys and values of ``cache`` (all layers, all rows, padding included)."""
    total = 0
    for layer in getattr(cache, "layers", None) or []:
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int,
             device: Optional[torch.device] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists into one batch.

    Args:
        prompts: ``batch`` lists of token ids, each non-empty.
        pad_id: id written into padded positions (they are masked, so its value does not matter).
        device: where the tensors go.

    Returns:
        ``(input_ids, attention_mask)``, both ``[batch, max_len]`` int64; the mask is 1 on real tokens.
    """
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            ids[row, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only: ``cumsum(mask) - 1``, padded positions set to 0.

    The rule transformers' ``generate`` uses (``_prepare_position_ids_for_generation``), so a padded row
    sees the same rotary positions as the same prompt alone.

    Args:
        attention_mask: ``[batch, seq]`` 1 on real tokens.

    Returns:
        ``[batch, seq]`` int64 positions.
    """
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


def token_history(prompts: List[List[int]], vocab: int, extra: int,
                  device: Optional[torch.device] = None) -> torch.Tensor:
    """A ``[batch, width + extra]`` int64 buffer for the repetition penalty: row ``i`` starts with its prompt,
    left-aligned to the padded width; the ``extra`` columns receive the generated tokens.

    Padding slots, and ids the logits cannot produce (``>= vocab``), repeat the row's last prompt token, which
    is penalised anyway: so padding is never penalised, as in transformers (``prompt_ignore_length``).
    """
    width = max(len(p) for p in prompts)
    history = torch.zeros((len(prompts), width + extra), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        valid = [t for t in prompt if 0 <= t < vocab]
        fill = valid[-1] if valid else 0
        history[row, :width] = fill
        if valid:
            history[row, width - len(valid):width] = torch.as_tensor(valid, dtype=torch.long)
    return history.to(device)
