"""The training loss without the full logits: vocabulary projection + cross-entropy over supervised tokens in chunks.

A causal LM's loss needs ``log_softmax(hidden @ W_vocab^T)`` only at the supervised positions, and only the sum of
the target tokens' negative log-likelihoods. Materialising ``[tokens, vocab]`` fp32 logits for that (Qwen2.5's
vocabulary has 151,936 / 152,064 rows: 0.6 MB per token) dominates a QLoRA step's memory at long sequences.
:func:`linear_cross_entropy` computes the same sum chunk by chunk and, as it goes, the gradient with respect to the
hidden states (``(softmax(z) - onehot(t)) @ W``, the standard softmax cross-entropy gradient), so that only one
chunk's logits are ever alive and nothing of them is kept for backward. This is the method of fused linear
cross-entropy kernels (Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss``; Wijmans et al. 2024, "Cut Your Losses in
Large-Vocabulary Language Models", section 3), written in plain PyTorch so that it runs on every device; on CUDA
``train.kernels=liger`` uses Liger's Triton version instead (:mod:`qwenft.kernels`).

Precision follows autocast as ``F.linear`` would: inside a 16-bit autocast region the projection runs in that dtype
(the hidden states and the weight cast once), the log-softmax in fp32 (as transformers' ``ForCausalLMLoss`` upcasts
the logits).
"""

from __future__ import annotations

import contextlib

import torch

from qwenft.kernels import chunk_tokens

class _LinearCrossEntropy(torch.autograd.Function):
    """Sum of ``cross_entropy(hidden @ weight.T, targets)`` with the gradients computed in the forward, chunk by chunk.

    Saved for backward: the gradient of the sum with respect to ``hidden`` (``[tokens, hidden]``, hidden's dtype) and,
    only when ``weight`` requires grad, with respect to ``weight`` (fp32). Backward scales them by the incoming
    gradient (a scalar).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):  # noqa: D102 - documented on the class
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.weight_dtype = weight.dtype
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        for start in range(0, hidden.shape[0], chunk):
            h, t = hidden[start:start + chunk], targets[start:start + chunk]
            logits = (h @ weight.t()).float()  # [chunk, vocab]; the only [chunk, vocab] fp32 buffer
            target = logits.gather(1, t[:, None]).squeeze(1)
            peak = logits.amax(dim=-1, keepdim=True)
            sums = logits.sub_(peak).exp_().sum(dim=-1)  # in place: torch.logsumexp would allocate a second buffer
            total += (peak.squeeze(1) + sums.log() - target).sum()  # log-sum-exp minus the target's logit
            if need_hidden or need_weight:
                probs = logits.div_(sums[:, None])  # softmax, in place
                probs[torch.arange(t.shape[0], device=t.device), t] -= 1.0  # d(sum NLL)/d(logits)
                grad_logits = probs.to(hidden.dtype)
                if need_hidden:
                    grad_hidden[start:start + chunk] = grad_logits @ weight
                if need_weight:
                    grad_weight += grad_logits.t().float() @ h.float()
            del logits
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_output):  # noqa: D102 - documented on the class
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_output.float()
        out_hidden = (grad_hidden.float() * scale).to(grad_hidden.dtype) if grad_hidden is not None else None
        out_weight = (grad_weight * scale).to(ctx.weight_dtype) if grad_weight is not None else None
        return out_hidden, out_weight, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk: int) -> torch.Tensor:
    """Summed token NLL of ``targets`` under the logits ``hidden @ weight.T``, never holding all the logits.

    Equal to ``F.cross_entropy((hidden @ weight.T).float(), targets, reduction="sum")`` (and its gradients), computed
    ``chunk`` tokens at a time. Under a 16-bit autocast region the projection runs in the autocast dtype, like
    ``F.linear`` there; the softmax is fp32 either way.

    Args:
        hidden: ``[tokens, hidden]`` final hidden states at the supervised positions.
        weight: ``[vocab, hidden]`` the vocabulary projection (``lm_head.weight``; no bias in Qwen2).
        targets: ``[tokens]`` int64 target ids, all in ``[0, vocab)`` (ignored positions removed beforehand).
        chunk: tokens per chunk (>= 1; :func:`qwenft.kernels.chunk_tokens` gives the one training uses).

    Returns:
        A 0-dim fp32 tensor: the sum over tokens (divide by the token count for the mean).

    Raises:
        ValueError: mismatched shapes.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or \
            targets.shape != hidden.shape[:1]:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, targets "
                         f"{tuple(targets.shape)}: expected [tokens, hidden], [vocab, hidden], [tokens]")
    if chunk < 1:
        raise ValueError(f"linear_cross_entropy: chunk={chunk}; expected >= 1 token")
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    hidden_c, weight_c = hidden.to(dtype), weight.to(dtype)  # autograd-tracked casts, as autocast's own
    with torch.autocast(device_type, enabled=False):  # the chunks run in exactly the dtypes chosen above
        return _LinearCrossEntropy.apply(hidden_c, weight_c, targets, chunk)


def fused_loss(hidden, weight, targets, kernels: str):
    """Summed token NLL of ``targets`` under ``hidden @ weight.T`` without a logits tensor (module docstring).

    Args:
        hidden: ``[tokens, hidden]`` final hidden states at the supervised positions.
        weight: ``[vocab, hidden]`` ``lm_head.weight``.
        targets: ``[tokens]`` int64 target ids.
        kernels: resolved ``train.kernels``: ``liger`` uses ``LigerFusedLinearCrossEntropyLoss(reduction="sum")``,
            ``none`` qwenft's chunked PyTorch loss. Either way the projection runs in the autocast dtype when inside
            a 16-bit autocast region (both inputs are cast once here for Liger).

    Returns:
        A 0-dim fp32 tensor: the sum over tokens.
    """
    if kernels != "liger":
        return linear_cross_entropy(hidden, weight, targets, chunk_tokens(weight.shape[0]))
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    return LigerFusedLinearCrossEntropyLoss(reduction="sum")(weight.to(dtype), hidden.to(dtype), targets).float()


def supervised_loss_sum(model, inputs, kernels: str):
    """The summed NLL of the supervised next tokens of ``inputs`` and their count, without a logits tensor.

    Runs the causal LM's body (``model.model``; a ``PeftModel`` is unwrapped to its base) and :func:`fused_loss` on
    the positions whose shifted label is not -100, inside whatever autocast region the caller opened. Under FSDP2
    the body is run through the top-level module's forward (:func:`_body_output_through_root`).

    Args:
        model: a ``Qwen2ForCausalLM`` or a ``PeftModel`` around one.
        inputs: ``input_ids``, ``attention_mask`` (``[batch, seq]``), ``labels`` (``[batch, seq]``, -100 = ignored)
            and any other keyword the body takes.
        kernels: resolved ``train.kernels``.

    Returns:
        ``(loss_sum, count)``: a 0-dim fp32 tensor and a 0-dim int64 tensor (supervised tokens).
    """
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    labels = inputs["labels"]
    features = {k: v for k, v in inputs.items() if k != "labels"}
    if _fsdp_root(model):
        hidden = _body_output_through_root(model, causal, features)
    else:
        hidden = causal.model(**features, use_cache=False).last_hidden_state
    targets = labels[:, 1:]
    keep = targets != -100
    with _gathered(causal.lm_head.weight) as weight:
        return fused_loss(hidden[:, :-1][keep], weight, targets[keep], kernels), keep.sum()


def _fsdp_root(model) -> bool:
    """Whether ``model`` is the root of an FSDP2 wrapping (``fully_shard``, as accelerate applies it)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def _body_output_through_root(model, causal, features):
    """The body's ``[batch, seq, hidden]`` last hidden state, computed by calling the FSDP2 root ``model`` itself.

    FSDP2 gathers the root's own weights (embeddings, final norm, lm_head) in the root module's forward hooks, and
    its first forward sets up the whole wrapping (which module is the root, the backward's reduce-scatter): calling
    ``causal.model`` directly fails with "aten.mul.Tensor got mixed torch.Tensor and DTensor" at the final norm.
    The root forward computes the logits of the last position only (``logits_to_keep=1``, ``[batch, 1, vocab]``);
    the root keeps its weights gathered after forward (FSDP2 does not reshard the root then), so
    ``causal.lm_head.weight`` is the whole matrix for :func:`fused_loss`.
    """
    captured = {}

    def keep(_module, _args, output):
        captured["hidden"] = output.last_hidden_state

    handle = causal.model.register_forward_hook(keep)
    try:
        model(**features, use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    return captured["hidden"]


@contextlib.contextmanager
def _gathered(weight):
    """``weight`` whole: a DeepSpeed ZeRO-3 partitioned parameter (``ds_id``; outside its module's forward it is an
    empty placeholder, and the vocabulary size read from it was 0) is gathered for the body of the ``with``.

    Safe for the loss: :func:`fused_loss` computes the hidden-state gradient during its forward, so the whole
    weight is not needed in backward, and ``lm_head`` is frozen (no weight gradient to scatter back).
    """
    if not hasattr(weight, "ds_id"):
        yield weight
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters([weight], modifier_rank=None):
        yield weight
