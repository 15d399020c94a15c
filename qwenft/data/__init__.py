"""The data pipeline: read -> normalise to chat messages -> validate -> template + tokenize + mask -> mix -> pack.

Modules, one step each:

- :mod:`~qwenft.data.read` and :mod:`~qwenft.data.formats`: files (.json, .jsonl, .csv, .parquet) or
  Hugging Face datasets, formats alpaca / messages / sharegpt / text with ``columns`` renaming fields, rows
  validated with errors that name file, line or row, and field (:class:`DataError`).
- :mod:`~qwenft.data.checks`: ``replace`` fills ``{{name}}`` placeholders; warnings for unfilled ones, skipped
  rows (count, first rows, "... and N more") and an ``eval_rows`` share above a third.
- :mod:`~qwenft.data.template`: the tokenizer's own chat template, response-only labels
  (:func:`encode_example`), and the sampler's prompt (:func:`prompt_ids`), token for token the prefix the
  trainer saw.
- :mod:`~qwenft.data.mix`: seeded eval hold-out, exact-ratio mixing (the largest-weight source used once per
  epoch, the others sampled to the ratio without replacement while rows last), packing.
- :mod:`~qwenft.data.pipeline`: :func:`build` ties the steps together, caches tokenized data by content +
  tokenizer + settings, and reports :class:`DataBundle` stats.
- :mod:`~qwenft.data.collate`: :class:`DataCollator` (right padding, labels padded by position, packed rows).
- :mod:`~qwenft.data.command`: :func:`~qwenft.data.command.preview`, the ``python -m qwenft data`` command (a
  command room: it may import :mod:`qwenft.model`; the rest of this room imports only :mod:`qwenft.config`,
  :mod:`qwenft.chat`, :mod:`qwenft.files`).
"""

from qwenft.data.pipeline import DataBundle, build, tokenizer_fingerprint
from qwenft.data.collate import DataCollator
from qwenft.data.formats import DataError, normalise
from qwenft.data.mix import choose, mix_counts, pack, split_eval
from qwenft.data.read import read_rows, read_source, resolve_path
from qwenft.data.template import IGNORE_INDEX, encode_example, encode_text, prompt_ids, segments, with_system

__all__ = [
    "DataBundle", "DataCollator", "DataError", "IGNORE_INDEX", "build", "choose", "encode_example", "encode_text",
    "mix_counts", "normalise", "pack", "prompt_ids", "read_rows", "read_source", "resolve_path",
    "segments", "split_eval", "tokenizer_fingerprint", "with_system",
]
