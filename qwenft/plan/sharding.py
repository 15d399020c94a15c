"""What one process holds when FSDP or DeepSpeed ZeRO shards a LoRA run over ``N`` processes (bytes).

The sharding modes (``TrainSetup.sharding``, from ``dist.strategy`` and its preset by :func:`sharding_mode`):

- ``none`` (``dist=none``, ``ddp``, ZeRO stage 0): every process holds everything.
- ``zero1``: AdamW states sharded over the processes (Rajbhandari et al. 2020, "ZeRO", section 5.1, P_os).
- ``zero2``: states and gradients sharded (P_os+g); the weights stay whole in every process.
- ``zero3``: weights (frozen base and LoRA), gradients and states sharded (P_os+g+p). DeepSpeed 0.19.8 gathers a
  module's weights when it runs and releases them after (``runtime/zero/partitioned_param_coordinator.py``). Its
  keep-for-reuse rule (``__params_to_release``, ``stage3_max_reuse_distance``) and its prefetch need a complete module
  trace, and the trace only advances in ``reset_step``, which runs in the root module's forward pre-hook
  (``parameter_offload.py``, ``_start_of_forward_hook``). qwenft's loss runs the body (``causal.model``), never the
  root's forward (:func:`qwenft.train.loss.supervised_loss_sum`), so the trace stays ``INVALID``: every module is
  released after its forward and after its backward, nothing is prefetched, no layer is kept. Seen on 2 CPU processes
  (embedded 0.5B, fp32, 3 steps): no decoder-layer parameter is gathered (``ds_status``) at the loss or when the
  last layer's backward starts, in any step, and ``reset_step`` never ran. qwenft's loss gathers the lm_head
  (``qwenft.train.loss._gathered``, ``GatheredParameters``): whole through the loss, and ``copies`` of it at its
  all-gather: the parameter, plus gloo's own flat output on CPU processes (measured: the peak rises 1,038-1,039 MiB,
  2 x the 519 MiB lm_head, over the RSS before the gather, and the RSS 519 MiB inside it). Planned: the lm_head at
  the loss, ``copies`` x it at its gather, and the running layer (``copies`` at its gather) in backward. The
  embedding's gather, at the start of the forward, holds as much with no activations yet and is left out. Not
  counted: parameters under ``stage3_param_persistence_threshold`` (``auto``: 10 x hidden elements) stay whole in
  every process (``ds_persist``): norms, biases, small LoRA matrices (6.4 MiB on the 0.5B).
- ``fsdp``: PyTorch FSDP2 (``fully_shard``) with ``reshard_after_forward: true``, the ``dist=fsdp`` preset, grouped
  as accelerate 1.15 groups it (``accelerate.utils.fsdp_utils.fsdp2_prepare_model``): each ``Qwen2DecoderLayer``
  (with its LoRA weights), the input embedding (untied), and the tail ``[final norm, lm_head]`` (with the embedding
  when tied) wrapped with ``reshard_after_forward=False``; every parameter is split into ``N`` dim-0 chunks.
  A group's weights are all-gathered when it runs. The decoder layers are freed after their forward, re-gathered in
  backward, and the next one is prefetched (``FSDPParamGroup.pre_backward`` -> ``_backward_prefetch``). The tail is
  gathered when qwenft's loss runs the root forward (``qwenft.train.loss``: ``lm_head.weight`` whole) and stays
  gathered to the end of backward: its lm_head output gets no gradient, so its post-backward reshard does not run
  before the root's final callback (seen on 2 CPU processes: ``lm_head.weight`` is a plain tensor during layer 0's
  backward, a DTensor after the final norm's forward). An all-gather writes into one flat buffer of the group and
  then copies it out into the unsharded parameters (``foreach_all_gather_copy_out``): two copies of the group at
  once; gloo (CPU processes) holds a third, its own flat output, until the work object is dropped (measured: 202 MiB
  more peak for a 200 MiB ``all_gather_into_tensor``, and a tail gather of 3 x 545 MiB on the 0.5B:
  benchmarks/dist_memory.py). Planned: the tail whole through the loss and the layers' backward, ``copies`` x the
  tail at its gather, and in backward the running layer plus the prefetched one at its gather (torch 2.13
  ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``, ``_fsdp_param_group.py``). The input embedding's
  gather, at the start of the forward, holds less than the tail's and is left out.
- ``fsdp_no_reshard``: FSDP2 with ``reshard_after_forward: false`` (ZeRO-2-like): the shards persist and every
  group stays gathered from its forward to its backward, so at the loss all the weights are gathered too.

Activations are per process in every mode: each process runs its own micro-batch of ``train.batch_size`` rows.
ZeRO-1/2 with ``contiguous_gradients`` stage gradients in ``reduce_bucket_size``-element buffers of the trainable
parameters' dtype (fp32 LoRA), two of them with ``overlap_comm`` (DeepSpeed ``stage_1_and_2.py``,
``setup_buckets``): :func:`zero_reduce_buffers`. Not modelled: FSDP's reduce-scatter buffers, ZeRO-3's buckets
and the collectives' own memory (NCCL / gloo).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping

MODES = ("none", "zero1", "zero2", "zero3", "fsdp", "fsdp_no_reshard")


def sharding_mode(strategy: str, fsdp: Mapping[str, Any], deepspeed: Mapping[str, Any]) -> str:
    """The sharding mode (one of :data:`MODES`) of ``dist.strategy`` with its ``dist.fsdp`` / ``dist.deepspeed``
    settings: fsdp is ``fsdp`` unless ``reshard_after_forward`` is false; deepspeed is ``zero<stage>`` (stage 0:
    ``none``); ``none`` and ``ddp`` shard nothing."""
    if strategy == "fsdp":
        return "fsdp" if fsdp.get("reshard_after_forward", True) else "fsdp_no_reshard"
    if strategy == "deepspeed":
        stage = (deepspeed.get("zero_optimization") or {}).get("stage", 0)
        return f"zero{stage}" if stage else "none"
    return "none"


def split(nbytes: int, processes: int) -> int:
    """Bytes of one process's shard of ``nbytes`` split over ``processes`` (rounded up: FSDP2 pads the last chunk,
    ZeRO pads each flat partition)."""
    return math.ceil(nbytes / processes)


def shard(mode: str, processes: int, weights: int, lora_weights: int, gradients: int, states: int,
          step: int) -> Dict[str, int]:
    """Per-process bytes of the static rows after sharding.

    Args:
        mode: one of :data:`MODES`.
        processes: the number of processes ``N`` (>= 1).
        weights: the frozen base's weight bytes during training (whole model).
        lora_weights, gradients, states, step: fp32 LoRA weights, their gradients, the optimizer states and the
            optimizer step's temporaries (whole model).

    Returns:
        The same five keys, divided by ``N`` where ``mode`` shards them (:func:`split`).

    Raises:
        ValueError: an unknown ``mode`` or ``processes < 1``.
    """
    if mode not in MODES or processes < 1:
        raise ValueError(f"sharding mode {mode!r} over {processes} processes: need one of {MODES} and >= 1")
    full = mode in ("zero3", "fsdp", "fsdp_no_reshard")
    grads = full or mode == "zero2"
    optim = mode != "none"
    n = processes
    return {"weights": split(weights, n) if full else weights,
            "lora_weights": split(lora_weights, n) if full else lora_weights,
            "gradients": split(gradients, n) if grads else gradients,
            "optimizer_states": split(states, n) if optim else states,
            "step": split(step, n) if optim else step}


def gathered(mode: str, processes: int, layer: int, head: int, everything: int, gloo: bool = False) -> Dict[str, int]:
    """Bytes of unsharded weights a process holds besides its shards (see the module docstring for each mode).

    Args:
        mode: one of :data:`MODES`; processes: ``N``.
        layer: one decoder layer's weights with its LoRA weights (training dtypes).
        head: the lm_head with the final norm (FSDP's tail group; the embedding when tied; what qwenft's loss
            gathers under ZeRO-3).
        everything: all the weights (base and LoRA).
        gloo: CPU processes (gloo's all-gather holds its own copy of the output, see the module docstring).

    Returns:
        ``loss``: held while the loss runs; ``at_gather``: held at the all-gather just before it (activations
        held, the loss not started); ``layers``: held during the layers' backward. Zeros when nothing is gathered
        (``N == 1`` or no weight sharding).
    """
    if processes == 1 or mode not in ("zero3", "fsdp", "fsdp_no_reshard"):
        return {"loss": 0, "at_gather": 0, "layers": 0}
    if mode == "zero3":  # nothing kept (the trace never completes): the lm_head at the loss, the running layer
        copies = 2 if gloo else 1  # the gathered parameter (+ gloo's output)
        return {"loss": head, "at_gather": copies * head, "layers": copies * layer}
    copies = 3 if gloo else 2  # a group at its all-gather: flat buffer + unsharded parameters (+ gloo's output)
    if mode == "fsdp":  # the tail through the loss and backward; backward: running layer + the prefetched at its gather
        return {"loss": head, "at_gather": copies * head, "layers": head + (1 + copies) * layer}
    return {"loss": everything, "at_gather": everything, "layers": everything}  # fsdp_no_reshard


def zero_reduce_buffers(mode: str, deepspeed: Mapping[str, Any]) -> Dict[str, int]:
    """ZeRO-1/2's gradient staging buffers: ``{"count": buffers, "elements": elements each}`` (zeros otherwise).

    ``contiguous_gradients`` allocates one ``torch.empty(reduce_bucket_size)`` buffer, and a second one with
    ``overlap_comm`` (DeepSpeed ``DeepSpeedZeroOptimizer.setup_buckets``); the ``dist=deepspeed_zero2`` preset's
    2e8 elements in fp32 are 2 x 800 MB on a GPU, whatever the model. An "auto" size is left out (transformers fills
    it from the hidden size, for ZeRO-3).
    """
    zero = deepspeed.get("zero_optimization") or {}
    size = zero.get("reduce_bucket_size", 500_000_000)  # DeepSpeed's default
    if mode not in ("zero1", "zero2") or not zero.get("contiguous_gradients", True) or not isinstance(size, int):
        return {"count": 0, "elements": 0}
    return {"count": 2 if zero.get("overlap_comm", False) else 1, "elements": int(size)}
