"""The one way eval, generate, inspect and merge get an adapter's base ready: check the adapter directory before
anything loads, resolve the base it was trained on (:func:`qwenft.model.adapter.inference_config`), then load
base + adapter for inference."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Tuple

from qwenft.config import Config
from qwenft.model.adapter import check_adapter_dir, inference_config, read_adapter_meta
from qwenft.model.load import load_model
from qwenft.model.lora import load_adapter
from qwenft.model.serving import read_adapter_config, vllm_support, vllm_warning

log = logging.getLogger(__name__)


def prepare_inference(config: Config) -> Config:
    """``config`` for running an adapter: the directory checked (a typo fails before any load; a run directory
    stands for its ``adapter/``, :func:`qwenft.model.adapter.check_adapter_dir`) and the model,
    quantization and system prompt the adapter was trained with, except what the user typed. Without
    ``adapter``, ``config`` as it is. For ``eval``, one warning when vLLM cannot serve the adapter unmerged
    (:func:`qwenft.model.serving.vllm_support`).

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
