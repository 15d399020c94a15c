"""Config section of the training data (``data``): its sources, lengths, masking and mixing settings."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from qwenft.config.base import _check, _check_choice


# The fields each data format reads; ``data.sources[].columns`` maps them onto the file's own field names. For
# messages and sharegpt the first three are the list of turns, then the role and content keys of a turn.
FORMAT_FIELDS = {
    "alpaca": ("instruction", "input", "output", "system", "history"),
    "messages": ("messages", "role", "content"),
    "sharegpt": ("conversations", "from", "value", "system"),
    "text": ("text",),
}
# Preference formats (qwenft.preference.formats: pairs for DPO / IPO / SimPO / ORPO, labelled answers for KTO) and
# the fields each reads; ``preference`` detects the format on the first row.
PREFERENCE_FIELDS = {
    "pairs_alpaca": ("instruction", "input", "chosen", "rejected", "system"),
    "pairs_sharegpt": ("conversations", "from", "value", "chosen", "rejected", "system"),
    "pairs_trl": ("prompt", "chosen", "rejected", "role", "content"),
    "hh_rlhf": ("chosen", "rejected"),
    "kto": ("messages", "role", "content", "label"),
    "kto_trl": ("prompt", "completion", "label", "role", "content"),
}
PREFERENCE_AUTO = "preference"
UNPAIRED_FORMATS = ("kto", "kto_trl")
FILE_TYPES = ("json", "jsonl", "csv", "tsv", "parquet", "txt", "arrow")  # given as format=: a file type, not a shape


def is_preference(fmt: str) -> bool:
    """Whether ``fmt`` (a source's ``format``) is a preference format (or ``preference``, detected)."""
    return fmt in PREFERENCE_FIELDS or fmt == PREFERENCE_AUTO


def source_fields(fmt: str) -> tuple:
    """The fields ``columns`` may map for a source of format ``fmt`` (for ``preference``: every preference
    format's)."""
    if fmt == PREFERENCE_AUTO:
        return tuple(dict.fromkeys(name for names in PREFERENCE_FIELDS.values() for name in names))
    return FORMAT_FIELDS.get(fmt) or PREFERENCE_FIELDS[fmt]


def format_shape(fmt: str) -> str:
    """The fields a row of format ``fmt`` needs, in words: ``instruction, output``, ``messages: [{role, content}]``,
    ``conversations: [{from, value}]``, ``text`` (the optional ones left out)."""
    fields = FORMAT_FIELDS[fmt]
    if fmt in ("messages", "sharegpt"):
        return f"{fields[0]}: [{{{fields[1]}, {fields[2]}}}]"
    return f"{fields[0]}, {fields[2]}" if fmt == "alpaca" else fields[0]


@dataclass
class DataSource:
    """One dataset of the training mix (see ``qwenft.data``).

    ``eval_by``: a field of the file's rows (e.g. ``fact``); when set, the ``eval_rows`` held out are
    spread over its distinct values (one row per value before a second one), instead of drawn at random.
    ``replace``: placeholder name -> text; every ``{{name}}`` in the rows' texts is replaced before use.
    ``max_rows``: read only the first N rows that pass the read's checks, in file order: rows refused while read
    (malformed, a missing field, ``data.on_bad_row=skip``) are not counted and the read goes on past them; rows
    lost later, when tokenized (no supervised token, ``overlong=drop``), are counted, so fewer than N may be
    usable; ``eval_rows`` is held out of these N.
    """

    name: str = "source"
    path: str = ""
    format: str = "alpaca"
    columns: Dict[str, str] = field(default_factory=dict)
    weight: float = 1.0
    max_rows: Optional[int] = None
    eval_rows: int = 0
    subset: Optional[str] = None
    split: str = "train"
    eval_by: Optional[str] = None
    replace: Dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(str(self.format).lower().lstrip(".") not in FILE_TYPES, f"data.sources[{self.name}].format", self.format,
               "the file type comes from the path's extension (.json, .jsonl, .csv, .parquet); format is the shape of "
               f"its rows, one of: {'; '.join(f'{k} ({format_shape(k)})' for k in FORMAT_FIELDS)}; for preference "
               f"training: {', '.join(PREFERENCE_FIELDS)} or {PREFERENCE_AUTO} (detected)")
        _check_choice(f"data.sources[{self.name}].format", self.format,
                      (*FORMAT_FIELDS, *PREFERENCE_FIELDS, PREFERENCE_AUTO))
        for key, value in self.replace.items():
            _check(re.fullmatch(r"[^\W\d]\w*", str(key)) is not None and isinstance(value, str),
                   f"data.sources[{self.name}].replace.{key}", value,
                   "needs a placeholder name (letters, digits, _) and a text: replace={name: Ada} fills {{name}}")
        for key in self.columns:  # keys: the format's field names; values: the file's
            _check(key in source_fields(self.format), f"data.sources[{self.name}].columns.{key}", self.columns[key],
                   f"{key!r} is not a field of the {self.format} format; the keys allowed are its fields: "
                   f"{', '.join(source_fields(self.format))} (columns={{FIELD: the file's name for it}})")
        _check(self.weight >= 0, f"data.sources[{self.name}].weight", self.weight, "must be >= 0")
        _check(self.max_rows is None or self.max_rows > 0, f"data.sources[{self.name}].max_rows", self.max_rows,
               "must be a positive integer or null")
        _check(self.eval_rows >= 0, f"data.sources[{self.name}].eval_rows", self.eval_rows, "must be >= 0")
        _check(bool(self.path) and self.path != "???", f"data.sources[{self.name}].path", self.path,
               "must be set: data.sources.N.path=FILE (N: the source's index, from 0)")


@dataclass
class DataConfig:
    """The training data: sources mixed by weight, templated, tokenized and masked."""

    sources: List[DataSource] = field(default_factory=list)
    max_seq_len: int = 1024
    overlong: str = "truncate"
    packing: bool = False
    train_on: str = "assistant"
    system_prompt: Optional[str] = None
    on_bad_row: str = "error"
    seed: int = 0
    num_proc: int = 1
    cache: bool = True

    def __post_init__(self) -> None:
        _check(self.max_seq_len >= 8, "data.max_seq_len", self.max_seq_len, "must be >= 8 tokens")
        _check_choice("data.overlong", self.overlong, ("truncate", "drop"))
        _check_choice("data.train_on", self.train_on, ("assistant", "last_assistant", "all"))
        _check_choice("data.on_bad_row", self.on_bad_row, ("error", "skip"))
        _check(self.num_proc >= 1, "data.num_proc", self.num_proc, "must be >= 1")
        if self.sources:
            names = [s.name for s in self.sources]
            _check(len(set(names)) == len(names), "data.sources.name", names, "source names must be distinct")
