"""Token ids and labels for normalised rows: :func:`encode_batch` in a batched ``datasets.map``, written to a cache
entry on disk shard by shard (:mod:`qwenft.data.store`), never held in memory.

The rows' messages go into the map as a typed column (:func:`qwenft.data.store.example_features`), the tokenizer
as an argument of the map function (``fn_kwargs``).
"""

from __future__ import annotations

import hashlib
import json
import pickle
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from qwenft.config import DataConfig, DataSource
from qwenft.data.formats import DataError
from qwenft.data.store import (ENCODED, WRITE_ROWS, build_entry, complete, data_root, encoded_features, load_entry,
                               scratch_entry)
from qwenft.data.render import TemplateCache
from qwenft.data.template import cut, encode_many

CACHE_VERSION = 10  # bump when the encoding or its columns change, so old cached datasets are not reused
# Rows per map batch, and so per record batch of the shard files: fewer, larger batches mean fewer headers to read
# when a shard is opened (64-row batches made opening 100k rows fault in a third of the file: +58 MB of RSS).
MAP_BATCH = 1_000


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the tokenizer's vocabulary, merges, special tokens and chat template."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update(backend.to_str().encode() if backend is not None
                  else json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(str(tokenizer.chat_template).encode())
    digest.update(json.dumps([tokenizer.eos_token, tokenizer.pad_token]).encode())
    return digest.hexdigest()


class _CPickled:
    """Travels to ``datasets.map``'s worker processes as ``obj`` pickled once by the standard library's C pickler,
    and arrives as ``obj`` itself. The workers' transport (dill) pickles in pure Python: 1.1 s per worker for Qwen's
    tokenizer (its Python copies of the 151k-entry vocabulary and merges) against 0.16 s once, where tokenizing
    1,000 rows takes 0.4 s."""

    def __init__(self, obj: Any) -> None:
        self.obj, self.blob = obj, None

    def __reduce__(self):
        if self.blob is None:
            self.blob = pickle.dumps(self.obj, protocol=pickle.HIGHEST_PROTOCOL)
        return pickle.loads, (self.blob,)


def encode_batch(batch: Dict[str, list], *, tokenizer, max_seq_len: int, train_on: str,
                 system_prompt: Optional[str], file: str, unit: str,
                 cutter: Optional[TemplateCache] = None) -> Dict[str, list]:
    """The ``datasets.map`` function (batched): rows ``row, messages, text`` -> token ids and labels.

    The tokenizer and settings come as keyword arguments (``fn_kwargs``); a module-level function, so ``num_proc``
    workers receive it by name. ``cutter``: the run's :class:`qwenft.data.render.TemplateCache` (None: the template
    renders every row). Per row: ``input_ids``, ``labels``, ``length``, ``overflow`` (tokens cut), ``supervised``
    (supervised tokens kept), ``prompt_len`` (see :func:`qwenft.data.template.encode_many`) and ``error`` (the
    located DataError text, "" when none; the token columns are then empty or 0).
    """
    if isinstance(tokenizer, _CPickled):  # a shard run in this process
        tokenizer = tokenizer.obj
    items = list(zip(batch["messages"], batch["text"]))
    results = encode_many(tokenizer, items, max_seq_len=max_seq_len, train_on=train_on, system_prompt=system_prompt,
                          cutter=cutter or cut)
    out: Dict[str, list] = {name: [] for name in ENCODED if name != "row"}
    for row, result in zip(batch["row"], results):
        error = isinstance(result, DataError)
        ids = [] if error else result["input_ids"]
        out["input_ids"].append(ids)
        out["labels"].append([] if error else result["labels"])
        out["length"].append(len(ids))
        out["overflow"].append(0 if error else result["overflow"])
        out["supervised"].append(0 if error else result["supervised"])
        out["prompt_len"].append(0 if error else result["prompt_len"])
        out["error"].append(str(result.located(file, row, unit)) if error else "")
    return out


def _cache_key(rows: List[dict], fingerprint: str, dcfg: DataConfig, file: str, unit: str) -> str:
    """The cache entry of ``rows``: a hash of everything the tokenized dataset holds or depends on."""
    digest = hashlib.sha256()
    settings = [CACHE_VERSION, fingerprint, dcfg.max_seq_len, dcfg.train_on, dcfg.system_prompt, file, unit]
    digest.update(json.dumps(settings).encode())
    for row in rows:  # the row numbers too: the dataset holds them (and its error messages name them)
        digest.update(json.dumps([row["row"], row["messages"], row["text"]], ensure_ascii=False).encode())
    return digest.hexdigest()[:32]


def tokenize_rows(rows: List[dict], tokenizer, dcfg: DataConfig, src: DataSource, unit: str, fingerprint: str,
                  split: str):
    """Tokenize normalised rows through ``datasets.map`` (batched, ``data.num_proc`` processes), cached, on disk.

    The rows are written to an Arrow file first (:class:`qwenft.data.store.ShardInput`: every message exactly
    ``{role, content}``) and mapped from that memory map, :data:`qwenft.data.store.SHARD_ROWS` rows at a time,
    each shard's output written to its own file (:func:`qwenft.data.store.build_entry`): the tokenized data is
    never held in memory. :func:`encode_batch` gets the tokenizer through ``fn_kwargs`` (with ``num_proc > 1``
    datasets pickles it to each worker, here with the C pickler, :class:`_CPickled`; the map's fingerprint is the
    cache key, so datasets never hashes it). The cache key hashes the rows (row numbers and contents), the file and
    unit the error messages name, the tokenizer (:func:`tokenizer_fingerprint`) and the settings that change the
    tokens (max_seq_len, train_on, system_prompt). With ``data.cache`` the entry is ``<qwenft cache>/data/<key>``:
    a complete one is a hit (memory-mapped, nothing tokenized), an incomplete one (a killed run) is finished from
    its done shards; without, the entry is a scratch folder removed at exit.

    Returns:
        ``(dataset, cache_hit)``; columns :data:`ENCODED` (``row, input_ids, labels, length, overflow,
        supervised, prompt_len, error``; ids and labels ``int32``), one row per input row, in order.
    """
    key = _cache_key(rows, fingerprint, dcfg, src.path, unit)
    entry = data_root() / key if dcfg.cache else scratch_entry()
    if dcfg.cache and complete(entry):
        return load_entry(entry), True
    batches = (rows[start:start + WRITE_ROWS] for start in range(0, len(rows), WRITE_ROWS))
    tokenize_into(entry, batches, tokenizer, dcfg, src, unit, key, split, {"source": src.path, "name": src.name,
                                                                           "split": split})
    return load_entry(entry), False


def tokenize_into(entry, batches: Iterable[Sequence[dict]], tokenizer, dcfg: DataConfig, src: DataSource, unit: str,
                  key: str, desc: str, info: Dict[str, Any], final: Callable[[], Dict[str, Any]] = dict) -> bool:
    """Tokenize the rows of ``batches`` (normalised rows, a batch at a time, as they stream) into the cache entry
    folder ``entry`` (:func:`qwenft.data.store.build_entry`: shard by shard, resuming a killed run's finished shards)
    with :func:`encode_batch` in ``datasets.map`` (``data.num_proc`` processes); ``key`` is the map's fingerprint,
    ``desc`` names the progress bar, ``info`` (and ``final()``, once the rows are all read) go to ``entry.json``.

    Returns:
        Whether the entry was built here (False: another process completed it meanwhile; ``batches`` unread)."""
    settings = {"max_seq_len": dcfg.max_seq_len, "train_on": dcfg.train_on, "system_prompt": dcfg.system_prompt,
                "file": src.path, "unit": unit, "cutter": TemplateCache()}

    def map_shard(part, cache_file: str, shard: str):
        num_proc = dcfg.num_proc if dcfg.num_proc > 1 and len(part) >= 2 * dcfg.num_proc else None
        kwargs = {**settings, "tokenizer": _CPickled(tokenizer) if num_proc else tokenizer}
        return part.map(encode_batch, fn_kwargs=kwargs, batched=True, batch_size=MAP_BATCH, num_proc=num_proc,
                        remove_columns=["messages", "text"], features=encoded_features(), new_fingerprint=key,
                        cache_file_name=cache_file, load_from_cache_file=False,
                        desc=f"tokenizing {src.name} ({desc}{', ' + shard if shard else ''})")

    return build_entry(entry, batches, map_shard, info, final)
