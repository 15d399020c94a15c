"""Normalise one record of a dataset file to chat messages, and validate them.

Formats (``data.sources[].format``) and the fields they read (``columns`` renames them):

- ``alpaca``: ``instruction``, ``input`` (optional, joined to the instruction by a blank line), ``output``
  (the answer), ``system`` (optional), ``history`` (optional list of ``[query, answer]`` pairs, earlier turns).
- ``messages``: ``messages``, a list of ``{role, content}`` with roles system / user / assistant.
- ``sharegpt``: ``conversations``, a list of ``{from, value}`` with human / gpt / system (also user /
  assistant); optional top-level ``system``.
- ``text``: ``text``, plain text for continued pre-training and perplexity.

A conversation is an optional system turn, then user and assistant turns alternating, ending with an
assistant turn (the answer). Leading and trailing whitespace of every turn is removed: the chat template
supplies the separators. Fields given as JSON text (e.g. a ``messages`` column in a CSV file) are parsed.
A number where text is expected is taken as its text (``"input": 5`` -> "5", ``12.5`` -> "12.5");
true/false, a list or an object there is refused.
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Optional, Tuple

from qwenft.chat import END_OF_TEXT, IM_END, IM_START
from qwenft.config import FORMAT_FIELDS, QwenftError
from qwenft.config.data import format_shape

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "system": "system"}
CHAT_ROLES = ("system", "user", "assistant")
CHATML_SPECIALS = (IM_START, IM_END, END_OF_TEXT)  # refused inside a turn's content (:func:`check_conversation`)
TURN_FORMATS = ("messages", "sharegpt")  # FORMAT_FIELDS[fmt][:3]: the list of turns, its role key, its content key
REQUIRED = {fmt: (names[0], names[2]) if fmt == "alpaca" else names[:1] for fmt, names in FORMAT_FIELDS.items()}


class DataError(QwenftError):
    """Bad input data; the message names the file, the line or row (1-based) and the field.

    Attributes:
        reason: what is wrong, without the location.
        file: the file (or dataset id), when known.
        row: the 1-based line (JSONL, CSV, malformed JSON) or row (JSON array, parquet, HF dataset).
        unit: ``"line"`` or ``"row"``: how ``row`` counts.
        field: the field of the record, as the file names it.
    """

    def __init__(self, reason: str, *, file: Optional[str] = None, row: Optional[int] = None,
                 field: Optional[str] = None, unit: str = "row") -> None:
        self.reason, self.file, self.row, self.field, self.unit = reason, file, row, field, unit
        parts = [str(file)] if file else []
        if row is not None:
            parts.append(f"{unit} {row}")
        if field:
            parts.append(f"field '{field}'")
        super().__init__(": ".join(parts + [reason]))

    def located(self, file: str, row: Optional[int], unit: str) -> "DataError":
        """This error with the file and row filled in where they were not known yet."""
        return DataError(self.reason, file=self.file or file, row=self.row if self.row is not None else row,
                         field=self.field, unit=self.unit if self.row is not None else unit)


class JsonFloat(float):
    """A float read from JSON text that remembers how the file wrote it (``text``: "12.50", "1e-7")."""

    text: str


def json_float(text: str) -> float:
    """``json.loads``'s ``parse_float`` for data files: the value, with the file's spelling kept as ``.text`` so
    that a number where text is expected is taken as exactly what the file says (:func:`_string`)."""
    value = JsonFloat(text)
    value.text = text
    return value


def _label(columns: Dict[str, str], name: str) -> str:
    """How the file names the format field ``name`` (``answer (output)`` when renamed)."""
    mapped = columns.get(name, name)
    return mapped if mapped == name else f"{mapped} (as {name})"


def _get(record: Dict[str, Any], columns: Dict[str, str], name: str, required: bool) -> Any:
    key = columns.get(name, name)
    if key not in record:
        if required:
            have = ", ".join(map(str, record)) or "(none)"
            raise DataError(f"missing; the row has fields: {have}", field=_label(columns, name))
        return None
    return record[key]


def _string(value: Any, field: str, required: bool) -> str:
    """The text of a field, stripped: a string as it is, a number as its text (``5`` -> "5", ``12.5`` -> "12.5").

    A float read from JSON text keeps the file's spelling (``12.50`` -> "12.50", ``1e-7`` -> "1e-7", see
    :func:`json_float`); any other float (parquet, a Hugging Face dataset) becomes Python's shortest text that
    reads back as the same value. An integer never gains a ".0". True/false is refused like a list or an object:
    it is rarely meant as text, and "True" would not be what the file says.

    Raises:
        DataError: null where text is required, NaN or infinity, true/false, a list or an object.
    """
    if value is None:
        if required:
            raise DataError("is null; expected text", field=field)
        return ""
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, bool):  # before int: bool is a subclass of int
        raise DataError(f"must be a string, got true/false ({_short(value)}); write \"{str(value).lower()}\" in "
                        "quotes if the text is meant", field=field)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DataError(f"must be a string or a finite number, got {value!r}", field=field)
        return getattr(value, "text", None) or repr(value)
    raise DataError(f"must be a string, got {type(value).__name__} ({_short(value)})", field=field)


def _list(value: Any, field: str) -> list:
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value, parse_float=json_float)
        except json.JSONDecodeError as exc:
            raise DataError(f"is text that is not a valid JSON list ({exc.msg})", field=field) from None
    if not isinstance(value, list):
        raise DataError(f"must be a list, got {type(value).__name__} ({_short(value)})", field=field)
    return value


def describe(value: Any) -> str:
    """What a JSON value is, in words, for an error: ``a one-item list holding an object``, ``a number``, ..."""
    names = {dict: "an object", list: "a list", str: "a text", bool: "true/false", int: "a number",
             float: "a number", type(None): "null"}
    if isinstance(value, (list, tuple)):
        if len(value) == 1:
            return f"a one-item list holding {names.get(type(value[0]), type(value[0]).__name__)}"
        return f"a list of {len(value)} items" if value else "an empty list"
    return names.get(type(value), type(value).__name__)


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _alpaca(record: Dict[str, Any], columns: Dict[str, str]) -> List[Dict[str, str]]:
    label = lambda name: _label(columns, name)  # noqa: E731
    instruction = _string(_get(record, columns, "instruction", True), label("instruction"), True)
    extra = _string(_get(record, columns, "input", False), label("input"), False)
    output = _string(_get(record, columns, "output", True), label("output"), True)
    system = _string(_get(record, columns, "system", False), label("system"), False)
    history = _get(record, columns, "history", False)
    prompt = "\n\n".join(part for part in (instruction, extra) if part)
    if not prompt:
        raise DataError("empty prompt (instruction and input are both empty)", field=label("instruction"))
    if not output:
        raise DataError("empty answer", field=label("output"))
    messages = [{"role": "system", "content": system, "_field": label("system")}] if system else []
    for i, pair in enumerate(_list(history, label("history")) if history is not None else []):
        where = f"{label('history')}[{i}]"
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise DataError(f"must be a [query, answer] pair, got {_short(pair)}", field=where)
        messages.append({"role": "user", "content": _string(pair[0], f"{where}[0]", True), "_field": f"{where}[0]"})
        messages.append({"role": "assistant", "content": _string(pair[1], f"{where}[1]", True),
                         "_field": f"{where}[1]"})
    prompt_field = label("input") if extra and _special(extra) and not _special(instruction) else label("instruction")
    messages.append({"role": "user", "content": prompt, "_field": prompt_field})
    messages.append({"role": "assistant", "content": output, "_field": label("output")})
    return messages


def _turns(record: Dict[str, Any], columns: Dict[str, str], fmt: str, key: str) -> List[Dict[str, str]]:
    list_name, role_name, content_name = FORMAT_FIELDS[fmt][:3]  # the list field, then its turns' two keys
    role_key, content_key = columns.get(role_name, role_name), columns.get(content_name, content_name)
    label = _label(columns, list_name)
    turns = _list(_get(record, columns, list_name, True), label)
    messages: List[Dict[str, str]] = []
    if fmt == "sharegpt":
        system = _string(_get(record, columns, "system", False), _label(columns, "system"), False)
        if system:
            messages.append({"role": "system", "content": system, "_field": _label(columns, "system")})
    for i, turn in enumerate(turns):
        where = f"{label}[{i}]"
        if not isinstance(turn, dict):
            raise DataError(f"must be an object with '{role_key}' and '{content_key}', got {_short(turn)}",
                            field=where)
        for name in (role_key, content_key):
            if name not in turn:
                raise DataError(f"missing; the turn has fields: {', '.join(map(str, turn)) or '(none)'}"
                                f"{_turns_hint(turn, fmt, columns.get(list_name, list_name), key)}",
                                field=f"{where}.{name}")
        role = turn[role_key]
        accepted = CHAT_ROLES if fmt == "messages" else tuple(SHAREGPT_ROLES)
        if role not in accepted:
            raise DataError(f"unknown role {role!r}; accepted: {', '.join(accepted)}", field=f"{where}.{role_key}")
        role = role if fmt == "messages" else SHAREGPT_ROLES[role]
        messages.append({"role": role, "content": _string(turn[content_key], f"{where}.{content_key}", True),
                         "_field": f"{where}.{content_key}", "_role_field": f"{where}.{role_key}"})
    return messages


def _turn_format(turn: Any) -> Optional[str]:
    """The turn format whose role and content keys ``turn`` has (their usual names), else None."""
    for fmt in TURN_FORMATS:
        if isinstance(turn, dict) and all(name in turn for name in FORMAT_FIELDS[fmt][1:3]):
            return fmt
    return None


def _turns_hint(turn: Any, fmt: str, list_key: str, key: str) -> str:
    """``; the turns look like the messages format's (role, content): set ...`` when ``turn`` has the other turn
    format's keys, else ''. ``list_key``: the file's name of the list of turns; ``key``: the source's config key."""
    shape = _turn_format(turn)
    if shape is None or shape == fmt:
        return ""
    name = FORMAT_FIELDS[shape][0]
    columns = f" '{key}.columns={{{name}: {list_key}}}'" if list_key != name else ""
    return (f"; the turns look like the {shape} format's ({', '.join(FORMAT_FIELDS[shape][1:3])}): set "
            f"{key}.format={shape}{columns}")


def field_hint(record: Dict[str, Any], fmt: str, columns: Dict[str, str], key: str) -> str:
    """The way forward for ``record``, which lacks a field format ``fmt`` needs (``key``: the source's config key).

    Returns:
        ``; it looks like the sharegpt format (conversations: [{from, value}]): set data.sources.0.format=sharegpt``
        when the record has another format's fields under their usual names (with a ``columns`` mapping when its
        list holds the other turn format's turns); else ``; map the file's fields ... with
        'data.sources.0.columns={instruction: FIELD, output: FIELD}'`` unless ``columns`` maps them already; or ''.
    """
    for other in FORMAT_FIELDS:
        if other == fmt or not all(name in record for name in REQUIRED[other]):
            continue
        if other in TURN_FORMATS:
            turns = record[REQUIRED[other][0]]
            shape = _turn_format(turns[0] if isinstance(turns, list) and turns else None)
            list_key = REQUIRED[other][0]
            if shape == fmt:  # this format's turns under the other format's list name
                return (f"; its '{list_key}' holds {fmt} turns: map it with "
                        f"'{key}.columns={{{REQUIRED[fmt][0]}: {list_key}}}'")
            if shape is not None and shape != other:  # e.g. "conversations" holding {role, content} turns
                return _turns_hint(turns[0], other, list_key, key)
        return f"; it looks like the {other} format ({format_shape(other)}): set {key}.format={other}"
    mapping = {**columns, **{name: "FIELD" for name in REQUIRED[fmt] if name not in columns}}
    if len(mapping) == len(columns):
        return ""
    return (f"; map the file's fields to the {fmt} format's ({format_shape(fmt)}) with "
            f"'{key}.columns={{{', '.join(f'{name}: {field}' for name, field in mapping.items())}}}'")


def check_conversation(messages: List[Dict[str, str]]) -> List[Dict[str, str]]:
    """Validate turn order and contents; returns the messages as plain ``{role, content}`` dicts.

    Raises:
        DataError: no turns, a system turn after the first, roles that do not alternate user / assistant
            starting with user, a conversation not ending with an assistant turn, an empty user turn or
            answer, or a turn holding a ChatML special token as text (naming the turn, its role and field). The field is the turn's, when the format has one: its role field (``conversations[2].from``,
            ``messages[2].role``) for a turn-order error, its content field for an empty turn.
    """
    fields = [m.get("_field") for m in messages]
    role_fields = [m.get("_role_field") or m.get("_field") for m in messages]
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    if not plain:
        raise DataError("the conversation has no turns")
    start = 1 if plain[0]["role"] == "system" else 0
    for i, message in enumerate(plain[start:], start=start):
        expected = "user" if (i - start) % 2 == 0 else "assistant"
        if message["role"] != expected:
            raise DataError(f"turn {i + 1} has role {message['role']!r} where {expected!r} was expected "
                            "(an optional system turn first, then user and assistant alternating)",
                            field=role_fields[i])
        if not message["content"]:
            what = "empty answer" if expected == "assistant" else "empty user turn"
            raise DataError(what, field=fields[i])
    if len(plain) == start or plain[-1]["role"] != "assistant":
        raise DataError("the conversation must end with an assistant turn (the answer)", field=role_fields[-1])
    for i, message in enumerate(plain):
        special = _special(message["content"])
        if special:
            raise DataError(f"contains the special token {special} as text (turn {i + 1}, {message['role']}); it "
                            "would be read as the token itself, ending or opening a turn: remove or reword it",
                            field=fields[i])
    return plain


def _special(text: str) -> Optional[str]:
    """The first ChatML special token (``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``) written in ``text``."""
    if "<|" not in text:
        return None
    return next((special for special in CHATML_SPECIALS if special in text), None)


def normalise(record: Any, fmt: str, columns: Dict[str, str],
              key: str = "data.sources.N") -> Tuple[List[Dict[str, str]], Optional[str], Dict[str, Any]]:
    """Turn one record into ``(messages, text, meta)``.

    Args:
        record: one row of the file (a dict).
        fmt: ``alpaca`` | ``messages`` | ``sharegpt`` | ``text``.
        columns: format field -> the file's field name.
        key: the source's config key (``data.sources.0``), for the way forward a missing field's error gives.

    Returns:
        ``messages`` (validated ``[{role, content}]``, empty for ``text``), ``text`` (``None`` unless
        ``fmt == "text"``) and ``meta``: the record's other fields (e.g. an id used by ``eval_by``).

    Raises:
        DataError: naming the field (the caller adds file and row). A missing field's error says which format the
            row looks like when it fits another one, else how ``columns`` maps the file's fields (:func:`field_hint`).
    """
    if not isinstance(record, dict):
        raise DataError(f"expected an object (a row with named fields), got {describe(record)}")
    for name in REQUIRED[fmt]:
        if columns.get(name, name) not in record:
            raise DataError(f"missing; the row has fields: {', '.join(map(str, record)) or '(none)'}"
                            f"{field_hint(record, fmt, columns, key)}", field=_label(columns, name))
    used = {columns.get(name, name) for name in top_level_fields(fmt)}
    meta = {k: v for k, v in record.items() if k not in used}
    if fmt == "text":
        text = _string(_get(record, columns, "text", True), _label(columns, "text"), True)
        if not text:
            raise DataError("empty text", field=_label(columns, "text"))
        return [], text, meta
    messages = _alpaca(record, columns) if fmt == "alpaca" else _turns(record, columns, fmt, key)
    return check_conversation(messages), None, meta



def top_level_fields(fmt: str) -> tuple:
    """The fields of a record that format ``fmt`` consumes (the others go to ``meta``): its
    :data:`~qwenft.config.FORMAT_FIELDS` less the role and content keys, which live inside the turns."""
    turn_keys = FORMAT_FIELDS[fmt][1:3] if fmt in TURN_FORMATS else ()
    return tuple(name for name in FORMAT_FIELDS[fmt] if name not in turn_keys)


# The field readers under public names, for the preference formats (:mod:`qwenft.preference.formats`), which read a
# row's fields exactly as the formats above do.
field_label, field_value, text_value, list_value = _label, _get, _string, _list
