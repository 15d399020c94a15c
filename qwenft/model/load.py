"""Loading: the tokenizer, the base model in NF4 (bitsandbytes) or 16-bit, and its dequantization for inference.

Weights are only ever read from safetensors and ``trust_remote_code`` is never set (no Qwen2.5 needs it).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any, Optional, Tuple

from qwenft.chat import END_OF_TEXT, IM_END, set_end_tokens
from qwenft.config import Config, QuantConfig, QwenftError
from qwenft.model.sources import MERGE_MARKER, resolve_model_dir
from qwenft.runtime import default_device, torch_dtype

log = logging.getLogger(__name__)


def check_attention(attn_implementation: str, device: str) -> None:
    """Check that ``model.attn_implementation`` can run on ``device``.

    ``flash_attention_2`` needs the flash-attn package and a CUDA device; ``sdpa`` and ``eager`` run anywhere.

    Raises:
        QwenftError: one line saying what is missing and what to use instead.
    """
    if attn_implementation != "flash_attention_2":
        return
    missing = []
    if importlib.util.find_spec("flash_attn") is None:
        missing.append("the flash-attn package (pip install flash-attn --no-build-isolation), which is not installed")
    if not str(device).startswith("cuda"):
        missing.append(f"a CUDA GPU (this run is on {device})")
    if missing:
        raise QwenftError(f"model.attn_implementation=flash_attention_2 needs {' and '.join(missing)}; use sdpa "
                          "(the default) or eager")


def load_tokenizer(model_dir: str, revision: Optional[str] = None):
    """Load the tokenizer; the pad token is ``<|endoftext|>``, never the end-of-turn ``<|im_end|>``.

    Padding side is right (training); the sampler pads left itself.

    Raises:
        QwenftError: the tokenizer cannot be loaded (a Hub id offline and not in the cache, an unknown id) or has
            no usable pad token.
    """
    from transformers import AutoTokenizer

    kwargs = {"revision": revision} if revision else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, **kwargs)
    except (OSError, ValueError) as exc:  # transformers / huggingface_hub report a missing model as these
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        local = Path(str(model_dir)).expanduser()
        looks_local = str(model_dir).startswith((".", "/", "~")) or str(model_dir).count("/") > 1  # not owner/name
        hint = "" if local.is_dir() else (
            (f"; no local directory {local.resolve()} either (a local model: model.source=local model.path=DIR)"
             if looks_local else "") +
            f"; a Hub model needs the network once, or its files in the HF cache (huggingface-cli download "
            f"{model_dir}); offline: HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', 'unset')}")
        raise QwenftError(f"model {model_dir}: cannot load it ({first[:300]}){hint}") from None
    eot = tokenizer.convert_tokens_to_ids(END_OF_TEXT) if END_OF_TEXT in tokenizer.get_vocab() else None
    if tokenizer.pad_token is None or tokenizer.pad_token == IM_END:
        if eot is None:
            raise QwenftError(f"{model_dir}: the tokenizer has no pad token and no {END_OF_TEXT} to use as one")
        tokenizer.pad_token = END_OF_TEXT
    tokenizer.padding_side = "right"
    return tokenizer


def quantization_config(qcfg: QuantConfig, storage: str = "uint8"):
    """The bitsandbytes config for ``quant=nf4`` (None for ``quant=none``).

    NF4 with double quantization of the absmax scales and a 16-bit compute dtype is the QLoRA recipe
    (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs", sections 2-3). ``storage``
    (``dist.quant_storage``) is the dtype the packed 4-bit values are stored in: ``uint8`` normally, a float
    dtype for FSDP / ZeRO-3, which shard only floating-point tensors (bitsandbytes ``bnb_4bit_quant_storage``).
    """
    if qcfg.method == "none":
        return None
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_use_double_quant=qcfg.double_quant,
                              bnb_4bit_compute_dtype=torch_dtype(qcfg.compute_dtype),
                              bnb_4bit_quant_storage=getattr(torch, storage))


def _disable_cpu_repacking(model) -> int:
    """Stop bitsandbytes from repacking 4-bit weights for CPU inference.

    On a CPU with AVX512-BF16, a no-grad forward in eval mode repacks every ``Linear4bit`` weight in place;
    a training step afterwards fails ("a view of a leaf Variable that requires grad is being used in an
    in-place operation"). Evaluating the base before training hits exactly this, so it is turned off.

    Returns:
        The number of 4-bit layers changed.
    """
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:  # quant=none without bitsandbytes installed
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False
            count += 1
    return count


def load_model(cfg: Config, device: Optional[str] = None, tokenizer=None) -> Tuple[Any, Any]:
    """Load the tokenizer and the base model described by ``cfg.model`` and ``cfg.quant``.

    ``tokenizer``: one already loaded from the same source (:func:`load_tokenizer`; training loads it first to
    build the data), used as is instead of loading it again.

    The base is frozen-ready (no LoRA yet), on ``device`` (default: :func:`default_device`), with its
    generation_config stopping on every end token (:func:`stop_token_ids`) and padding with the
    tokenizer's pad id. The embedding matrix is never resized to ``len(tokenizer)`` (Qwen2.5 keeps
    151,936 rows for 151,665 tokens).

    Returns:
        ``(model, tokenizer)``.

    ``model.rope_scaling`` is written into the model config before the model is built
    (:func:`qwenft.model.rope.apply_rope_scaling`); training with ``data.max_seq_len`` beyond the model's context
    logs a warning. Under a distributed launch each rank loads its own copy onto its own device
    (``cuda:LOCAL_RANK``, :func:`default_device`; a CPU for all ranks without CUDA).

    Raises:
        QwenftError: an unusable source (see :func:`resolve_model_dir`), a tokenizer larger than the
            embedding matrix, or an attention implementation that cannot run on ``device``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from qwenft.model.load import check_attention
    from qwenft.model.rope import apply_rope_scaling, context_warning

    device = device or default_device()
    check_attention(cfg.model.attn_implementation, device)
    model_dir = resolve_model_dir(cfg.model)
    revision = cfg.model.revision if cfg.model.source == "hub" else None
    if tokenizer is None:
        tokenizer = load_tokenizer(model_dir, revision)
    storage = cfg.dist.quant_storage
    bnb = quantization_config(cfg.quant, storage)
    if bnb is not None and cfg.command != "train" and (Path(model_dir) / MERGE_MARKER).is_file() \
            and not cfg.quant.requantize_merged:
        # A LoRA delta is small next to NF4's rounding step: quantizing merged weights again rounds most of
        # the fine-tune away (the merged quickstart model lost the facts it had learned). Training on a merged
        # base in NF4 (QLoRA again) is fine and keeps quant as given.
        log.warning("%s was merged by qwenft from a LoRA adapter: loading its 16-bit weights (NF4 would round "
                    "away most of the fine-tune; quant.requantize_merged=true to quantize anyway)", model_dir)
        bnb = None
    if bnb is not None and storage != "uint8":  # sharded QLoRA: the other weights share the 4-bit storage dtype
        dtype = torch_dtype(storage, device)
    else:
        dtype = torch_dtype(cfg.quant.compute_dtype if bnb is not None else cfg.model.dtype, device)
    kwargs = {"revision": revision} if revision else {}
    hf_config = AutoConfig.from_pretrained(model_dir, **kwargs)
    warning = context_warning(cfg.data.max_seq_len, hf_config.max_position_embeddings, cfg.model.rope_scaling)
    if warning and cfg.command == "train":
        log.warning("%s", warning)
    apply_rope_scaling(hf_config, cfg.model.rope_scaling)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, config=hf_config, dtype=dtype, quantization_config=bnb,
        attn_implementation=cfg.model.attn_implementation, device_map={"": device}, use_safetensors=True, **kwargs)
    if bnb is not None and device == "cpu":
        _disable_cpu_repacking(model)
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        raise QwenftError(f"{model_dir}: the tokenizer has {len(tokenizer)} tokens but the embedding matrix only "
                          f"{rows} rows")
    set_end_tokens(model, tokenizer)
    log.info("loaded %s (%s, %s) on %s: %.1f M parameters", cfg.model.name, cfg.model.source,
             "NF4, compute " + str(dtype) if bnb is not None else str(dtype), device, count_parameters(model)[1] / 1e6)
    return model, tokenizer


def dequantize_for_inference(model, qcfg: QuantConfig, device: Optional[str] = None, enabled: Optional[bool] = None,
                              dtype: Any = None) -> int:
    """Replace every bitsandbytes ``Linear4bit`` of ``model`` by a plain ``nn.Linear`` holding its dequantized weight.

    For inference only (evaluation, generation; the model must not be trained afterwards). bitsandbytes
    dequantizes each 4-bit weight again on every forward; on a CPU that costs more than the matmul itself
    (docs/performance.md, "4-bit weights at inference on a CPU").
    The new weights are ``dequantize_4bit(W)`` in the compute dtype: the same values the 4-bit layer
    multiplies by, so outputs agree up to float rounding. LoRA layers wrapping a 4-bit base keep working
    (peft calls ``base_layer(x)``). Memory grows to the dense size of those layers.

    Args:
        qcfg: ``quant.dequantize_for_inference``: None = only when ``device`` is a CPU, True / False force.
        device: where the model runs (default: :func:`default_device`).
        enabled: the decision already taken by the caller (``qwenft.generation.engine.choose_path``, which also
            weighs free GPU memory); None: ``qcfg`` as above.
        dtype: of the new weights (default: the embeddings' dtype, the one the rest of the model computes in).

    Returns:
        The number of layers replaced (0 when nothing was 4-bit or the setting said no).
    """
    flag = qcfg.dequantize_for_inference if enabled is None else enabled
    if flag is None:
        flag = (device or default_device()) == "cpu"
    if not flag or qcfg.method == "none":
        return 0
    import bitsandbytes.functional as bnbf
    import torch
    from bitsandbytes.nn import Linear4bit

    # The dtype the rest of the model computes in: the compute dtype, or the 4-bit storage dtype when the base
    # was loaded for sharding (dist.quant_storage=bfloat16 loads every other weight in it too).
    if dtype is None:
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        dtype = embeddings.weight.dtype if embeddings is not None else torch_dtype(qcfg.compute_dtype, device)
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, Linear4bit)]
    for name, module in targets:
        weight = bnbf.dequantize_4bit(module.weight.data, module.weight.quant_state).to(dtype)
        dense = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                device=weight.device, dtype=dtype)
        with torch.no_grad():
            dense.weight.copy_(weight)
            if module.bias is not None:
                dense.bias.copy_(module.bias.to(dtype))
        dense.requires_grad_(False)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, dense)
    if targets:
        log.info("dequantized %d 4-bit layers to %s for inference", len(targets), dtype)
    return len(targets)


def count_parameters(model) -> Tuple[int, int]:
    """``(trainable, total)`` parameter counts; a packed 4-bit weight counts its unpacked elements."""
    trainable = total = 0
    for param in model.parameters():
        n = param.numel()
        if param.__class__.__name__ == "Params4bit":
            n *= 2  # two 4-bit values per stored byte
        total += n
        if param.requires_grad:
            trainable += n
    return trainable, total


def has_4bit_layers(model) -> bool:
    """Whether ``model`` still holds a bitsandbytes ``Linear4bit`` (peft's LoRA wrapper of one, also named
    ``Linear4bit``, does not count: its base layer does)."""
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return False
    return any(isinstance(module, Linear4bit) for module in model.modules())
