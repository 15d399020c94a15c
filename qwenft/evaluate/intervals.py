"""95% intervals for the verdict's gates: paired differences (tuned - base on the same items) and single means.

Right/wrong items (``contains_fact``, ``exact_match_number``, a benchmark question) are counted in the paired 2x2
table and get score intervals, which stay honest at small n and at 0 or n successes:

- a proportion: Wilson's score interval (Wilson 1927, "Probable inference, the law of succession, and statistical
  inference", JASA 22: 209-212);
- a paired difference of proportions: Newcombe's square-and-add interval from the two margins' Wilson intervals
  with the correlation correction (Newcombe 1998, "Improved confidence intervals for the difference between
  binomial proportions based on paired data", Statistics in Medicine 17: 2635-2650, method 10).

Graded items (``char_f1``, ``rouge_l`` in [0, 1]) get a percentile bootstrap over items: for a difference the per-item
differences are resampled together, so the pairing is kept (Efron & Tibshirani 1993, "An Introduction to the
Bootstrap"; Koehn 2004, "Statistical Significance Tests for Machine Translation Evaluation", for paired resampling
of one test set).

:func:`n_to_decide` gives the number of items at which an interval of the same shape would clear a threshold at the
observed effect: the half-width of each interval here shrinks as 1/sqrt(n) at a fixed effect, so
``n' = n * (half-width / distance to the threshold)^2`` (an estimate, stated as "about").
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

Z95 = 1.959963984540054  # the standard normal's 97.5th percentile
RESAMPLES = 10_000
WILSON = "Wilson score interval"
NEWCOMBE = "Newcombe paired score interval"
BOOTSTRAP = f"paired bootstrap over items, {RESAMPLES:,} resamples"
BOOTSTRAP_MEAN = f"bootstrap over items, {RESAMPLES:,} resamples"


def wilson(successes: int, n: int, z: float = Z95) -> Tuple[float, float]:
    """Wilson's score interval of a proportion ``successes / n`` (module docstring).

    Raises:
        ValueError: ``n < 1`` or ``successes`` outside ``[0, n]``.
    """
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"wilson needs 0 <= successes <= n and n >= 1; got {successes} of {n}")
    p = successes / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe_paired(both: int, tuned_only: int, base_only: int, neither: int,
                    z: float = Z95) -> Tuple[float, float]:
    """Newcombe's square-and-add interval of ``p_tuned - p_base`` for paired right/wrong items (module docstring).

    Args:
        both: items right on both sides; ``tuned_only``: right for tuned only (wrong -> right); ``base_only``: right
            for base only (right -> wrong); ``neither``: wrong on both.

    Returns:
        ``(low, high)`` around ``(tuned_only - base_only) / n``.

    Raises:
        ValueError: a negative count or no items.
    """
    counts = (both, tuned_only, base_only, neither)
    n = sum(counts)
    if min(counts) < 0 or n < 1:
        raise ValueError(f"newcombe_paired needs non-negative counts and at least one item; got {counts}")
    p_tuned, p_base = (both + tuned_only) / n, (both + base_only) / n
    low_t, high_t = wilson(both + tuned_only, n, z)
    low_b, high_b = wilson(both + base_only, n, z)
    margins = (both + tuned_only) * (base_only + neither) * (both + base_only) * (tuned_only + neither)
    phi = 0.0
    if margins > 0:  # the correlation of the two margins, with Newcombe's continuity correction toward 0
        cross = both * neither - tuned_only * base_only
        phi = (cross - n / 2 if cross > n / 2 else min(cross, 0)) / math.sqrt(margins)
    delta = p_tuned - p_base
    below = math.sqrt(max(0.0, (p_tuned - low_t) ** 2 + (high_b - p_base) ** 2
                          - 2 * phi * (p_tuned - low_t) * (high_b - p_base)))
    above = math.sqrt(max(0.0, (high_t - p_tuned) ** 2 + (p_base - low_b) ** 2
                          - 2 * phi * (high_t - p_tuned) * (p_base - low_b)))
    return max(-1.0, delta - below), min(1.0, delta + above)


def _bootstrap_means(values: Sequence[float], seed: int, resamples: int) -> List[float]:
    import numpy as np

    data = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    step = max(1, 2_000_000 // len(data))  # resamples per block: at most ~2 M indices (16 MB) at once
    for start in range(0, resamples, step):
        count = min(step, resamples - start)
        means[start:start + count] = data[rng.integers(0, len(data), size=(count, len(data)))].mean(axis=1)
    return means


def bootstrap_mean(values: Sequence[float], seed: int = 0, resamples: int = RESAMPLES) -> Tuple[float, float]:
    """95% percentile-bootstrap interval of ``mean(values)``; numpy's generator seeded with ``seed``.

    Raises:
        ValueError: no values.
    """
    import numpy as np

    if not len(values):
        raise ValueError("bootstrap_mean needs at least one value")
    low, high = np.percentile(_bootstrap_means(values, seed, resamples), [2.5, 97.5])
    return float(low), float(high)


def paired_bootstrap(base: Sequence[float], tuned: Sequence[float], seed: int = 0,
                     resamples: int = RESAMPLES) -> Tuple[float, float]:
    """95% percentile-bootstrap interval of ``mean(tuned) - mean(base)`` over paired items: the per-item
    differences resampled with replacement; ``(d, d)`` when every difference is the same ``d``.

    Raises:
        ValueError: lengths differ or no items.
    """
    if len(base) != len(tuned) or not len(base):
        raise ValueError(f"paired_bootstrap needs equal, non-empty lists; got {len(base)} and {len(tuned)} items")
    return bootstrap_mean([t - b for b, t in zip(base, tuned)], seed, resamples)


def is_binary(values: Sequence[float]) -> bool:
    """Whether every value is 0 or 1 (right/wrong items: score intervals; else the bootstrap)."""
    return all(v in (0, 1) for v in values)


def paired_interval(base: Sequence[float], tuned: Sequence[float], seed: int = 0) -> Tuple[Tuple[float, float], str]:
    """The 95% interval of ``mean(tuned) - mean(base)`` over paired items and its method's name: Newcombe's for
    right/wrong items (0/1 on both sides), else the paired bootstrap seeded with ``seed``.

    Raises:
        ValueError: lengths differ or no items.
    """
    if len(base) != len(tuned) or not len(base):
        raise ValueError(f"paired_interval needs equal, non-empty lists; got {len(base)} and {len(tuned)} items")
    if is_binary(base) and is_binary(tuned):
        pairs = list(zip(base, tuned))
        return newcombe_paired(pairs.count((1, 1)), pairs.count((0, 1)), pairs.count((1, 0)),
                               pairs.count((0, 0))), NEWCOMBE
    return paired_bootstrap(base, tuned, seed), BOOTSTRAP


def mean_interval(values: Sequence[float], seed: int = 0) -> Tuple[Tuple[float, float], str]:
    """The 95% interval of ``mean(values)`` and its method: Wilson's for 0/1 values, else the bootstrap.

    Raises:
        ValueError: no values.
    """
    if not len(values):
        raise ValueError("mean_interval needs at least one value")
    if is_binary(values):
        return wilson(int(sum(values)), len(values)), WILSON
    return bootstrap_mean(values, seed), BOOTSTRAP_MEAN


def n_to_decide(n: int, estimate: float, interval: Tuple[float, float], threshold: float) -> Optional[int]:
    """About how many items an interval of this shape needs to lie wholly on one side of ``threshold`` at the
    observed ``estimate`` (module docstring): the half-width on the threshold's side scaled by 1/sqrt(n).

    Returns:
        The item count (at least ``n + 1``), or None when ``estimate`` is the threshold itself (no n decides).
    """
    low, high = interval
    gap = estimate - threshold
    if abs(gap) < 1e-12:
        return None
    half = (estimate - low) if gap > 0 else (high - estimate)
    if half <= 0:
        return n
    return max(n + 1, math.ceil(n * (half / abs(gap)) ** 2))
