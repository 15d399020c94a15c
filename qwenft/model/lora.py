"""LoRA: fresh adapters for training (peft, with the QLoRA preparation of a 4-bit base) and saved ones loaded."""

from __future__ import annotations

import contextlib
import logging
import warnings

from qwenft.config import LoraConfig, QwenftError
from qwenft.model.adapter import check_adapter_dir
from qwenft.model.load import count_parameters

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _peft_deprecations_quiet():
    """peft 0.21 still calls transformers 5's deprecated ``*gradient_checkpointing*`` names: not the user's concern."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing.* is deprecated", category=FutureWarning)
        yield


def attach_lora(model, lcfg: LoraConfig, gradient_checkpointing: bool = True, keep_dtype: bool = False):
    """Wrap ``model`` with fresh LoRA adapters for training (a ``peft.PeftModel``).

    A 4-bit base goes through peft's k-bit preparation (frozen base, fp32 norms, input grads), unless
    ``keep_dtype`` (sharded QLoRA, FSDP / ZeRO-3: the weights must keep the one storage dtype they are sharded
    in, so the base is only frozen, as a 16-bit one is). Gradient checkpointing is non-reentrant, so LoRA
    weights still get gradients when the embeddings are frozen; ``use_cache`` is off while training.

    Returns:
        The PEFT model; trainable and total parameter counts are logged.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, prepare_model_for_kbit_training

    ckpt_kwargs = {"use_reentrant": False}
    if getattr(model, "is_loaded_in_4bit", False) and not keep_dtype:
        with _peft_deprecations_quiet():
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing,
                                                    gradient_checkpointing_kwargs=ckpt_kwargs)
    else:
        for param in model.parameters():
            param.requires_grad_(False)
        if gradient_checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt_kwargs)
            model.enable_input_require_grads()
    model.config.use_cache = False
    peft_config = PeftLoraConfig(r=lcfg.r, lora_alpha=lcfg.lora_alpha, lora_dropout=lcfg.lora_dropout,
                                 target_modules=list(lcfg.target_modules), bias=lcfg.bias,
                                 use_rslora=lcfg.use_rslora, use_dora=lcfg.use_dora, task_type="CAUSAL_LM")
    with _peft_deprecations_quiet():
        peft_model = get_peft_model(model, peft_config)
    trainable, total = count_parameters(peft_model)
    log.info("LoRA r=%d alpha=%d on %s: %s trainable of %s parameters (%.3f%%)", lcfg.r, lcfg.lora_alpha,
             ",".join(lcfg.target_modules), f"{trainable:,}", f"{total:,}", 100.0 * trainable / max(total, 1))
    return peft_model


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
