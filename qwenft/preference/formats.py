"""Preference rows in the formats people have, read into typed examples: a :class:`PreferencePair` (a prompt as chat
messages, a chosen and a rejected answer) or KTO's :class:`UnpairedExample` (a prompt, one answer, a label).

Formats (``format``) and the fields they read (``columns`` renames them, as for SFT: format field -> the file's):

- ``pairs_alpaca``: ``instruction``, ``input`` (optional, joined to the instruction by a blank line), ``chosen``,
  ``rejected`` (the answers, text), ``system`` (optional).
- ``pairs_sharegpt`` (LLaMA-Factory's ranking data): ``conversations``, a list of ``{from, value}`` turns (human /
  gpt / system, also user / assistant) ending with the user's turn; ``chosen`` and ``rejected``, each one ``{from,
  value}`` turn of the assistant (or its text); ``system`` (optional).
- ``pairs_trl`` (TRL's preference data): ``prompt``, ``chosen``, ``rejected`` as text, or as lists of ``{role,
  content}`` messages. A side may be the answer's turn alone (the ``prompt`` holds the turns before it) or a whole
  conversation ending with the answer (UltraFeedback-binarized: TRL's implicit prompt); the turns before the answer
  must then be the same in ``chosen`` and ``rejected``, and a ``prompt`` beside them must agree with them (the text
  of their last user turn, or the same turns).
- ``hh_rlhf`` (Anthropic HH-RLHF): ``chosen``, ``rejected``: whole transcripts ``"\\n\\nHuman: ...\\n\\nAssistant:
  ..."``. The prompt is what both share up to the last ``"\\n\\nAssistant:"`` of their common beginning, split into
  user / assistant turns (a speaker's consecutive turns joined by a blank line); the rest of each is its answer.
- ``kto`` (LLaMA-Factory's KTO data): ``messages``, a list of ``{role, content}`` ending with the answer, and
  ``label`` (true: a desirable answer, false: an undesirable one).
- ``kto_trl`` (TRL's unpaired data): ``prompt``, ``completion`` (text or message lists, as ``pairs_trl``), ``label``.
- ``auto``: the format whose fields the file's first row has (:func:`detect_format`), used for every row.

A label is true / false, or the text or number that says so in a CSV file (``true``, ``false``, ``1``, ``0``).
Every conversation is checked as SFT checks it (:func:`qwenft.data.formats.check_conversation`: an optional system
turn, user and assistant alternating, no empty turn, no ChatML special token as text); texts are stripped.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple, Union

from qwenft.config.data import PREFERENCE_FIELDS, UNPAIRED_FORMATS  # every field a format reads (columns may map)
from qwenft.data.formats import (CHAT_ROLES, SHAREGPT_ROLES, DataError, check_conversation, describe, field_label,
                                 field_value, list_value, text_value)

REQUIRED = {"pairs_alpaca": ("instruction", "chosen", "rejected"),
            "pairs_sharegpt": ("conversations", "chosen", "rejected"), "pairs_trl": ("chosen", "rejected"),
            "hh_rlhf": ("chosen", "rejected"), "kto": ("messages", "label"),
            "kto_trl": ("prompt", "completion", "label")}
TURN_KEYS = ("from", "value", "role", "content")  # the keys inside a turn, not fields of the row
PREFERENCE_FORMATS = tuple(PREFERENCE_FIELDS) + ("auto",)
HH_HUMAN, HH_ASSISTANT = "\n\nHuman:", "\n\nAssistant:"
_HH_TURN = re.compile(r"\n\n(Human|Assistant):")
_LABELS = {"true": True, "false": False, "1": True, "0": False}

Message = Dict[str, str]


@dataclass
class PreferencePair:
    """One preference pair: two answers to the same prompt, one preferred.

    Attributes:
        prompt: the turns before the answer, ``[{role, content}]`` (an optional system turn, then user and assistant
            alternating, ending with a user turn).
        chosen / rejected: the preferred and the other answer (stripped text, never empty, never equal).
        meta: the row's fields no format field took (e.g. an id).
        file / row / unit: where it was read (``row`` 1-based, counted in ``unit``: ``line`` or ``row``).
        fields: the file's names of ``prompt``, ``chosen`` and ``rejected``, for errors found later (tokenizing).
    """

    prompt: List[Message]
    chosen: str
    rejected: str
    meta: Dict[str, Any] = field(default_factory=dict)
    file: str = ""
    row: int = 0
    unit: str = "row"
    fields: Dict[str, str] = field(default_factory=dict)


@dataclass
class UnpairedExample:
    """KTO's unpaired example: one answer to a prompt, labelled desirable (True) or not (False). Attributes as
    :class:`PreferencePair`, with ``answer`` and ``label`` in place of ``chosen`` and ``rejected``."""

    prompt: List[Message]
    answer: str
    label: bool
    meta: Dict[str, Any] = field(default_factory=dict)
    file: str = ""
    row: int = 0
    unit: str = "row"
    fields: Dict[str, str] = field(default_factory=dict)


Example = Union[PreferencePair, UnpairedExample]


def _turn(turn: Any, where: str, role_key: str, content_key: str, roles: Dict[str, str]) -> Message:
    """One ``{role_key, content_key}`` turn as a message carrying its fields (``_field``, ``_role_field``) for the
    errors :func:`check_conversation` raises; ``roles`` maps the file's roles to system / user / assistant."""
    if not isinstance(turn, dict):
        raise DataError(f"must be an object with '{role_key}' and '{content_key}', got {describe(turn)}", field=where)
    for name in (role_key, content_key):
        if name not in turn:
            other = ("role", "content") if role_key == "from" else ("from", "value")
            hint = (f"; map its keys with columns={{{role_key}: {other[0]}, {content_key}: {other[1]}}}"
                    if all(key in turn for key in other) else "")
            raise DataError(f"missing; the turn has fields: {', '.join(map(str, turn)) or '(none)'}{hint}",
                            field=f"{where}.{name}")
    role = turn[role_key]
    if not isinstance(role, str) or role not in roles:
        raise DataError(f"unknown role {role!r}; accepted: {', '.join(roles)}", field=f"{where}.{role_key}")
    return {"role": roles[role], "content": text_value(turn[content_key], f"{where}.{content_key}", True),
            "_field": f"{where}.{content_key}", "_role_field": f"{where}.{role_key}"}


def _turns(value: Any, where: str, role_key: str, content_key: str, roles: Dict[str, str]) -> List[Message]:
    return [_turn(turn, f"{where}[{i}]", role_key, content_key, roles)
            for i, turn in enumerate(list_value(value, where))]


def _text_turn(value: Any, where: str, role: str) -> Message:
    return {"role": role, "content": text_value(value, where, True), "_field": where}


def _is_turns(value: Any, keys: Tuple[str, str]) -> bool:
    """A list of turns rather than a text: a list, or the JSON text of a list of objects that all have the turn
    ``keys`` (role and content: as a CSV cell holds a list; other text, such as an answer that is JSON code, stays
    text)."""
    if isinstance(value, list):
        return True
    if not (isinstance(value, str) and value.lstrip().startswith("[{")):
        return False
    try:
        parsed = json.loads(value)
    except ValueError:
        return False
    return isinstance(parsed, list) and bool(parsed) and all(isinstance(t, dict) and set(keys) <= set(t)
                                                             for t in parsed)


def _same(a: List[Message], b: List[Message]) -> bool:
    return [(m["role"], m["content"]) for m in a] == [(m["role"], m["content"]) for m in b]


def _differ(first: List[Message], other: List[Message], other_label: str) -> DataError:
    """The error for prompts that differ between two sides, naming the first turn of ``other`` that differs."""
    for i, (a, b) in enumerate(zip(first, other)):
        if (a["role"], a["content"]) != (b["role"], b["content"]):
            return DataError(f"the prompt differs between the answers at turn {i + 1} (before the answer, both must "
                             "hold the same turns)", field=b.get("_field", other_label))
    return DataError(f"the prompt differs between the answers: {len(first)} turns before one answer, {len(other)} "
                     "before the other (both must hold the same turns)", field=other_label)


def _pairs_alpaca(record: Dict[str, Any], columns: Dict[str, str]) -> Tuple[List[Message], List[Message]]:
    label = lambda name: field_label(columns, name)  # noqa: E731
    instruction = text_value(field_value(record, columns, "instruction", True), label("instruction"), True)
    extra = text_value(field_value(record, columns, "input", False), label("input"), False)
    system = text_value(field_value(record, columns, "system", False), label("system"), False)
    prompt = "\n\n".join(part for part in (instruction, extra) if part)
    if not prompt:
        raise DataError("empty prompt (instruction and input are both empty)", field=label("instruction"))
    messages = [{"role": "system", "content": system, "_field": label("system")}] if system else []
    messages.append({"role": "user", "content": prompt, "_field": label("instruction")})
    return messages, [_text_turn(field_value(record, columns, side, True), label(side), "assistant")
                      for side in ("chosen", "rejected")]


def _pairs_sharegpt(record: Dict[str, Any], columns: Dict[str, str]) -> Tuple[List[Message], List[Message]]:
    keys = columns.get("from", "from"), columns.get("value", "value")
    prompt = _turns(field_value(record, columns, "conversations", True), field_label(columns, "conversations"),
                    *keys, SHAREGPT_ROLES)
    system = text_value(field_value(record, columns, "system", False), field_label(columns, "system"), False)
    if system and not (prompt and prompt[0]["role"] == "system"):
        prompt.insert(0, {"role": "system", "content": system, "_field": field_label(columns, "system")})
    answers = []
    for side in ("chosen", "rejected"):
        value, where = field_value(record, columns, side, True), field_label(columns, side)
        answers.append(_turn(value, where, *keys, SHAREGPT_ROLES) if isinstance(value, dict)
                       else _text_turn(value, where, "assistant"))
    return prompt, answers


def _trl(record: Dict[str, Any], columns: Dict[str, str],
         sides: Tuple[str, ...]) -> Tuple[List[Message], List[Message]]:
    """The prompt and the answers of TRL's preference (``sides``: chosen, rejected) or unpaired (completion) row."""
    keys, roles = (columns.get("role", "role"), columns.get("content", "content")), {r: r for r in CHAT_ROLES}
    values = [field_value(record, columns, side, True) for side in sides]
    labels = [field_label(columns, side) for side in sides]
    prompt_value = field_value(record, columns, "prompt", False)
    prompt_label = field_label(columns, "prompt")
    lists = [_is_turns(v, keys) for v in values]
    if len(set(lists)) > 1:
        raise DataError(f"{' and '.join(sides)} must both be text or both be message lists", field=labels[-1])
    if not lists[0]:
        answers = [_text_turn(v, where, "assistant") for v, where in zip(values, labels)]
        implicit: List[Message] = []
    else:
        turns = [_turns(v, where, *keys, roles) for v, where in zip(values, labels)]
        for side_turns, where in zip(turns, labels):
            if not side_turns:
                raise DataError("an empty list; expected the answer's turn (the conversation's last)", field=where)
        answers = [side_turns[-1] for side_turns in turns]
        implicit = turns[0][:-1]
        for side_turns, where in zip(turns[1:], labels[1:]):
            if not _same(implicit, side_turns[:-1]):
                raise _differ(implicit, side_turns[:-1], where)
    if not implicit:
        if prompt_value is None:
            hint = ("; the answers look like HH-RLHF transcripts: set format=hh_rlhf"
                    if isinstance(values[0], str) and HH_ASSISTANT in values[0] else "")
            raise DataError(f"missing; the row has fields: {', '.join(map(str, record))}{hint}", field=prompt_label)
        return (_turns(prompt_value, prompt_label, *keys, roles) if _is_turns(prompt_value, keys)
                else [_text_turn(prompt_value, prompt_label, "user")]), answers
    if prompt_value is not None:  # beside an implicit prompt, it must say the same (TRL would ignore it)
        if _is_turns(prompt_value, keys):
            given = _turns(prompt_value, prompt_label, *keys, roles)
            agrees = _same(given, implicit)
        else:
            users = [m["content"] for m in implicit if m["role"] == "user"]
            agrees = bool(users) and text_value(prompt_value, prompt_label, False) == users[-1]
        if not agrees:
            raise DataError(f"differs from the turns before the answer in {labels[0]} (the prompt the answers "
                            "carry); remove it or make them agree", field=prompt_label)
    return implicit, answers


def _hh_rlhf(record: Dict[str, Any], columns: Dict[str, str]) -> Tuple[List[Message], List[Message]]:
    labels = [field_label(columns, side) for side in ("chosen", "rejected")]
    texts = []
    for side, where in zip(("chosen", "rejected"), labels):
        value = field_value(record, columns, side, True)
        if not isinstance(value, str):
            raise DataError(f"must be a transcript (text), got {describe(value)}", field=where)
        texts.append(value if value.startswith("\n\n") else "\n\n" + value.lstrip())  # "Human: ..." first allowed
    if texts[0] == texts[1]:
        raise DataError("chosen and rejected are the same transcript; a pair needs two different answers",
                        field=labels[1])
    end = os.path.commonprefix(texts).rfind(HH_ASSISTANT)
    if end < 0:
        raise DataError(f"no {HH_ASSISTANT.strip()!r} in the part both transcripts share: HH-RLHF transcripts are "
                        "'\\n\\nHuman: ...\\n\\nAssistant: ...' and differ only in the last answer", field=labels[0])
    for text, where in zip(texts, labels):
        if HH_HUMAN in text[end:]:
            raise DataError("the prompt differs between chosen and rejected: the transcripts part before their "
                            f"last {HH_ASSISTANT.strip()!r} turn (both must hold the same turns)", field=where)
    parts = _HH_TURN.split(texts[0][:end])  # text before the first turn, then (speaker, text) pairs
    if parts[0].strip():
        raise DataError(f"text before the first {HH_HUMAN.strip()!r} turn: {parts[0].strip()[:40]!r}",
                        field=labels[0])
    prompt: List[Message] = []
    for speaker, text in zip(parts[1::2], parts[2::2]):
        role = "user" if speaker == "Human" else "assistant"
        if prompt and prompt[-1]["role"] == role:  # a speaker's turns one after another: one turn
            prompt[-1]["content"] = f"{prompt[-1]['content']}\n\n{text.strip()}".strip()
        else:
            prompt.append({"role": role, "content": text.strip(), "_field": labels[0]})
    return prompt, [_text_turn(text[end + len(HH_ASSISTANT):], where, "assistant")
                    for text, where in zip(texts, labels)]


def _label_value(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if isinstance(value, (str, int)) else None
    if text not in _LABELS:
        raise DataError(f"must be true or false (a desirable answer or not), got {describe(value)} "
                        f"({str(value)[:40]!r})", field=where)
    return _LABELS[text]


def detect_format(record: Dict[str, Any], columns: Dict[str, str]) -> str:
    """The preference format ``record`` (one row of the file, a dict) has the fields of (mapped through
    ``columns``): ``kto`` / ``kto_trl`` when it has a label, else by what holds the answers' prompt:
    ``pairs_sharegpt`` (conversations), ``pairs_alpaca`` (instruction), ``pairs_trl`` (prompt, or chosen as message
    lists), ``hh_rlhf`` (chosen as a transcript).

    Raises:
        DataError: no format's fields, naming the fields the row has and the formats (with ``format=`` to set).
    """
    has = lambda *names: all(columns.get(name, name) in record for name in names)  # noqa: E731
    if has("label"):
        for fmt in UNPAIRED_FORMATS:
            if has(*REQUIRED[fmt]):
                return fmt
    elif has("chosen", "rejected"):
        for fmt, name in (("pairs_sharegpt", "conversations"), ("pairs_alpaca", "instruction"),
                          ("pairs_trl", "prompt")):
            if has(name):
                return fmt
        chosen = record[columns.get("chosen", "chosen")]
        if _is_turns(chosen, (columns.get("role", "role"), columns.get("content", "content"))):
            return "pairs_trl"
        if isinstance(chosen, str) and HH_ASSISTANT.strip() in chosen:
            return "hh_rlhf"
    shapes = "; ".join(f"{fmt} ({', '.join(REQUIRED[fmt])})" for fmt in PREFERENCE_FIELDS)
    raise DataError(f"cannot tell the preference format from the row's fields ({', '.join(map(str, record))}); "
                    f"set format= one of: {shapes}, with columns= to map other field names")


_READERS = {"pairs_alpaca": _pairs_alpaca, "pairs_sharegpt": _pairs_sharegpt, "hh_rlhf": _hh_rlhf,
            "pairs_trl": lambda record, columns: _trl(record, columns, ("chosen", "rejected")),
            "kto": None, "kto_trl": lambda record, columns: _trl(record, columns, ("completion",))}


def normalise_preference(record: Any, fmt: str, columns: Dict[str, str]) -> Example:
    """Turn one row into a :class:`PreferencePair` or (``kto``, ``kto_trl``) an :class:`UnpairedExample`, validated.

    Args:
        record: one row of the file (a dict).
        fmt: a preference format (not ``auto``: :func:`detect_format` first).
        columns: format field -> the file's field name.

    Returns:
        The example, its ``file`` and ``row`` not yet set (the reader sets them).

    Raises:
        DataError: naming the field (the caller adds file and row): a missing field, a wrong type, an empty prompt or
            answer, chosen == rejected, prompts that differ between chosen and rejected, an answer that is not the
            assistant's, a turn order SFT would refuse, a label that is not true / false.
    """
    if not isinstance(record, dict):
        raise DataError(f"expected an object (a row with named fields), got {describe(record)}")
    for name in REQUIRED[fmt]:
        field_value(record, columns, name, True)  # a missing field first, naming what the row has
    used = {columns.get(name, name) for name in PREFERENCE_FIELDS[fmt] if name not in TURN_KEYS}
    meta = {k: v for k, v in record.items() if k not in used}
    if fmt == "kto":
        keys = columns.get("role", "role"), columns.get("content", "content")
        turns = _turns(field_value(record, columns, "messages", True), field_label(columns, "messages"), *keys,
                       {r: r for r in CHAT_ROLES})
        prompt, answers = turns[:-1], turns[-1:]
        if not turns:
            raise DataError("an empty list; expected a conversation ending with the answer",
                            field=field_label(columns, "messages"))
    else:
        prompt, answers = _READERS[fmt](record, columns)
    for answer in answers:
        if answer["role"] != "assistant":
            raise DataError(f"must be the assistant's answer (the conversation's last turn), got role "
                            f"{answer['role']!r}", field=answer.get("_role_field") or answer["_field"])
    if prompt and prompt[-1]["role"] != "user":  # the answers answer the user's last turn
        raise DataError(f"the turns before the answer must end with the user's, got {prompt[-1]['role']!r}",
                        field=prompt[-1].get("_role_field") or prompt[-1].get("_field"))
    plain = [check_conversation(prompt + [answer]) for answer in answers]
    fields = {"prompt": (prompt[-1].get("_field") if prompt else None) or field_label(columns, "prompt"),
              **{name: answer.get("_field", "") for name, answer in zip(("chosen", "rejected"), answers)}}
    if fmt in UNPAIRED_FORMATS:
        label = _label_value(field_value(record, columns, "label", True), field_label(columns, "label"))
        return UnpairedExample(prompt=plain[0][:-1], answer=plain[0][-1]["content"], label=label, meta=meta,
                               fields={"prompt": fields["prompt"], "answer": fields["chosen"]})
    chosen, rejected = (p[-1]["content"] for p in plain)
    if chosen == rejected:
        raise DataError("chosen and rejected are the same answer; a pair needs two different answers",
                        field=fields["rejected"])
    return PreferencePair(prompt=plain[0][:-1], chosen=chosen, rejected=rejected, meta=meta, fields=fields)
