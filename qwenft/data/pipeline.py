"""``build``: sources -> normalised rows -> eval hold-out -> token ids + labels (cached) -> mixed -> packed.

One way through: each source is read once and tokenized into a cache entry on disk (:mod:`qwenft.data.source`),
the eval hold-out, usable rows and statistics are index arithmetic on its columns, and the held-out rows come back
with their ids.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from qwenft.config import Config, ConfigError, DataConfig
from qwenft.data.checks import LISTED_SKIPS, eval_rows_for, eval_share_warning, skipped_lines
from qwenft.data.collate import Packing, pack_examples, packing_of
from qwenft.data.encode import tokenizer_fingerprint
from qwenft.data.formats import DataError
from qwenft.data.mix import choose, eval_indices, mix_counts
from qwenft.data.source import load_source
from qwenft.data.template import prompt_ids, trained_system

log = logging.getLogger(__name__)

COLUMNS = ["input_ids", "labels", "length"]


@dataclass
class DataBundle:
    """What :func:`build` returns.

    Attributes:
        train: ``datasets.Dataset`` (memory-mapped, in training order through an indices mapping) with
            ``input_ids`` and ``labels`` (``[seq]`` lists of ids; labels -100 where not supervised); when
            ``data.packing``, a :class:`qwenft.data.collate.PackedDataset` whose rows also carry ``position_ids``
            restarting at 0 for each example (gathered from the memory map when asked for).
        eval: the held-out rows, tokenized the same way, never packed (possibly empty), for the eval loss.
        eval_rows: source name -> the held-out normalised rows (``messages`` with the reference answer last,
            ``text``, ``meta``, ``row``), each with its tokens for evaluation: ``input_ids`` and ``labels`` as
            trained on (truncated to ``max_seq_len``; None for a row that could not be encoded, skipped with
            ``on_bad_row=skip``) and ``prompt_ids`` (a conversation's generation prompt, token for token the
            trainer's prefix of its answer, :func:`qwenft.data.prompt_ids`; None for ``text``).
        stats: counts per source, ratio achieved, token lengths, truncated / dropped / skipped counts,
            supervised share, packing fill, cache hits (see :func:`build`).
        sample: the first training example before packing: ``{source, row, input_ids, labels}``.
        train_row_ids: source name -> the ``row`` numbers of its training examples, in training order
            (repeats included): a numpy int64 array ``[examples of that source]``.
        packing: whether and how ``train`` is packed (:func:`qwenft.data.packing_of`); the collator is built
            from it (:func:`qwenft.data.collator`).
    """

    train: Any
    eval: Any
    eval_rows: Dict[str, List[dict]]
    stats: Dict[str, Any]
    sample: Optional[Dict[str, Any]] = field(default=None, repr=False)
    train_row_ids: Dict[str, Any] = field(default_factory=dict, repr=False)
    packing: Packing = field(default_factory=Packing)


def _column(ds, name: str):
    """The column ``name`` of ``ds`` (a dataset without an indices mapping) as one numpy array, read whole from
    Arrow (never row by row)."""
    import numpy as np

    return np.asarray(ds.with_format("arrow")[name])


def _usable(encoded, indices, dcfg: DataConfig, counts: Dict[str, Any], name: str):
    """Apply on_bad_row and overlong to the rows ``indices`` (numpy, ascending) of a tokenized source (whole
    columns, no row loop); fills ``counts``.

    Returns:
        ``(usable, columns)``: the usable rows (``encoded.select``) and their ``length``, ``overflow``,
        ``supervised`` and ``row`` as numpy arrays (for the statistics, without reading the rows again).
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    errors = encoded.with_format("arrow")["error"].take(pa.array(indices, type=pa.int64()))
    failed = np.asarray(pc.not_equal(errors, ""), dtype=bool) if len(errors) else np.zeros(0, dtype=bool)
    n_bad = int(np.count_nonzero(failed))
    # the first messages only: the log names LISTED_SKIPS of them and counts the rest
    bad = errors.filter(pa.array(failed, type=pa.bool_())).slice(0, LISTED_SKIPS).to_pylist() if n_bad else []
    if bad and dcfg.on_bad_row == "error":
        raise DataError(bad[0])
    for line in skipped_lines(name, bad, len(errors), n_bad):
        log.warning("%s", line)
    cut = _column(encoded, "overflow")[indices] > 0
    # truncation that leaves nothing to learn also drops
    drop = ~failed & cut & ((_column(encoded, "supervised")[indices] == 0) | (dcfg.overlong == "drop"))
    keep = np.flatnonzero(~failed & ~drop)
    counts["skipped"] += n_bad
    counts["truncated"] += int(np.count_nonzero(cut[keep]))
    counts["dropped"] += int(np.count_nonzero(drop))
    rows = indices[keep]
    columns = {column: _column(encoded, column)[rows] for column in ("length", "overflow", "supervised", "row")}
    return (encoded if len(rows) == len(encoded) else encoded.select(rows)), columns


def _first_error(encoded) -> None:
    """Raise the first row of ``encoded`` (a tokenized source, in file order) that could not be encoded, if any.

    Raises:
        DataError: that row's error (file, line or row, field).
    """
    import pyarrow.compute as pc

    errors = encoded.with_format("arrow")["error"]
    if len(errors):
        first = pc.index(pc.not_equal(errors, ""), True).as_py()
        if first >= 0:
            raise DataError(errors[first].as_py())


def _percentiles(values) -> Dict[str, int]:
    import numpy as np

    values = np.asarray(values, dtype=np.int64)
    if not len(values):
        return {"p50": 0, "p95": 0, "max": 0, "mean": 0}
    p50, p95 = np.percentile(values, [50, 95])  # linear interpolation between order statistics
    return {"p50": int(round(p50)), "p95": int(round(p95)), "max": int(values.max()),
            "mean": int(round(int(values.sum()) / len(values)))}


def _with_ids(held: List[dict], encoded, tokenizer, system_prompt: Optional[str]) -> List[dict]:
    """The held-out rows with their tokens (see :class:`DataBundle` ``eval_rows``), from ``encoded``, their
    :func:`qwenft.data.encode.tokenize_rows` result (one row each, in order). A conversation's prompt is its tokens
    before the last answer; only where those were cut (``max_seq_len``) or the row could not be encoded is it
    tokenized again."""
    out = []
    columns = (encoded[name] for name in ("row", "input_ids", "labels", "prompt_len", "error"))
    for row, (number, ids, labels, prompt_len, error) in zip(held, zip(*columns)):
        assert number == row["row"], "tokenize_rows returns its rows in order"
        prompt = None
        if row["text"] is None:
            prompt = (ids[:prompt_len] if not error and 0 < prompt_len <= len(ids)
                      else prompt_ids(tokenizer, row["messages"], system_prompt))
        out.append({**row, "input_ids": None if error else ids, "labels": None if error else labels,
                    "prompt_ids": prompt})
    return out


def _eval_only_bundle(held_out, eval_rows, per_source, dcfg: DataConfig, hits: int, misses: int,
                      packing: Packing, start: float) -> DataBundle:
    """The bundle of a run whose sources all have weight 0: an empty training set, the held-out rows (``start``:
    the build's ``time.perf_counter()`` at its start, for ``stats["seconds"]``)."""
    import datasets

    empty = datasets.Dataset.from_dict({"input_ids": [], "labels": []})
    evals = [held_out[n].select_columns(["input_ids", "labels"]) for n in held_out if len(held_out[n])]
    eval_ds = datasets.concatenate_datasets(evals) if evals else empty
    lengths = [len(ids) for ids in eval_ds["input_ids"]]
    supervised = sum(sum(label != -100 for label in labels) for labels in eval_ds["labels"])
    sample = None
    if len(eval_ds):
        name = next(n for n in held_out if len(held_out[n]))
        sample = {"source": name, "row": eval_rows[name][0].get("row"), "input_ids": eval_ds[0]["input_ids"],
                  "labels": eval_ds[0]["labels"]}
    for counts in per_source.values():
        counts.update(used=0, repeats=0, share_target=0.0, share_achieved=0.0)
    stats = {"sources": per_source, "train_examples": 0, "train_rows": 0, "eval_examples": len(eval_ds),
             "tokens": _percentiles(lengths), "max_seq_len": dcfg.max_seq_len, "truncated": 0, "dropped": 0,
             "skipped": sum(c["skipped"] for c in per_source.values()),
             "supervised_share": round(supervised / max(sum(lengths), 1), 6),
             "packing": dcfg.packing, "pack_fill": None, "cache_hits": hits, "cache_misses": misses,
             "seconds": round(time.perf_counter() - start, 3)}
    log.info("data: evaluation only (every source has weight 0): %d eval examples", len(eval_ds))
    return DataBundle(train=empty, eval=eval_ds, eval_rows=eval_rows, stats=stats, sample=sample,
                      train_row_ids={}, packing=packing)


def build(config: Config, tokenizer, positions: Optional[Sequence[int]] = None) -> DataBundle:
    """Build the training and eval datasets of ``config.data``.

    Steps: read and validate every source (:func:`qwenft.data.read_source`), hold out ``eval_rows`` per source
    (seeded), tokenize with the chat template and response-only labels (cached, ``datasets.map``), apply
    ``overlong`` (truncate keeps the first ``max_seq_len`` tokens; an example left with no supervised token
    is dropped), mix to the weights (rule in :mod:`qwenft.data.mix`), then pack as :func:`qwenft.data.packing_of`
    decides (``data.packing``). The held-out rows keep their tokens for evaluation (``eval_rows``).

    Args:
        config: the validated config (``config.data``; ``model.attn_implementation`` for the packing).
        tokenizer: from :func:`qwenft.model.load_tokenizer`.
        positions: each source's position in the user's ``data.sources``, for the messages that name it
            (``data.sources.N``; default: its position in ``config.data.sources``; a preference run builds its SFT
            sources apart, :mod:`qwenft.preference.pipeline`).

    Returns:
        A :class:`DataBundle`. ``stats`` holds ``sources`` (per source: rows read, skipped, eval (rows held out),
        usable, truncated, dropped, used, weight, share target and achieved; skipped, truncated and dropped count
        held-out rows too), ``train_examples``, ``train_rows``
        (packed rows, or examples), ``eval_examples``, ``tokens`` (p50 / p95 / max / mean length of the
        used examples before truncation), ``truncated``, ``dropped``, ``skipped``, ``supervised_share``
        (supervised / all tokens of the used examples), ``pack_fill`` (tokens / (rows x max_seq_len)),
        ``cache_hits`` / ``cache_misses`` (sources found in / added to the cache, :mod:`qwenft.data.source`) and
        ``system_prompt`` (the one most training examples carried and its
        share, :func:`qwenft.data.template.trained_system`) and ``seconds`` (wall seconds of this build: reading,
        tokenizing or opening the cache, mixing, packing; not the tokenizer's load).

    Raises:
        ConfigError: no sources; ``eval_rows`` larger than a training source of under 3 rows (:func:`eval_rows_for`).
        DataError: bad data (see :func:`qwenft.data.read_source`), a row with no supervised token (unless
            ``on_bad_row=skip``; the first such row in the file, held out or not), a weighted source left with no
            rows.

    Example:
        The project's general data (run from a checkout), 8 rows held out, for the tiny-random model:

        >>> from qwenft.config import Config, DataConfig, DataSource, TinyModelConfig
        >>> from qwenft.model import load_tokenizer
        >>> from qwenft.model.tiny import tiny_model_dir
        >>> tokenizer = load_tokenizer(str(tiny_model_dir(TinyModelConfig())))
        >>> source = DataSource(name="general", path="data/general.jsonl", eval_rows=8)
        >>> bundle = build(Config(data=DataConfig(sources=[source])), tokenizer)
        >>> bundle.stats["train_examples"], len(bundle.eval_rows["general"])
        (105, 8)
    """
    import datasets
    import numpy as np

    start = time.perf_counter()
    dcfg = config.data
    if not dcfg.sources:
        raise ConfigError("data.sources is empty; give at least one source (see conf/data/default.yaml)")
    fingerprint = tokenizer_fingerprint(tokenizer)
    packing = packing_of(config)
    per_source: Dict[str, Dict[str, Any]] = {}
    usable: Dict[str, Any] = {}
    columns: Dict[str, Dict[str, Any]] = {}  # per source: length, overflow, supervised, row of its usable rows
    held_out: Dict[str, Any] = {}
    eval_rows: Dict[str, List[dict]] = {}
    systems: Dict[str, Dict[Optional[str], int]] = {}  # per source: system prompt -> rows trained with it
    hits = misses = 0
    for k, src in enumerate(dcfg.sources):
        index = positions[k] if positions is not None else k
        data = load_source(src, index, dcfg, tokenizer, fingerprint)  # read + tokenized, or from the cache
        hits, misses = hits + data.hit, misses + (not data.hit)
        n, skipped = len(data.rows), data.n_skipped
        for line in skipped_lines(src.name, data.skipped, n + skipped, skipped):  # before any other check
            log.warning("%s", line)
        if dcfg.on_bad_row == "error":  # the first bad row in the file, held out or not
            _first_error(data.encoded)
        n_eval, clamped = eval_rows_for(src, index, n)  # more than the source has: clamped or refused
        if src.weight <= 0 and not src.eval_rows:
            log.warning("%s: weight 0 and no eval_rows: neither trained nor evaluated on; set "
                        "data.sources.%d.eval_rows=N to evaluate on it, or a weight > 0 to train on it", src.name, index)
        for warning in (clamped, data.placeholder, eval_share_warning(src, index, n)):
            if warning:
                log.warning("%s", warning)
        held_idx = np.asarray(eval_indices(data.rows, n_eval, dcfg.seed, src.name, src.eval_by,
                                             file=src.path, unit=data.unit), dtype=np.int64)
        kept_idx = np.setdiff1d(np.arange(n, dtype=np.int64), held_idx, assume_unique=True)
        counts = {"path": src.path, "format": src.format, "rows_read": n + skipped,
                  "skipped": skipped, "eval": len(held_idx), "truncated": 0, "dropped": 0, "weight": src.weight}
        if len(held_idx):
            held = data.take(held_idx)
            eval_rows[src.name] = _with_ids(held, data.encoded.select(held_idx), tokenizer, dcfg.system_prompt)
            held_out[src.name], _ = _usable(data.encoded, np.sort(held_idx), dcfg, counts, f"{src.name} (held out)")
        if src.weight > 0:
            systems[src.name] = data.system_counts(kept_idx, dcfg.system_prompt)
            usable[src.name], columns[src.name] = _usable(data.encoded, kept_idx, dcfg, counts, src.name)
        counts["usable"] = len(usable[src.name]) if src.name in usable else 0
        per_source[src.name] = counts

    if not usable:  # evaluation-only sources (every weight 0): nothing to mix, only held-out rows
        return _eval_only_bundle(held_out, eval_rows, per_source, dcfg, hits, misses, packing, start)
    weights = {src.name: src.weight for src in dcfg.sources}
    available = {name: len(ds) for name, ds in usable.items()}
    counts_used = mix_counts(available, {n: weights[n] for n in available})
    picked = choose(available, counts_used, dcfg.seed)
    names = list(usable)
    assert list(picked.names) == names, "choose keeps the sources' order"
    starts = np.cumsum([0] + [available[n] for n in names[:-1]]).astype(np.int64)  # each source's first row in pool
    order, origin = starts[picked.source] + picked.index, picked.source
    pool = datasets.concatenate_datasets([usable[n].select_columns(COLUMNS + ["row"]) for n in names])
    selected = pool.select(order)
    chosen = {column: np.concatenate([columns[n][column] for n in names])[order]
              for column in ("length", "overflow", "supervised", "row")}
    total = len(selected)
    active = sum(w for w in weights.values() if w > 0)
    for name, counts in per_source.items():
        used = counts_used.get(name, 0)
        counts.update(used=used, repeats=max(0, used - counts["usable"]),
                      share_target=round(weights[name] / active, 6), share_achieved=round(used / total, 6))

    full_lengths = chosen["length"] + chosen["overflow"]
    n_tokens, n_supervised = int(chosen["length"].sum()), int(chosen["supervised"].sum())
    examples = selected.select_columns(["input_ids", "labels"])
    train = pack_examples(examples, packing.max_len, chosen["length"]) if packing.packed else examples
    evals = [held_out[n].select_columns(["input_ids", "labels"]) for n in held_out if len(held_out[n])]
    eval_ds = (datasets.concatenate_datasets(evals) if evals
               else datasets.Dataset.from_dict({"input_ids": [], "labels": []}))
    first = selected[0]
    sample = {"source": picked[0][0], "row": first["row"], "input_ids": first["input_ids"], "labels": first["labels"]}
    stats = {
        "sources": per_source, "train_examples": total, "train_rows": len(train), "eval_examples": len(eval_ds),
        "tokens": _percentiles(full_lengths), "max_seq_len": dcfg.max_seq_len,
        "truncated": sum(c["truncated"] for c in per_source.values()),
        "dropped": sum(c["dropped"] for c in per_source.values()),
        "skipped": sum(c["skipped"] for c in per_source.values()),
        "supervised_share": round(n_supervised / max(n_tokens, 1), 6), "packing": dcfg.packing,
        "pack_fill": round(n_tokens / (len(train) * dcfg.max_seq_len), 6) if dcfg.packing else None,
        "cache_hits": hits, "cache_misses": misses, "system_prompt": trained_system(systems, counts_used),
        "seconds": round(time.perf_counter() - start, 3),
    }
    log.info("data: %d training examples (%s), %d eval; tokens p50 %d p95 %d max %d; %d truncated, %d dropped; "
             "built in %.1f s (cache: %d hit(s), %d miss(es))",
             total, ", ".join(f"{n} {c['used']}" for n, c in per_source.items()), len(eval_ds),
             stats["tokens"]["p50"], stats["tokens"]["p95"], stats["tokens"]["max"], stats["truncated"],
             stats["dropped"], stats["seconds"], hits, misses)
    row_ids = {name: chosen["row"][origin == k] for k, name in enumerate(names)}
    return DataBundle(train=train, eval=eval_ds, eval_rows=eval_rows, stats=stats, sample=sample,
                      train_row_ids=row_ids, packing=packing)
