"""Preference data, read and tokenized: rows of a file (:mod:`qwenft.preference.formats` for the formats) -> typed
examples -> token ids, the prompt shared token for token by both answers of a pair.

- :class:`PreferenceSource`: a file (``.json``, ``.jsonl``, ``.csv``, ``.parquet``, read by SFT's readers,
  :func:`qwenft.data.read.records`: streamed, UTF-8, errors naming file and line) or a Hugging Face dataset id, its
  ``format`` and ``columns``.
- :func:`read_preference`: the valid rows as :class:`~qwenft.preference.formats.PreferencePair` /
  :class:`~qwenft.preference.formats.UnpairedExample`; a bad row (:class:`~qwenft.data.formats.DataError` naming
  file, row and field) raises (``on_bad_row="error"``) or is skipped and counted (``"skip"``), as SFT's reader.
- :func:`encode_preference`: the prompt rendered by the model's chat template once, through SFT's own cut
  (:class:`qwenft.data.render.TemplateCache`: the pieces :func:`qwenft.data.template.cut` gives, so the prompt is
  token for token SFT's and the sampler's), then each answer with its end-of-turn token (``<|im_end|>``); the
  template's newline after it is not part of the answer. An answer longer than ``max_seq_len - len(prompt)`` tokens
  is truncated to that budget (``overlong="truncate"``, counted; never emptied: an empty completion gives NaN in
  TRL, trl #6548) or the pair dropped (``"drop"``, counted). A prompt that leaves no room for an answer, or a pair
  whose answers are the same within the budget, is a bad row: raised under ``on_bad_row="error"``, else dropped
  and counted.

Not wired into training or ``qwenft data`` yet (issue 45, a later stage): no cache, no mixing, no held-out rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

from qwenft.config import ConfigError, DataSource
from qwenft.data.formats import DataError
from qwenft.data.read import records
from qwenft.data.render import TemplateCache
from qwenft.data.template import IGNORE_INDEX, tokenize_texts, with_system
from qwenft.preference.formats import (PREFERENCE_FIELDS, PREFERENCE_FORMATS, Example, PreferencePair, detect_format,
                                       normalise_preference)

KEPT_REASONS = 20  # messages of skipped or dropped rows kept in full; the rest are only counted


@dataclass
class PreferenceSource:
    """A file (or Hugging Face dataset id) of preference rows.

    Attributes:
        name: how the source is called in messages.
        path: the file (relative to the directory the command runs from) or a dataset id.
        format: one of :data:`~qwenft.preference.formats.PREFERENCE_FORMATS` (``auto``: detected on the first row).
        columns: format field -> the file's name for it (``{chosen: better, rejected: worse}``).
        max_rows: read only the first N valid rows (None: all).
        subset / split: of a Hugging Face dataset.

    Raises:
        ConfigError: an unknown format, a ``columns`` key that is not a field of the format, no path, ``max_rows``
            below 1; the message names the key.
    """

    name: str = "pairs"
    path: str = ""
    format: str = "auto"
    columns: Dict[str, str] = field(default_factory=dict)
    max_rows: Optional[int] = None
    subset: Optional[str] = None
    split: str = "train"

    def __post_init__(self) -> None:
        key = f"preference source {self.name}"
        if self.format not in PREFERENCE_FORMATS:
            raise ConfigError(f"{key}: format={self.format!r} is not accepted; choose one of: "
                              f"{', '.join(PREFERENCE_FORMATS)}")
        known = (PREFERENCE_FIELDS[self.format] if self.format != "auto"
                 else tuple(dict.fromkeys(name for names in PREFERENCE_FIELDS.values() for name in names)))
        for name in self.columns:
            if name not in known:
                raise ConfigError(f"{key}: columns.{name} is not accepted; {name!r} is not a field of the "
                                  f"{self.format} format; its fields: {', '.join(known)}")
        if not self.path:
            raise ConfigError(f"{key}: path must be set (a .json, .jsonl, .csv or .parquet file)")
        if self.max_rows is not None and self.max_rows < 1:
            raise ConfigError(f"{key}: max_rows={self.max_rows!r} is not accepted; a positive integer or null")


@dataclass
class PreferenceRead:
    """What :func:`read_preference` read.

    Attributes:
        examples: the valid rows in file order (pairs, or unpaired examples for ``kto`` / ``kto_trl``).
        format: the format read (the detected one under ``auto``; ``auto`` when no row could tell).
        skipped: messages of the first :data:`KEPT_REASONS` bad rows skipped; n_skipped: all of them.
        file / unit: the file named in messages and how its rows count (``line`` or ``row``).
    """

    examples: List[Example]
    format: str
    skipped: List[str]
    n_skipped: int
    file: str
    unit: str


def read_preference(source: PreferenceSource, *, on_bad_row: str = "error") -> PreferenceRead:
    """Read the rows of ``source`` into typed examples (the first ``max_rows`` valid ones, in file order).

    Args:
        source: the file, its format and column mapping.
        on_bad_row: ``error`` raises at the first bad row; ``skip`` drops it and counts it.

    Returns:
        A :class:`PreferenceRead`; every example's ``file``, ``row`` and ``unit`` are set.

    Raises:
        DataError: naming the file, the line or row and the field: a missing file, malformed JSON or CSV, a row
            :func:`~qwenft.preference.formats.normalise_preference` refuses (chosen == rejected, an empty answer,
            prompts that differ between chosen and rejected, a missing field), no row telling the format under
            ``auto``; a file of no rows; with ``skip``, every row skipped (naming the first).
    """
    if on_bad_row not in ("error", "skip"):
        raise ConfigError(f"on_bad_row={on_bad_row!r} is not accepted; choose one of: error, skip")
    # SFT's readers take a DataSource: the file, the dataset's subset / split, and max_rows (which streams a dataset)
    rows, unit, file = records(DataSource(name=source.name, path=source.path, max_rows=source.max_rows,
                                          subset=source.subset, split=source.split))
    fmt = source.format
    out = PreferenceRead(examples=[], format=fmt, skipped=[], n_skipped=0, file=file, unit=unit)
    for number, record in rows:
        try:
            if isinstance(record, DataError):
                raise record
            if fmt == "auto" and isinstance(record, dict):  # the first row tells the format of them all
                fmt = out.format = detect_format(record, source.columns)
            example = normalise_preference(record, fmt, source.columns)  # a row that is no object: refused first
        except DataError as exc:
            error = exc.located(file, number, unit)
            if on_bad_row == "error":
                raise error from None
            out.n_skipped += 1
            if len(out.skipped) < KEPT_REASONS:
                out.skipped.append(str(error))
            continue
        example.file, example.row, example.unit = file, number, unit
        out.examples.append(example)
        if source.max_rows is not None and len(out.examples) >= source.max_rows:
            break
    if not (out.examples or out.n_skipped):
        raise DataError("no rows; a preference source needs at least one row", file=file)
    if not out.examples:
        raise DataError(f"all {out.n_skipped} rows were skipped as bad (first: {out.skipped[0]})", file=file)
    return out


@dataclass
class EncodedPair:
    """A pair's token ids: ``prompt_ids`` ``[prompt]`` (the chat template's generation prompt), ``chosen_ids``
    ``[chosen]`` and ``rejected_ids`` ``[rejected]`` (each answer's content and its end-of-turn token, unless
    truncated); ``len(prompt_ids) + len(each answer) <= max_seq_len`` tokens. ``truncated``: an answer was cut;
    ``file`` / ``row`` / ``unit``: where the row was read."""

    prompt_ids: List[int]
    chosen_ids: List[int]
    rejected_ids: List[int]
    truncated: bool = False
    file: str = ""
    row: int = 0
    unit: str = "row"

    def sequences(self) -> Dict[str, List[int]]:
        """``chosen_input_ids`` / ``rejected_input_ids`` (the prompt, then the answer) and ``chosen_labels`` /
        ``rejected_labels`` (``-100`` over the prompt, the answer's ids after it), each ``[prompt + answer]``."""
        masked = [IGNORE_INDEX] * len(self.prompt_ids)
        return {"chosen_input_ids": self.prompt_ids + self.chosen_ids, "chosen_labels": masked + self.chosen_ids,
                "rejected_input_ids": self.prompt_ids + self.rejected_ids,
                "rejected_labels": masked + self.rejected_ids}


@dataclass
class EncodedUnpaired:
    """KTO's example as token ids: ``prompt_ids`` ``[prompt]``, ``completion_ids`` ``[completion]`` (the answer
    and its end-of-turn token, unless truncated) and ``label`` (True: desirable); the rest as :class:`EncodedPair`."""

    prompt_ids: List[int]
    completion_ids: List[int]
    label: bool
    truncated: bool = False
    file: str = ""
    row: int = 0
    unit: str = "row"

    def sequences(self) -> Dict[str, List[int]]:
        """``input_ids`` (prompt, then completion) and ``labels`` (``-100`` over the prompt), ``[prompt +
        completion]`` each."""
        return {"input_ids": self.prompt_ids + self.completion_ids,
                "labels": [IGNORE_INDEX] * len(self.prompt_ids) + self.completion_ids}


Encoded = Union[EncodedPair, EncodedUnpaired]


@dataclass
class PreferenceCounts:
    """What :func:`encode_preference` kept: ``pairs`` (examples encoded: pairs, or KTO's unpaired examples),
    ``truncated`` (of those, the ones with an answer cut to the budget), ``dropped`` (examples left out: a prompt
    with no room for an answer, answers equal within the budget, ``overlong="drop"``); ``reasons``: the first
    :data:`KEPT_REASONS` drops' messages (file, row, field)."""

    pairs: int = 0
    truncated: int = 0
    dropped: int = 0
    reasons: List[str] = field(default_factory=list)


def _prompt_and_answer(pieces: Sequence[Tuple[str, bool]], prompt_chars: int) -> Tuple[List[str], str]:
    """The prompt's pieces (the first ``prompt_chars`` characters) and the answer's piece after them, from
    :func:`qwenft.data.template.cut`'s pieces of a conversation ending with the answer."""
    chars = k = 0
    while chars < prompt_chars and k < len(pieces):
        chars, k = chars + len(pieces[k][0]), k + 1
    if chars != prompt_chars or k >= len(pieces) or not pieces[k][1]:
        raise DataError("the chat template does not render the answer as a piece of its own after the prompt")
    return [text for text, _ in pieces[:k]], pieces[k][0]


def tokenize_example(example: Example, tokenizer, *, max_seq_len: int, system_prompt: Optional[str] = None,
                     overlong: str = "truncate", cutter: Optional[TemplateCache] = None) -> Optional[Encoded]:
    """Tokenize one pair (or unpaired example): the prompt once, each answer after it (see the module docstring).

    Args:
        example: a :class:`PreferencePair` or an :class:`UnpairedExample`.
        tokenizer: the model's tokenizer (its chat template renders the prompt).
        max_seq_len: tokens of the prompt plus one answer, at most.
        system_prompt: a system turn for prompts that have none (None: the template's default), as SFT's.
        overlong: ``truncate`` cuts an answer to ``max_seq_len - len(prompt)`` tokens; ``drop`` returns None.
        cutter: the run's template cache (None: a new one).

    Returns:
        An :class:`EncodedPair` / :class:`EncodedUnpaired`, or None (dropped under ``overlong="drop"``).

    Raises:
        DataError: naming the field, without file and row (the caller adds them): the prompt alone takes
            ``max_seq_len`` tokens or more; chosen and rejected the same within the budget; a ChatML special token
            as text; a chat template that renders the prompt differently before the two answers.
    """
    cutter = cutter or TemplateCache()
    pair = isinstance(example, PreferencePair)
    answers = [example.chosen, example.rejected] if pair else [example.answer]
    prompt = with_system([{"role": m["role"], "content": m["content"]} for m in example.prompt], system_prompt)
    prompt_texts: Optional[List[str]] = None
    answer_texts: List[str] = []
    for answer in answers:
        texts, answer_text = _prompt_and_answer(*cutter(tokenizer, prompt + [{"role": "assistant", "content": answer}],
                                                        "last_assistant"))
        if prompt_texts is not None and texts != prompt_texts:
            raise DataError("the chat template renders the prompt differently before the two answers",
                            field=example.fields.get("prompt"))
        prompt_texts = texts
        answer_texts.append(answer_text)
    ids = tokenize_texts(tokenizer, prompt_texts + answer_texts)
    prompt_ids = [token for piece in ids[:len(prompt_texts)] for token in piece]
    answer_ids = ids[len(prompt_texts):]
    budget = max_seq_len - len(prompt_ids)
    if budget < 1:
        raise DataError(f"the prompt alone is {len(prompt_ids)} tokens and max_seq_len is {max_seq_len}: no room for "
                        "an answer; raise max_seq_len or shorten the prompt (on_bad_row=skip drops such rows, "
                        "counted)", field=example.fields.get("prompt"))
    truncated = any(len(answer) > budget for answer in answer_ids)
    if truncated and overlong == "drop":
        return None
    answer_ids = [answer[:budget] for answer in answer_ids]
    where = dict(truncated=truncated, file=example.file, row=example.row, unit=example.unit)
    if not pair:
        return EncodedUnpaired(prompt_ids=prompt_ids, completion_ids=answer_ids[0], label=example.label, **where)
    if answer_ids[0] == answer_ids[1]:
        raise DataError(f"chosen and rejected are the same in their first {budget} tokens, all that max_seq_len "
                        f"{max_seq_len} leaves after the prompt's {len(prompt_ids)}; raise max_seq_len",
                        field=example.fields.get("rejected"))
    return EncodedPair(prompt_ids=prompt_ids, chosen_ids=answer_ids[0], rejected_ids=answer_ids[1], **where)


def encode_preference(examples: Iterable[Example], tokenizer, *, max_seq_len: int,
                      system_prompt: Optional[str] = None, overlong: str = "truncate",
                      on_bad_row: str = "error") -> Tuple[List[Encoded], PreferenceCounts]:
    """Tokenize examples (:func:`tokenize_example`, one template cache for them all) and count what was kept.

    Args:
        examples: from :func:`read_preference`.
        tokenizer, max_seq_len, system_prompt, overlong: as :func:`tokenize_example`.
        on_bad_row: ``error`` raises at the first example that cannot be encoded; ``skip`` drops it, counted.

    Returns:
        ``(encoded, counts)``: the encoded examples in order, and a :class:`PreferenceCounts`.

    Raises:
        DataError: with ``on_bad_row="error"``, the first example :func:`tokenize_example` refuses, naming its file,
            row and field.
        ConfigError: an ``overlong`` or ``on_bad_row`` value that is not accepted.
    """
    if overlong not in ("truncate", "drop") or on_bad_row not in ("error", "skip"):
        raise ConfigError(f"overlong={overlong!r}, on_bad_row={on_bad_row!r} are not accepted; overlong: truncate or "
                          "drop, on_bad_row: error or skip")
    cutter = TemplateCache()
    encoded: List[Encoded] = []
    counts = PreferenceCounts()
    for example in examples:
        try:
            item = tokenize_example(example, tokenizer, max_seq_len=max_seq_len, system_prompt=system_prompt,
                                    overlong=overlong, cutter=cutter)
        except DataError as exc:
            error = exc.located(example.file, example.row, example.unit)
            if on_bad_row == "error":
                raise error from None
            counts.dropped += 1
            if len(counts.reasons) < KEPT_REASONS:
                counts.reasons.append(str(error))
            continue
        if item is None:
            counts.dropped += 1
            continue
        encoded.append(item)
        counts.pairs += 1
        counts.truncated += int(item.truncated)
    return encoded, counts


def load_preference(source: PreferenceSource, tokenizer, *, max_seq_len: int, system_prompt: Optional[str] = None,
                    overlong: str = "truncate",
                    on_bad_row: str = "error") -> Tuple[List[Encoded], PreferenceCounts, PreferenceRead]:
    """:func:`read_preference` then :func:`encode_preference` with the same ``on_bad_row``.

    Returns:
        ``(encoded, counts, read)``: ``read.n_skipped`` rows were refused while read, ``counts.dropped`` while
        tokenized.

    Raises:
        DataError: see :func:`read_preference` and :func:`encode_preference`.
    """
    read = read_preference(source, on_bad_row=on_bad_row)
    encoded, counts = encode_preference(read.examples, tokenizer, max_seq_len=max_seq_len,
                                        system_prompt=system_prompt, overlong=overlong, on_bad_row=on_bad_row)
    return encoded, counts, read
