"""The preference trainer's collator (:mod:`qwenft.train.preference`): a batch of pairs (or KTO examples) as
``2B`` sequences, padded or padding-free, with any mixed-in SFT rows laid out apart."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch

from qwenft.data.collate import DataCollator
from qwenft.data.template import IGNORE_INDEX


class PreferenceCollator:
    """Preference rows -> one batch of ``2B`` sequences (module docstring).

    Pairs (``prompt_ids``, ``chosen_ids``, ``rejected_ids``): prompt + chosen for every pair, then prompt + rejected.
    KTO examples (``prompt_ids``, ``completion_ids``, ``label``): prompt + answer for every example, then prompt
    ``i`` + answer ``i - 1`` (the KL estimate's mismatched pairs; a batch of one pairs its prompt with its own
    answer); ``label`` ``[B]`` bool. Precomputed reference log-probs (``ref_chosen_logps`` / ``ref_rejected_logps``
    columns) are passed through as ``[B]`` tensors.

    Returns per batch: ``input_ids``, ``labels`` (-100 over prompts and padding), ``seq_ids`` (which sequence a token
    belongs to, -1 for padding), ``n_seqs``, ``pairs`` (``B``), and ``attention_mask`` (padded, ``[2B, longest]``,
    right padding) or ``position_ids`` (padding-free, ``[1, all tokens]``); none of these when the batch holds no
    pair. SFT rows (non-empty ``input_ids`` / ``labels`` columns, :func:`is_sft_row`) are laid out apart, right-padded
    by SFT's :class:`qwenft.data.collate.DataCollator`:
    ``sft_input_ids``, ``sft_labels``, ``sft_attention_mask`` ``[S, longest]``; ``sft_rows`` (``S``, 0 without any).
    """

    def __init__(self, pad_token_id: int, padding_free: bool, unpaired: bool = False) -> None:
        self.pad, self.padding_free, self.unpaired = pad_token_id, padding_free, unpaired

    def sequences(self, features: Sequence[Dict[str, Any]]) -> List[tuple]:
        """``(input_ids, labels)`` of every preference sequence, in batch order (SFT rows left out)."""
        features = [f for f in features if not is_sft_row(f)]
        out = []
        if self.unpaired:
            answers = [f["completion_ids"] for f in features]
            mismatched = answers[-1:] + answers[:-1]
            parts = [(f["prompt_ids"], a) for f, a in zip(features, answers)] + \
                [(f["prompt_ids"], a) for f, a in zip(features, mismatched)]
        else:
            parts = [(f["prompt_ids"], f["chosen_ids"]) for f in features] + \
                [(f["prompt_ids"], f["rejected_ids"]) for f in features]
        for prompt, answer in parts:
            out.append((list(prompt) + list(answer), [IGNORE_INDEX] * len(prompt) + list(answer)))
        return out

    def __call__(self, features: Sequence[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
        sft = [f for f in features if is_sft_row(f)]
        features = [f for f in features if not is_sft_row(f)]
        batch: Dict[str, torch.Tensor] = {"sft_rows": torch.tensor(len(sft))}
        if sft:  # padded as SFT's batches are
            rows = DataCollator(self.pad)([{"input_ids": f["input_ids"], "labels": f["labels"]} for f in sft])
            batch.update({f"sft_{name}": rows[name] for name in ("input_ids", "labels", "attention_mask")})
        batch["pairs"] = torch.tensor(len(features))
        if not features:
            return batch
        seqs = self.sequences(features)
        batch["n_seqs"] = torch.tensor(len(seqs))
        if self.padding_free:
            ids = [t for s, _ in seqs for t in s]
            batch["input_ids"] = torch.tensor([ids], dtype=torch.long)
            batch["labels"] = torch.tensor([[t for _, lab in seqs for t in lab]], dtype=torch.long)
            batch["position_ids"] = torch.tensor([[p for s, _ in seqs for p in range(len(s))]], dtype=torch.long)
            batch["seq_ids"] = torch.tensor([[k for k, (s, _) in enumerate(seqs) for _ in s]], dtype=torch.long)
        else:
            width = max(len(s) for s, _ in seqs)
            pad = lambda values, fill: values + [fill] * (width - len(values))  # noqa: E731
            batch["input_ids"] = torch.tensor([pad(s, self.pad) for s, _ in seqs], dtype=torch.long)
            batch["labels"] = torch.tensor([pad(lab, IGNORE_INDEX) for _, lab in seqs], dtype=torch.long)
            batch["attention_mask"] = torch.tensor([pad([1] * len(s), 0) for s, _ in seqs], dtype=torch.long)
            batch["seq_ids"] = torch.tensor([pad([k] * len(s), -1) for k, (s, _) in enumerate(seqs)],
                                            dtype=torch.long)
        if self.unpaired:
            batch["label"] = torch.tensor([bool(f["label"]) for f in features], dtype=torch.bool)
        for name in ("ref_chosen_logps", "ref_rejected_logps"):
            if all(name in f for f in features):
                batch[name] = torch.tensor([float(f[name]) for f in features], dtype=torch.float32)
        return batch


def is_sft_row(feature: Dict[str, Any]) -> bool:
    """Whether a training row is an SFT row mixed into a preference run (its ``input_ids`` column filled; a pair's or
    KTO example's is empty, :mod:`qwenft.preference.pipeline`)."""
    return bool(feature.get("input_ids"))
