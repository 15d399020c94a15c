"""How eval and generate run the model: the decode path chosen for the device and memory, and the batch size.

On CUDA the fastest exact path is taken when it fits (issue 18): the NF4 base is dequantized once to 16-bit
(decode reads 16-bit weights at full bandwidth instead of bitsandbytes dequantizing every weight on every step),
the tuned side folds its LoRA delta into those weights (:mod:`qwenft.model.fold`), and decode steps run from a
static cache through ``torch.compile`` with CUDA graphs. When the 16-bit weights do not fit, NF4 + LoRA as loaded.
On a CPU the 4-bit base is dequantized (bitsandbytes' per-forward dequantization dominates there) and nothing is
compiled or folded unless asked for. On every device the weights are then in the compute dtype: the evaluation after
``train`` (where QLoRA's preparation left fp32 weights) runs exactly the dtypes of a later ``qwenft eval``.

Memory comes from the planner's byte formulas (:mod:`qwenft.plan.memory`) applied to the loaded model's
architecture, against the free GPU memory (``torch.cuda.mem_get_info`` plus what torch's allocator holds unused).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from qwenft.config import Config, QwenftError
from qwenft.plan.evaluation import CPU_BATCH, MARGIN_BYTES  # the planner's numbers (their one home)

log = logging.getLogger(__name__)

MAX_AUTO_ROWS = 128  # generation rows per batch under eval.batch_size=auto (decode is bandwidth bound well past this)
MAX_AUTO_WINDOWS = 16  # perplexity windows per batch under auto


@dataclass(frozen=True)
class DecodePath:
    """The resolved way of running inference.

    Attributes:
        device: ``cuda`` or ``cpu`` (the device type the model is on).
        dequantize: replace the 4-bit layers by 16-bit copies once.
        dtype: the dtype the fp32 weights (and the dequantized ones) are cast to: ``quant.compute_dtype`` for a
            4-bit base, else ``model.dtype``, ``auto`` resolved; the same on every device, after training or loaded.
        fold: fold the LoRA delta into the 16-bit weights for the tuned side.
        compile: static cache + ``torch.compile`` (CUDA graphs) of the decode step.
        reason: one line for the log: what was chosen and why.
    """

    device: str
    dequantize: bool
    dtype: Optional[str]
    fold: bool
    compile: bool
    reason: str


def _tri(value: str) -> Optional[bool]:
    return {"auto": None, "true": True, "false": False}[value]


def choose_path(config: Config, device: str, *, nf4: bool, adapter: bool, fold_blocker: Optional[str],
                dense_bytes: int, free_bytes: Optional[int], reserve_bytes: int,
                native_bf16: Optional[bool] = None) -> DecodePath:
    """Decide dequantize / dtype / fold / compile for ``device`` from the config and the memory numbers.

    Args:
        device: the device type, ``cuda`` or ``cpu``.
        nf4: the base is loaded in 4-bit.
        adapter: a LoRA adapter is attached (a tuned side exists).
        fold_blocker: why the adapter cannot be folded into a 16-bit base (:func:`qwenft.model.fold.fold_blocker`
            once dequantized), or None.
        dense_bytes: bytes of the 4-bit projections in 16-bit (``qwenft.plan.weight_bytes`` attention + mlp).
        free_bytes: free device memory (bytes); None on a CPU.
        reserve_bytes: what decoding needs beside the weights (:func:`reserve_bytes`).
        native_bf16: whether the device runs bf16 natively (resolves a dtype ``auto``); None: ask the device
            (:func:`qwenft.runtime.native_bf16`).

    Returns:
        The :class:`DecodePath`.

    Raises:
        QwenftError: ``generate.compile=true`` off CUDA; ``generate.fold_lora=true`` on a 4-bit base that is not
            dequantized, or on an adapter that cannot be folded.
    """
    cuda = device == "cuda"
    want = config.quant.dequantize_for_inference
    fits = free_bytes is not None and dense_bytes + reserve_bytes <= free_bytes
    if not nf4:
        dequantize, why = False, "16-bit base"
    elif want is not None:
        dequantize, why = want, f"quant.dequantize_for_inference={str(want).lower()}"
    elif not cuda:
        dequantize, why = True, "NF4 dequantized on the CPU"
    else:
        dequantize = fits
        need = f"{(dense_bytes + reserve_bytes) / 2**30:.1f} GiB needed, {(free_bytes or 0) / 2**30:.1f} GiB free"
        why = f"NF4 dequantized to 16-bit ({need})" if fits else f"NF4 kept: 16-bit weights do not fit ({need})"
    sixteen = not nf4 or dequantize
    compile_wanted = _tri(config.generate.compile)
    if compile_wanted and not cuda:
        raise QwenftError("generate.compile=true (static cache + torch.compile) needs the model on a CUDA device; "
                          "use generate.static_cache=true (no compile) or generate.compile=false")
    from qwenft.generation.generate import auto_compile

    compile_on = compile_wanted if compile_wanted is not None else auto_compile(device, sixteen)
    fold_wanted = _tri(config.generate.fold_lora)
    fold = False
    if adapter and fold_wanted is not False:
        if fold_wanted and not sixteen:
            raise QwenftError("generate.fold_lora=true needs a 16-bit base: the NF4 base is kept (set "
                              "quant.dequantize_for_inference=true, or generate.fold_lora=auto)")
        if fold_wanted and fold_blocker:
            raise QwenftError(f"generate.fold_lora=true: {fold_blocker}; run it as an adapter with "
                              "generate.fold_lora=auto or false")
        fold = bool(sixteen and not fold_blocker and (fold_wanted or cuda))
    from qwenft.runtime import native_bf16 as probe

    # Every device, dequantized or not: the weights evaluation reads are the compute dtype's, whether the model was
    # just trained (QLoRA's preparation left the non-4-bit weights and LoRA in fp32) or loaded by `qwenft eval`.
    dtype = config.quant.compute_dtype if nf4 else config.model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if (probe(device) if native_bf16 is None else native_bf16) else "float32"
    parts = [why, f"LoRA {'folded into the weights' if fold else 'as adapter'}" if adapter else None,
             f"decode {'compiled (static cache, CUDA graphs)' if compile_on else 'static cache' if config.generate.static_cache else 'dynamic cache'}"]
    return DecodePath(device=device, dequantize=dequantize and nf4, dtype=dtype, fold=fold, compile=compile_on,
                      reason="; ".join(p for p in parts if p))


def architecture(model):
    """The planner's :class:`~qwenft.plan.Architecture` of a loaded model (PEFT-wrapped or not)."""
    from qwenft.plan import Architecture

    return Architecture.from_config_dict(model.config.to_dict(), "the loaded model")


def dense_projection_bytes(arch, bytes_per_value: int = 2) -> int:
    """Bytes of the seven projections of every layer in 16-bit (the planner's ``weight_bytes``)."""
    from qwenft.plan import weight_bytes

    weights = weight_bytes(arch, nf4=False, double_quant=False, dense_bytes=bytes_per_value)
    return weights["attention"] + weights["mlp"]


def row_bytes(arch, cache_len: int, prompt_len: int) -> int:
    """Bytes one generation row needs beside the weights: its KV cache of ``cache_len`` tokens in 16-bit
    (:func:`qwenft.plan.kv_cache_bytes`), the prefill's largest transient (the MLP's gate, up and activation
    outputs, ``3 * prompt_len * intermediate`` 16-bit values) and the last position's logits (fp32, the raw
    copy, the processed scores and the softmax: ``3 * vocab * 4``)."""
    from qwenft.plan import kv_cache_bytes

    return (kv_cache_bytes(arch, cache_len) + 3 * 2 * prompt_len * arch.intermediate_size
            + 3 * 4 * arch.vocab_size)


def window_bytes(arch, window: int) -> int:
    """Bytes one perplexity window needs in 16-bit: its no-grad forward through the model body
    (:func:`qwenft.plan.evaluation.forward_bytes`) and the gathered hidden states of its scored positions. No
    ``[window, vocab]`` logits: the vocabulary is projected a chunk at a time, one chunk per batch
    (:func:`qwenft.plan.evaluation.chunk_logits_bytes`, in :func:`reserve_bytes`)."""
    from qwenft.plan.evaluation import forward_bytes

    return forward_bytes(arch, 1, window, 2) + window * arch.hidden_size * 2


def reserve_bytes(arch, cache_len: int, prompt_len: int, window: int) -> int:
    """Memory kept for decoding one row or scoring one perplexity window (with its chunk of logits), plus
    :data:`MARGIN_BYTES`."""
    from qwenft.plan.evaluation import chunk_logits_bytes

    return max(row_bytes(arch, cache_len, prompt_len),
               window_bytes(arch, window) + chunk_logits_bytes(arch, window, 2)) + MARGIN_BYTES


def auto_batch_sizes(arch, free_bytes: Optional[int], cache_len: int, prompt_len: int, window: int):
    """``eval.batch_size=auto``: ``(generation rows, perplexity windows)`` per batch.

    On CUDA: as many rows as :func:`row_bytes` allows in ``free_bytes`` less :data:`MARGIN_BYTES`, rounded down
    to a power of two (fewer distinct compiled shapes), at most :data:`MAX_AUTO_ROWS`; windows likewise from
    :func:`window_bytes`, at most :data:`MAX_AUTO_WINDOWS`. On a CPU (``free_bytes`` None): :data:`CPU_BATCH`.
    """
    if free_bytes is None:
        return CPU_BATCH, CPU_BATCH
    room = max(free_bytes - MARGIN_BYTES, 0)

    def fit(each: int, cap: int) -> int:
        n = max(1, min(cap, room // max(each, 1)))
        return 1 << (n.bit_length() - 1)

    return fit(row_bytes(arch, cache_len, prompt_len), MAX_AUTO_ROWS), fit(window_bytes(arch, window), MAX_AUTO_WINDOWS)


def free_device_bytes(device: str) -> Optional[int]:
    """Free memory of the current CUDA device (driver's free plus torch's cached, unused blocks); None on a CPU."""
    if device != "cuda":
        return None
    import torch

    free, _ = torch.cuda.mem_get_info()
    return int(free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated())


class Engine:
    """A model made ready for eval / generate along a :class:`DecodePath`, with its base and tuned sides.

    ``model`` is what the sampler runs: the PEFT model as loaded, or, when folding, the plain transformers model
    (its weights are the base's until the tuned side folds the adapter in; the base side must come first).
    """

    def __init__(self, model, path: DecodePath, fold=None):
        self.model = model
        self.path = path
        self._fold = fold

    @contextlib.contextmanager
    def side(self, name: str) -> Iterator[Any]:
        """Run the block on the ``base`` (adapter off) or ``tuned`` (adapter on) side; yields the model.

        Raises:
            RuntimeError: ``base`` after ``tuned`` when the adapter was folded (the weights are the tuned ones).
        """
        if self._fold is not None:
            if name == "tuned" and not self._fold.folded:
                count = self._fold.fold_()
                log.info("folded the LoRA delta into %d projections for the tuned side", count)
            elif name == "base" and self._fold.folded:
                raise RuntimeError("the base side must be evaluated before the tuned side folds the adapter in")
            yield self.model
        elif name == "base" and hasattr(self.model, "disable_adapter"):
            with self.model.disable_adapter():
                yield self.model
        else:
            yield self.model

    def settings(self, generate):
        """``generate`` (a :class:`~qwenft.config.GenerateConfig`) with this path's compile decision."""
        return dataclasses.replace(generate, compile="true" if self.path.compile else "false")


def prepare_for_decoding(model, config: Config, *, cache_len: int, prompt_len: int) -> Engine:
    """Choose the :class:`DecodePath` for ``model`` (as :func:`qwenft.model.lora.load_for_inference`
    loaded it, or just trained) and apply it: cast, dequantize, unwrap for folding.

    On a CPU every weight not cast or dequantized is copied into the process's own memory: the loader leaves the
    16-bit weights it did not convert (embeddings, norms, lm_head) as views into the memory-mapped safetensors file,
    which keeps the whole file mapped, and every page of it that loading read counts in the resident set. The copy
    drops the file's pages as it goes (:func:`qwenft.memory.release_mapped_weights`), so it does not hold them and
    the copies at once (docs/performance.md, "Memory on a CPU").

    Args:
        cache_len: tokens one row will cache (longest prompt + max_new_tokens); prompt_len: longest prompt.

    Raises:
        QwenftError: see :func:`choose_path`.
    """
    from qwenft.model.fold import fold_blocker, unwrap
    from qwenft.model.load import dequantize_for_inference, has_4bit_layers
    from qwenft.runtime import torch_dtype
    from qwenft.memory import release_freed_memory, release_mapped_weights, return_freed_memory_promptly

    device = next(model.parameters()).device.type
    nf4 = has_4bit_layers(model)
    adapter = hasattr(model, "peft_config")
    arch = architecture(model)
    blocker = fold_blocker(model, dequantizing=True) if adapter else None
    path = choose_path(config, device, nf4=nf4, adapter=adapter, fold_blocker=blocker,
                       dense_bytes=dense_projection_bytes(arch) if nf4 else 0, free_bytes=free_device_bytes(device),
                       reserve_bytes=reserve_bytes(arch, cache_len, prompt_len, config.eval.ppl_window))
    model.eval()
    if device == "cpu":  # inference's activations of a few MiB: returned to the system when freed
        return_freed_memory_promptly()
    dtype = torch_dtype(path.dtype, device) if path.dtype else None
    for param in model.parameters():  # before dequantizing: the fp32 copies are gone by then
        if not param.is_floating_point() or type(param).__name__ == "Params4bit":
            continue
        if dtype is not None and param.dtype != dtype:  # after QLoRA training the non-4-bit weights and LoRA are
            param.data = param.data.to(dtype)  # fp32 (an untied lm_head 16-bit): read in the dtype a later eval loads
    if device == "cpu":  # out of the loaded file's mapping (docstring)
        release_mapped_weights([*model.parameters(), *model.buffers()])
    if path.dequantize:
        dequantize_for_inference(model, config.quant, device, enabled=True, dtype=dtype)
    if device == "cpu":  # the replaced 4-bit and fp32 weights, freed into the heap while loading: back to the system
        release_freed_memory()
    model.config.use_cache = True  # training switched the cache off
    contiguous_head_input(model)
    fold = None
    if path.fold:
        model, fold = unwrap(model)
    log.info("inference path: %s", path.reason)
    return Engine(model, path, fold)


def contiguous_head_input(model) -> bool:
    """Give the vocabulary projection (``lm_head``) a contiguous input, once per model; returns whether a hook was added.

    transformers slices the positions it keeps (``hidden_states[:, -1:, :]`` under ``logits_to_keep=1``, the
    sampler's prefill) into a strided ``[batch, 1, hidden]`` view. For such a view and a weight that does not require
    grad (frozen, as in evaluation), ``torch.matmul`` does not fold the batch into one GEMM but runs a ``bmm``
    against the weight expanded to ``[batch, hidden, vocab]``, which the CPU kernel materialises (docs/performance.md,
    "Memory on a CPU"). The copy of ``[batch, 1, hidden]`` costs nothing, and the logits are the same.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or getattr(head, "_qwenft_contiguous_input", False):
        return False
    head.register_forward_pre_hook(lambda module, args: (args[0].contiguous(), *args[1:]) if args else None)
    head._qwenft_contiguous_input = True
    return True


def batch_sizes(config: Config, model, cache_len: int, prompt_len: int):
    """``(generation rows, perplexity windows)`` per batch: ``eval.batch_size`` when it is a number, else
    :func:`auto_batch_sizes` for the memory left beside ``model`` (call it after :func:`prepare_for_decoding`)."""
    if config.eval.batch_size != "auto":
        return int(config.eval.batch_size), int(config.eval.batch_size)
    device = next(model.parameters()).device.type
    rows, windows = auto_batch_sizes(architecture(model), free_device_bytes(device), cache_len, prompt_len,
                                     config.eval.ppl_window)
    log.info("eval.batch_size=auto: %d prompts per generation batch, %d perplexity windows per batch", rows, windows)
    return rows, windows
