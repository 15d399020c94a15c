"""One data source, read once: its rows normalised and tokenized into a cache entry keyed by the file's content.

The key (:func:`source_key`) hashes the file's bytes (:func:`file_digest`: xxh3-128, memoised by path, inode,
size and mtime_ns, so an unchanged file is not read again; a Hugging Face dataset id stands for itself with its
subset and split), the tokenizer (:func:`qwenft.data.encode.tokenizer_fingerprint`: vocabulary, merges, special
tokens, chat template) and every setting that changes the rows or their tokens: format, columns, replace,
max_rows, max_seq_len, train_on, system_prompt, and the source's name, path and index (its messages name them).
Not in it: on_bad_row, overlong, eval_rows, eval_by, weight, seed and packing, which act on the cached columns.

An entry (:mod:`qwenft.data.store`) holds the tokenized shards of every valid row and ``rows.arrow``: per row the
normalised row pickled (``py``, read back only for the held-out rows and for ``eval_by``), its own system prompt
(``system``, null when none) and whether it is a conversation (``chat``). ``entry.json`` records the read: rows,
unit, skipped rows (their count and first messages) and the read's warnings. A hit reads neither the file nor its
rows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

from qwenft.config import DataConfig, DataSource
from qwenft.data.checks import Placeholders
from qwenft.data.encode import CACHE_VERSION, tokenize_into
from qwenft.data.formats import DataError
from qwenft.data.read import RowStream, looks_local, resolve_path
from qwenft.data.store import WRITE_ROWS, complete, data_root, load_entry, scratch_entry, sweep

log = logging.getLogger(__name__)

DIGESTS = ".digests.json"  # in <cache>/data: path -> [inode, size, mtime_ns, digest]
BLOCK = 16 << 20  # bytes hashed at a time
KEEP_SKIPPED = 1_000  # messages of skipped rows kept in entry.json (the count is exact)
ROWS_BATCH = 10_000  # rows unpickled at a time when all are iterated (eval_by)


def file_digest(path: Path) -> str:
    """``xxh3_128:<hex>`` of the bytes of ``path`` (sha256 where xxhash is missing), memoised in
    ``<cache>/data/.digests.json`` by path, inode, size and mtime_ns: an unchanged file is hashed once."""
    stat = path.stat()
    stamp = [stat.st_ino, stat.st_size, stat.st_mtime_ns]
    memo_path = data_root() / DIGESTS
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    known = memo.get(str(path))
    if known and known[:3] == stamp:
        return known[3]
    try:
        import xxhash

        digest, name = xxhash.xxh3_128(), "xxh3_128"
    except ImportError:  # a dependency of datasets, but not promised
        digest, name = hashlib.sha256(), "sha256"
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(BLOCK), b""):
            digest.update(block)
    value = f"{name}:{digest.hexdigest()}"
    memo[str(path)] = stamp + [value]
    memo_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo_path.with_name(f"{DIGESTS}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(memo))
    os.replace(tmp, memo_path)  # concurrent runs: the last writer wins, each entry stays right
    return value


def source_key(src: DataSource, index: int, dcfg: DataConfig, fingerprint: str) -> Optional[str]:
    """The cache key of ``src`` (see the module docstring), or None where the source is not a readable file nor a
    dataset id (the read then says what is wrong)."""
    local = looks_local(src.path) or resolve_path(src.path).exists()
    if local:
        path = resolve_path(src.path)
        if not path.is_file():
            return None
        content = file_digest(path)
    else:
        content = json.dumps(["hub", src.path, src.subset, src.split])
    settings = [CACHE_VERSION, content, fingerprint, src.name, src.path, index, src.format, src.columns,
                src.replace, src.max_rows, dcfg.max_seq_len, dcfg.train_on, dcfg.system_prompt]
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:32]


class PickledRows(Sequence):
    """The normalised rows of a cached source, unpickled only when indexed or iterated (``rows.arrow``'s ``py``)."""

    def __init__(self, column) -> None:
        self.column = column

    def __len__(self) -> int:
        return len(self.column)

    def __getitem__(self, i):
        return pickle.loads(self.column[i].as_py())

    def __iter__(self) -> Iterator[dict]:
        for chunk in self.column.chunks:  # a chunk at a time, not an element lookup per row
            for start in range(0, len(chunk), ROWS_BATCH):
                yield from map(pickle.loads, chunk.slice(start, ROWS_BATCH).to_pylist())

    def take(self, indices: Sequence[int]) -> List[dict]:
        return [pickle.loads(blob) for blob in self.column.take(list(indices)).to_pylist()]


@dataclass
class SourceData:
    """A source read (or found in the cache): ``encoded`` (:data:`qwenft.data.store.ENCODED`, every valid row, in
    file order), ``rows`` (the normalised rows, :class:`PickledRows`), ``system`` (pyarrow: each row's own system
    prompt or null), ``chat`` (numpy bool: a conversation), ``unit``, ``n_skipped`` (bad rows skipped) and
    ``skipped`` (the first :data:`KEEP_SKIPPED` of their messages), ``placeholder``
    (:func:`qwenft.data.checks.placeholder_warning`), ``hit``."""

    encoded: Any
    rows: PickledRows
    system: Any
    chat: Any
    unit: str
    skipped: List[str] = field(default_factory=list)
    n_skipped: int = 0
    placeholder: Optional[str] = None
    hit: bool = False

    def take(self, indices: Sequence[int]) -> List[dict]:
        """The rows at ``indices``."""
        return self.rows.take(indices)

    def system_counts(self, indices, system_prompt: Optional[str]) -> Dict[Optional[str], int]:
        """:func:`qwenft.data.template.system_counts` of the rows at ``indices`` (numpy), from the ``system`` and
        ``chat`` columns: the same counts in the same (first seen) order, no row read."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        chats = np.asarray(indices, dtype=np.int64)
        chats = chats[self.chat[chats]]
        counts: Dict[Optional[str], int] = {}
        if not len(chats):
            return counts
        encoded = pc.dictionary_encode(self.system.take(pa.array(chats)).combine_chunks())
        codes = np.asarray(encoded.indices.fill_null(-1), dtype=np.int64)
        values = encoded.dictionary.to_pylist()
        found, first, number = np.unique(codes, return_index=True, return_counts=True)
        for pos in np.argsort(first):  # in the order first seen, as the rows would be counted
            key = system_prompt if found[pos] < 0 else values[found[pos]]
            counts[key] = counts.get(key, 0) + int(number[pos])
        return counts


def _own_system(row: dict) -> Optional[str]:
    messages = row.get("messages") or []
    return messages[0]["content"] if messages and messages[0]["role"] == "system" else None


class _RowsFile:
    """``rows.arrow`` (see the module docstring), written a batch at a time beside ``path`` and renamed by
    :meth:`finish` (:meth:`abort` removes it)."""

    def __init__(self, path: Path) -> None:
        import pyarrow as pa

        self.path, self.tmp = path, path.with_name(f".{path.name}.{os.getpid()}.tmp")
        self.schema = pa.schema([("py", pa.binary()), ("system", pa.string()), ("chat", pa.bool_())])
        self.sink = pa.OSFile(str(self.tmp), "wb")
        self.writer = pa.ipc.new_file(self.sink, self.schema)

    def write(self, rows: Sequence[dict]) -> None:
        import pyarrow as pa

        self.writer.write_batch(pa.record_batch([
            pa.array([pickle.dumps(r, protocol=pickle.HIGHEST_PROTOCOL) for r in rows], pa.binary()),
            pa.array([_own_system(r) for r in rows], pa.string()),
            pa.array([bool(r.get("messages")) for r in rows], pa.bool_())], schema=self.schema))

    def finish(self) -> None:
        self.writer.close()
        self.sink.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if not self.sink.closed:
            self.sink.close()
        self.tmp.unlink(missing_ok=True)


def _batches(stream: RowStream, rows_path: Path, placeholders: Placeholders) -> Iterator[List[dict]]:
    """The rows of ``stream`` in batches of :data:`qwenft.data.store.WRITE_ROWS`, each also appended to
    ``rows.arrow`` (``rows_path``, complete once the stream is) and counted by ``placeholders``."""
    out = _RowsFile(rows_path)
    try:
        batch: List[dict] = []
        for row in stream:
            batch.append(row)
            if len(batch) == WRITE_ROWS:
                out.write(batch)
                placeholders.add(batch)
                yield batch
                batch = []
        if batch:
            out.write(batch)
            placeholders.add(batch)
            yield batch
        out.finish()
    finally:
        out.abort()  # nothing left when finished; the temporary file when the read failed


def _rows_file(path: Path):
    """The columns of ``rows.arrow``, memory-mapped: ``(py, system, chat)``."""
    import numpy as np
    import pyarrow as pa

    table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    return table.column("py"), table.column("system"), np.asarray(table.column("chat"), dtype=bool)


def _cached(entry: Path, dcfg: DataConfig, hit: bool) -> SourceData:
    """The source of the complete entry ``entry``, with what the read recorded (``entry.json``)."""
    info = json.loads((entry / "entry.json").read_text())
    if hit:
        if info["skipped"] and dcfg.on_bad_row == "error":
            raise DataError(info["skipped"][0])
        for note in info["notes"]:  # what the read said (an unused replace key), said again
            log.warning("%s", note)
    py, system, chat = _rows_file(entry / "rows.arrow")
    return SourceData(load_entry(entry), PickledRows(py), system, chat, info["unit"], info["skipped"],
                      info["skipped_count"], info["placeholder"], hit=hit)


def load_source(src: DataSource, index: int, dcfg: DataConfig, tokenizer, fingerprint: str) -> SourceData:
    """Read, normalise and tokenize ``src`` (``data.sources[index]``) in one streamed pass, or find it in the cache.

    The rows stream from the file (:class:`qwenft.data.read.RowStream`) in batches that are written to ``rows.arrow``,
    counted for the placeholder warning and tokenized shard by shard (:func:`qwenft.data.encode.tokenize_into`);
    no list of all rows is made. A killed run's finished shards are kept: the rerun reads the file again and
    tokenizes only the shards missing.

    Raises:
        DataError: see :func:`qwenft.data.read_source` (with ``on_bad_row=error`` the first bad row stops the read
            where it is; the shards finished before it stay for the next run, and an entry with none is removed);
            a cached source's first bad row.
    """
    key = source_key(src, index, dcfg, fingerprint) if dcfg.cache else None
    entry = data_root() / key if key else scratch_entry()
    if key and complete(entry):
        return _cached(entry, dcfg, hit=True)
    sweep()  # what killed runs left: dead processes' temporary files, entries with nothing to resume
    notes: List[str] = []
    stream = RowStream(src, dcfg.on_bad_row, index, notes=notes, keep_skipped=KEEP_SKIPPED)  # a bad path: raised
    placeholders = Placeholders()
    entry.mkdir(parents=True, exist_ok=True)

    def final() -> Dict[str, Any]:
        return {"skipped": stream.skipped, "skipped_count": stream.n_skipped, "notes": notes,
                "placeholder": placeholders.warning(src, index)}

    built = tokenize_into(entry, _batches(stream, entry / "rows.arrow", placeholders), tokenizer, dcfg, src,
                          stream.unit, key or "scratch", "all rows",
                          {"source": src.path, "name": src.name, "unit": stream.unit}, final)
    return _cached(entry, dcfg, hit=not built)
