"""The tokenized data on disk: an entry per cache key, written in fixed contiguous shards, read memory-mapped.

An entry ``<qwenft cache>/data/<key>/`` holds ``shards/NNNNN-J.arrow`` (the rows ``NNNNN * SHARD_ROWS`` onward,
``J`` the part a ``datasets.map`` worker wrote), ``shards/NNNNN.json`` (the shard's marker: its rows and parts,
written last, by rename) and ``entry.json`` (written when every shard is there: the entry is complete). Nothing is
held in memory: the rows arrive as a stream of batches, each written to its shard's input Arrow file
(:class:`ShardInput`) and dropped; a full shard is mapped from that file (memory-mapped), the map writes its output
to a file (``cache_file_name``), and the result is ``Dataset.from_file`` of the parts, a memory map. A shard is a
fixed range of valid rows (:data:`SHARD_ROWS`). A run killed halfway leaves its finished shards; the next run with
the same key reads the rows again but maps only the missing shards, and since a shard depends only on its own rows,
the ids are those of an uninterrupted run.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence

SHARD_ROWS = 50_000  # rows per shard: what a killed run can lose, and the unit of resume
ENCODED = ["row", "input_ids", "labels", "length", "overflow", "supervised", "prompt_len", "error"]
WRITE_ROWS = 10_000  # rows per batch written to a shard's input file


def example_features():
    """The ``datasets.Features`` of the rows going into tokenization: ``row`` (int), ``messages`` (a list of
    ``{role, content}`` texts; empty for ``text`` rows) and ``text`` (null for conversations)."""
    import datasets

    text = datasets.Value("string")
    return datasets.Features({"row": datasets.Value("int64"),
                              "messages": datasets.List({"role": text, "content": text}), "text": text})


def encoded_features():
    """The ``datasets.Features`` of a tokenized entry (:data:`ENCODED`): ``input_ids`` and ``labels`` ``int32``
    (4 B a token: Qwen's 151,936 ids and -100 fit; ``int64`` would double the entry), the counts ``int64``."""
    import datasets

    count = datasets.Value("int64")
    ids = datasets.List(datasets.Value("int32"))
    return datasets.Features({"row": count, "input_ids": ids, "labels": ids, "length": count, "overflow": count,
                              "supervised": count, "prompt_len": count, "error": datasets.Value("string")})


def data_root() -> Path:
    """``<qwenft cache>/data``: one folder per entry (names starting with ``.`` are scratch, never entries)."""
    from qwenft.runtime import cache_dir

    return cache_dir() / "data"


def scratch_entry() -> Path:
    """A folder for an entry that is not kept (``data.cache=false``): removed when the process exits (the data
    still goes to disk, not to memory)."""
    root = data_root()
    root.mkdir(parents=True, exist_ok=True)
    for old in root.glob(".scratch-*-*"):  # left by a process killed before its exit handler ran
        if not _alive(int(old.name.split("-")[1])):
            shutil.rmtree(old, ignore_errors=True)
    path = Path(tempfile.mkdtemp(prefix=f".scratch-{os.getpid()}-", dir=root))
    atexit.register(shutil.rmtree, path, True)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):  # another user's process, or a check this system refuses: keep its folder
        return True
    return True


def _write_json(path: Path, value: Any) -> None:
    """``value`` as JSON at ``path``, written beside it and renamed (a reader sees all of it or nothing)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def complete(entry: Path) -> bool:
    """Whether ``entry`` holds every shard (its ``entry.json`` exists)."""
    return (entry / "entry.json").is_file()


class ShardInput:
    """The Arrow file of one shard's rows going into the map (typed by :func:`example_features`, every message
    exactly ``{role, content}``), written a batch at a time (:meth:`write`) and closed by :meth:`finish`."""

    def __init__(self, path: Path) -> None:
        from datasets.arrow_writer import ArrowWriter

        self.path, self.open = path, True
        self.writer = ArrowWriter(features=example_features(), path=str(path))

    def write(self, rows: Sequence[dict]) -> None:
        """Append normalised rows (``row``, ``messages``, ``text``)."""
        self.writer.write_batch({
            "row": [r["row"] for r in rows],
            "messages": [[{"role": m["role"], "content": m["content"]} for m in r["messages"]]
                         if r["text"] is None else [] for r in rows],
            "text": [r["text"] for r in rows]})

    def finish(self) -> None:
        """Write the file's footer and close it (once: a second call does nothing)."""
        if not self.open:
            return
        self.open = False
        try:
            self.writer.finalize()
        finally:
            self.writer.close()


def build_entry(entry: Path, batches: Iterable[Sequence[dict]], map_shard: Callable[[Any, str, str], Any],
                info: Dict[str, Any], final: Callable[[], Dict[str, Any]] = dict) -> bool:
    """Tokenize the rows of ``batches`` into ``entry`` shard by shard as they come, skipping the shards a previous
    run finished (their rows are read and passed over, not tokenized again).

    Args:
        entry: the entry folder (created if missing).
        batches: the normalised rows, in order, a batch at a time (a stream: a batch is written to the shard's
            input file, then dropped; consumed only when the entry is built here).
        map_shard: ``(dataset, cache_file_name, desc) -> dataset``: the ``datasets.map`` of one shard's rows
            (memory-mapped input) writing to ``cache_file_name`` (with ``num_proc`` workers, one part each).
        info: what ``building.json`` and ``entry.json`` record besides the rows, shards and date (source, split).
        final: called once ``batches`` is exhausted: more for ``entry.json`` (what the read counted).

    Returns:
        Whether this call built the entry (False: another process completed it while this one waited).

    Raises:
        whatever ``batches`` or ``map_shard`` raise (a bad row, an interrupt); the entry is then removed when no
        shard was finished, else kept for the next run to resume.
    """
    shards = entry / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    with _locked(entry):  # another run building the same entry: wait for it, then find it complete
        if complete(entry):
            return False
        shards.mkdir(parents=True, exist_ok=True)  # again: a failed build before this one may have removed it
        try:
            _build(entry, shards, batches, map_shard, info, final)
        except BaseException:
            if not _shards_done(entry):  # nothing to resume: no folder left behind (else kept, see the docstring)
                shutil.rmtree(entry, ignore_errors=True)
            raise
        return True


def _shards_done(entry: Path) -> int:
    return len(list((entry / "shards").glob("[0-9]*.json")))


_TEMPORARY = re.compile(r"\.[^/]*\.(\d+)\.(tmp|input\.arrow|tmp\.arrow)")  # .NAME.<pid>.tmp and a shard's files


def sweep() -> None:
    """Remove what killed runs left in the cache: the temporary files of dead processes (``.rows.arrow.<pid>.tmp``,
    a shard's ``.NNNNN.<pid>.input.arrow`` / ``.tmp.arrow``, a JSON file's ``.<name>.<pid>.tmp``), and an incomplete
    entry with no finished shard whose builder (the pid in ``building.json``) is dead: nothing there to resume.
    An incomplete entry with finished shards stays (the next run with its key resumes them)."""
    root = data_root()
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if entry.name.startswith(".") or not entry.is_dir() or complete(entry):
            continue
        for folder in (entry, entry / "shards"):
            for path in (folder.iterdir() if folder.is_dir() else ()):
                match = _TEMPORARY.fullmatch(path.name)
                if match and not _alive(int(match.group(1))):
                    path.unlink(missing_ok=True)
        try:
            builder = json.loads((entry / "building.json").read_text()).get("pid")
        except (OSError, ValueError, AttributeError):  # not begun yet, or an older qwenft's: left alone
            continue
        if isinstance(builder, int) and not _alive(builder) and not _shards_done(entry):
            shutil.rmtree(entry, ignore_errors=True)


def _build(entry: Path, shards: Path, batches: Iterable[Sequence[dict]], map_shard, info: Dict[str, Any],
           final: Callable[[], Dict[str, Any]]) -> None:
    _write_json(entry / "building.json", {**info, "pid": os.getpid()})  # what an incomplete entry is (cache=list)
    done = {m.name for m in shards.glob("[0-9]*.json")}
    done |= {name for m in shards.glob("[0-9]*.json") for name in json.loads(m.read_text())["files"]}
    for path in shards.iterdir():  # what a killed run left half-written (its inputs, temporary outputs)
        if path.name not in done:
            path.unlink(missing_ok=True)
    shard, filled, total, current = 0, 0, 0, None  # shard number, its rows so far, all rows, its input file
    # A full shard is tokenized on a worker thread while this thread reads the next one: the tokenizer's batch
    # encoding releases the GIL, so the read (Python) and the tokenization (Rust) overlap. One shard at most is in
    # flight (the next waits for it), so memory stays one shard's map batch, and shards finish in file order.
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qwenft-shard")
    pending: Optional[Future] = None
    try:
        for batch in batches:
            pos = 0
            while pos < len(batch):
                part = batch[pos:pos + SHARD_ROWS - filled]
                pos, filled, total = pos + len(part), filled + len(part), total + len(part)
                if not (shards / f"{shard:05d}.json").is_file():  # else finished by an earlier run: passed over
                    if current is None:
                        current = ShardInput(shards / f".{shard:05d}.{os.getpid()}.input.arrow")
                    current.write(part)
                if filled == SHARD_ROWS:
                    pending, before = None, pending
                    if before is not None:
                        before.result()  # the shard before: done, or its error raised here, in file order
                    pending = pool.submit(_finish_shard, shards, shard, current, map_shard)
                    shard, filled, current = shard + 1, 0, None
        pending, before = None, pending
        if before is not None:
            before.result()
        if filled:
            _finish_shard(shards, shard, current, map_shard)
            shard, current = shard + 1, None
    finally:
        try:
            if pending is not None:  # the read failed while the shard before it was tokenized: that shard finishes
                pending.result()  # (it is valid and resumable); its own error, earlier in the file, would win
        finally:
            pool.shutdown(wait=True)
            if current is not None:  # the stream failed (a bad row): the half-written input goes
                current.finish()
                current.path.unlink(missing_ok=True)
    _write_json(entry / "entry.json", {**info, **final(), "rows": total, "shards": shard,
                                       "created": time.strftime("%Y-%m-%d %H:%M:%S")})


def _finish_shard(shards: Path, shard: int, current: Optional[ShardInput], map_shard) -> None:
    """Tokenize shard ``shard`` from its input file ``current`` (None: finished by an earlier run) and mark it
    done: its parts renamed into place, then its marker ``NNNNN.json``."""
    import datasets

    if current is None:
        return
    current.finish()
    try:
        part = datasets.Dataset.from_file(str(current.path))
        mapped = map_shard(part, str(shards / f".{shard:05d}.{os.getpid()}.tmp.arrow"), f"shard {shard + 1}")
        names = []
        for j, cached in enumerate(mapped.cache_files):  # one file, or one per map worker, in row order
            names.append(f"{shard:05d}-{j}.arrow")
            os.replace(cached["filename"], shards / names[-1])
        _write_json(shards / f"{shard:05d}.json", {"rows": len(part), "files": names})
    finally:
        current.path.unlink(missing_ok=True)


@contextlib.contextmanager
def _locked(entry: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``entry`` (``fcntl.flock`` of ``entry/.lock``; none where there is no fcntl:
    concurrent builders then only share the finished shards' names, renamed into place whole)."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    with open(entry / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_entry(entry: Path):
    """The tokenized dataset of a complete entry (:func:`build_entry`): its shards' parts memory-mapped, in order."""
    import datasets

    parts = []
    for marker in sorted((entry / "shards").glob("[0-9]*.json")):
        for name in json.loads(marker.read_text())["files"]:
            parts.append(datasets.Dataset.from_file(str(marker.parent / name)))
    if not parts:
        return datasets.Dataset.from_dict({name: [] for name in ENCODED}, features=encoded_features())
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def entries() -> List[Dict[str, Any]]:
    """The cache entries: ``{key, path, bytes, complete}`` plus what ``entry.json`` records (``source``, ``split``,
    ``rows``, ``shards``, ``created``) for a complete one; an incomplete one (a killed run: resumable) has
    ``shards_done``, one an older qwenft wrote ``legacy``."""
    root = data_root()
    out: List[Dict[str, Any]] = []
    if not root.is_dir():
        return out
    for path in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        item: Dict[str, Any] = {"key": path.name, "path": str(path), "bytes": size, "complete": complete(path)}
        if item["complete"]:
            item.update(json.loads((path / "entry.json").read_text()))
        elif not (path / "shards").is_dir() and not (path / "rows.arrow").is_file():
            item["legacy"] = True  # an entry of an older qwenft (a saved dataset): never read, cache=clear removes it
        else:
            if (path / "building.json").is_file():
                item.update(json.loads((path / "building.json").read_text()))
            item["shards_done"] = _shards_done(path)
        out.append(item)
    return out


def clear(keys: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    """Remove the cache entries (all, or those whose key starts with one of ``keys``); returns those removed."""
    removed = [e for e in entries() if not keys or any(e["key"].startswith(k) for k in keys)]
    for item in removed:
        shutil.rmtree(item["path"], ignore_errors=True)
    return removed
