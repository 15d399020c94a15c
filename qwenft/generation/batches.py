"""Many prompts through the sampler: batches of similar length, results in input order, few compiled shapes.

Used by the evaluation (held-out prompts, base and tuned) and by ``qwenft generate prompts_file=...``. Prompts
are sorted by token length (a stable sort, so the batches are deterministic) and cut into batches of
``batch_size``: similar lengths waste less compute on left padding. On the static / compiled path every decode
step's shapes are ``[rows, 1]`` inputs over a ``[rows, cache_len]`` cache; rows are padded to one size and cache
lengths to at most :data:`MAX_SHAPES` values (:func:`plan_batches`), so an evaluation compiles at most 3 times,
and a tuned side whose LoRA delta was folded into the same weights (:mod:`qwenft.model.fold`) reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from qwenft.generation.results import GenerationStats, SequenceResult

MAX_SHAPES = 3
ALIGN = 16  # cache lengths are rounded up to a multiple of 16 tokens


@dataclass(frozen=True)
class Batch:
    """Prompt indices (into the caller's list) of one batch and the static cache length it runs with."""

    indices: Tuple[int, ...]
    cache_len: int


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_batches(lengths: Sequence[int], batch_size: int, max_new_tokens: int,
                 max_shapes: int = MAX_SHAPES) -> List[Batch]:
    """Batches of prompts sorted by length, each with a cache length from at most ``max_shapes`` values.

    Batch ``j`` needs ``need_j = longest prompt + max_new_tokens`` cache positions (rounded up to a multiple of
    :data:`ALIGN`); needs grow with ``j`` because prompts are sorted. The chosen lengths minimise the total padded
    positions ``sum_j (length_j - need_j)``: a dynamic programme over the sorted needs, where each length is the
    largest need of a run of consecutive batches (O(batches^2 * max_shapes)).

    Args:
        lengths: token count of each prompt.
        batch_size: prompts per batch (>= 1).
        max_new_tokens: tokens generated per prompt at most.

    Returns:
        The batches in order of increasing prompt length; every index appears once.

    Raises:
        ValueError: an empty ``lengths`` or ``batch_size`` < 1.
    """
    if not lengths or batch_size < 1:
        raise ValueError("plan_batches needs prompts and batch_size >= 1")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups = [tuple(order[i:i + batch_size]) for i in range(0, len(order), batch_size)]
    needs = [_align(max(lengths[i] for i in g) + max_new_tokens) for g in groups]
    n, k = len(needs), max(1, min(max_shapes, len(set(needs))))
    inf = float("inf")
    # cost[s][j]: least padding for batches [0, j) using s lengths, the last one covering batch j - 1.
    cost = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    cost[0][0] = 0
    prefix = [0]
    for need in needs:
        prefix.append(prefix[-1] + need)
    for s in range(1, k + 1):
        for j in range(1, n + 1):
            for i in range(j):  # batches [i, j) share length needs[j - 1]
                if cost[s - 1][i] == inf:
                    continue
                c = cost[s - 1][i] + (j - i) * needs[j - 1] - (prefix[j] - prefix[i])
                if c < cost[s][j]:
                    cost[s][j], cut[s][j] = c, i
    best = min(range(1, k + 1), key=lambda s: cost[s][n])
    lengths_of = [0] * n
    j = n
    for s in range(best, 0, -1):
        i = cut[s][j]
        for b in range(i, j):
            lengths_of[b] = needs[j - 1]
        j = i
    return [Batch(indices=g, cache_len=c) for g, c in zip(groups, lengths_of)]


def generate_many(sampler, prompts: Sequence[Sequence[int]], batch_size: int, desc: Optional[str] = None,
                  progress_file=None, **overrides) -> Tuple[List[SequenceResult], GenerationStats]:
    """Generate for every prompt (token ids), batched as :func:`plan_batches` says; results in input order.

    Args:
        sampler: a :class:`qwenft.generation.Sampler`; on its static path batches are padded to
            ``min(batch_size, len(prompts))`` rows and run with their planned cache length.
        prompts: token id lists (e.g. the bundle's ``prompt_ids``).
        batch_size: prompts per batch.
        desc: a tqdm progress bar over prompts with this label (None: no bar).
        **overrides: sampler settings for every call (e.g. ``max_new_tokens``).

    Returns:
        ``(results, totals)``: one :class:`SequenceResult` per prompt, in input order, and the summed
        :class:`GenerationStats` (``kv_cache_bytes`` the largest of one call; ``batch_size`` the rows per batch).
    """
    from tqdm.auto import tqdm

    max_new = sampler.params(**overrides).max_new_tokens
    plan = plan_batches([len(p) for p in prompts], batch_size, max_new)
    rows = min(batch_size, len(prompts))
    results: List[Optional[SequenceResult]] = [None] * len(prompts)
    totals = GenerationStats(batch_size=rows, prompt_tokens=0, generated_tokens=0, decode_tokens=0, prefill_s=0.0,
                             decode_s=0.0, kv_cache_bytes=0, steps=0)
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", leave=False, file=progress_file) if desc else None
    for batch in plan:
        shape = {"cache_len": batch.cache_len, "rows": rows} if sampler.static else {}
        out = sampler.generate([prompts[i] for i in batch.indices], **shape, **overrides)
        for i, seq in zip(batch.indices, out.sequences):
            results[i] = seq
        s = out.stats
        totals.prompt_tokens += s.prompt_tokens
        totals.generated_tokens += s.generated_tokens
        totals.decode_tokens += s.decode_tokens
        totals.prefill_s += s.prefill_s
        totals.decode_s += s.decode_s
        totals.steps += s.steps
        totals.kv_cache_bytes = max(totals.kv_cache_bytes, s.kv_cache_bytes)
        if bar is not None:
            bar.update(len(batch.indices))
    if bar is not None:
        bar.close()
    return results, totals
