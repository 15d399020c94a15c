"""Read a data source (a local .json / .jsonl / .csv / .parquet file or a Hugging Face dataset id) into
normalised rows ``{"messages": [...], "text": str | None, "meta": {...}, "source": name, "row": int}``.

A relative path is resolved against the directory the command runs from. :func:`read_text` is the one
reader of every text file qwenft takes (data, prompts, ``eval.ppl_sources``): UTF-8, a leading byte-order mark
removed, bytes that are not UTF-8 refused naming the file, line and byte offset. Row numbers are 1-based: the
line for JSONL and CSV, the element for a JSON array, the row for parquet and Hugging Face datasets.

Data files are streamed (:mod:`qwenft.data.records`; a Hugging Face dataset a batch at a time, streamed from the Hub
when ``max_rows`` is set): :class:`RowStream` yields the normalised rows one by one, so a caller that writes them
away as they come never holds them all; :func:`read_source` / :func:`read_rows` collect them in a list.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator, List, Optional, Set, Tuple

from qwenft.config import DataSource
from qwenft.data.checks import fill
from qwenft.data.formats import DataError, normalise
from qwenft.data.records import (BOM, Record, csv_records, decode_utf8, json_records, jsonl_records,
                                 parquet_records)

log = logging.getLogger(__name__)

FILE_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")
_EMPTY = {".csv": "the file is empty or holds only its header line", ".jsonl": "the file is empty or all blank lines",
          ".json": "an empty array", ".parquet": "the table has no rows"}  # what a source of no rows is, by type
HUB_BATCH = 1_000  # rows of a Hugging Face dataset converted to Python at a time


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


def _hub(source: DataSource) -> Iterator[Record]:
    """The rows of a Hugging Face dataset id, :data:`HUB_BATCH` at a time; streamed (nothing downloaded or prepared
    beyond what is read) when ``max_rows`` is set, where the dataset allows it, else loaded (memory-mapped)."""
    import datasets

    batches = None
    if source.max_rows is not None:
        try:
            streamed = datasets.load_dataset(source.path, source.subset, split=source.split, streaming=True)
            batches = streamed.iter(batch_size=HUB_BATCH)
            first = [next(batches, None)]  # a dataset that cannot stream fails here, not halfway
            batches = (batch for part in (first, batches) for batch in part if batch is not None)
        except Exception:  # no streaming for this dataset (or offline without its files): load it whole below
            batches = None
    try:
        if batches is None:
            batches = datasets.load_dataset(source.path, source.subset, split=source.split).iter(batch_size=HUB_BATCH)
    except Exception as exc:  # offline cache miss, unknown id, bad split: all reported the same way
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"no such local file (resolved to {resolve_path(source.path)}), and not loadable as a "
                        f"Hugging Face dataset id (subset={source.subset}, split={source.split}): {reason}"
                        f"{near_file(source.path)}", file=source.path) from None
    return _hub_rows(batches)


def _hub_rows(batches) -> Iterator[Record]:
    number = 0
    for batch in batches:
        names = list(batch)
        for values in zip(*batch.values()):
            number += 1
            yield number, dict(zip(names, values))


def records(source: DataSource) -> Tuple[Iterator[Record], str, str]:
    """Iterate the raw records of ``source``, streamed (:mod:`qwenft.data.records`: never the whole file in memory).

    Returns:
        ``(records, unit, file)``: an iterator of ``(row, record or DataError)``, how rows count (``line``
        or ``row``) and the file name to report.

    Raises:
        DataError: the path does not exist, has an unsupported suffix, is one JSON object, or names no loadable
            dataset; the iterator raises what is found while reading (not UTF-8, malformed JSON array or CSV).
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
        return parquet_records(path, file), "row", file
    if suffix == ".jsonl":
        return jsonl_records(path, file), "line", file
    if suffix == ".csv":
        return csv_records(path, file), "line", file
    iterator, unit = json_records(path, file)
    return iterator, unit, file


class RowStream:
    """The normalised rows of one source, in file order, read as they are iterated: no list of all rows is made.

    Iterating yields ``{"messages", "text", "meta", "source", "row"}`` (see :func:`read_source`): the first
    ``max_rows`` valid rows. Every text of a record gets ``source.replace`` filled in first. A bad row raises
    (``on_bad_row="error"``) or is counted in ``n_skipped``, its message kept in ``skipped`` (the first
    ``keep_skipped``; all when None). When the iteration ends, every row skipped raises, and a ``replace`` key no
    row held is warned (logged, and added to ``notes``).

    Attributes:
        unit: how ``row`` counts (``line`` or ``row``); file: the file named in messages.
        n_rows / n_skipped: valid rows yielded / bad rows skipped so far.

    Raises:
        DataError: when made, a source that cannot be read (see :func:`records`); while iterated, see
            :func:`read_source`; at the end, a source that held no rows at all (``FILE: no rows (...)``: an empty
            file, a CSV header line only, an empty array) or, with ``on_bad_row=skip``, every row skipped (naming
            the first).
    """

    def __init__(self, source: DataSource, on_bad_row: str = "error", index: Optional[int] = None,
                 notes: Optional[List[str]] = None, keep_skipped: Optional[int] = None) -> None:
        self.source, self.on_bad_row, self.notes, self.keep_skipped = source, on_bad_row, notes, keep_skipped
        self.key = f"data.sources.{'N' if index is None else index}"
        self.records, self.unit, self.file = records(source)
        self.skipped: List[str] = []
        self.n_rows = self.n_skipped = 0
        self.used: Set[str] = set()

    def __iter__(self) -> Iterator[dict]:
        source, limit = self.source, self.source.max_rows
        for number, record in self.records:
            try:
                if isinstance(record, DataError):
                    raise record
                if source.replace:
                    record = fill(record, source.replace, self.used)
                messages, text, meta = normalise(record, source.format, source.columns, self.key)
            except DataError as exc:
                error = exc.located(self.file, number, self.unit)
                if self.on_bad_row == "error":
                    raise error from None
                self.n_skipped += 1
                if self.keep_skipped is None or len(self.skipped) < self.keep_skipped:
                    self.skipped.append(str(error))
                continue
            self.n_rows += 1
            yield {"messages": messages, "text": text, "meta": meta, "source": source.name, "row": number}
            if limit is not None and self.n_rows >= limit:
                break
        if not (self.n_rows or self.n_skipped):
            raise DataError(f"no rows ({_EMPTY.get(Path(self.file).suffix.lower(), 'the dataset is empty')}); a source "
                            "needs at least one row: fill the file, or remove the source from data.sources",
                            file=self.file)
        if self.n_skipped and not self.n_rows:
            raise DataError(f"all {self.n_skipped} rows were skipped as bad (first: {self.skipped[0]})",
                            file=source.name)
        warning = unused_warning(source, self.used) if self.n_rows else None
        if warning:
            log.warning("%s", warning)
            if self.notes is not None:  # kept with a cached source, to be said again when it is read from the cache
                self.notes.append(warning)


def read_rows(source: DataSource, on_bad_row: str = "error", index: Optional[int] = None,
              notes: Optional[List[str]] = None) -> Tuple[List[dict], List[str], str]:
    """:func:`read_source` with more detail, every row in a list (small sources; :class:`RowStream` streams them);
    ``index``: the source's place in ``data.sources``, for the overrides a missing field's error suggests
    (``data.sources.N.format=...``); ``notes`` collects the warnings logged (a ``replace`` key no row holds).

    Returns:
        ``(rows, skipped, unit)``: the normalised rows, the messages of skipped bad rows (``on_bad_row=skip``)
        and how ``row`` counts (``line`` or ``row``).

    Raises:
        DataError: see :func:`read_source`; with ``on_bad_row=skip``, every row skipped (naming the first).
    """
    stream = RowStream(source, on_bad_row, index, notes)
    rows = list(stream)
    return rows, stream.skipped, stream.unit


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
            missing mapped field (with the fields the row has), a wrong type, an empty answer, non-UTF-8 bytes; a
            file of no rows (naming the file).
    """
    rows, bad, _ = read_rows(source, on_bad_row)
    if skipped is not None:
        skipped.extend(bad)
    return rows
