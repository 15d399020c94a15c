"""The tokenized data on disk: an entry per cache key, written in fixed contiguous shards, read memory-mapped.

An entry ``<qwenft cache>/data/<key>/`` holds ``shards/NNNNN-J.arrow`` (the rows ``NNNNN * SHARD_ROWS`` onward,
``J`` the part a ``datasets.map`` worker wrote), ``shards/NNNNN.json`` (the shard's marker: its rows and parts,
written last, by rename) and ``entry.json`` (written when every shard is there: the entry is complete). Nothing is
held in memory: the rows going into the map are written to an Arrow file first (:func:`write_rows`), the map
writes its output to a file (``cache_file_name``), and the result is ``Dataset.from_file`` of the parts, a memory
map. A run killed halfway leaves its finished shards; the next run with the same key maps only the missing ones,
and since a shard depends only on its own rows, the ids are those of an uninterrupted run.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

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


def write_rows(rows: List[dict], path: Path) -> None:
    """Write normalised rows (``row``, ``messages``, ``text``) to the Arrow file ``path`` (typed by
    :func:`example_features`, every message exactly ``{role, content}``), :data:`WRITE_ROWS` at a time."""
    from datasets.arrow_writer import ArrowWriter

    writer = ArrowWriter(features=example_features(), path=str(path))
    try:
        for start in range(0, len(rows), WRITE_ROWS):
            part = rows[start:start + WRITE_ROWS]
            writer.write_batch({
                "row": [r["row"] for r in part],
                "messages": [[{"role": m["role"], "content": m["content"]} for m in r["messages"]]
                             if r["text"] is None else [] for r in part],
                "text": [r["text"] for r in part]})
        writer.finalize()
    finally:
        writer.close()


def build_entry(entry: Path, rows: List[dict], map_shard: Callable[[Any, str, str], Any],
                info: Dict[str, Any]) -> None:
    """Tokenize ``rows`` into ``entry`` shard by shard, skipping the shards a previous run finished.

    Args:
        entry: the entry folder (created if missing).
        rows: the normalised rows, in order.
        map_shard: ``(dataset, cache_file_name, desc) -> dataset``: the ``datasets.map`` of one shard's rows
            (memory-mapped input) writing to ``cache_file_name`` (with ``num_proc`` workers, one part each).
        info: what ``entry.json`` records besides the rows, shards and date (source, split).
    """
    shards = entry / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    with _locked(entry):  # another run building the same entry: wait for it, then find it complete
        if not complete(entry):
            _build(entry, shards, rows, map_shard, info)


def _build(entry: Path, shards: Path, rows: List[dict], map_shard, info: Dict[str, Any]) -> None:
    import datasets

    _write_json(entry / "building.json", info)  # what an incomplete entry is (cache=list)
    done = {m.name for m in shards.glob("[0-9]*.json")}
    done |= {name for m in shards.glob("[0-9]*.json") for name in json.loads(m.read_text())["files"]}
    for path in shards.iterdir():  # what a killed run left half-written (its inputs, temporary outputs)
        if path.name not in done:
            path.unlink(missing_ok=True)
    starts = list(range(0, len(rows), SHARD_ROWS))
    for k, start in enumerate(starts):
        marker = shards / f"{k:05d}.json"
        if marker.is_file():
            continue
        tag = f"{k:05d}.{os.getpid()}"
        source = shards / f".{tag}.input.arrow"
        write_rows(rows[start:start + SHARD_ROWS], source)
        try:
            part = datasets.Dataset.from_file(str(source))
            desc = f"shard {k + 1}/{len(starts)}" if len(starts) > 1 else ""
            mapped = map_shard(part, str(shards / f".{tag}.tmp.arrow"), desc)
            names = []
            for j, cached in enumerate(mapped.cache_files):  # one file, or one per map worker, in row order
                names.append(f"{k:05d}-{j}.arrow")
                os.replace(cached["filename"], shards / names[-1])
            _write_json(marker, {"rows": len(part), "files": names})
        finally:
            source.unlink(missing_ok=True)
    _write_json(entry / "entry.json", {**info, "rows": len(rows), "shards": len(starts),
                                       "created": time.strftime("%Y-%m-%d %H:%M:%S")})


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
            item["shards_done"] = len(list((path / "shards").glob("[0-9]*.json")))
        out.append(item)
    return out


def clear(keys: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    """Remove the cache entries (all, or those whose key starts with one of ``keys``); returns those removed."""
    removed = [e for e in entries() if not keys or any(e["key"].startswith(k) for k in keys)]
    for item in removed:
        shutil.rmtree(item["path"], ignore_errors=True)
    return removed
