"""LoRA: fresh adapters for training (peft, with the QLoRA preparation of a 4-bit base), and trained ones loaded for
inference on the base they were trained on: the one way eval, generate, inspect, serve and merge get an adapter's
base ready (:func:`prepare_inference`, then :func:`load_for_inference`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from typing import Any, Optional, Tuple

from qwenft.config import Config, LoraConfig, QwenftError
from qwenft.kernels import apply_kernels, resolve_kernels
from qwenft.model.adapter import check_adapter_dir, inference_config, read_adapter_meta
from qwenft.model.load import count_parameters, load_model
from qwenft.model.vllm_lora import read_adapter_config, vllm_support, vllm_warning

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _peft_deprecations_quiet():
    """peft 0.21 still calls transformers 5's deprecated ``*gradient_checkpointing*`` names: not the user's concern."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing.* is deprecated", category=FutureWarning)
        yield


def attach_lora(model, lcfg: LoraConfig, gradient_checkpointing: bool = True, keep_dtype: bool = False,
                kernels: str = "none", init_adapter: Optional[str] = None, reference: bool = False,
                autocast_dtype=None):
    """Wrap ``model`` with fresh LoRA adapters for training (a ``peft.PeftModel``), or with the saved adapter
    ``init_adapter`` made trainable (a second stage: DPO after SFT); ``reference`` also loads that adapter a
    second time, frozen, as ``reference`` (the preference objectives' reference model,
    :func:`qwenft.train.preference.reference_adapter`).

    The base's layers are first patched with the chosen kernels (``kernels``: ``train.kernels``, resolved for the
    model's device by :func:`qwenft.kernels.resolve_kernels`, applied by :func:`qwenft.kernels.apply_kernels`).
    A 4-bit base goes through the k-bit preparation (:func:`prepare_kbit`: frozen base, fp32 norms and residual
    stream; under autocast to ``autocast_dtype``, the training's ``train.precision`` resolved by
    :func:`qwenft.train.trainer.autocast_dtype`, the embedding and lm_head stay in it), unless ``keep_dtype``
    (sharded QLoRA, FSDP / ZeRO-3: the weights must keep the one storage dtype they are sharded in, so the base is
    only frozen, as a 16-bit one is). Gradient checkpointing is non-reentrant, so LoRA weights still get gradients
    when the embeddings are frozen; ``use_cache`` is off while training.

    Returns:
        The PEFT model; trainable and total parameter counts are logged.

    Raises:
        QwenftError: ``kernels="liger"`` without a CUDA device or without liger-kernel.
    """
    apply_kernels(model, resolve_kernels(kernels, next(model.parameters()).device.type == "cuda"))
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    ckpt_kwargs = {"use_reentrant": False}
    if getattr(model, "is_loaded_in_4bit", False) and not keep_dtype:
        prepare_kbit(model, autocast_dtype)
        if gradient_checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt_kwargs)
    else:
        for param in model.parameters():
            param.requires_grad_(False)
        if gradient_checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt_kwargs)
            model.enable_input_require_grads()
    model.config.use_cache = False
    if init_adapter:
        from peft import PeftModel

        path = str(check_adapter_dir(init_adapter))
        with _peft_deprecations_quiet():
            peft_model = PeftModel.from_pretrained(model, path, is_trainable=True)
            if reference:
                peft_model.load_adapter(path, adapter_name="reference", is_trainable=False)
                peft_model.set_adapter("default")  # the trained copy active; the reference frozen
        trainable, total = count_parameters(peft_model)
        log.info("LoRA from %s%s: %s trainable of %s parameters", path, " (and its frozen copy as the reference)"
                 if reference else "", f"{trainable:,}", f"{total:,}")
        return peft_model
    peft_config = PeftLoraConfig(r=lcfg.r, lora_alpha=lcfg.lora_alpha, lora_dropout=lcfg.lora_dropout,
                                 target_modules=list(lcfg.target_modules), bias=lcfg.bias,
                                 use_rslora=lcfg.use_rslora, use_dora=lcfg.use_dora, task_type="CAUSAL_LM")
    with _peft_deprecations_quiet():
        peft_model = get_peft_model(model, peft_config)
    trainable, total = count_parameters(peft_model)
    log.info("LoRA r=%d alpha=%d on %s: %s trainable of %s parameters (%.3f%%)", lcfg.r, lcfg.lora_alpha,
             ",".join(lcfg.target_modules), f"{trainable:,}", f"{total:,}", 100.0 * trainable / max(total, 1))
    return peft_model


EMBEDDING_CAST = "_qwenft_embedding_cast"  # the model attribute holding the hook prepare_kbit registered


def prepare_kbit(model, autocast_dtype=None) -> int:
    """Prepare a 4-bit base for LoRA training as peft's ``prepare_model_for_kbit_training`` does (every parameter
    frozen; every 16-bit parameter that is not 4-bit cast to fp32: norms, biases, embedding, lm_head), except that
    under a 16-bit autocast (``autocast_dtype``, a torch dtype, or None) an embedding and lm_head already in that
    dtype stay in it, and the embedding's output is cast to fp32 instead (a forward hook, removed by
    :func:`end_training`): the residual stream is fp32 as after peft's preparation, with the same values (the fp32
    table peft makes holds the 16-bit values), and the losses and gradients are the same bit for bit
    (docs/performance.md, "DPO step"). The vocabulary projection runs in the autocast dtype either way. This keeps
    2 bytes per embedding and lm_head weight out of the peak: Qwen2.5-0.5B's tied 151,936 x 896 table, 260 MiB;
    Qwen2.5-7B's untied embedding, 1.1 GB (its lm_head went back to 16-bit after peft's cast already,
    :func:`qwenft.train.trainer.head_to_autocast_dtype`, but only after the fp32 copy was made).

    Gradient checkpointing is the caller's (non-reentrant, so no input-grad hook is needed). On a CPU the weights
    left as views into the memory-mapped checkpoint are copied out of it (:func:`qwenft.memory.release_mapped_weights`),
    so the file's pages do not stay resident beside them.

    Returns:
        The bytes of embedding and lm_head kept 16-bit (0 when they were cast to fp32).
    """
    import torch

    for param in model.parameters():
        param.requires_grad_(False)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    keep = {}
    if autocast_dtype in (torch.bfloat16, torch.float16):
        for module in (embed, head):
            if module is not None and module.weight.dtype == autocast_dtype:
                keep[id(module.weight)] = module.weight
    for param in model.parameters():
        if param.dtype in (torch.float16, torch.bfloat16) and type(param).__name__ != "Params4bit" \
                and id(param) not in keep:
            param.data = param.data.to(torch.float32)
    if id(embed.weight) in keep:
        setattr(model, EMBEDDING_CAST, embed.register_forward_hook(_embedding_output_fp32))
    device = next(model.parameters()).device.type
    if device == "cuda":
        torch.cuda.empty_cache()
    elif device == "cpu":
        from qwenft.memory import release_mapped_weights

        release_mapped_weights([*model.parameters(), *model.buffers()])
    return sum(p.numel() * p.element_size() for p in keep.values())


def _embedding_output_fp32(module, inputs, output):
    return output.float()


def end_training(model) -> bool:
    """Remove the embedding's fp32 cast :func:`prepare_kbit` registered (on ``model`` or the base a PEFT model wraps),
    so an evaluation in the training's process runs as a later ``qwenft eval`` does. Returns whether one was there."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model forwards reads only
    handle = base.__dict__.pop(EMBEDDING_CAST, None)
    if handle is None:
        return False
    handle.remove()
    return True


def load_adapter(model, adapter_dir: str, trainable: bool = False):
    """Load a saved PEFT LoRA adapter directory onto a base model.

    Raises:
        QwenftError: ``adapter_dir`` has no adapter_config.json (it is written by ``python -m qwenft train``), or its
            weights have other shapes than ``model``'s layers (an adapter of another base model).
    """
    from peft import PeftModel

    path = check_adapter_dir(adapter_dir)
    try:
        with _peft_deprecations_quiet():  # peft reads is_gradient_checkpointing while loading, too
            return PeftModel.from_pretrained(model, str(path), is_trainable=trainable)
    except RuntimeError as exc:
        if "size mismatch" not in str(exc):
            raise
        name = getattr(getattr(model, "config", None), "_name_or_path", "the loaded model")
        raise QwenftError(f"adapter={adapter_dir!r} does not fit {name}: its LoRA shapes belong to another base model; "
                          "pass the model it was trained on (model=... / model.source=... model.path=...)") from None


def prepare_inference(config: Config) -> Config:
    """``config`` for running an adapter: the directory checked (a typo fails before any load; a run directory
    stands for its ``adapter/``, :func:`qwenft.model.adapter.check_adapter_dir`) and the model,
    quantization and system prompt the adapter was trained with, except what the user typed. Without
    ``adapter``, ``config`` as it is. For ``eval``, one warning when vLLM cannot serve the adapter unmerged
    (:func:`qwenft.model.vllm_lora.vllm_support`).

    Raises:
        QwenftError: ``config.adapter`` is missing or holds no adapter; an unreadable ``qwenft.json``.
    """
    if not config.adapter:
        return config
    # a run directory stands for its adapter/: everything after this reads the adapter directory itself
    config = dataclasses.replace(config, adapter=str(check_adapter_dir(config.adapter)))
    config = inference_config(config)
    meta = read_adapter_meta(config.adapter)
    trained_on = (meta or {}).get("model", {}).get("name")
    if trained_on and trained_on != config.model.name:
        log.warning("adapter %s was trained on %s; running it on %s", config.adapter, trained_on, config.model.name)
    elif trained_on:
        log.info("adapter trained on %s", trained_on)
    reasons = vllm_support(read_adapter_config(config.adapter)) if config.command == "eval" else []
    if reasons:  # eval: said before its numbers are taken to a vLLM deployment of the adapter as it is
        log.warning("%s", vllm_warning(config.adapter, reasons))
    return config


def load_for_inference(config: Config, device: Optional[str] = None, tokenizer=None) -> Tuple[Any, Any]:
    """Base (``config.model`` / ``config.quant``, as :func:`prepare_inference` resolved them) plus the adapter
    when ``config.adapter`` is set, in eval mode, as loaded: a 4-bit base stays 4-bit (``inspect`` traces that
    computation; eval and generate let ``qwenft.generation.engine.prepare_for_decoding`` decide whether to
    dequantize it, with the free GPU memory in view).

    Args:
        device: where to load (default: :func:`qwenft.runtime.default_device`).
        tokenizer: one already loaded from the same source (e.g. to read the data before the weights).

    Returns:
        ``(model, tokenizer)``: a ``PeftModel`` when an adapter was loaded.

    Raises:
        QwenftError: see :func:`qwenft.model.load.load_model` and :func:`qwenft.model.lora.load_adapter`.
    """
    model, tokenizer = load_model(config, device=device, tokenizer=tokenizer)
    if config.adapter:
        model = load_adapter(model, config.adapter)
    model.eval()
    return model, tokenizer
