"""Fold a LoRA adapter into its base: pick the base, load it in 16-bit, merge, save an HF directory.

An adapter trained on an NF4 base learned a correction to the *NF4-dequantized* weights, not to the
original ones. ``merge.base=dequantized`` (the default) therefore rebuilds exactly the weights training saw:
each Linear weight the NF4 load quantizes is cast to the compute dtype, quantized with bitsandbytes
(``quantize_4bit``: NF4, blocksize 64, double quant as trained) and dequantized again; every other weight is
rounded through the compute dtype, as the NF4 load did. The merged model then reproduces adapter-on-NF4-base,
up to the 16-bit rounding of the merge. ``merge.base=original`` adds the delta to the original 16-bit weights
instead: the quantization error is gone from the base, but the adapter was never trained against those
weights, so the result is a different model from the one that was evaluated (usually close, not guaranteed).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from qwenft.config import MergeConfig, ModelConfig, QuantConfig, QwenftError
from qwenft.chat import set_end_tokens
from qwenft.model import load_adapter, load_tokenizer, resolve_model_dir
from qwenft.runtime import resolve_dtype, torch_dtype

log = logging.getLogger(__name__)

NF4_BLOCKSIZE = 64  # bitsandbytes' Params4bit default; BitsAndBytesConfig exposes no other value


def load_base(mcfg: ModelConfig, merge: MergeConfig, device: str):
    """Load the base in ``merge.dtype`` (never quantized) and its tokenizer.

    Returns:
        ``(model, tokenizer, model_dir)``.

    Raises:
        QwenftError: an unusable source, or a checkpoint that is itself quantized (merge needs 16-bit weights).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from qwenft.model.rope import apply_rope_scaling

    model_dir = resolve_model_dir(mcfg)
    revision = mcfg.revision if mcfg.source == "hub" else None
    tokenizer = load_tokenizer(model_dir, revision)
    kwargs = {"revision": revision} if revision else {}
    hf_config = AutoConfig.from_pretrained(model_dir, **kwargs)
    apply_rope_scaling(hf_config, mcfg.rope_scaling)  # the merged config.json keeps the trained context
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, config=hf_config, dtype=torch_dtype(merge.dtype), attn_implementation=mcfg.attn_implementation,
        device_map={"": device}, use_safetensors=True, **kwargs)
    if getattr(model.config, "quantization_config", None) is not None or getattr(model, "hf_quantizer", None):
        raise QwenftError(f"{model_dir}: the base checkpoint is itself quantized; merge needs a 16-bit base "
                          "(model.source=local model.path=<16-bit HF directory>)")
    model.eval()
    return model, tokenizer, model_dir


def nf4_round_trip_(model, qcfg: QuantConfig) -> int:
    """Replace the weights in place by what an NF4 load of them holds (see the module docstring).

    The Linear layers chosen are the ones transformers' bitsandbytes quantizer converts: every
    ``nn.Linear`` outside ``get_keys_to_not_convert`` (the output embedding). Formula: NF4 block-wise
    quantization (Dettmers et al. 2023, QLoRA, section 2: blocks of 64, absmax scales, double quant of the
    scales), done by bitsandbytes ``quantize_4bit`` / ``dequantize_4bit``.

    Returns:
        The number of Linear weights quantized and dequantized.
    """
    import bitsandbytes.functional as bnbf
    import torch
    from tqdm.auto import tqdm
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    # qwenft.json records the compute dtype training resolved; "auto" (no qwenft.json) resolves here.
    compute = torch_dtype(qcfg.compute_dtype, str(next(model.parameters()).device))
    skip = get_keys_to_not_convert(model)
    linears = [(name, module) for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and should_convert_module(name, skip)]
    with torch.no_grad():
        # The NF4 load reads every weight in the compute dtype first (norms, embeddings, biases included).
        for param in model.parameters():
            if param.is_floating_point():
                param.data = param.data.to(compute).to(param.dtype)
        for _, module in tqdm(linears, desc="NF4 round trip", disable=None):
            weight = module.weight
            packed, state = bnbf.quantize_4bit(weight.data.to(compute).contiguous(), blocksize=NF4_BLOCKSIZE,
                                               compress_statistics=qcfg.double_quant, quant_type="nf4")
            weight.data = bnbf.dequantize_4bit(packed, state).to(weight.dtype)
    return len(linears)


def untie_(model) -> bool:
    """Give a tied output embedding its own copy of the matrix, so a merge cannot write into both.

    Returns:
        Whether the model was tied (then :func:`retie_` decides after the merge).
    """
    import torch

    if not getattr(model.config, "tie_word_embeddings", False):
        return False
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight is embed.weight:
        head.weight = torch.nn.Parameter(embed.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    return True


def retie_(model, was_tied: bool) -> bool:
    """Tie the embeddings again when they are still equal after the merge; else leave them untied.

    Returns:
        Whether the saved model is tied (``config.tie_word_embeddings``).
    """
    import torch

    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if was_tied and torch.equal(head.weight, embed.weight):
        head.weight = embed.weight
        model.config.tie_word_embeddings = True
        return True
    if was_tied:
        log.warning("the merge changed the output embedding: saving with tie_word_embeddings=false")
    model.config.tie_word_embeddings = False
    return False


def attach_adapter(model, adapter_dir: Path):
    """The adapter on the base (a ``PeftModel``, eval mode), with a user error when it does not fit.

    Raises:
        QwenftError: no adapter_config.json, not a LoRA adapter, or shapes that do not match the base.
    """
    config_path = adapter_dir / "adapter_config.json"
    if config_path.is_file():
        peft_type = json.loads(config_path.read_text(encoding="utf-8")).get("peft_type")
        if peft_type not in (None, "LORA"):
            raise QwenftError(f"{config_path}: peft_type={peft_type!r}; qwenft merges LoRA adapters only")
    try:
        peft_model = load_adapter(model, str(adapter_dir))
    except (RuntimeError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise QwenftError(f"adapter={adapter_dir}: does not fit the base model ({first[:300]}); "
                          "name the base it was trained on with model=...") from None
    peft_model.eval()
    return peft_model


def merge_(peft_model, adapter_dir: Path):
    """Fold the LoRA delta into the base weights (peft ``merge_and_unload`` with ``safe_merge``).

    ``safe_merge`` adds each delta on a copy and checks it for NaN/inf before committing it; every
    parameter is checked again afterwards (``modules_to_save`` copies included).

    Returns:
        The plain transformers model.

    Raises:
        QwenftError: non-finite merged weights (a broken adapter).
    """
    import torch

    try:
        model = peft_model.merge_and_unload(safe_merge=True, progressbar=True)
    except ValueError as exc:
        raise QwenftError(f"adapter={adapter_dir}: {exc}") from None
    for name, param in model.named_parameters():
        if not torch.isfinite(param).all():
            raise QwenftError(f"adapter={adapter_dir}: merged weight {name} has NaN/inf values")
    return model


def save_merged(model, tokenizer, out_dir: Path, max_shard_size: str) -> None:
    """Save the merged model as safetensors shards, the tokenizer (with its chat template) and a
    generation_config that stops on every end token (:func:`qwenft.chat.set_end_tokens`); with RoPE scaling,
    config.json carries it as ``rope_scaling`` beside transformers 5's ``rope_parameters``."""
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.use_cache = True
    set_end_tokens(model, tokenizer)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(out_dir)
    config = json.loads((out_dir / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" in config:  # belt and braces: a merged model is never quantized
        raise QwenftError(f"{out_dir / 'config.json'}: still has a quantization_config after the merge")
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" and "rope_scaling" not in config:
        # transformers 5 writes only rope_parameters; readers on transformers 4 (vLLM among them: it copies
        # rope_scaling into rope_parameters there) read rope_scaling. transformers 5.24 reloads a config with both.
        config["rope_scaling"] = dict(rope)
        (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def describe_base(mcfg: ModelConfig, qcfg: QuantConfig, merge: MergeConfig, model_dir: str) -> dict:
    """The base as the model card and ``qwenft_merge.json`` record it."""
    trained_nf4 = qcfg.method == "nf4"
    compute = resolve_dtype(qcfg.compute_dtype)
    return {"name": mcfg.name, "source": mcfg.source, "path": mcfg.path or model_dir,
            "trained_on": ("NF4" + (" + double quant" if qcfg.double_quant else "")
                           + f", {compute} compute") if trained_nf4 else "16-bit",
            "merged_into": ("NF4-dequantized weights" if trained_nf4 and merge.base == "dequantized"
                            else "original 16-bit weights")}

