"""Token ids and labels for normalised rows: :func:`encode_batch` in a batched ``datasets.map``, written to a cache
entry on disk shard by shard (:mod:`qwenft.data.store`), never held in memory.

The rows' messages go into the map as a typed column (:func:`qwenft.data.store.example_features`), the tokenizer
as an argument of the map function (``fn_kwargs``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import pickle
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from qwenft.config import DataConfig, DataSource
from qwenft.data.formats import DataError
from qwenft.data.store import (ENCODED, WRITE_ROWS, build_entry, complete, data_root, encoded_features, load_entry,
                               scratch_entry)
from qwenft.data.render import TemplateCache
from qwenft.data.template import IGNORE_INDEX, _tokenize, cut, end_of_text_id, with_system

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
                 system_prompt: Optional[str], file: str, unit: str, cutter: Optional[TemplateCache] = None):
    """The ``datasets.map`` function (batched): rows ``row, messages, text`` -> a ``pyarrow.Table`` of token ids
    and labels, one row per input row, columns :data:`qwenft.data.store.ENCODED`.

    The tokenizer and settings come as keyword arguments (``fn_kwargs``); a module-level function, so ``num_proc``
    workers receive it by name. ``cutter``: the run's :class:`qwenft.data.render.TemplateCache` (None: the template
    renders every row). Per row: ``input_ids``, ``labels`` (``int32 [length]`` each), ``length``, ``overflow``
    (tokens cut), ``supervised`` (supervised tokens kept), ``prompt_len`` (the tokens before the last answer, token
    for token :func:`qwenft.data.template.prompt_ids`; 0 for a text row) and ``error`` (the located DataError
    text, "" when none; the token columns are then empty or 0).

    The tokens never become per-row Python lists: the pieces' ids are laid end to end in one ``int32`` array (the
    pieces are tokenized in row order, so that array is every row's ids before truncation), the labels and the
    truncation are masks over it, and the columns are Arrow list arrays over those values (the per-row work is on
    the pieces' lengths only). This is :func:`qwenft.data.template.assemble` vectorised.
    """
    import numpy as np
    import pyarrow as pa

    if isinstance(tokenizer, _CPickled):  # a shard run in this process
        tokenizer = tokenizer.obj
    cutter = cutter or cut
    eos = [end_of_text_id(tokenizer)]
    texts: List[str] = []
    plans: List[Any] = []  # per row: a DataError, or (first text, pieces, prompt_chars, is_text)
    for messages, text in zip(batch["messages"], batch["text"]):
        try:
            pieces, prompt_chars = (([(text, True)], 0) if text is not None
                                    else cutter(tokenizer, with_system(messages or [], system_prompt), train_on))
        except DataError as exc:
            plans.append(exc)
            continue
        plans.append((len(texts), pieces, prompt_chars, text is not None))
        texts.extend(t for t, _ in pieces)
    ids = _tokenize(tokenizer, texts)
    piece_lists: List[List[int]] = []  # in row order, a text row's end-of-text as a piece of its own
    piece_flags: List[bool] = []
    rows = len(plans)
    length, overflow, supervised, prompt_len = ([0] * rows for _ in range(4))
    full = [0] * rows  # tokens of each row before truncation (0 for a row with an error)
    errors = [""] * rows
    for r, (row, plan) in enumerate(zip(batch["row"], plans)):
        if isinstance(plan, DataError):
            errors[r] = str(plan.located(file, row, unit))
            continue
        start, pieces, prompt_chars, is_text = plan
        lists = ids[start:start + len(pieces)] + ([eos] if is_text else [])
        flags = [f for _, f in pieces] + ([True] if is_text else [])
        total = kept = chars = prompt = 0
        last = None  # where the last supervised piece ends (tokens)
        for k, (tokens, flag) in enumerate(zip(lists, flags)):
            n = len(tokens)
            if flag and n:
                last = total + n
                kept += max(0, min(last, max_seq_len) - total)
            if k < len(pieces) and chars < prompt_chars:  # the prompt ends on a piece boundary
                chars, prompt = chars + len(pieces[k][0]), prompt + n
            total += n
        cut_tokens = max(0, total - max_seq_len)
        if cut_tokens and last is not None and last <= max_seq_len:
            cut_tokens = 0  # only an unsupervised tail is cut: nothing the loss sees is lost
        if cut_tokens == 0 and kept == 0:
            errors[r] = str(DataError("no supervised tokens").located(file, row, unit))
            continue
        piece_lists.extend(lists)
        piece_flags.extend(flags)
        full[r], length[r], overflow[r] = total, min(total, max_seq_len), cut_tokens
        supervised[r], prompt_len[r] = kept, prompt
    lens = np.fromiter((len(p) for p in piece_lists), dtype=np.int64, count=len(piece_lists))
    flat = np.fromiter(itertools.chain.from_iterable(piece_lists), dtype=np.int32, count=int(lens.sum()))
    labels = np.where(np.repeat(np.asarray(piece_flags, dtype=bool), lens), flat, np.int32(IGNORE_INDEX))
    full_arr = np.asarray(full, dtype=np.int64)
    starts = np.cumsum(full_arr) - full_arr
    keep = (np.arange(flat.size, dtype=np.int64) - np.repeat(starts, full_arr)) < max_seq_len
    offsets = pa.array(np.concatenate([[0], np.cumsum(length)]).astype(np.int32))
    columns = {"row": pa.array(batch["row"], pa.int64()),
               "input_ids": pa.ListArray.from_arrays(offsets, pa.array(flat[keep])),
               "labels": pa.ListArray.from_arrays(offsets, pa.array(labels[keep])),
               "length": pa.array(length, pa.int64()), "overflow": pa.array(overflow, pa.int64()),
               "supervised": pa.array(supervised, pa.int64()), "prompt_len": pa.array(prompt_len, pa.int64()),
               "error": pa.array(errors, pa.string())}
    return pa.table([columns[name] for name in ENCODED], names=ENCODED)


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
