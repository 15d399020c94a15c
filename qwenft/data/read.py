"""Read a data source (a local .json / .jsonl / .csv / .parquet file or a Hugging Face dataset id) into
normalised rows ``{"messages": [...], "text": str | None, "meta": {...}, "source": name, "row": int}``.

A relative path is resolved against the directory the command runs from. Text must be UTF-8 (a BOM is
accepted). Row numbers are 1-based: the line for JSONL and CSV, the element for a JSON array, the row for
parquet and Hugging Face datasets.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any, Iterator, List, Optional, Tuple

from qwenft.config import DataSource
from qwenft.data.formats import DataError, normalise

FILE_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")
Record = Tuple[int, Any]  # (1-based line/row, the record, or a DataError for that line)


def resolve_path(path: str) -> Path:
    """``path`` with ``~`` expanded, relative to the current directory when it is not absolute."""
    resolved = Path(path).expanduser()
    return resolved if resolved.is_absolute() else Path.cwd() / resolved


def _looks_local(path: str) -> bool:
    """A file path rather than a Hugging Face dataset id (``name`` or ``owner/name``)."""
    data_suffixes = FILE_SUFFIXES + (".txt", ".tsv", ".gz", ".zip", ".arrow", ".xlsx")
    return (path.lower().endswith(data_suffixes) or path.startswith((".", "/", "~", "\\")) or path.count("/") > 1
            or ":\\" in path)


def _decode(data: bytes, file: str, line_offset: int = 0, unit: str = "line") -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1 + line_offset
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise DataError(f"not UTF-8 text: byte 0x{data[exc.start]:02x} at column {column} (re-save the file "
                        "as UTF-8)", file=file, row=line, unit=unit) from None


def _jsonl(data: bytes, file: str) -> Iterator[Record]:
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            line = _decode(raw, file, number - 1)
            record = json.loads(line)
            if not isinstance(record, dict):
                raise DataError(f"expected a JSON object, got {type(record).__name__}", file=file, row=number,
                                unit="line")
        except DataError as exc:
            yield number, exc
            continue
        except json.JSONDecodeError as exc:
            yield number, DataError(f"malformed JSON: {exc.msg} (column {exc.colno})", file=file, row=number,
                                    unit="line")
            continue
        yield number, record


def _json(data: bytes, file: str) -> Tuple[Iterator[Record], str]:
    text = _decode(data, file)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data" and text.lstrip().startswith("{"):
            return _jsonl(data, file), "line"  # JSON Lines saved under a .json name
        raise DataError(f"malformed JSON: {exc.msg} (column {exc.colno})", file=file, row=exc.lineno,
                        unit="line") from None
    if isinstance(value, dict):
        raise DataError(f"expected a JSON array of objects (or JSON Lines); got an object with keys: "
                        f"{', '.join(list(value)[:8])}", file=file)
    if not isinstance(value, list):
        raise DataError(f"expected a JSON array of objects, got {type(value).__name__}", file=file)
    return iter(enumerate(value, start=1)), "row"


def _csv(data: bytes, file: str) -> Iterator[Record]:
    reader = csv.DictReader(io.StringIO(_decode(data, file), newline=""))
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
        raise DataError(f"not a local file, and not loadable as a Hugging Face dataset "
                        f"(subset={source.subset}, split={source.split}): {reason}", file=source.path) from None
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
    local = _looks_local(source.path) or resolve_path(source.path).exists()
    if not local:
        return _hub(source), "row", source.path
    path = resolve_path(source.path)
    file = str(source.path)
    if not path.exists():
        raise DataError(f"no such file (resolved to {path}; relative paths are resolved against the "
                        f"directory the command runs from, {Path.cwd()})", file=file)
    if path.is_dir():
        raise DataError(f"is a directory; expected a file ending in {', '.join(FILE_SUFFIXES)}", file=file)
    suffix = path.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise DataError(f"unsupported file type {suffix or '(none)'!r}; use {', '.join(FILE_SUFFIXES)}", file=file)
    if suffix == ".parquet":
        return _parquet(path, file), "row", file
    data = path.read_bytes()
    if suffix == ".jsonl":
        return _jsonl(data, file), "line", file
    if suffix == ".csv":
        return _csv(data, file), "line", file
    iterator, unit = _json(data, file)
    return iterator, unit, file


def read_rows(source: DataSource, on_bad_row: str = "error") -> Tuple[List[dict], List[str], str]:
    """:func:`read_source` with more detail.

    Returns:
        ``(rows, skipped, unit)``: the normalised rows, the messages of skipped bad rows (``on_bad_row=skip``)
        and how ``row`` counts (``line`` or ``row``).
    """
    iterator, unit, file = records(source)
    rows: List[dict] = []
    skipped: List[str] = []
    for number, record in iterator:
        try:
            if isinstance(record, DataError):
                raise record
            messages, text, meta = normalise(record, source.format, source.columns)
        except DataError as exc:
            error = exc.located(file, number, unit)
            if on_bad_row == "error":
                raise error from None
            skipped.append(str(error))
            continue
        rows.append({"messages": messages, "text": text, "meta": meta, "source": source.name, "row": number})
        if source.max_rows is not None and len(rows) >= source.max_rows:
            break
    return rows, skipped, unit


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
