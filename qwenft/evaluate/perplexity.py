"""Perplexity: exp of the token-weighted mean negative log-likelihood over every predicted token.

Long texts are scored with a sliding window (as in Hugging Face's "Perplexity of fixed-length models"
guide): windows of ``window`` tokens start every ``stride`` tokens; each token is scored at most once, in
the first window that holds it with at least one token of context before it, so it sees up to
``window - 1`` tokens of context. With ``stride < window`` every token but a text's first is scored; with
``stride == window`` this is the plain non-overlapping chunk computation, where each chunk's first token
has no context and is not scored. Windows from all texts are batched with right padding; padding and context-only positions carry no weight. NLLs are summed in float64.

No ``[batch, seq, vocab]`` logits tensor is made: the model's body gives the final hidden states and only the scored
positions are projected onto the vocabulary, a chunk at a time (:func:`qwenft.kernels.target_logprobs`, the
inference twin of the training loss), so a batch's memory is its activations plus one chunk's logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, List, Sequence, Tuple

import torch

from qwenft.kernels import target_logprobs


@dataclass
class Perplexity:
    """``perplexity = exp(nll / tokens)``; ``nll`` in nats, summed; ``tokens`` scored."""

    perplexity: float
    nll: float
    tokens: int

    def as_dict(self) -> dict:
        return {"perplexity": self.perplexity, "mean_nll": self.nll / max(self.tokens, 1), "tokens": self.tokens}


def windows(length: int, window: int, stride: int) -> List[Tuple[int, int, int]]:
    """The ``(begin, end, first_scored)`` windows of a text of ``length`` tokens.

    Tokens ``first_scored .. end-1`` are scored in window ``[begin, end)``.

    Raises:
        ValueError: ``stride`` outside ``[1, window]`` or ``window < 2``.
    """
    if window < 2 or not 1 <= stride <= window:
        raise ValueError(f"need window >= 2 and 1 <= stride <= window, got window={window}, stride={stride}")
    spans, scored_until, begin = [], 1, 0
    while scored_until < length:
        end = min(begin + window, length)
        first = max(scored_until, begin + 1)
        if first < end:
            spans.append((begin, end, first))
        scored_until = max(scored_until, end)
        begin += stride
    return spans


def causal_parts(model):
    """``(body, head_weight)`` of a causal LM: the decoder stack (``model.model``, returning ``last_hidden_state``
    ``[batch, seq, hidden]``) and ``lm_head.weight`` ``[vocab, hidden]``. A ``PeftModel`` is unwrapped to its base
    model, whose layers still carry the adapter: ``disable_adapter()`` switches it off there, so the side the caller
    chose is the side scored (as :func:`qwenft.train.loss.supervised_loss_sum` unwraps for training). A trained
    lm_head (peft ``modules_to_save``) answers ``.weight`` with the copy of the side set (peft's wrapper)."""
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    return causal.model, causal.lm_head.weight


def _score_batch(model, rows: Sequence[Tuple[List[int], List[bool]]], pad_id: int, device) -> Tuple[float, int]:
    """Summed NLL (float64) and count over ``rows`` of ``(ids [seq], scored [seq])``.

    ``scored[t]`` says whether token ``t`` (predicted from the tokens before it) counts; ``scored[0]`` must
    be False. Only the scored positions' hidden states are projected (:func:`qwenft.kernels.target_logprobs`).
    """
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    weight = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (ids, scored) in enumerate(rows):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attention[i, :len(ids)] = 1
        weight[i, :len(ids)] = torch.tensor(scored, dtype=torch.bool)
    input_ids, attention, weight = input_ids.to(device), attention.to(device), weight.to(device)
    body, head = causal_parts(model)
    mask = weight[:, 1:]  # position t's hidden state predicts token t+1
    with torch.no_grad():
        hidden = body(input_ids=input_ids, attention_mask=attention, use_cache=False).last_hidden_state
        logprobs, _ = target_logprobs(hidden[:, :-1][mask], head, input_ids[:, 1:][mask])
    return -float(logprobs.double().sum().item()), int(mask.sum().item())


def perplexity_of_ids(model, texts: Iterable[Sequence[int]], *, window: int, stride: int, batch_size: int,
                      pad_id: int, progress: bool = False) -> Perplexity:
    """Sliding-window perplexity of token sequences (each ``[seq]``), batched.

    Args:
        model: a causal LM with a ``model`` body and an ``lm_head`` (a ``PeftModel`` around one: the side
            its adapter is set to), see :func:`causal_parts`.
        texts: token id sequences; each is scored from its second token on.
        window: tokens per forward pass (context + scored).
        stride: tokens between window starts (``stride == window``: non-overlapping chunks).
        batch_size: windows per forward pass.
        pad_id: id used for right padding (never scored).
        progress: show a tqdm bar over batches.

    Returns:
        :class:`Perplexity` with the summed NLL in nats and the scored token count.
    """
    return score_rows(model, window_rows(texts, window, stride), batch_size, pad_id, progress)


def perplexity_of_labels(model, examples: Iterable[Tuple[Sequence[int], Sequence[int]]], *, batch_size: int,
                         pad_id: int, progress: bool = False) -> Perplexity:
    """Perplexity of chat examples on their supervised tokens only (labels != -100), batched.

    Args:
        examples: ``(input_ids [seq], labels [seq])`` pairs as the data pipeline builds them (labels are the
            input ids at supervised positions, -100 elsewhere, unshifted).
    """
    return score_rows(model, label_rows(examples), batch_size, pad_id, progress)


Row = Tuple[List[int], List[bool]]


def window_rows(texts: Iterable[Sequence[int]], window: int, stride: int) -> List[Row]:
    """The scored rows of sliding-window perplexity: one ``(ids [window], scored [window])`` per window of each text
    (:func:`windows`); ``scored[t]`` marks the tokens that window scores. What :func:`perplexity_of_ids` scores, for
    any backend that can score a row (``qwenft merge``'s llama.cpp measurement scores the same rows)."""
    rows = []
    for ids in texts:
        ids = list(ids)
        for begin, end, first in windows(len(ids), window, stride):
            rows.append((ids[begin:end], [t >= first for t in range(begin, end)]))
    return rows


def label_rows(examples: Iterable[Tuple[Sequence[int], Sequence[int]]]) -> List[Row]:
    """The scored rows of supervised-token perplexity: ``(input_ids [seq], scored [seq])`` with ``scored[t]`` where
    ``labels[t] != -100`` (and ``t > 0``), sorted by length so that similar lengths share a batch (less padding).
    What :func:`perplexity_of_labels` scores."""
    rows = [(list(ids), [t > 0 and lab != -100 for t, lab in enumerate(labels)]) for ids, labels in examples]
    rows.sort(key=lambda row: len(row[0]))
    return rows


def _maybe_tqdm(items, progress: bool, desc: str):
    if not progress:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit="batch", leave=False)


def score_rows(model, rows: Sequence[Row], batch_size: int, pad_id: int, progress: bool = False) -> Perplexity:
    """Perplexity of ``rows`` (:func:`window_rows` / :func:`label_rows`) under ``model``, ``batch_size`` rows a
    forward pass, right-padded with ``pad_id``."""
    device = next(model.parameters()).device
    total_nll, total = 0.0, 0
    batches = [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]
    for batch in _maybe_tqdm(batches, progress, "perplexity"):
        nll, count = _score_batch(model, batch, pad_id, device)
        total_nll += nll
        total += count
    return Perplexity(math.exp(total_nll / total) if total else float("nan"), total_nll, total)
