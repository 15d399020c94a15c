"""Batching for the Trainer: right padding, labels padded by position, packed rows with restarting positions."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from qwenft.config import QwenftError
from qwenft.data.template import IGNORE_INDEX


class DataCollator:
    """Turn examples ``{input_ids, labels[, position_ids]}`` into a batch of tensors.

    Unpacked examples are padded on the right to the longest in the batch with the tokenizer's pad id;
    labels are padded with ``-100`` **by position** (the pad id is ``<|endoftext|>``, a token that can be
    supervised, e.g. at the end of a ``text`` example, so labels are never masked by token id) and
    ``attention_mask`` is 1 on real tokens. Output: ``input_ids, labels, attention_mask: [batch, seq]``.

    Packed rows (they carry ``position_ids`` restarting at 0 for every example) get **no**
    ``attention_mask``: transformers then derives the sequence boundaries from ``position_ids``
    (``masking_utils.find_packed_sequence_indices``: a block-diagonal causal mask for sdpa / eager; for
    flash-attention the boundaries come from ``position_ids`` only when the batch is one row, hence
    ``flatten``). Padding continues the positions as one more sequence, so real tokens never attend to it.
    The model must run with ``use_cache=False`` (as in training): with a KV cache, transformers 5.24 skips
    the packed-sequence detection and the examples of a row would attend to each other.
    Output: ``input_ids, labels, position_ids: [batch, seq]``.

    Args:
        tokenizer: gives ``pad_token_id``.
        flatten: concatenate the whole batch into one row ``[1, total_tokens]`` with restarting
            ``position_ids`` and no padding (padding-free, as transformers' ``DataCollatorWithFlattening``);
            use it with ``attn_implementation=flash_attention_2``. The first label of every example is set
            to ``-100`` so no token is trained to predict across a boundary.
        pad_to_multiple_of: round the padded length up to a multiple of this (tokens).

    Raises:
        QwenftError: the tokenizer has no pad token.
    """

    def __init__(self, tokenizer, *, flatten: bool = False, pad_to_multiple_of: Optional[int] = None) -> None:
        pad = tokenizer if isinstance(tokenizer, int) else getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            raise QwenftError("the tokenizer has no pad token; load it with qwenft.model.load_tokenizer")
        self.pad_token_id = int(pad)
        self.flatten = flatten
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: Sequence[Dict[str, Sequence[int]]]) -> Dict[str, "object"]:
        import torch

        if not features:
            raise ValueError("DataCollator got an empty batch")
        if self.flatten:
            return self._flatten(features)
        packed = "position_ids" in features[0]
        longest = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = len(features)
        input_ids = torch.full((batch, longest), self.pad_token_id, dtype=torch.long)
        labels = torch.full((batch, longest), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((batch, longest), dtype=torch.long)
        positions = torch.zeros((batch, longest), dtype=torch.long)
        for b, feature in enumerate(features):
            n = len(feature["input_ids"])
            input_ids[b, :n] = torch.as_tensor(feature["input_ids"], dtype=torch.long)
            labels[b, :n] = torch.as_tensor(feature["labels"], dtype=torch.long)
            mask[b, :n] = 1
            if packed:
                positions[b, :n] = torch.as_tensor(feature["position_ids"], dtype=torch.long)
                positions[b, n:] = torch.arange(longest - n)  # the padding: one more sequence of its own
        if packed:
            return {"input_ids": input_ids, "labels": labels, "position_ids": positions}
        return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}

    def _flatten(self, features: Sequence[Dict[str, Sequence[int]]]) -> Dict[str, "object"]:
        import torch

        ids: List[int] = []
        labels: List[int] = []
        positions: List[int] = []
        for feature in features:
            pos = list(feature["position_ids"] if "position_ids" in feature else range(len(feature["input_ids"])))
            lab = list(feature["labels"])
            for j, p in enumerate(pos):
                if p == 0:
                    lab[j] = IGNORE_INDEX  # never predict the first token of an example from the previous one
            ids.extend(feature["input_ids"])
            labels.extend(lab)
            positions.extend(pos)
        as_row = lambda values: torch.tensor([values], dtype=torch.long)  # noqa: E731
        return {"input_ids": as_row(ids), "labels": as_row(labels), "position_ids": as_row(positions)}
