"""Log-likelihoods of many ``(context, continuation)`` token pairs, with shared prefixes computed once.

A 5-shot multiple-choice benchmark asks, for every question, the log-likelihood of each answer letter after the same
five worked examples of its subject: the shots are 80-90% of every prompt and identical across a subject's
questions, and the four letters share one context. :func:`score_pairs` exploits both, exactly:

1. Requests whose model input (context + continuation less its last token) is the same run as one row; each
   single-token continuation (" A", " B", ...) is read from the same last position, so four choices cost one row.
2. Rows are sorted by their token ids; a run of neighbours sharing at least :data:`MIN_PREFIX` leading tokens is a
   group. The group's common prefix is run once through the model with a KV cache; the cache is copied for each
   batch of the group's suffixes, which run on top of it (right padded; a causal model's real positions never see
   the padding). Rows sharing no long prefix run whole, in batches of similar length.
3. Only the positions that predict a continuation token are projected onto the vocabulary, through
   :func:`qwenft.kernels.target_logprobs` (no ``[batch, seq, vocab]`` logits).

The arithmetic is the full forward's: attention over the cached prefix keys/values equals attention over the same
positions computed in one pass (up to floating-point summation order). lm-eval's ``HFLM`` runs every distinct
context whole (its one-token continuation cache gives step 1, not step 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

MIN_PREFIX = 32  # shortest shared prefix (tokens) worth a prefill of its own
MAX_ROWS_FACTOR = 4  # a suffix batch holds at most 4 x batch_size rows (each with its copy of the prefix's cache)


@dataclass
class _Row:
    """One distinct model input and the requests read from it."""

    ids: Tuple[int, ...]
    need: int = 0  # positions at the end of ``ids`` whose next-token distribution is read
    reads: List[Tuple[int, List[int]]] = field(default_factory=list)  # (request index, continuation ids)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _rows(pairs: Sequence[Tuple[Sequence[int], Sequence[int]]], max_length: int) -> List[_Row]:
    """Distinct inputs: ``(context + continuation)[:-1]``, left-truncated to ``max_length`` tokens (as lm-eval's
    HFLM truncates), each with the requests it answers."""
    by_ids: Dict[Tuple[int, ...], _Row] = {}
    for index, (context, continuation) in enumerate(pairs):
        if not continuation:
            raise ValueError(f"request {index}: empty continuation")
        if len(continuation) > max_length:
            raise ValueError(f"request {index}: continuation of {len(continuation)} tokens > max_length {max_length}")
        ids = tuple((list(context) + list(continuation))[-(max_length + 1):][:-1])
        row = by_ids.setdefault(ids, _Row(ids))
        row.need = max(row.need, len(continuation))
        row.reads.append((index, list(continuation)))
    return sorted(by_ids.values(), key=lambda r: r.ids)


def _groups(rows: List[_Row], min_prefix: int) -> List[Tuple[int, List[_Row]]]:
    """Runs of sorted rows sharing ``>= min_prefix`` leading tokens: ``(prefix length, rows)``; a lone row: 0.

    A group's prefix stops before the first position any of its rows reads, so every read lies in the suffix.
    """
    out: List[Tuple[int, List[_Row]]] = []
    i = 0
    while i < len(rows):
        j, shared = i + 1, len(rows[i].ids) - rows[i].need
        while j < len(rows):
            lcp = min(shared, _common_prefix(rows[j - 1].ids, rows[j].ids), len(rows[j].ids) - rows[j].need)
            if lcp < min_prefix:
                break
            shared, j = lcp, j + 1
        out.append((shared if j - i > 1 else 0, rows[i:j]))
        i = j
    return out


def _body_and_head(model):
    """The decoder body (``model.model``) and ``lm_head`` of a causal LM, unwrapping a ``PeftModel`` (its LoRA
    layers live inside the body, so the adapter's state is kept)."""
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    return causal.model, causal.lm_head


def _copy_cache(model, layers: List[Tuple[torch.Tensor, torch.Tensor]], rows: int):
    from qwenft.generation.kv_cache import new_cache

    cache = new_cache(model)
    for index, (keys, values) in enumerate(layers):
        cache.update(keys.expand(rows, -1, -1, -1).contiguous(), values.expand(rows, -1, -1, -1).contiguous(), index)
    return cache


def _read(hidden: torch.Tensor, batch: List[_Row], lengths: List[int], head, out) -> None:
    """Project the read positions of ``hidden [rows, seq, hidden]`` and add each request's log-likelihood into
    ``out`` (a list of ``[logprob, greedy]``). ``lengths[r]`` is row r's token count in ``hidden``."""
    from qwenft.kernels import target_logprobs

    picks, targets, owners = [], [], []
    for r, (row, length) in enumerate(zip(batch, lengths)):
        for request, continuation in row.reads:
            first = length - len(continuation)  # position predicting the continuation's first token
            for k, token in enumerate(continuation):
                picks.append((r, first + k))
                targets.append(token)
                owners.append(request)
    index = torch.tensor(picks, device=hidden.device)
    states = hidden[index[:, 0], index[:, 1]]
    logprobs, greedy = target_logprobs(states, head.weight, torch.tensor(targets, device=hidden.device))
    for request, lp, g in zip(owners, logprobs.tolist(), greedy.tolist()):
        out[request][0] += lp
        out[request][1] = out[request][1] and g


def _pad(seqs: List[Sequence[int]], pad_id: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask[i, :len(s)] = 1
    return ids.to(device), mask.to(device)


def suffix_rows(batch_size: int, prefix: int, longest: int) -> int:
    """Rows per suffix batch of a group: as many suffixes as fit the tokens of ``batch_size`` whole rows
    (``batch_size * longest // (longest - prefix)``), at most :data:`MAX_ROWS_FACTOR` x ``batch_size``. A whole row
    of the group holds ``longest`` tokens, its suffix ``longest - prefix``: short suffix batches run small matrix
    products, slower per token than the whole rows they replace (measured on a CPU: 31 vs 14 ms a token at 6 x 62
    vs 6 x 305 tokens), so they are made as large in tokens as a batch of whole rows would be."""
    suffix = max(1, longest - prefix)
    return max(batch_size, min(MAX_ROWS_FACTOR * batch_size, batch_size * longest // suffix))


@torch.inference_mode()
def score_pairs(model, pairs: Sequence[Tuple[Sequence[int], Sequence[int]]], *, batch_size: int, max_length: int,
                pad_id: int = 0, min_prefix: int = MIN_PREFIX, progress=None) -> List[Tuple[float, bool]]:
    """Log-likelihood of each continuation given its context, and whether greedy decoding would produce it.

    Args:
        model: a causal LM (``Qwen2ForCausalLM`` or a ``PeftModel`` around one) in eval mode.
        pairs: ``(context ids, continuation ids)``; a continuation is at least one token.
        batch_size: rows per forward pass of whole rows; a group's suffixes run up to the same number of tokens
            (:func:`suffix_rows`).
        max_length: the longest input (tokens); longer ones keep their last ``max_length`` tokens.
        pad_id: right-padding id (never attended to, never read).
        min_prefix: shortest shared prefix (tokens) run once for a group of rows.
        progress: called with the number of requests finished after each batch (a tqdm ``update``), or None.

    Returns:
        One ``(sum of log-probabilities in nats, is_greedy)`` per pair, in order.

    Raises:
        ValueError: an empty continuation, or one longer than ``max_length``.
    """
    out = [[0.0, True] for _ in pairs]
    body, head = _body_and_head(model)
    device = head.weight.device
    singles: List[_Row] = []
    for prefix, rows in _groups(_rows(pairs, max_length), min_prefix):
        if not prefix:
            singles.extend(rows)
            continue
        prefill = body(input_ids=torch.tensor([rows[0].ids[:prefix]], device=device), use_cache=True)
        layers = [(layer.keys, layer.values) for layer in prefill.cache.layers]
        step = suffix_rows(batch_size, prefix, max(len(r.ids) for r in rows))
        for start in range(0, len(rows), step):
            batch = rows[start:start + step]
            ids, mask = _pad([r.ids[prefix:] for r in batch], pad_id, device)
            mask = torch.cat([torch.ones((len(batch), prefix), dtype=mask.dtype, device=device), mask], dim=1)
            hidden = body(input_ids=ids, attention_mask=mask, cache=_copy_cache(model, layers, len(batch)),
                          use_cache=True).last_hidden_state
            _read(hidden, batch, [len(r.ids) - prefix for r in batch], head, out)
            if progress is not None:
                progress(sum(len(r.reads) for r in batch))
        del prefill, layers
    singles.sort(key=lambda r: len(r.ids))
    for start in range(0, len(singles), batch_size):
        batch = singles[start:start + batch_size]
        ids, mask = _pad([r.ids for r in batch], pad_id, device)
        hidden = body(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        _read(hidden, batch, [len(r.ids) for r in batch], head, out)
        if progress is not None:
            progress(sum(len(r.reads) for r in batch))
    return [(float(lp), bool(g)) for lp, g in out]


def full_forward_scores(model, pairs: Sequence[Tuple[Sequence[int], Sequence[int]]],
                        max_length: Optional[int] = None) -> List[Tuple[float, bool]]:
    """The reference for :func:`score_pairs`: each pair run whole, alone, through the full model (``logits``),
    fp32 log-softmax. For tests and the benchmark; slow."""
    out = []
    with torch.inference_mode():
        for context, continuation in pairs:
            ids = (list(context) + list(continuation))
            if max_length is not None:
                ids = ids[-(max_length + 1):]
            inputs = torch.tensor([ids[:-1]], device=next(model.parameters()).device)
            logits = model(input_ids=inputs).logits[0, -len(continuation):].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            target = torch.tensor(list(continuation), device=logits.device)
            out.append((float(logprobs.gather(1, target[:, None]).sum()),
                        bool((logits.argmax(dim=-1) == target).all())))
    return out
