"""The raw records of a data file, streamed: a file is read a block at a time and never held whole.

- JSON Lines: line by line (blank lines skipped, a byte-order mark at the start of any line removed).
- A JSON array: its elements decoded one after another from a sliding window of the text
  (``json.JSONDecoder.raw_decode`` at each element's start); only the window (:data:`BLOCK` characters plus one
  element) is held. A file whose first value is an object followed by more is JSON Lines under a ``.json`` name.
- CSV: ``csv.DictReader`` over the file's lines, decoded one at a time; parquet: record batches of
  :data:`BATCH_ROWS` rows.

Every text is UTF-8; bytes that are not are refused naming the file, line, byte offset and column, as
:func:`decode_utf8` says. Records come as ``(row, record or DataError)``: the 1-based line (JSON Lines, CSV) or
element / row (JSON array, parquet) and the record, or the error of that one line (a malformed JSON line, which
``data.on_bad_row=skip`` may skip; a CSV row with a misplaced quote too). An error of the file as a whole
(malformed JSON array, a CSV quoted field never closed, non-UTF-8 bytes outside JSON Lines) is raised.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Optional, Tuple

from qwenft.data.formats import DataError, describe, json_float

Record = Tuple[int, Any]  # (1-based line/row, the record, or a DataError for that line)
BOM = b"\xef\xbb\xbf"  # the UTF-8 byte-order mark some editors write first: not content
BLOCK = 4 << 20  # bytes read at a time (JSON arrays)
BATCH_ROWS = 10_000  # parquet rows converted to Python at a time
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")  # a \uD800-\uDFFF escape: half of a UTF-16 pair, or all of one


def unparsable(exc: BaseException) -> Optional[str]:
    """What a value the JSON reader gave up on holds, for the errors :mod:`json` raises beside
    ``JSONDecodeError``: nesting deeper than Python's recursion limit, an integer longer than Python converts
    (``sys.get_int_max_str_digits``); None for any other error."""
    if isinstance(exc, RecursionError):
        return "nested too deeply (lists or objects inside each other beyond Python's recursion limit)"
    if isinstance(exc, ValueError) and not isinstance(exc, json.JSONDecodeError) and "digits" in str(exc):
        return f"an integer too long to read ({exc})"
    return None


def lone_surrogate(value: Any, raw: str, row: int, file: str, unit: str) -> Optional[DataError]:
    """A DataError where ``value`` (decoded from ``raw``) holds a ``\\uD800``-``\\uDFFF`` escape that is not half
    of a surrogate pair: a character no UTF-8 text can hold (Arrow refuses it); None otherwise. ``raw`` is only
    searched for such an escape, so the common case costs one regex scan."""
    if not _SURROGATE.search(raw):
        return None
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        return DataError(f"a \\u{ord(exc.object[exc.start]):04x} escape is half of a UTF-16 surrogate pair, not "
                         f"a character: write the character itself, or the escapes of the whole pair",
                         file=file, row=row, unit=unit)
    return None
_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace


def decode_utf8(data: bytes, file: str, *, offset: int = 0, line: int = 1, column: int = 1) -> str:
    """Decode ``data``, a part of ``file`` starting at byte ``offset``, line ``line`` and byte column ``column``
    (both 1-based), as UTF-8.

    Raises:
        DataError: a byte sequence that is not UTF-8, naming the file, its line, the byte value and its byte
            offset in the file (0-based) and column (1-based, in bytes).
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad_line = line + data[: exc.start].count(b"\n")
        newline = data.rfind(b"\n", 0, exc.start)
        bad_column = exc.start - newline if newline >= 0 else column + exc.start
        raise DataError(f"not UTF-8 text: byte 0x{data[exc.start]:02x} at byte offset {offset + exc.start} "
                        f"(column {bad_column}); re-save the file as UTF-8", file=file, row=bad_line,
                        unit="line") from None


def open_file(path: Path, file: str) -> BinaryIO:
    """``path`` opened for reading bytes.

    Raises:
        DataError: it cannot be read (permissions, a vanished file), naming ``file``.
    """
    try:
        return open(path, "rb")
    except OSError as exc:
        raise DataError(f"cannot be read ({exc.strerror or type(exc).__name__})", file=file) from None


def _lines(path: Path, file: str) -> Iterator[Tuple[int, int, bytes]]:
    """``(line number, byte offset, bytes)`` of each line of ``path`` with its ``\\n`` (the last may lack it), a
    byte-order mark at the start of the file removed (the offset then counts it)."""
    with open_file(path, file) as handle:
        offset = 0
        for number, raw in enumerate(handle, start=1):
            start, offset = offset, offset + len(raw)
            if number == 1 and raw.startswith(BOM):
                raw, start = raw[len(BOM):], start + len(BOM)
            yield number, start, raw


def jsonl_records(path: Path, file: str) -> Iterator[Record]:
    """The records of a JSON Lines file, one per non-blank line (see the module docstring)."""
    for number, start, raw in _lines(path, file):
        if raw.startswith(BOM):  # JSON Lines files concatenated with their byte-order marks
            raw, start = raw[len(BOM):], start + len(BOM)
        if not raw.strip():
            continue
        try:
            line = decode_utf8(raw, file, offset=start, line=number).rstrip("\r\n")  # columns count the line only
            record = json.loads(line, parse_float=json_float)
            if not isinstance(record, dict):
                raise DataError(f"expected a JSON object, got {describe(record)}", file=file, row=number,
                                unit="line")
            bad = lone_surrogate(record, line, number, file, "line")
            if bad is not None:
                raise bad
        except DataError as exc:
            yield number, exc
            continue
        except json.JSONDecodeError as exc:
            if "\r" in line and exc.msg == "Extra data":  # CR-only line ends: the whole file is one line to Python
                yield number, DataError(f"the lines end in a carriage return (\\r) only, so the file reads as one "
                                        f"line holding {line.count(chr(13)) + 1} JSON values; re-save it with LF "
                                        "(or CRLF) line endings", file=file, row=number, unit="line")
                continue
            yield number, DataError(f"malformed JSON: {exc.msg} (column {exc.colno})", file=file, row=number,
                                    unit="line")
            continue
        except (RecursionError, ValueError) as exc:
            if unparsable(exc) is None:
                raise
            yield number, DataError(f"malformed JSON: {unparsable(exc)}", file=file, row=number, unit="line")
            continue
        yield number, record


class _Window:
    """The text of a UTF-8 file as a window ``text`` that grows a block at a time (:meth:`more`) and drops what was
    read (:meth:`drop`), with the line and column of ``text[0]`` kept for the messages."""

    def __init__(self, path: Path, file: str) -> None:
        self.file, self.text, self.eof = file, "", False
        self.handle = open_file(path, file)
        self.pending = self.handle.read(len(BOM))
        self.offset = len(BOM) if self.pending == BOM else 0  # file offset of the next byte decoded
        self.pending = b"" if self.offset else self.pending
        self.byte_line, self.byte_column = 1, 1  # where the next byte decoded is
        self.line, self.column = 1, 0  # line of text[0], characters of that line before it

    def more(self) -> bool:
        """Decode the next block onto ``text``; False at the end of the file (nothing added)."""
        part = b""
        while not (part or self.eof):
            data = self.pending + self.handle.read(BLOCK)
            self.eof = len(data) == len(self.pending)  # nothing more was read
            cut = len(data) if self.eof else _char_boundary(data)
            part, self.pending = data[:cut], data[cut:]
        if not part:
            return False
        self.text += decode_utf8(part, self.file, offset=self.offset, line=self.byte_line, column=self.byte_column)
        self.offset += len(part)
        newline = part.rfind(b"\n")
        self.byte_line += part.count(b"\n")
        self.byte_column = len(part) - newline if newline >= 0 else self.byte_column + len(part)
        if self.eof:
            self.handle.close()
        return True

    def skip_space(self, pos: int) -> int:
        """The position of the next non-whitespace character at or after ``pos`` (``len(text)`` at the end)."""
        while True:
            pos = _SPACE.match(self.text, pos).end()
            if pos < len(self.text) or not self.more():
                return pos

    def value(self, decoder: json.JSONDecoder, pos: int) -> Tuple[Any, int]:
        """The JSON value starting at ``pos`` and the position after it, reading more text while it is cut short.

        Raises:
            DataError: malformed JSON, naming the line and column.
        """
        while True:
            try:
                value, end = decoder.raw_decode(self.text, pos)
                if end < len(self.text) or not self.more():  # a number or name ending the window may go on
                    return value, end
            except json.JSONDecodeError as exc:
                # A value cut by the window's end fails at (or a few characters before) that end, or in a string
                # with no closing quote yet; any other failure is in the text itself.
                cut = exc.msg.startswith("Unterminated string") or exc.pos >= len(self.text) - 6
                if not (cut and self.more()):
                    raise self.error(exc.msg, exc.pos) from None
            except (RecursionError, ValueError) as exc:  # after JSONDecodeError, a ValueError itself
                if unparsable(exc) is None:
                    raise
                raise self.error(str(unparsable(exc)), pos) from None

    def error(self, message: str, pos: int) -> DataError:
        """``malformed JSON: MESSAGE (column C)`` at ``text[pos]``, naming its line."""
        exc = json.JSONDecodeError(message, self.text, min(pos, len(self.text)))
        column = exc.colno + (self.column if exc.lineno == 1 else 0)
        return DataError(f"malformed JSON: {message} (column {column})", file=self.file,
                         row=self.line + exc.lineno - 1, unit="line")

    def drop(self, pos: int) -> int:
        """Forget ``text[:pos]`` once it is over a block long; returns where ``pos`` now is."""
        if pos < BLOCK:
            return pos
        gone = self.text[:pos]
        newline = gone.rfind("\n")
        self.line += gone.count("\n")
        self.column = pos - newline - 1 if newline >= 0 else self.column + pos
        self.text = self.text[pos:]
        return 0


def _char_boundary(data: bytes) -> int:
    """The length of the longest prefix of ``data`` that does not end inside a UTF-8 character."""
    i = len(data) - 1
    while i >= 0 and len(data) - i <= 4 and 0x80 <= data[i] < 0xC0:  # continuation bytes
        i -= 1
    if i < 0 or data[i] < 0xC0:
        return len(data)
    needed = 2 if data[i] < 0xE0 else 3 if data[i] < 0xF0 else 4  # the lead byte's character length
    return i if i + needed > len(data) else len(data)


def json_records(path: Path, file: str) -> Tuple[Iterator[Record], str]:
    """The records of a ``.json`` file: the elements of its top-level array (unit ``row``), or its lines when it is
    JSON Lines (unit ``line``).

    Raises:
        DataError: not UTF-8, an empty file, or the file is one object or another value than an array; malformed
            JSON is raised by the iterator when it is reached (naming line and column).
    """
    window = _Window(path, file)
    decoder = json.JSONDecoder(parse_float=json_float)
    pos = window.skip_space(0)
    first = window.text[pos:pos + 1]
    if first == "{":
        value, end = window.value(decoder, pos)
        if window.skip_space(end) < len(window.text):  # more after one object: JSON Lines
            window.handle.close()
            return jsonl_records(path, file), "line"
        raise DataError(f"expected a JSON array of objects (or JSON Lines); got an object with keys: "
                        f"{', '.join(list(value)[:8])}", file=file)
    if first != "[":
        if not first:
            raise DataError("no rows (the file is empty or all whitespace)", file=file)
        value, end = window.value(decoder, pos)
        if window.skip_space(end) < len(window.text):
            raise window.error("Extra data", window.skip_space(end))
        raise DataError(f"expected a JSON array of objects, got {type(value).__name__}", file=file)
    return _elements(window, decoder, pos + 1), "row"


def _elements(window: _Window, decoder: json.JSONDecoder, pos: int) -> Iterator[Record]:
    """The elements of the array whose ``[`` ends just before ``pos``, numbered from 1; then nothing but
    whitespace may follow its ``]``."""
    number = 0
    pos = window.skip_space(pos)
    if window.text[pos:pos + 1] == "]":
        pos += 1
    else:
        while True:
            start = pos
            value, pos = window.value(decoder, pos)
            number += 1
            bad = lone_surrogate(value, window.text[start:pos], number, window.file, "row")
            yield number, (value if bad is None else bad)
            pos = window.drop(window.skip_space(pos))
            found = window.text[pos:pos + 1]
            if found == "]":
                pos += 1
                break
            if found != ",":
                raise window.error("Expecting ',' delimiter", pos)
            pos = window.skip_space(pos + 1)
    pos = window.skip_space(pos)
    if pos < len(window.text):
        raise window.error("Extra data", pos)


def csv_records(path: Path, file: str) -> Iterator[Record]:
    """The records of a CSV file with a header line: each a ``{column: text}`` dict, its row the line it starts on.

    Quoting is read strictly: a quote inside an unquoted-then-quoted field (``"a"b``) makes that row a bad row
    (skippable). A quoted field that is never closed swallows every line after it, so nothing past its opening
    row can be told apart: it is raised, even with ``data.on_bad_row=skip``, naming the row it opens on.

    A row of more or fewer cells than the header is a bad row saying both counts.

    Raises (when reached):
        DataError: a quoted field never closed (naming the line of its row and the lines it swallowed), malformed
            CSV in the header line, a header naming a column twice, or bytes that are not UTF-8.
    """
    text = (decode_utf8(raw, file, offset=start, line=number) for number, start, raw in _lines(path, file))
    reader = csv.DictReader(text, strict=True)
    lines = reader.reader  # DictReader.line_num is stale after an error; the reader's own count is not
    try:
        reader.fieldnames  # reads the header line
    except csv.Error as exc:
        raise DataError(f"malformed CSV in the header line: {_csv_reason(exc)}", file=file, row=lines.line_num or 1,
                        unit="line") from None
    header = reader.fieldnames or []
    twice = sorted({name for name in header if header.count(name) > 1})
    if twice:
        raise DataError(f"the header line names {', '.join(repr(name) for name in twice)} more than once; each "
                        "column needs its own name (a row's later cell would silently win)", file=file,
                        row=lines.line_num, unit="line")
    line = lines.line_num
    while True:
        start = line + 1
        try:
            record = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            if "unexpected end of data" in str(exc):
                raise DataError(f"a quoted field of the row starting here is never closed: it runs to the end of "
                                f"the file (line {lines.line_num}), so lines {start}-{lines.line_num} cannot be read "
                                "as rows (data.on_bad_row=skip cannot skip them); close the quote (a \" inside a "
                                "quoted field is written \"\")", file=file, row=start, unit="line") from None
            line = lines.line_num
            yield start, DataError(f"malformed CSV: {_csv_reason(exc)}", file=file, row=start, unit="line")
            continue
        line = lines.line_num
        if None in record or None in record.values():  # more cells than the header names, or fewer
            cells = len(header) + len(record.get(None, ())) - sum(v is None for k, v in record.items() if k is not None)
            yield start, DataError(f"the row has {cells} cell{'s' * (cells != 1)} where the header has {len(header)} "
                                   f"({', '.join(header)})", file=file, row=start, unit="line")
            continue
        yield start, record


def _csv_reason(exc: Exception) -> str:
    """The csv module's message, without its hint about opening the file (the file is read line by line)."""
    message = str(exc)
    if message.startswith("new-line character seen in unquoted field"):
        return "a carriage return (\\r) inside an unquoted field: lines end in CR only; re-save with LF or CRLF"
    return message


def parquet_records(path: Path, file: str) -> Iterator[Record]:
    """The rows of a parquet file as dicts, :data:`BATCH_ROWS` converted at a time.

    Raises:
        DataError: not a readable parquet file.
    """
    import pyarrow.parquet as pq

    try:
        reader: Optional[pq.ParquetFile] = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt or non-parquet file
        raise DataError(f"not a readable parquet file ({type(exc).__name__}: {str(exc).splitlines()[0]})",
                        file=file) from None
    return _batches(reader.iter_batches(batch_size=BATCH_ROWS))


def _batches(batches) -> Iterator[Record]:
    number = 0
    for batch in batches:
        for record in batch.to_pylist():
            number += 1
            yield number, record
