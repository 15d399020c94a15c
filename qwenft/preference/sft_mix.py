"""The SFT sources of a preference run (:mod:`qwenft.preference.pipeline`): built by the SFT path
(:func:`qwenft.data.build`), apart from the pairs, their messages still naming their ``data.sources`` positions; one of
weight > 0 is trained on, its rows mixed with the pairs by weight (their NLL joins the objective's loss,
:mod:`qwenft.train.preference`), or under KTO as desirable examples (:func:`desirable`)."""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any, Dict, List

from qwenft.config import Config, DataSource
from qwenft.config.data import is_preference
from qwenft.data.pipeline import DataBundle
from qwenft.data.template import IGNORE_INDEX

log = logging.getLogger("qwenft.data")

SFT_COLUMNS = ("input_ids", "labels")  # an SFT row mixed in (its preference columns empty)
UNPAIRED_COLUMNS = ("prompt_ids", "completion_ids", "label")  # KTO's examples (qwenft.preference.pipeline)


def sft_build(config: Config, tokenizer, sources: List[DataSource], cache: Dict[str, int]) -> DataBundle:
    """The SFT build (:func:`qwenft.data.build`) of ``sources`` (entries of ``config.data.sources``, named by their
    positions there in its messages) alone, in ``config``'s data settings; its cache hits and misses added to
    ``cache``."""
    from qwenft.data.pipeline import build

    sft_config = copy.copy(config)  # no Config.__post_init__: the objective's checks are not the SFT build's
    sft_config.data = dataclasses.replace(config.data, sources=sources)
    level = log.level
    log.setLevel(max(logging.WARNING, log.getEffectiveLevel()))  # its summary line is part of the preference build's
    try:
        bundle = build(sft_config, tokenizer, positions=[source_position(config, src) for src in sources])
    finally:
        log.setLevel(level)
    cache["hits"] += bundle.stats["cache_hits"]
    cache["misses"] += bundle.stats["cache_misses"]
    return bundle


def source_position(config: Config, src: DataSource) -> int:
    """``src``'s position in ``config.data.sources`` (source names are unique: ``qwenft.config``)."""
    return next(k for k, other in enumerate(config.data.sources) if other.name == src.name)


def sft_training_rows(config: Config, tokenizer, per_source: Dict[str, Dict[str, Any]],
                       eval_rows: Dict[str, List[dict]], cache: Dict[str, int]) -> Dict[str, Dict[str, list]]:
    """The SFT sources of weight > 0 of a preference run, each built alone (weight 1: every usable row once, its
    held-out rows into ``eval_rows``, its counts into ``per_source`` with its own weight): per source, its rows'
    ``input_ids`` and ``labels`` columns, to be mixed with the pairs by weight; for ``train.objective=kto``, its
    rows as desirable examples instead (:func:`desirable`)."""
    out: Dict[str, Dict[str, list]] = {}
    for src in config.data.sources:
        if is_preference(src.format) or src.weight <= 0:
            continue
        source = dataclasses.replace(src, weight=1.0)  # built alone: every usable row once
        bundle = sft_build(config, tokenizer, [source], cache)
        eval_rows.update(bundle.eval_rows)
        per_source[src.name] = {**bundle.stats["sources"][src.name], "weight": src.weight}
        columns = {column: bundle.train[column] for column in SFT_COLUMNS}
        out[src.name] = desirable(columns) if config.train.objective == "kto" else columns
    return out


def desirable(columns: Dict[str, list]) -> Dict[str, list]:
    """SFT rows as KTO's desirable examples: each row's last answer (its last run of supervised tokens) after the
    conversation before it as the prompt, label true (the KTO paper's use of SFT data); an earlier answer of a
    multi-turn row is then part of the prompt, and the unsupervised tokens after the last answer are left out."""
    out: Dict[str, list] = {name: [] for name in UNPAIRED_COLUMNS}
    for ids, labels in zip(columns["input_ids"], columns["labels"]):
        end = max(k for k, t in enumerate(labels) if t != IGNORE_INDEX) + 1
        start = end
        while start > 0 and labels[start - 1] != IGNORE_INDEX:
            start -= 1
        out["prompt_ids"].append(list(ids[:start]))
        out["completion_ids"].append(list(ids[start:end]))
        out["label"].append(True)
    return out
