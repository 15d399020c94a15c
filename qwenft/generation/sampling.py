"""Logits processors and token selection: the sampling half of the sampler.

Every processor takes fp32 scores ``[batch, vocab]`` and returns scores of the same shape, filtered
entries set to ``-inf``; the first two work in place on the caller's copy, touching only the entries they
change (cost O(batch x tokens seen), not O(batch x vocab)). Each performs the same float operations on
each entry as the transformers 5.24 processor of the same purpose (``generation/logits_process.py``), so
the processed scores are bit-identical and, fed to the same RNG draw, so are the sampled tokens. The
order in which :func:`process_scores` applies them is transformers' order: repetition penalty,
min-new-tokens, then (sampling only) temperature, top_k, top_p, min_p.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

from qwenft.config import QwenftError
from qwenft.generation.params import SamplingParams


class NonFiniteLogits(QwenftError):
    """The model produced NaN or inf logits: a fault of the model or its dtype (fp16 overflows on Qwen2), not of
    the request. The CLI prints it as one line; the server answers 500 naming it."""


def check_finite(logits: torch.Tensor, rows: torch.Tensor, step: int, dtype: torch.dtype) -> None:
    """Refuse non-finite logits instead of sampling from them: ``argmax`` over NaN picks token 0 (the "!!!!"
    answers of an fp16 Qwen, QwenLM/Qwen3#761), and ``softmax`` of them cannot be drawn from.

    Args:
        logits: ``[batch, vocab]`` fp32 next-token logits.
        rows: ``[batch]`` bool, the rows still generating (a finished row's logits are not used).
        step: the decode step (0: the logits of the prefill).
        dtype: the dtype the model computed the logits in (named in the error).

    Raises:
        NonFiniteLogits: naming the step, the rows, the dtype and what to do.
    """
    bad = ~torch.isfinite(logits).all(dim=-1) & rows
    if bool(bad.any()):
        which = [int(i) for i in bad.nonzero().flatten().tolist()]
        kind = "NaN" if bool(torch.isnan(logits[bad]).any()) else "inf"
        where = "prefill (step 0)" if step == 0 else f"decode step {step}"
        hint = ("fp16 overflows on Qwen2: run in bfloat16 or float32 (model.dtype=bfloat16, or "
                "quant.compute_dtype=bfloat16 for NF4)") if dtype == torch.float16 else \
            "the weights or the adapter may hold NaN/inf (check them with qwenft inspect)"
        raise NonFiniteLogits(f"the model produced {kind} logits at {where}, row(s) {which}, computed in "
                              f"{str(dtype).replace('torch.', '')}; refusing to sample from them: {hint}")


def raw_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor,
                 k: int) -> List[Tuple[float, Sequence[Tuple[int, float]]]]:
    """Per row: the chosen token's log-probability and the ``k`` most likely tokens with theirs.

    Args:
        logprobs: ``[batch, vocab]`` ``log_softmax`` of the raw fp32 logits (before any processor: the model's own
            distribution, what OpenAI's and vLLM's default ``logprobs`` report).
        chosen: ``[batch]`` int64 chosen ids.
        k: alternatives per row (0: none); at most the vocabulary.

    Returns:
        ``batch`` pairs ``(logprob, [(id, logprob)] * k)``, most likely first; nats.
    """
    picked = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
    if k <= 0:
        return [(value, ()) for value in picked]
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
    return [(value, tuple(zip(row_ids, row_values)))
            for value, row_ids, row_values in zip(picked, ids.tolist(), values.tolist())]


def repetition_penalty(scores: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    """Penalise every token already present in the sequence, at most once per token (in place).

    CTRL (Keskar et al. 2019, section 4.1), as transformers' ``RepetitionPenaltyLogitsProcessor``
    applies it: a negative score is multiplied by ``penalty``, a positive one divided by it.

    Args:
        scores: ``[batch, vocab]`` fp32 scores, modified in place.
        history: ``[batch, length]`` ids of the (unpadded) prompt and the tokens generated so far; a token
            listed twice is still penalised once. Every id must be ``< vocab`` (fill padding with a real id
            of the row).
        penalty: > 1 discourages repetition, < 1 encourages it, 1 is a no-op.

    Returns:
        ``scores``, penalised.
    """
    values = scores.gather(1, history)
    # Duplicate ids write the same value, so the scatter's order does not matter.
    return scores.scatter_(1, history, torch.where(values < 0, values * penalty, values / penalty))


def suppress_tokens(scores: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Set the scores of ``token_ids`` (``[n]`` int64) to ``-inf``, in place: how min_new_tokens blocks the stop
    tokens (transformers' ``MinNewTokensLengthLogitsProcessor``)."""
    return scores.index_fill_(1, token_ids, -math.inf)


def temperature(scores: torch.Tensor, value: float) -> torch.Tensor:
    """Divide the scores by ``value`` > 0 (transformers' ``TemperatureLogitsWarper``)."""
    return scores / value


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` highest scores per row; ties with the k-th score are all kept.

    Same rule as transformers' ``TopKLogitsWarper``: remove every score strictly below the k-th largest.
    """
    k = min(k, scores.size(-1))
    kth = torch.topk(scores, k)[0][..., -1, None]
    return scores.masked_fill(scores < kth, -math.inf)


def top_p(scores: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering (Holtzman et al. 2020, section 3.1): keep the smallest set of most probable tokens
    whose probability mass reaches ``p``; the most probable token is always kept, even when it alone holds
    more than ``p``.

    Same operations as transformers' ``TopPLogitsWarper``: sort ascending, cumulative softmax, drop the
    prefix whose mass is ``<= 1 - p``.
    """
    sorted_scores, sorted_idx = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    sorted_remove = cumulative <= (1 - p)
    sorted_remove[..., -1:] = False  # min_tokens_to_keep = 1
    remove = sorted_remove.scatter(1, sorted_idx, sorted_remove)
    return scores.masked_fill(remove, -math.inf)


def min_p(scores: torch.Tensor, value: float) -> torch.Tensor:
    """Min-p filtering (Nguyen et al. 2024): drop tokens whose probability is below ``value`` times the
    probability of the most likely token; the most likely token is always kept.

    Same operations as transformers' ``MinPLogitsWarper`` (applied after temperature).
    """
    probs = torch.softmax(scores, dim=-1)
    threshold = value * probs.amax(dim=-1, keepdim=True)
    remove = probs < threshold
    remove.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
    return scores.masked_fill(remove, -math.inf)


def process_scores(logits: torch.Tensor, params: SamplingParams, history: Optional[torch.Tensor],
                   stop_ids: Optional[torch.Tensor], generated: int) -> torch.Tensor:
    """Apply the processors of ``params`` in transformers' order.

    Args:
        logits: ``[batch, vocab]`` fp32 next-token logits; a copy the caller gives up (modified in place).
        params: resolved sampling parameters.
        history: ``[batch, length]`` token ids seen so far, for the repetition penalty (see
            :func:`repetition_penalty`; None when the penalty is 1).
        stop_ids: ``[n]`` int64 stop token ids (None when there are none).
        generated: tokens generated so far in this call (the same for every row).

    Returns:
        ``[batch, vocab]`` scores; greedy decoding takes their argmax, sampling draws from their softmax.
    """
    scores = logits
    if params.repetition_penalty != 1.0 and history is not None:
        scores = repetition_penalty(scores, history, params.repetition_penalty)
    if stop_ids is not None and len(stop_ids) and generated < params.min_new_tokens:
        scores = suppress_tokens(scores, stop_ids)
    if params.greedy:
        return scores
    if params.temperature != 1.0:
        scores = temperature(scores, params.temperature)
    if params.top_k > 0:
        scores = top_k(scores, params.top_k)
    if params.top_p < 1.0:
        scores = top_p(scores, params.top_p)
    if params.min_p > 0.0:
        scores = min_p(scores, params.min_p)
    return scores


def select_tokens(scores: torch.Tensor, greedy: bool,
                  generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Choose one token per row and describe the distribution it came from.

    Greedy takes the argmax (the first index on ties, as ``torch.argmax``). Sampling draws with
    ``torch.multinomial(softmax(scores), 1)``, the call transformers makes, from ``generator`` or, when it
    is None, from torch's global RNG; one draw covers the whole batch, so finished rows still consume
    their share of random numbers exactly as in transformers.

    Args:
        scores: ``[batch, vocab]`` processed fp32 scores.
        greedy: argmax instead of a draw.
        generator: a seeded ``torch.Generator`` on the scores' device, or None for the global RNG.

    Returns:
        ``(tokens, logprobs, entropies)``, each ``[batch]``: the chosen ids, their log-probability (nats)
        under ``softmax(scores)`` and that distribution's entropy ``sum(-p log p)`` (nats, 0 log 0 = 0).
    """
    probs = torch.softmax(scores, dim=-1)  # the exact call transformers feeds to multinomial
    if greedy:
        tokens = torch.argmax(scores, dim=-1)
    else:
        tokens = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
    chosen = torch.log(probs.gather(1, tokens[:, None]).squeeze(1))
    entropy = torch.special.entr(probs).sum(dim=-1)
    return tokens, chosen, entropy
