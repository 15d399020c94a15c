"""Memory of one preference training step (``train.objective`` dpo, ipo, simpo, orpo or kto), in bytes.

What a step of ``B`` pairs runs (:mod:`qwenft.train.preference`), and what the plan counts for it:

- ``2B`` sequences of up to ``data.max_seq_len`` tokens each (prompt + chosen, prompt + rejected; KTO: ``B``
  examples and ``B`` mismatched ones): padded ``[2B, seq]`` with an attention mask, or padding-free
  (``pref.padding_free``) one row of ``2B x seq`` tokens. Both reach attention with a mask: a padding-free row
  gets transformers' packed-sequence mask, ``[1, 1, tokens, tokens]``, which SDPA turns into a float mask and
  saves in every layer (:func:`qwenft.plan.memory.activation_terms` with ``masked``), so its attention term grows
  with the square of all the batch's tokens, not of one sequence's. The policy's forward saves what an SFT forward
  of that layout saves (every sequence at its full length, the worst case, as the SFT plan assumes).
- the loss (:func:`qwenft.train.preference.token_logprobs`): only the answer tokens (``rows``,
  ``plan.supervised_fraction`` of the predicted positions) are projected onto the vocabulary, a chunk of
  :func:`qwenft.kernels.chunk_tokens` rows at a time, and no logits are kept; it saves the gathered hidden states in
  the projection dtype ``c`` (bf16 under autocast) and a ``c`` copy of an fp32 lm_head, and recomputes each
  chunk's logits in backward. One chunk holds ``8`` bytes per logit in forward (fp32 logits and ``logsumexp``'s
  fp32 temporary) and ``8 + c`` in backward (``c`` 2: the ``c`` product, its fp32 softmax and the scaled
  gradient with its ``c`` copy; ``c`` 4: the softmax and its scaled copy). While it runs the body's output
  ``[tokens, hidden]`` is alive too.
- the reference forward (objectives with a reference, unless ``pref.precompute_ref``): the same sequences through
  the same model with the adapter off, under ``torch.no_grad``, after the policy's forward and before its backward:
  the policy's saved activations are alive, and the reference adds its largest transient, one layer's forward
  working set (:func:`qwenft.plan.evaluation.forward_bytes` in the residual dtype, plus SDPA's float copy of the
  mask, plus a dequantized NF4 weight) or its own loss forward (body output, gathered rows, one chunk), whichever
  is larger. SimPO and ORPO have no reference; with ``pref.precompute_ref`` the reference runs once before training
  (a no-grad pass smaller than a step) and not in the step.

The loss phase of :func:`qwenft.plan.memory.training_memory` then holds the policy's activations, the loss's saved
tensors and the largest of the loss forward's, the reference's and the loss backward's transients; the layer and
optimizer phases are the SFT ones for the same layout.
"""

from __future__ import annotations

import math
from typing import Dict, Tuple

from qwenft.plan.arch import Architecture
from qwenft.plan.memory import TrainSetup, activation_terms, head_bytes_training, training_memory

SEQUENCES_PER_PAIR = 2  # chosen and rejected (KTO: an example and its mismatched pair)
FORWARD_CHUNK_BYTES = 8  # per logit: fp32 logits + logsumexp's fp32 (logits - max) temporary


def layout(setup: TrainSetup, pairs: int, seq: int) -> Tuple[int, int, bool]:
    """``(rows, width, masked)`` of the policy's forward for ``pairs`` pairs of ``seq``-token sequences: padded
    ``[2 pairs, seq]`` (a mask when there is more than one row), or padding-free ``[1, 2 pairs x seq]`` (a packed
    mask, except with flash-attention's varlen path, which needs none)."""
    sequences = SEQUENCES_PER_PAIR * pairs
    if setup.padding_free:
        return 1, sequences * seq, setup.attn != "flash_attention_2"
    return sequences, seq, sequences > 1


def chunk_bytes(arch: Architecture, rows: int, c: int) -> Tuple[int, int]:
    """``(forward, backward)`` bytes of one chunk of :class:`qwenft.train.preference._TokenLogprobs` for ``rows``
    projected rows in the ``c``-byte projection dtype (module docstring)."""
    from qwenft.kernels import chunk_tokens

    logits = min(rows, chunk_tokens(arch.vocab_size)) * arch.vocab_size
    return FORWARD_CHUNK_BYTES * logits, (8 + (c if c != 4 else 0)) * logits


def preference_terms(arch: Architecture, setup: TrainSetup, pairs: int, seq: int) -> Dict[str, int]:
    """:func:`qwenft.plan.memory.activation_terms` of a preference step of ``pairs`` pairs (module docstring).

    The body's terms are those of :func:`layout`; ``loss_saved`` is what the loss keeps for backward (the gathered
    ``[rows, hidden]`` states in ``c``, the ``c`` lm_head copy, the rows' int64 targets and owning sequences),
    ``loss_transient`` the largest of ``policy_loss`` (its forward), ``reference`` (0 when ``setup.reference`` is
    off) and ``loss_backward``.

    Returns:
        the terms of :func:`~qwenft.plan.memory.activation_terms` with those replaced, plus ``sequences``,
        ``rows`` (answer tokens projected), ``policy_loss``, ``reference``, ``loss_backward``.
    """
    from qwenft.plan.evaluation import forward_bytes

    H, V = arch.hidden_size, arch.vocab_size
    b, s, masked = layout(setup, pairs, seq)
    terms = dict(activation_terms(arch, setup, b, s, masked=masked))
    sequences = SEQUENCES_PER_PAIR * pairs
    n = b * s
    rows = math.ceil(setup.supervised * sequences * (seq - 1))
    res_b = 4 if setup.nf4 else setup.model_bytes  # the residual stream and the body's output
    c = 2 if setup.amp else res_b  # token_logprobs: the autocast dtype, else the hidden states'
    head_copy = 2 * V * H if setup.amp and head_bytes_training(arch, setup) != 2 else 0
    fwd_chunk, bwd_chunk = chunk_bytes(arch, rows, c)
    gathered = rows * H * res_b  # hidden[:, :-1][keep]; it is the saved tensor itself when c == res_b
    saved = rows * H * c + head_copy + 16 * rows  # + each row's int64 target and owning sequence (index_add)
    policy_loss = n * H * res_b + (gathered if c != res_b else 0) + fwd_chunk
    loss_backward = rows * H * c + bwd_chunk  # the hidden-state gradient, one chunk recomputed
    reference = 0
    if setup.reference:
        attn_b = 2 if setup.amp else res_b  # q, k, v as SDPA gets them (activation_terms)
        mask = attn_b * b * s * s if masked and setup.attn == "sdpa" else 0  # SDPA's float copy of the bool mask
        if setup.attn == "eager":  # fp32 probabilities of one layer (+ their 16-bit copy under autocast)
            mask = b * arch.num_attention_heads * s * s * (4 + (attn_b if attn_b != 4 else 0))
        body = forward_bytes(arch, b, s, res_b) + mask + terms["dequant_transient"]
        loss = n * H * res_b + gathered + (rows * H * c if c != res_b else 0) + head_copy + fwd_chunk
        reference = max(body, loss)
    terms.update({"loss_saved": saved, "loss_transient": max(policy_loss, reference, loss_backward),
                  "sequences": sequences, "rows": rows, "policy_loss": policy_loss, "reference": reference,
                  "loss_backward": loss_backward})
    return terms


def step_memory(arch: Architecture, setup: TrainSetup, batch: int, seq: int, steady: bool = True) -> Dict[str, int]:
    """Peak bytes of one training step of ``setup.objective``: :func:`qwenft.plan.memory.training_memory` of
    ``batch x seq`` for SFT, unchanged; for a preference objective ``batch`` is pairs and the step is planned from
    :func:`preference_terms` (its ``sequences``, ``reference`` and ``rows`` added to the result)."""
    if setup.objective == "sft":
        return training_memory(arch, setup, batch, seq, steady)
    terms = preference_terms(arch, setup, batch, seq)
    b, s, _ = layout(setup, batch, seq)
    out = training_memory(arch, setup, b, s, steady, terms=terms)
    out.update({k: terms[k] for k in ("sequences", "rows", "reference")})
    return out
