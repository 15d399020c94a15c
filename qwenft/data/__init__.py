"""The data pipeline, one way: rows -> typed examples -> token ids + labels -> mix -> pack -> collate.

Modules, one step each:

- :mod:`~qwenft.data.read`, :mod:`~qwenft.data.records` and :mod:`~qwenft.data.formats`: files (.json, .jsonl,
  .csv, .parquet, streamed a block at a time) or Hugging Face datasets, formats alpaca / messages / sharegpt /
  text with ``columns`` renaming fields, rows validated with errors that name file, line or row, and field
  (:class:`DataError`); a row missing a field says which other format it looks like, and the override that sets it.
- :mod:`~qwenft.data.checks`: ``replace`` fills ``{{name}}`` placeholders; warnings for unfilled ones, skipped
  rows (count, first rows, "... and N more") and an ``eval_rows`` share above a third; ``eval_rows`` larger than
  a source clamped (to a third of a training source, with a warning) or refused (``checks.eval_rows_for``).
- :mod:`~qwenft.data.template`: the tokenizer's own chat template, response-only labels
  (:func:`encode_example`), and the sampler's prompt (:func:`prompt_ids`), token for token the prefix the
  trainer saw.
- :mod:`~qwenft.data.mix`: seeded eval hold-out, exact-ratio mixing (the largest-weight source used once per
  epoch, the others sampled to the ratio without replacement while rows last).
- :mod:`~qwenft.data.encode`: token ids and labels in a batched ``datasets.map`` (the rows as a typed messages
  column, the tokenizer as an argument), written to disk; :mod:`~qwenft.data.store`: cache entries in shards
  (resumable, memory-mapped, listed and cleared); :mod:`~qwenft.data.source`: one source read once, keyed by the
  file's bytes + tokenizer + settings (a hit reads nothing).
- :mod:`~qwenft.data.pipeline`: :func:`build` ties the steps together (eval hold-out, usable rows and statistics on
  whole columns) and returns a :class:`DataBundle`: datasets, stats, the held-out rows with their token ids (which
  evaluation uses as they are) and the packing.
- :mod:`~qwenft.data.collate`: packing in one place: :func:`packing_of` decides it from the config (the bundle
  carries it), :func:`pack` / :func:`pack_examples` build the rows, :func:`collator` gives the Trainer its
  :class:`DataCollator` (right padding, labels padded by position, packed rows, flash-attention's flat batch).
- :mod:`~qwenft.data.command`: :func:`~qwenft.data.command.data_command`, the ``python -m qwenft data`` command (a
  command room: it may import :mod:`qwenft.model`; the rest of this room imports only :mod:`qwenft.config`,
  :mod:`qwenft.chat`, :mod:`qwenft.files` and, for the cache directory, :mod:`qwenft.runtime`).
"""

from qwenft.data.encode import tokenizer_fingerprint
from qwenft.data.pipeline import DataBundle, build
from qwenft.data.collate import DataCollator, Packing, collator, pack, pack_examples, packing_of
from qwenft.data.formats import DataError, normalise
from qwenft.data.mix import choose, mix_counts, split_eval
from qwenft.data.read import read_rows, read_source, resolve_path
from qwenft.data.template import IGNORE_INDEX, encode_example, encode_text, prompt_ids, segments, with_system

__all__ = [
    "DataBundle", "DataCollator", "DataError", "IGNORE_INDEX", "Packing", "build", "choose", "collator",
    "encode_example", "encode_text", "mix_counts", "normalise", "pack", "pack_examples", "packing_of", "prompt_ids",
    "read_rows", "read_source", "resolve_path", "segments", "split_eval", "tokenizer_fingerprint", "with_system",
]
