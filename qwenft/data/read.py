"""Read a data source (a local .json / .jsonl / .csv / .parquet file or a Hugging Face dataset id) into
normalised rows ``{"messages": [...], "text": str | None, "meta": {...}, "source": name, "row": int}``.

A relative path is resolved against the directory the command runs from. :func:`read_text` is the one
reader of every text file qwenft takes (data, prompts, ``eval.ppl_sources``): UTF-8, a leading byte-order mark
removed, bytes that are not UTF-8 refused naming the file, line and byte offset. Row numbers are 1-based: the
line for JSONL and CSV, the element for a JSON array, the row for parquet and Hugging Face datasets.
"""

from __future__ import annotations

import csv
import io
import json
import logging
from pathlib import Path
from typing import Any, Iterator, List, Optional, Set, Tuple

from qwenft.config import DataSource
from qwenft.data.checks import fill
from qwenft.data.formats import DataError, describe, json_float, normalise

log = logging.getLogger(__name__)

FILE_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")
Record = Tuple[int, Any]  # (1-based line/row, the record, or a DataError for that line)


def resolve_path(path: str) -> Path:
    """``path`` with ``~`` expanded, relative to the current directory when it is not absolute."""
    resolved = Path(path).expanduser()
    return resolved if resolved.is_absolute() else Path.cwd() / resolved


def near_file(path: str) -> str:
    """``; did you mean NAME?`` naming a data file beside ``path`` (resolved, :func:`resolve_path`) whose name is
    close to its name (a typo such as ``qa.cvs`` for ``qa.csv``), else ''."""
    import difflib

    resolved = resolve_path(path)
    try:
        names = [p.name for p in resolved.parent.iterdir() if p.suffix.lower() in FILE_SUFFIXES + (".txt",)]
    except OSError:  # no such folder, or not readable
        return ""
    match = difflib.get_close_matches(resolved.name, names, n=1, cutoff=0.75)
    return f"; did you mean {Path(path).with_name(match[0])}?" if match else ""


def looks_local(path: str) -> bool:
    """A file path rather than a Hugging Face dataset id (``name`` or ``owner/name``)."""
    data_suffixes = FILE_SUFFIXES + (".txt", ".tsv", ".gz", ".zip", ".arrow", ".xlsx")
    return (path.lower().endswith(data_suffixes) or path.startswith((".", "/", "~", "\\")) or path.count("/") > 1
            or ":\\" in path)


BOM = b"\xef\xbb\xbf"  # the UTF-8 byte-order mark some editors write first: not content


def decode_utf8(data: bytes, file: str, *, offset: int = 0, line: int = 1) -> str:
    """Decode ``data``, a part of ``file`` starting at byte ``offset`` and line ``line`` (1-based), as UTF-8.

    Raises:
        DataError: a byte sequence that is not UTF-8, naming the file, its line, the byte value and its byte
            offset in the file (0-based) and column (1-based, in bytes).
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad_line = line + data[: exc.start].count(b"\n")
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise DataError(f"not UTF-8 text: byte 0x{data[exc.start]:02x} at byte offset {offset + exc.start} "
                        f"(column {column}); re-save the file as UTF-8", file=file, row=bad_line,
                        unit="line") from None


def file_bytes(path: str) -> Tuple[bytes, int]:
    """The bytes of the local file ``path`` (see :func:`resolve_path`) without a leading byte-order mark.

    Returns:
        ``(data, offset)``: ``offset`` is 3 when a BOM was removed, else 0 (the file offset of ``data[0]``).

    Raises:
        DataError: no such file, a directory, or unreadable (permissions), naming the file.
    """
    resolved = resolve_path(path)
    if not resolved.exists():
        raise DataError(f"no such file (resolved to {resolved}; relative paths are resolved against the "
                        f"directory the command runs from, {Path.cwd()}){near_file(path)}", file=path)
    if resolved.is_dir():
        raise DataError("is a directory; expected a file", file=path)
    try:
        data = resolved.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot be read ({exc.strerror or type(exc).__name__})", file=path) from None
    return (data[len(BOM):], len(BOM)) if data.startswith(BOM) else (data, 0)


def read_text(path: str) -> str:
    """The text of a UTF-8 file: the one reader of every text file qwenft takes (data files, prompts files,
    ``eval.ppl_sources``). A leading byte-order mark is removed; nothing else is changed.

    Raises:
        DataError: see :func:`file_bytes` and :func:`decode_utf8` (file, line and byte offset named).
    """
    data, offset = file_bytes(path)
    return decode_utf8(data, path, offset=offset)


def _jsonl(data: bytes, file: str, offset: int = 0) -> Iterator[Record]:
    start = offset  # file offset of the current line, for the not-UTF-8 message
    for number, raw in enumerate(data.split(b"\n"), start=1):
        line_start, start = start, start + len(raw) + 1
        if raw.startswith(BOM):  # JSON Lines files concatenated with their byte-order marks
            raw, line_start = raw[len(BOM):], line_start + len(BOM)
        if not raw.strip():
            continue
        try:
            line = decode_utf8(raw, file, offset=line_start, line=number)
            record = json.loads(line, parse_float=json_float)
            if not isinstance(record, dict):
                raise DataError(f"expected a JSON object, got {describe(record)}", file=file, row=number,
                                unit="line")
        except DataError as exc:
            yield number, exc
            continue
        except json.JSONDecodeError as exc:
            yield number, DataError(f"malformed JSON: {exc.msg} (column {exc.colno})", file=file, row=number,
                                    unit="line")
            continue
        yield number, record


def _json(data: bytes, file: str, offset: int) -> Tuple[Iterator[Record], str]:
    text = decode_utf8(data, file, offset=offset)
    try:
        value = json.loads(text, parse_float=json_float)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data" and text.lstrip().startswith("{"):
            return _jsonl(data, file, offset), "line"  # JSON Lines saved under a .json name
        raise DataError(f"malformed JSON: {exc.msg} (column {exc.colno})", file=file, row=exc.lineno,
                        unit="line") from None
    if isinstance(value, dict):
        raise DataError(f"expected a JSON array of objects (or JSON Lines); got an object with keys: "
                        f"{', '.join(list(value)[:8])}", file=file)
    if not isinstance(value, list):
        raise DataError(f"expected a JSON array of objects, got {type(value).__name__}", file=file)
    return iter(enumerate(value, start=1)), "row"


def _csv(data: bytes, file: str, offset: int) -> Iterator[Record]:
    reader = csv.DictReader(io.StringIO(decode_utf8(data, file, offset=offset), newline=""))
    try:
        reader.fieldnames  # reads the header line
        line = reader.line_num
        for record in reader:
            start, line = line + 1, reader.line_num
            if None in record:
                yield start, DataError(f"has {len(record) - 1 + len(record[None])} fields, the header "
                                       f"{len(reader.fieldnames)}", file=file, row=start, unit="line")
                continue
            yield start, {k: v for k, v in record.items() if v is not None}
    except csv.Error as exc:
        raise DataError(f"malformed CSV: {exc}", file=file, row=reader.line_num, unit="line") from None


def _parquet(path: Path, file: str) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt or non-parquet file
        raise DataError(f"not a readable parquet file ({type(exc).__name__}: {str(exc).splitlines()[0]})",
                        file=file) from None
    return iter(enumerate(table.to_pylist(), start=1))


def _hub(source: DataSource) -> Iterator[Record]:
    import datasets

    try:
        dataset = datasets.load_dataset(source.path, source.subset, split=source.split)
    except Exception as exc:  # offline cache miss, unknown id, bad split: all reported the same way
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"no such local file (resolved to {resolve_path(source.path)}), and not loadable as a "
                        f"Hugging Face dataset id (subset={source.subset}, split={source.split}): {reason}"
                        f"{near_file(source.path)}", file=source.path) from None
    return iter(enumerate(dataset, start=1))


def records(source: DataSource) -> Tuple[Iterator[Record], str, str]:
    """Iterate the raw records of ``source``.

    Returns:
        ``(records, unit, file)``: an iterator of ``(row, record or DataError)``, how rows count (``line``
        or ``row``) and the file name to report.

    Raises:
        DataError: the path does not exist, has an unsupported suffix, is not UTF-8, is malformed as a whole
            (a JSON file), or names no loadable dataset.
    """
    local = looks_local(source.path) or resolve_path(source.path).exists()
    if not local:
        return _hub(source), "row", source.path
    path = resolve_path(source.path)
    file = str(source.path)
    if path.is_dir():
        raise DataError(f"is a directory; expected a file ending in {', '.join(FILE_SUFFIXES)}", file=file)
    if not path.is_file():
        file_bytes(file)  # raises: no such file
    suffix = path.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise DataError(f"unsupported file type {suffix or '(none)'!r}; use {', '.join(FILE_SUFFIXES)}", file=file)
    if suffix == ".parquet":
        return _parquet(path, file), "row", file
    data, offset = file_bytes(file)
    if suffix == ".jsonl":
        return _jsonl(data, file, offset), "line", file
    if suffix == ".csv":
        return _csv(data, file, offset), "line", file
    iterator, unit = _json(data, file, offset)
    return iterator, unit, file


def read_rows(source: DataSource, on_bad_row: str = "error", index: Optional[int] = None,
              notes: Optional[List[str]] = None) -> Tuple[List[dict], List[str], str]:
    """:func:`read_source` with more detail; ``index``: the source's place in ``data.sources``, for the overrides
    a missing field's error suggests (``data.sources.N.format=...``).

    Every text of a record gets ``source.replace`` filled in first (``{{name}}`` -> its value). ``notes`` collects
    the warnings logged (a ``replace`` key no row holds).

    Returns:
        ``(rows, skipped, unit)``: the normalised rows, the messages of skipped bad rows (``on_bad_row=skip``)
        and how ``row`` counts (``line`` or ``row``).

    Raises:
        DataError: see :func:`read_source`; with ``on_bad_row=skip``, every row skipped (naming the first).
    """
    iterator, unit, file = records(source)
    key = f"data.sources.{'N' if index is None else index}"
    rows: List[dict] = []
    skipped: List[str] = []
    used: Set[str] = set()
    for number, record in iterator:
        try:
            if isinstance(record, DataError):
                raise record
            if source.replace:
                record = fill(record, source.replace, used)
            messages, text, meta = normalise(record, source.format, source.columns, key)
        except DataError as exc:
            error = exc.located(file, number, unit)
            if on_bad_row == "error":
                raise error from None
            skipped.append(str(error))
            continue
        rows.append({"messages": messages, "text": text, "meta": meta, "source": source.name, "row": number})
        if source.max_rows is not None and len(rows) >= source.max_rows:
            break
    if skipped and not rows:
        raise DataError(f"all {len(skipped)} rows were skipped as bad (first: {skipped[0]})", file=source.name)
    warning = unused_warning(source, used) if rows else None
    if warning:
        log.warning("%s", warning)
        if notes is not None:  # kept with a cached source, to be said again when it is read from the cache
            notes.append(warning)
    return rows, skipped, unit


def unused_warning(source: DataSource, used: Set[str]) -> Optional[str]:
    """The warning for ``replace`` keys no row of ``source`` held (``used``: the keys filled), else None."""
    unused = [key for key in source.replace if key not in used]
    return (f"{source.name}: replace: no row holds {', '.join(f'{{{{{key}}}}}' for key in unused)}" if unused
            else None)


def read_source(source: DataSource, *, on_bad_row: str = "error",
                skipped: Optional[List[str]] = None) -> List[dict]:
    """Read and normalise the rows of one source (the first ``max_rows`` valid rows, in file order).

    Args:
        source: the ``data.sources`` entry.
        on_bad_row: ``error`` raises at the first bad row; ``skip`` drops it and appends its message to
            ``skipped``.
        skipped: collects the messages of skipped rows (``on_bad_row="skip"``).

    Returns:
        Rows ``{"messages": [{role, content}], "text": None | str, "meta": {...}, "source": name, "row": int}``;
        ``text`` is set (and ``messages`` empty) for the ``text`` format, ``meta`` holds the record's other
        fields, ``row`` is the 1-based line (JSONL, CSV) or row (JSON array, parquet, HF dataset).

    Raises:
        DataError: naming the file, the line or row and the field: a missing path, malformed JSON / JSONL, a
            missing mapped field (with the fields the row has), a wrong type, an empty answer, non-UTF-8 bytes.
    """
    rows, bad, _ = read_rows(source, on_bad_row)
    if skipped is not None:
        skipped.extend(bad)
    return rows
