"""Packing and batching, in one place: whether and how examples are packed (:func:`packing_of`, decided once from
the config and carried by the bundle), the packed rows (:func:`pack`, :func:`pack_examples`), and the Trainer's
collator built from that decision (:func:`collator`): right padding, labels padded by position, packed rows with
restarting positions, or one flattened row for flash-attention. Packed rows are offset arrays over the examples
(:class:`PackedDataset`), gathered from the memory map when the Trainer asks for a row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from qwenft.config import Config, QwenftError
from qwenft.data.template import IGNORE_INDEX


@dataclass(frozen=True)
class Packing:
    """How the training examples become rows and batches (see :func:`packing_of`).

    Attributes:
        packed: examples are concatenated into rows of at most ``max_len`` tokens, each row carrying
            ``position_ids`` that restart at 0 for every example (:class:`PackedDataset`).
        flatten: the collator concatenates a whole batch into one row ``[1, tokens]`` (:class:`DataCollator`).
        max_len: the length of a packed row (tokens); None unpacked.
    """

    packed: bool = False
    flatten: bool = False
    max_len: Optional[int] = None


def packing_of(config: Config) -> Packing:
    """The packing of ``config``'s training data: packed with ``data.packing`` into rows of ``data.max_seq_len``,
    and flattened into one row per batch when packed on ``model.attn_implementation=flash_attention_2`` (which
    honours packed boundaries only in a batch of one row, read from ``position_ids``)."""
    packed = config.data.packing
    return Packing(packed=packed, flatten=packed and config.model.attn_implementation == "flash_attention_2",
                   max_len=config.data.max_seq_len if packed else None)


def pack_offsets(lengths: Sequence[int], max_len: int, window: int = 16):
    """Group examples into rows of at most ``max_len`` tokens, as offset arrays.

    First fit over the ``window`` most recently opened rows, in the given (shuffled) order, so the mix
    stays spread over the rows. Every example must fit (``lengths[i] <= max_len``).

    Args:
        lengths: ``[examples]`` token counts (a list or a numpy array).

    Returns:
        ``(offsets, members)``, numpy int64: row ``r`` holds the examples ``members[offsets[r]:offsets[r + 1]]``
        (ascending); ``offsets`` is ``[rows + 1]``, ``members`` ``[examples]``.
    """
    import numpy as np

    lengths = np.asarray(lengths, dtype=np.int64).tolist()  # Python ints: the loop below is scalar work
    row_of: List[int] = []
    room: List[int] = []
    for length in lengths:
        start = max(0, len(room) - window)
        for r in range(start, len(room)):
            if room[r] >= length:
                room[r] -= length
                row_of.append(r)
                break
        else:
            row_of.append(len(room))
            room.append(max_len - length)
    rows = np.asarray(row_of, dtype=np.int64)
    offsets = np.zeros(len(room) + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=len(room)), out=offsets[1:])
    return offsets, np.argsort(rows, kind="stable")  # stable: a row's examples stay in their order


def pack(lengths: Sequence[int], max_len: int, window: int = 16) -> List[List[int]]:
    """:func:`pack_offsets` as lists: the rows, each a list of example indices."""
    offsets, members = pack_offsets(lengths, max_len, window)
    return [members[a:b].tolist() for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]


class PackedDataset:
    """Packed training rows gathered from the examples on demand (a map-style dataset for the Trainer): only the
    offset arrays of :func:`pack_offsets` are held; row ``r`` reads its members' ids and labels from ``examples``
    (memory-mapped) when it is asked for.

    Items: ``{"input_ids", "labels", "position_ids"}``, lists ``[row_len]``; the examples concatenated in order,
    ``position_ids`` restarting at 0 for each, the first label of each example -100 (it would be predicted from the
    previous example; the same as transformers' ``DataCollatorWithFlattening`` separator).

    Args:
        examples: a ``datasets.Dataset`` with ``input_ids`` and ``labels`` (an indices mapping is fine).
        lengths: ``[examples]`` their token counts.
        max_len: the longest row (tokens).

    Raises:
        IndexError: a row number out of range (``__getitem__``).
    """

    column_names = ["input_ids", "labels", "position_ids"]

    def __init__(self, examples, lengths: Sequence[int], max_len: int) -> None:
        self.examples = examples.with_format("arrow", columns=["input_ids", "labels"])
        self.offsets, self.members = pack_offsets(lengths, max_len)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, r: int) -> Dict[str, List[int]]:
        import numpy as np
        import pyarrow.compute as pc

        n = len(self)
        r = int(r) + n if int(r) < 0 else int(r)
        if not 0 <= r < n:
            raise IndexError(f"packed row {r} of {n}")
        table = self.examples[self.members[self.offsets[r]:self.offsets[r + 1]].tolist()]
        sizes = np.asarray(pc.list_value_length(table.column("input_ids")), dtype=np.int64)
        ids = np.asarray(pc.list_flatten(table.column("input_ids")), dtype=np.int64)
        labels = np.asarray(pc.list_flatten(table.column("labels")), dtype=np.int64)
        starts = np.cumsum(sizes) - sizes
        labels[starts[sizes > 0]] = IGNORE_INDEX
        positions = np.arange(len(ids), dtype=np.int64) - np.repeat(starts, sizes)
        return {"input_ids": ids.tolist(), "labels": labels.tolist(), "position_ids": positions.tolist()}


def pack_examples(examples, max_len: int, lengths: Optional[Sequence[int]] = None) -> PackedDataset:
    """The examples of a ``datasets.Dataset`` (``input_ids``, ``labels``) packed into rows of at most ``max_len``
    tokens (:func:`pack_offsets`), in their order: a :class:`PackedDataset` (rows ``input_ids``, ``labels``,
    ``position_ids`` restarting at 0 for each example; the first label of every example -100).

    Args:
        lengths: the examples' token counts when known (else read from the ``input_ids`` column, whole).
    """
    import pyarrow.compute as pc

    if lengths is None:
        column = examples.with_format("arrow", columns=["input_ids"])[:]["input_ids"]
        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    return PackedDataset(examples, lengths, max_len)


def collator(bundle, tokenizer) -> "DataCollator":
    """The Trainer's collator for ``bundle`` (a :class:`~qwenft.data.DataBundle`), as its ``packing`` says."""
    return DataCollator(tokenizer, flatten=bundle.packing.flatten)


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
        tokenizer: gives ``pad_token_id`` (or that id itself, an int).
        flatten: concatenate the whole batch into one row ``[1, total_tokens]`` with restarting
            ``position_ids`` and no padding (padding-free, as transformers' ``DataCollatorWithFlattening``);
            use it with ``attn_implementation=flash_attention_2``. The first label of every example is set
            to ``-100`` so no token is trained to predict across a boundary.

    Raises:
        QwenftError: the tokenizer has no pad token.
    """

    def __init__(self, tokenizer, *, flatten: bool = False) -> None:
        pad = tokenizer if isinstance(tokenizer, int) else getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            raise QwenftError("the tokenizer has no pad token; load it with qwenft.model.load_tokenizer")
        self.pad_token_id = int(pad)
        self.flatten = flatten

    def __call__(self, features: Sequence[Dict[str, Sequence[int]]]) -> Dict[str, "object"]:
        import torch

        if not features:
            raise ValueError("DataCollator got an empty batch")
        if self.flatten:
            return self._flatten(features)
        packed = "position_ids" in features[0]
        longest = max(len(f["input_ids"]) for f in features)
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
