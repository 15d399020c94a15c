"""Eval hold-out and exact-ratio mixing: index arithmetic only, no tokenizer, no model (packing: collate.py).

Mixing rule (the size of an epoch):

- The *anchor* is the source with the largest weight (the first listed on a tie); all of its usable
  training rows are used, once per epoch, in a seeded random order.
- Every other source with weight ``w`` contributes ``round(n_anchor * w / w_anchor)`` examples (halves
  round up): its rows are drawn seeded and without replacement while rows last; only when a source has
  fewer rows than its share does a second pass (a fresh permutation) start, and so on.
- A weight of 0 keeps a source out of training (its ``eval_rows`` are still held out).

So the count of every source is within half an example of ``n_anchor * w / w_anchor``; with two sources
both shares of the total are within one example of the weights (the tests check this). The mixed list is
shuffled with ``data.seed``. The sample of a non-anchor source is the same in every epoch.
"""

from __future__ import annotations

import json
import math
import random
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from qwenft.data.formats import DataError


def group_key(value: object) -> str:
    """The ``eval_by`` group of a field value: its canonical JSON text (keys sorted), so any value a file holds
    (null, text, number, list, object) is one hashable group; a value JSON cannot write (e.g. a date from a parquet
    file) is written as its text."""
    try:
        return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
    except (TypeError, ValueError):  # e.g. an object whose keys cannot be sorted against each other
        return repr(value)


def split_eval(rows: Sequence[dict], n_eval: int, seed: int, name: str,
               by: Optional[str] = None) -> Tuple[List[dict], List[dict]]:
    """Hold out ``n_eval`` rows of a source, seeded by ``(seed, name)``.

    Args:
        rows: normalised rows (see :func:`qwenft.data.read_source`).
        n_eval: rows to hold out.
        seed: ``data.seed``.
        name: the source name (each source draws from its own stream).
        by: a ``meta`` field; when set, the held-out rows are spread over its values (one row of each
            value, in a seeded order, before any value gets a second one). Values are grouped by
            :func:`group_key`: a list or object is one value; ``1``, ``"1"`` and ``true`` are three.

    Returns:
        ``(eval_rows, train_rows)``, each in file order; disjoint and together ``rows``.

    Raises:
        DataError: ``n_eval`` is larger than the number of rows, or a row lacks the ``by`` field.
    """
    chosen = set(eval_indices(rows, n_eval, seed, name, by))
    held = [row for i, row in enumerate(rows) if i in chosen]
    kept = [row for i, row in enumerate(rows) if i not in chosen]
    return held, kept


def eval_indices(rows: Sequence[dict], n_eval: int, seed: int, name: str, by: Optional[str] = None, *,
                 file: Optional[str] = None, unit: str = "row") -> List[int]:
    """The positions in ``rows`` that :func:`split_eval` holds out, ascending. ``rows`` is only iterated for
    ``by`` (its ``meta``); otherwise only its length is used, so any sequence of rows will do (a lazy one).
    ``file`` and ``unit`` (``line`` or ``row``): what a row's error names (default: the source ``name``, ``row``).

    Raises:
        DataError: ``n_eval`` larger than ``rows``; a row without the ``by`` field (naming the file, its line or
            row and the field, with the fields it has)."""
    if n_eval > len(rows):
        raise DataError(f"eval_rows={n_eval} but the source has only {len(rows)} usable rows", file=name)
    rng = random.Random(f"{seed}:{name}:eval")
    if by is None:
        chosen = set(rng.sample(range(len(rows)), n_eval))
    else:
        groups: Dict[object, List[int]] = {}
        for i, row in enumerate(rows):  # iterated, not indexed: a lazy sequence reads its rows in batches
            if by not in row["meta"]:
                raise DataError(f"missing (needed by eval_by={by}; eval_by=null holds rows out at random); the row's "
                                f"other fields: {', '.join(row['meta']) or '(none besides those the format reads)'}",
                                file=file or name, row=row["row"], field=by, unit=unit)
            groups.setdefault(group_key(row["meta"][by]), []).append(i)
        order = list(groups.values())
        rng.shuffle(order)
        for members in order:
            rng.shuffle(members)
        chosen, depth = set(), 0
        while len(chosen) < n_eval:
            for members in order:
                if depth < len(members) and len(chosen) < n_eval:
                    chosen.add(members[depth])
            depth += 1
    return sorted(chosen)


def mix_counts(available: Dict[str, int], weights: Dict[str, float]) -> Dict[str, int]:
    """Examples per source for one epoch (see the module docstring for the rule).

    Args:
        available: usable training examples per source, in ``data.sources`` order.
        weights: mixing weight per source.

    Returns:
        Examples per source (0 for weight 0).

    Raises:
        DataError: a source with a positive weight has no usable training rows.
    """
    active = [name for name in available if weights[name] > 0]
    for name in active:
        if available[name] == 0:
            raise DataError("has weight > 0 but no usable training rows (all held out, dropped or skipped)",
                            file=name)
    anchor = max(active, key=lambda name: (weights[name], -active.index(name)))
    scale = available[anchor] / weights[anchor]
    counts = {name: 0 for name in available}
    for name in active:
        counts[name] = available[name] if name == anchor else math.floor(scale * weights[name] + 0.5)
    return counts


class Choice:
    """The examples of one epoch in training order (what :func:`choose` returns), as two index arrays.

    Attributes:
        names: the sources, in ``data.sources`` order.
        source: ``[examples]`` int64: example ``k`` comes from ``names[source[k]]``.
        index: ``[examples]`` int64: its position among that source's usable examples.

    Iterating (or indexing) gives ``(source name, index)`` pairs, one at a time; ``==`` compares the arrays (or,
    against a list, the pairs).
    """

    def __init__(self, names: Sequence[str], source, index) -> None:
        self.names, self.source, self.index = tuple(names), source, index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, k: int) -> Tuple[str, int]:
        return self.names[self.source[k]], int(self.index[k])

    def __iter__(self) -> Iterator[Tuple[str, int]]:
        for code, i in zip(self.source.tolist(), self.index.tolist()):
            yield self.names[code], i

    def __eq__(self, other: object) -> bool:
        import numpy as np

        if isinstance(other, Choice):
            return (self.names == other.names and np.array_equal(self.source, other.source)
                    and np.array_equal(self.index, other.index))
        return isinstance(other, list) and list(self) == other

    __hash__ = None  # mutable arrays inside: unhashable, as a list is


def choose(available: Dict[str, int], counts: Dict[str, int], seed: int) -> Choice:
    """Pick the examples of one epoch and shuffle them together.

    Each source draws from ``random.Random(f"{seed}:{name}:mix")``: a shuffled permutation of its usable examples
    per pass, taken from the front; the sources' picks, concatenated in ``counts`` order, are then shuffled with
    ``random.Random(f"{seed}:order")``. The random calls are those of shuffling the list of ``(name, index)`` pairs
    (a shuffle's calls depend only on the list's length), applied to index arrays: no pair is ever made.

    Returns:
        A :class:`Choice` (``source`` and ``index`` arrays, ``[sum(counts)]``) in training order.
    """
    import numpy as np

    sources: List = []
    indices: List = []
    for code, (name, count) in enumerate(counts.items()):
        rng = random.Random(f"{seed}:{name}:mix")
        taken = 0
        while taken < count:  # a fresh permutation per pass: no repeat before every row is used
            perm = list(range(available[name]))
            rng.shuffle(perm)
            part = np.array(perm[: count - taken], dtype=np.int64)
            del perm
            indices.append(part)
            sources.append(np.full(len(part), code, dtype=np.int64))
            taken += len(part)
    total = sum(len(part) for part in indices)
    order = list(range(total))
    random.Random(f"{seed}:order").shuffle(order)
    order = np.array(order, dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    return Choice(list(counts), (np.concatenate(sources) if sources else empty)[order],
                  (np.concatenate(indices) if indices else empty)[order])
