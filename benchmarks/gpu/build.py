"""A randomly initialised Qwen2.5-7B-Instruct-shaped model in NF4, built in memory (no download, no files).

The dense model is created directly on the target device in the 16-bit compute dtype (transformers'
``from_config`` under ``torch.device``; its ``_init_weights``: normal(0, 0.02) weights, zero biases, unit norms),
then every ``nn.Linear`` of the decoder layers is replaced, one at a time, by a bitsandbytes ``Linear4bit``
whose ``Params4bit`` weight is quantized on ``.to(device)`` (NF4, double quantization, uint8 storage), the
dense weight being freed as it goes. This is what ``from_pretrained(quantization_config=BitsAndBytesConfig(
load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=...))``
does to a checkpoint (transformers ``integrations/bitsandbytes.py``: ``replace_with_bnb_linear`` then
``Params4bit(...).to(device)``): the embeddings, the untied lm_head, the norms and the q/k/v biases stay in the
compute dtype. The peak while building is the dense 16-bit model (15.2 GB for 7B), never written to disk.
"""

from __future__ import annotations

from typing import Any, Dict, List

# Qwen2.5-7B-Instruct's config.json (DESIGN.md "Facts to get right"): GQA 28/4 heads of 128, untied lm_head,
# q/k/v bias (Qwen2 attention), RoPE base 1e6, no sliding window.
QWEN25_7B: Dict[str, Any] = {
    "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False, "use_sliding_window": False,
    "sliding_window": 131072, "max_window_layers": 28, "hidden_act": "silu", "initializer_range": 0.02,
    "bos_token_id": 151643, "eos_token_id": 151645,
}
# The shape-reduced model of ``--tiny``: the same architecture at toy size; the vocabulary matches the tiny
# tokenizer's embedding rows (qwenft.config.TinyModelConfig: 480 tokens, 512 rows).
TINY: Dict[str, Any] = dict(QWEN25_7B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_window_layers=2, bos_token_id=0,
                            eos_token_id=2)
# The architecture fields qwenft's planner reads (qwenft.plan.arch.Architecture).
PLAN_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "vocab_size", "tie_word_embeddings", "max_position_embeddings")


def tiny_overrides(shape: Dict[str, Any]) -> List[str]:
    """qwenft config overrides describing ``shape`` as the ``tiny-random`` model (for the planner)."""
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "max_position_embeddings")
    return ["model=tiny-random", *(f"model.tiny.{k}={shape[k]}" for k in keys)]


def quantize_linears(model, compute_dtype, double_quant: bool = True) -> int:
    """Replace every ``nn.Linear`` inside ``model.model.layers`` by an NF4 ``Linear4bit``, in place.

    Args:
        model: a ``Qwen2ForCausalLM`` with dense weights on their final device.
        compute_dtype: the dtype NF4 weights are dequantized to for matmuls (bf16 on CUDA, fp32 on a CPU).
        double_quant: quantize the absmax scales too (QLoRA, Dettmers et al. 2023, section 3).

    Returns:
        The number of layers replaced (7 per decoder layer).
    """
    import torch
    from bitsandbytes.nn import Linear4bit, Params4bit

    count = 0
    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not torch.nn.Linear:
                    continue
                device = child.weight.device
                new = Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                 compute_dtype=compute_dtype, compress_statistics=double_quant, quant_type="nf4",
                                 quant_storage=torch.uint8, device="meta")
                new.weight = Params4bit(child.weight.data, requires_grad=False, compress_statistics=double_quant,
                                        quant_type="nf4", quant_storage=torch.uint8, module=new).to(device)
                if child.bias is not None:
                    new.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
                new.requires_grad_(False)
                setattr(parent, name, new)
                del child
                count += 1
    return count


def build_nf4_model(shape: Dict[str, Any], device: str, compute_dtype, tokenizer, seed: int = 0):
    """A random ``Qwen2ForCausalLM`` of ``shape`` on ``device``, NF4 as qwenft's ``load_model`` loads it.

    The model is marked ``is_loaded_in_4bit`` / ``quantization_method = bitsandbytes`` as transformers marks a
    4-bit checkpoint, so ``qwenft.model.attach_lora`` and peft take their QLoRA path and the Trainer does not
    move it. Its generation_config is Qwen2.5-7B-Instruct's (repetition_penalty 1.05, temperature 0.7, top_p 0.8,
    top_k 20) with the end and pad ids of ``tokenizer`` (qwenft's tiny tokenizer: the sampler needs one to
    decode; prompts are token ids). Same ``seed``, same weights.

    Returns:
        The model, in eval mode, frozen.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config
    from transformers.utils.quantization_config import QuantizationMethod

    from qwenft.chat import stop_token_ids
    from qwenft.model.load import _disable_cpu_repacking

    config = Qwen2Config(**shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=compute_dtype, attn_implementation="sdpa")
    if next(model.parameters()).device.type != torch.device(device).type:  # an older transformers
        model.to(device)
    quantize_linears(model, compute_dtype)
    if torch.device(device).type == "cpu":
        _disable_cpu_repacking(model)  # bitsandbytes' CPU repacking breaks training after a no-grad forward
    model.is_loaded_in_4bit = True
    model.quantization_method = QuantizationMethod.BITS_AND_BYTES
    model.requires_grad_(False)
    stops = stop_token_ids(tokenizer, None)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.pad_token_id, pad_token_id=tokenizer.pad_token_id, eos_token_id=stops,
        do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = stops[0]
    model.eval()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return model


def tensor_bytes(model) -> int:
    """Bytes of every parameter, buffer and 4-bit quantization state of ``model`` (each tensor once)."""
    import torch

    seen, total = set(), 0

    def add(tensor):
        nonlocal total
        if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()

    for tensor in list(model.parameters()) + list(model.buffers()):
        add(tensor)
        state = getattr(tensor, "quant_state", None)
        while state is not None:
            for name in ("absmax", "code", "offset"):
                add(getattr(state, name, None))
            state = getattr(state, "state2", None)
    return total
