"""The preference data of a run: every preference source of ``data.sources`` read, tokenized (cached), held out,
mixed by weight, as one :class:`qwenft.data.DataBundle` (the SFT build's bundle, so ``train``, ``eval``, ``qwenft
data`` and the evaluation take it unchanged).

Per source (:func:`load_pairs`): the rows read (:func:`qwenft.preference.data.read_preference`), then each example
tokenized on its own (:func:`qwenft.preference.data.tokenize_example`), an example that cannot be encoded kept as
its error message; both cached on disk under ``<qwenft cache>/data/.preference/<key>.pkl`` (written to a temporary
name, then renamed), the key covering the file's bytes, the tokenizer and every setting that changes the result.
Then, as for SFT (:func:`qwenft.data.build`): ``eval_rows`` held out (seeded, spread over ``eval_by``), the bad
rows raised (``data.on_bad_row=error``, the first in the file) or skipped and counted, ``overlong`` applied, the
sources mixed to their weights (:func:`qwenft.data.mix.mix_counts`, :func:`qwenft.data.mix.choose`).

Train rows (``bundle.train``, a ``datasets.Dataset``): ``prompt_ids``, ``chosen_ids``, ``rejected_ids`` for pairs;
for ``train.objective=kto`` ``prompt_ids``, ``completion_ids``, ``label`` (a pair gives two examples: chosen
desirable, rejected undesirable, as TRL's ``unpair_preference_dataset``). ``bundle.eval``: the held-out examples the
same way (the eval loss during training). ``bundle.eval_rows``: per source, the held-out rows as the evaluation reads
SFT's (``messages`` ending with the chosen answer, ``prompt_ids``, ``input_ids`` / ``labels`` of prompt + chosen)
plus ``rejected`` (text), ``rejected_input_ids`` and ``rejected_labels``; KTO rows carry their ``label`` instead.

SFT sources in the same run are built by the SFT path (:func:`qwenft.data.build`) and their held-out rows join
``eval_rows`` (e.g. general answers held out for retention). One of weight > 0 is also trained on: each is built
alone (its usable rows, once each) and mixed with the preference sources by weight, exactly as SFT sources mix;
its rows carry ``input_ids`` / ``labels`` (the preference columns empty, a pair's ``input_ids`` / ``labels`` empty),
and the trainer adds their NLL to the objective's loss (:mod:`qwenft.train.preference`). Under KTO they are
desirable examples instead (:func:`qwenft.preference.sft_mix.desirable`), batched with the others (so every batch's
KL estimate has its examples).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from qwenft.config import Config, ConfigError, DataSource
from qwenft.config.data import PREFERENCE_AUTO, UNPAIRED_FORMATS, is_preference
from qwenft.data.checks import eval_rows_for, eval_share_warning, skipped_lines
from qwenft.data.formats import DataError
from qwenft.data.mix import choose, eval_indices, mix_counts
from qwenft.data.pipeline import DataBundle
from qwenft.data.render import TemplateCache
from qwenft.data.template import IGNORE_INDEX
from qwenft.preference.data import (EncodedPair, EncodedUnpaired, PreferenceRead, PreferenceSource, read_preference,
                                    tokenize_example)
from qwenft.preference.formats import PreferencePair
from qwenft.preference.sft_mix import SFT_COLUMNS, UNPAIRED_COLUMNS, sft_build, sft_training_rows

log = logging.getLogger("qwenft.data")

CACHE_VERSION = 1
PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


@dataclass
class LoadedPairs:
    """One preference source read and tokenized (:func:`load_pairs`): ``read`` (its rows), ``encoded`` (per example,
    in order: an :class:`~qwenft.preference.data.EncodedPair` / ``EncodedUnpaired``, None when dropped by
    ``overlong=drop``, or the error message naming file, row and field) and ``hit`` (read from the cache)."""

    read: PreferenceRead
    encoded: List[Union[EncodedPair, EncodedUnpaired, str, None]]
    hit: bool


def preference_source(src: DataSource) -> PreferenceSource:
    """The :class:`~qwenft.preference.data.PreferenceSource` of a ``data.sources`` entry of a preference format."""
    fmt = "auto" if src.format == PREFERENCE_AUTO else src.format
    return PreferenceSource(name=src.name, path=src.path, format=fmt, columns=dict(src.columns),
                            max_rows=src.max_rows, subset=src.subset, split=src.split)


def _cache_path(src: DataSource, config: Config, fingerprint: str) -> Optional[Path]:
    """Where :func:`load_pairs` caches ``src`` (None: not a local file, or ``data.cache=false``)."""
    from qwenft.data.read import resolve_path
    from qwenft.data.source import file_digest
    from qwenft.data.store import data_root

    path = resolve_path(src.path)
    if not config.data.cache or not path.is_file():
        return None
    d = config.data
    settings = [CACHE_VERSION, file_digest(path), fingerprint, src.name, str(path), src.format, src.columns,
                src.max_rows, d.max_seq_len, d.system_prompt, d.overlong, d.on_bad_row]
    key = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return data_root() / ".preference" / f"{key}.pkl"


def load_pairs(src: DataSource, config: Config, tokenizer, fingerprint: str) -> LoadedPairs:
    """Read and tokenize one preference source, or take both from the cache (module docstring).

    Raises:
        DataError: see :func:`qwenft.preference.data.read_preference` (a bad row under ``on_bad_row=error`` is
            raised while read; one that cannot be tokenized is kept as its message, raised by :func:`build_preference`
            in file order).
    """
    cache = _cache_path(src, config, fingerprint)
    if cache is not None and cache.is_file():
        try:
            with open(cache, "rb") as handle:
                read, encoded = pickle.load(handle)
            return LoadedPairs(read=read, encoded=encoded, hit=True)
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError):
            log.warning("%s: the cached tokens at %s could not be read; tokenizing again", src.name, cache)
    d = config.data
    read = read_preference(preference_source(src), on_bad_row=d.on_bad_row)
    cutter = TemplateCache()
    encoded: List[Union[EncodedPair, EncodedUnpaired, str, None]] = []
    for example in read.examples:
        try:
            encoded.append(tokenize_example(example, tokenizer, max_seq_len=d.max_seq_len,
                                            system_prompt=d.system_prompt, overlong=d.overlong, cutter=cutter))
        except DataError as exc:
            encoded.append(str(exc.located(example.file, example.row, example.unit)))
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as handle:
            pickle.dump((read, encoded), handle, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, cache)
    return LoadedPairs(read=read, encoded=encoded, hit=False)


def _eval_row(example, item) -> Dict[str, Any]:
    """A held-out example as the evaluation reads a held-out row (module docstring)."""
    pair = isinstance(example, PreferencePair)
    answer = example.chosen if pair else example.answer
    row: Dict[str, Any] = {"messages": [*example.prompt, {"role": "assistant", "content": answer}], "text": None,
                           "meta": dict(example.meta), "row": example.row, "input_ids": None, "labels": None,
                           "prompt_ids": None}
    if pair:
        row.update(rejected=example.rejected, rejected_input_ids=None, rejected_labels=None)
    else:
        row["label"] = example.label
    if isinstance(item, (EncodedPair, EncodedUnpaired)):
        seqs = item.sequences()
        row["prompt_ids"] = list(item.prompt_ids)
        if pair:
            row.update(input_ids=seqs["chosen_input_ids"], labels=seqs["chosen_labels"],
                       rejected_input_ids=seqs["rejected_input_ids"], rejected_labels=seqs["rejected_labels"])
        else:
            row.update(input_ids=seqs["input_ids"], labels=seqs["labels"])
    return row


def _columns(items: List[Union[EncodedPair, EncodedUnpaired]], unpaired: bool) -> Dict[str, list]:
    """Train / eval columns of encoded examples (module docstring); pairs become two examples when ``unpaired``."""
    out: Dict[str, list] = {name: [] for name in (UNPAIRED_COLUMNS if unpaired else PAIR_COLUMNS)}
    for item in items:
        if not unpaired:
            out["prompt_ids"].append(item.prompt_ids)
            out["chosen_ids"].append(item.chosen_ids)
            out["rejected_ids"].append(item.rejected_ids)
        elif isinstance(item, EncodedPair):
            for answer, label in ((item.chosen_ids, True), (item.rejected_ids, False)):
                out["prompt_ids"].append(item.prompt_ids)
                out["completion_ids"].append(answer)
                out["label"].append(label)
        else:
            out["prompt_ids"].append(item.prompt_ids)
            out["completion_ids"].append(item.completion_ids)
            out["label"].append(item.label)
    return out


def _percentiles(values: List[int]) -> Dict[str, int]:
    import numpy as np

    if not values:
        return {"p50": 0, "p95": 0, "max": 0, "mean": 0}
    p50, p95 = np.percentile(np.asarray(values, dtype=np.int64), [50, 95])
    return {"p50": int(round(p50)), "p95": int(round(p95)), "max": int(max(values)),
            "mean": int(round(sum(values) / len(values)))}


def _usable(loaded: LoadedPairs, indices: List[int], on_bad_row: str, counts: Dict[str, Any],
            name: str) -> List[Union[EncodedPair, EncodedUnpaired]]:
    """The encoded examples at ``indices`` that can be trained on; fills ``counts`` (skipped: cannot be encoded;
    dropped: ``overlong=drop``; truncated: an answer cut)."""
    bad = [loaded.encoded[i] for i in indices if isinstance(loaded.encoded[i], str)]
    for line in skipped_lines(name, bad[:20], len(indices), len(bad)):
        log.warning("%s", line)
    kept = [loaded.encoded[i] for i in indices if isinstance(loaded.encoded[i], (EncodedPair, EncodedUnpaired))]
    counts["skipped"] += len(bad)
    counts["dropped"] += sum(loaded.encoded[i] is None for i in indices)
    counts["truncated"] += sum(item.truncated for item in kept)
    return kept


def build_preference(config: Config, tokenizer) -> DataBundle:
    """Build the preference run's data (module docstring).

    Returns:
        A :class:`qwenft.data.DataBundle`. ``stats`` as the SFT build's, plus ``objective`` and ``kind``
        (``preference``); ``tokens`` are the lengths of prompt + chosen + rejected (prompt + answer for KTO) of the
        examples used; ``supervised_share`` the answers' share of those tokens.

    Raises:
        ConfigError: no preference source; see :func:`qwenft.data.checks.eval_rows_for`.
        DataError: bad rows (the first in the file, under ``data.on_bad_row=error``: read or tokenized), a weighted
            source left with no usable example.
    """
    import datasets

    from qwenft.data.encode import tokenizer_fingerprint

    start = time.perf_counter()
    dcfg = config.data
    pref_sources = [(i, s) for i, s in enumerate(dcfg.sources) if is_preference(s.format)]
    if not pref_sources:
        raise ConfigError("data.sources holds no preference source (format pairs_alpaca, pairs_sharegpt, pairs_trl, "
                          "hh_rlhf, kto, kto_trl or preference)")
    unpaired = config.train.objective == "kto"
    fingerprint = tokenizer_fingerprint(tokenizer)
    per_source: Dict[str, Dict[str, Any]] = {}
    usable: Dict[str, List[Union[EncodedPair, EncodedUnpaired]]] = {}
    held_items: Dict[str, List[Union[EncodedPair, EncodedUnpaired]]] = {}
    eval_rows: Dict[str, List[dict]] = {}
    hits = misses = 0
    for index, src in pref_sources:
        loaded = load_pairs(src, config, tokenizer, fingerprint)
        hits, misses = hits + loaded.hit, misses + (not loaded.hit)
        read, n = loaded.read, len(loaded.read.examples)
        if not unpaired and read.format in UNPAIRED_FORMATS:  # detected (format: preference): refused as configured
            raise ConfigError(f"data.sources[{src.name}].format: {read.file} holds unpaired labelled answers (detected "
                              f"{read.format}); train.objective={config.train.objective} needs pairs (chosen and "
                              "rejected); use train.objective=kto")
        for line in skipped_lines(src.name, read.skipped, n + read.n_skipped, read.n_skipped):
            log.warning("%s", line)
        if dcfg.on_bad_row == "error":
            first = next((e for e in loaded.encoded if isinstance(e, str)), None)
            if first is not None:
                raise DataError(first)
        n_eval, clamped = eval_rows_for(src, index, n)
        for warning in (clamped, eval_share_warning(src, index, n)):
            if warning:
                log.warning("%s", warning)
        rows = [{"meta": e.meta, "row": e.row} for e in read.examples]
        held = eval_indices(rows, n_eval, dcfg.seed, src.name, src.eval_by, file=read.file, unit=read.unit)
        held_set = set(held)
        kept = [i for i in range(n) if i not in held_set]
        counts = {"path": src.path, "format": read.format, "rows_read": n + read.n_skipped,
                  "skipped": read.n_skipped, "eval": len(held), "truncated": 0, "dropped": 0, "weight": src.weight}
        if held:  # an undesirable answer (KTO, label false) is no reference for the answers generated; a held-out
            # example that could not be encoded (skipped under on_bad_row=skip, or dropped as overlong) is not scored
            rows_out = [_eval_row(read.examples[i], loaded.encoded[i]) for i in held]
            eval_rows[src.name] = [row for row in rows_out if row.get("label", True) and row["prompt_ids"] is not None]
            held_items[src.name] = _usable(loaded, held, dcfg.on_bad_row, counts, f"{src.name} (held out)")
        if src.weight > 0:
            usable[src.name] = _usable(loaded, kept, dcfg.on_bad_row, counts, src.name)
        counts["usable"] = len(usable.get(src.name, []))
        per_source[src.name] = counts

    weights = {src.name: src.weight for _, src in pref_sources}
    train_items = {name: _columns(items, unpaired) for name, items in usable.items()}
    available = {name: len(columns["prompt_ids"]) for name, columns in train_items.items()}  # KTO: a pair is two
    cache = {"hits": 0, "misses": 0}  # the SFT sources' builds
    sft_rows = sft_training_rows(config, tokenizer, per_source, eval_rows, cache)
    if unpaired:  # KTO: desirable examples among the others
        train_items.update(sft_rows)
        sft_rows = {}
    for name in per_source:
        if name not in weights:  # an SFT source trained on
            weights[name] = per_source[name]["weight"]
            available[name] = len(train_items[name]["prompt_ids"]) if unpaired else len(sft_rows[name]["input_ids"])
    counts_used = mix_counts(available, {n: weights[n] for n in available}) if available else {}
    picked = choose(available, counts_used, dcfg.seed) if available else None
    columns = UNPAIRED_COLUMNS if unpaired else PAIR_COLUMNS
    mixed = bool(sft_rows)
    train: Dict[str, list] = {name: [] for name in (*columns, *(SFT_COLUMNS if mixed else ()), "source")}
    blank = {"label": False}  # an SFT row's empty preference columns, a pair's empty SFT ones
    total = len(picked) if picked is not None else 0
    if picked is not None:
        for name, k in picked:
            own = sft_rows[name] if name in sft_rows else train_items[name]
            for column in train:
                if column != "source":
                    train[column].append(own[column][k] if column in own else blank.get(column, []))
            train["source"].append(name)
    active = sum(w for w in weights.values() if w > 0) or 1.0
    for name, counts in per_source.items():
        used = counts_used.get(name, 0)
        counts.update(used=used, repeats=max(0, used - available.get(name, 0)),
                      share_target=round(weights[name] / active, 6) if weights.get(name, 0) > 0 else 0.0,
                      share_achieved=round(used / total, 6) if total else 0.0)
    lengths, answer_tokens = [], 0
    for k in range(total):
        if mixed and train["input_ids"][k]:
            lengths.append(len(train["input_ids"][k]))
            answer_tokens += sum(t != IGNORE_INDEX for t in train["labels"][k])
            continue
        answers = ([train["completion_ids"][k]] if unpaired else [train["chosen_ids"][k], train["rejected_ids"][k]])
        lengths.append(len(train["prompt_ids"][k]) * len(answers) + sum(map(len, answers)))
        answer_tokens += sum(map(len, answers))
    evals = [_columns(items, unpaired) for items in held_items.values() if items]
    eval_columns = {c: [v for part in evals for v in part[c]] for c in columns}
    train_ds = datasets.Dataset.from_dict(train)
    eval_ds = datasets.Dataset.from_dict(eval_columns)
    sample = None
    first = next((k for k in range(total) if not (mixed and train["input_ids"][k])), None)  # the first pair
    if first is not None:
        sample = {"source": train["source"][first], **{c: train[c][first] for c in columns}}
    stats: Dict[str, Any] = {
        "kind": "preference", "objective": config.train.objective, "sources": per_source, "train_examples": total,
        "train_rows": total, "eval_examples": len(eval_ds), "tokens": _percentiles(lengths),
        "max_seq_len": dcfg.max_seq_len, "truncated": sum(c["truncated"] for c in per_source.values()),
        "dropped": sum(c["dropped"] for c in per_source.values()),
        "skipped": sum(c["skipped"] for c in per_source.values()),
        "supervised_share": round(answer_tokens / max(sum(lengths), 1), 6), "packing": False, "pack_fill": None,
        "cache_hits": hits, "cache_misses": misses, "system_prompt": None,
    }
    sft_eval = [s for s in dcfg.sources if not is_preference(s.format) and s.weight <= 0]
    bundle = DataBundle(train=train_ds, eval=eval_ds, eval_rows=eval_rows, stats=stats, sample=sample)
    stats["sft_rows"] = sum(per_source[name].get("used", 0) for name in sft_rows)  # KTO's are examples
    if sft_eval:  # SFT sources of weight 0: their held-out rows, evaluated beside the pairs
        other = sft_build(config, tokenizer, sft_eval, cache)
        bundle.eval_rows.update(other.eval_rows)
        stats["sources"].update(other.stats["sources"])
    stats["cache_hits"] += cache["hits"]
    stats["cache_misses"] += cache["misses"]
    stats["seconds"] = round(time.perf_counter() - start, 3)
    kind = "examples" if unpaired else "pairs"
    log.info("data: %d training %s (%s), %d held out (%d usable for the eval loss); tokens p50 %d p95 %d max %d; %d "
             "truncated, %d dropped; built in %.1f s (cache: %d hit(s), %d miss(es))", total - stats["sft_rows"],
             kind + (f" and {stats['sft_rows']} SFT rows" if stats["sft_rows"] else ""),
             ", ".join(f"{n} {c.get('used', 0)}" for n, c in per_source.items()),
             sum(c["eval"] for c in per_source.values()), len(eval_ds),
             stats["tokens"]["p50"], stats["tokens"]["p95"], stats["tokens"]["max"], stats["truncated"],
             stats["dropped"], stats["seconds"], stats["cache_hits"], stats["cache_misses"])
    return bundle


def has_preference(config: Config) -> bool:
    """Whether ``config``'s data holds a preference source (the build goes through :func:`build_preference`)."""
    return any(is_preference(s.format) for s in config.data.sources)


def build_run_data(config: Config, tokenizer) -> Optional[DataBundle]:
    """The data of a run (``train``, ``eval``, ``merge``'s measurements): :func:`build_preference` when a source is
    a preference one, else the SFT build (:func:`qwenft.data.build`); None without sources."""
    from qwenft.data.pipeline import build

    if not config.data.sources:
        return None
    return build_preference(config, tokenizer) if has_preference(config) else build(config, tokenizer)
