"""``train.kernels``: which kernels a training run uses for the Qwen2 layers and the loss.

- ``none``: transformers' Qwen2 modules and qwenft's chunked PyTorch loss (:mod:`qwenft.train.loss`), on every device.
- ``liger``: Liger-Kernel's Triton kernels through its public API (``liger_kernel.transformers``): RMSNorm, RoPE and
  SwiGLU patched into the loaded model by ``apply_liger_kernel_to_qwen2(..., model=model)``, and the loss computed by
  ``LigerFusedLinearCrossEntropyLoss`` (vocabulary projection + cross-entropy fused, no logits tensor). CUDA only;
  installed with ``pip install 'qwenft[gpu]'``.
- ``auto`` (default): ``liger`` on a CUDA device when the package is installed, else ``none``.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Optional

from qwenft.config import QwenftError

log = logging.getLogger(__name__)

LIGER_PACKAGE = "liger_kernel"
# qwenft's chunked loss (train.kernels=none): one chunk's fp32 logits take at most this many bytes. Alive at once per
# chunk: the fp32 logits (softmax computed in place) and their 16-bit copy under autocast, so ~1.5x this; 64 MiB is
# 110 tokens a chunk for Qwen2.5's 152k vocabulary, whose GEMM ([110, 3584] x [3584, 152064], 120 GFLOP) stays large.
CHUNK_BYTES = 64 << 20


def chunk_tokens(vocab: int, budget: Optional[int] = None) -> int:
    """Tokens per chunk of qwenft's loss: ``[chunk, vocab]`` fp32 logits within ``budget`` bytes (default
    :data:`CHUNK_BYTES`); at least 1."""
    return max(1, (budget or CHUNK_BYTES) // (4 * vocab))


def liger_chunk_tokens(tokens: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk of Liger's fused linear cross-entropy (``ops/fused_linear_cross_entropy.py``, 0.8):
    ``next_power_of_2(ceil(tokens / ceil(vocab / hidden)))``, at most ``tokens``, so a chunk's logits are about as
    large as the hidden states."""
    if tokens <= 0:
        return 0
    per = -(-tokens // -(-vocab // hidden))
    return min(1 << (per - 1).bit_length(), tokens)


def liger_installed() -> bool:
    """Whether the liger-kernel package can be imported (without importing it)."""
    return importlib.util.find_spec(LIGER_PACKAGE) is not None


def resolve_kernels(choice: str, cuda: bool, installed: Optional[bool] = None) -> str:
    """``train.kernels`` resolved for this machine: ``none`` or ``liger``.

    Args:
        choice: ``auto``, ``none`` or ``liger``.
        cuda: whether training runs on a CUDA device.
        installed: whether liger-kernel is installed (default: looked up).

    Raises:
        QwenftError: ``liger`` asked for without a CUDA device or without the package (one line saying what to do).
    """
    installed = liger_installed() if installed is None else installed
    if choice == "none":
        return "none"
    if choice == "auto":
        return "liger" if cuda and installed else "none"
    missing = []
    if not cuda:
        missing.append("a CUDA GPU (Liger's kernels are Triton kernels; this run is on a CPU)")
    if not installed:
        missing.append("the liger-kernel package (pip install 'qwenft[gpu]'), which is not installed")
    if missing:
        raise QwenftError(f"train.kernels=liger needs {' and '.join(missing)}; use train.kernels=auto or none")
    return "liger"


def apply_kernels(model, kernels: str) -> None:
    """Patch ``model`` (a loaded ``Qwen2ForCausalLM``, before LoRA is attached) with the chosen layer kernels.

    ``liger``: RMSNorm, RoPE and SwiGLU through ``apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True,
    cross_entropy=False, fused_linear_cross_entropy=False, model=model)``: the loss is computed by qwenft's
    trainer (:func:`qwenft.train.loss.fused_loss`), which calls Liger's fused linear cross-entropy on the supervised
    positions only. ``none``: nothing changes.
    """
    if kernels != "liger":
        return
    from liger_kernel.transformers import apply_liger_kernel_to_qwen2

    apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                fused_linear_cross_entropy=False, model=model)
    log.info("train.kernels=liger: Liger's RMSNorm, RoPE and SwiGLU kernels, fused linear cross-entropy loss")


def target_logprobs(hidden, weight, targets, chunk: Optional[int] = None):
    """Log-probabilities of ``targets`` under ``log_softmax(hidden @ weight.T)``, ``chunk`` rows at a time, without
    a ``[rows, vocab]`` logits tensor: the inference twin of the training loss (:mod:`qwenft.train.loss`), used for
    perplexity windows, held-out answers and benchmark choices.

    The projection runs in the dtype of ``weight`` as given (the model's compute dtype; ``hidden`` is cast to it),
    or in the autocast dtype inside an autocast region; the log-softmax of each chunk in fp32 (as transformers' loss
    upcasts the logits; float64 for a float64 model), computed in place: one chunk holds ``chunk * vocab`` fp32
    values, plus the 16-bit product while it is upcast.

    Args:
        hidden: ``[rows, hidden]`` final hidden states at the positions that predict ``targets``.
        weight: ``[vocab, hidden]`` the vocabulary projection (``lm_head.weight``; Qwen2 has no bias there).
        targets: ``[rows]`` int64 ids in ``[0, vocab)``.
        chunk: rows per chunk (default: :func:`chunk_tokens` of the vocabulary, 64 MiB of fp32 logits).

    Returns:
        ``(logprobs, is_greedy)``: ``[rows]`` fp32 log-probabilities (nats, <= 0; float64 when ``weight`` is) and
        ``[rows]`` bool, whether the target is the arg-max token (ties count as greedy).

    Raises:
        ValueError: mismatched shapes.
    """
    import torch

    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or \
            targets.shape != hidden.shape[:1]:
        raise ValueError(f"target_logprobs: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, targets "
                         f"{tuple(targets.shape)}: expected [rows, hidden], [vocab, hidden], [rows]")
    chunk = chunk or chunk_tokens(weight.shape[0])
    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    reduce = torch.promote_types(weight.dtype, torch.float32)  # fp32; float64 stays float64
    out = torch.empty(targets.shape, dtype=reduce, device=hidden.device)
    greedy = torch.empty(targets.shape, dtype=torch.bool, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        stop = start + chunk
        logits = (hidden[start:stop] @ weight.t()).to(reduce)  # [chunk, vocab]: the only logits alive
        target = logits.gather(1, targets[start:stop, None]).squeeze(1)
        peak = logits.amax(dim=-1)
        greedy[start:stop] = target >= peak
        sums = logits.sub_(peak[:, None]).exp_().sum(dim=-1)  # in place: logsumexp would allocate a second buffer
        out[start:stop] = target - peak - sums.log()
        del logits
    return out, greedy
