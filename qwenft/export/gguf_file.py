"""Write a merged Qwen2 directory as a GGUF file for llama.cpp (``merge.gguf=f16`` or ``q8_0``).

Written with the ``gguf`` package the way llama.cpp's own converter lays out a ``qwen2`` model:
architecture metadata under ``qwen2.*``; the byte-level BPE vocabulary (``tokenizer.ggml.model=gpt2``, padded
with ``[PADn]`` tokens of type UNUSED up to the embedding rows), its merges, token types (CONTROL for special
added tokens, USER_DEFINED for other added tokens) and the chat template; tensor names from gguf's own
``get_tensor_name_map(MODEL_ARCH.QWEN2)`` (token_embd, blk.N.attn_q/k/v/output, ffn_gate/up/down,
attn_norm, ffn_norm, output_norm, output). Q/K weights are written as they are: llama.cpp does not permute
them for qwen2 (it uses NEOX-style RoPE, as HF does). 1-D tensors (norms, biases) stay float32; 2-D weights
are float16, or Q8_0 (blocks of 32 int8 with a float16 scale) where a row is a multiple of 32.
A tied model has no ``output`` tensor (llama.cpp then reuses token_embd). Tensors are streamed one at a time.
RoPE scaling (``model.rope_scaling`` yarn or linear) becomes llama.cpp's ``qwen2.rope.scaling.*`` keys
(:func:`rope_scaling_keys`), and ``qwen2.context_length`` the scaled context.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Dict, List, Tuple

from qwenft.config import QwenftError

log = logging.getLogger(__name__)

FLOAT16_MAX = 65504.0


def _tokenizer_fields(tokenizer, n_vocab: int) -> Tuple[List[str], List[int], List[str], str]:
    """``(tokens, token_types, merges, pre)`` for the GGUF tokenizer metadata.

    Raises:
        QwenftError: not a byte-level BPE tokenizer, a token id beyond the embedding rows, or a
            pre-tokenizer llama.cpp has no name for.
    """
    import gguf
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    model = backend.get("model") or {}
    if model.get("type") != "BPE":
        raise QwenftError(f"GGUF export needs a byte-level BPE tokenizer; this one is {model.get('type')!r}")
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [int(gguf.TokenType.UNUSED)] * n_vocab
    added = {t.content: t for t in tokenizer.added_tokens_decoder.values()}
    for token, index in tokenizer.get_vocab().items():
        if index >= n_vocab:
            raise QwenftError(f"token {token!r} has id {index}, beyond the {n_vocab} embedding rows")
        tokens[index] = token
        if token in added:
            types[index] = int(gguf.TokenType.CONTROL if added[token].special else gguf.TokenType.USER_DEFINED)
        else:
            types[index] = int(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    text = json.dumps(backend.get("pre_tokenizer"))
    if json.dumps(PRETOKENIZE_REGEX)[1:-1] in text:
        pre = "qwen2"  # Qwen2's split regex, then byte-level
    elif '"ByteLevel"' in text and '"use_regex": true' in text:
        pre = "gpt-2"  # byte-level with GPT-2's regex (the tiny-random tokenizer)
    else:
        raise QwenftError("GGUF export: the tokenizer's pre-tokenizer is neither Qwen2's nor GPT-2's byte-level one")
    return tokens, types, merges, pre


def _safetensors_index(model_dir: Path) -> Dict[str, Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    from safetensors import safe_open

    single = model_dir / "model.safetensors"
    with safe_open(str(single), framework="pt") as handle:
        return {name: single for name in handle.keys()}


def _plan(shape: Tuple[int, ...], qtype: str):
    """``(ggml type, numpy dtype for add_tensor_info, byte shape, nbytes)`` of one tensor."""
    import gguf
    import numpy as np

    numel = int(np.prod(shape))
    if len(shape) == 1:
        return gguf.GGMLQuantizationType.F32, np.float32, shape, numel * 4
    if qtype == "q8_0" and shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0] == 0:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0]
        byte_shape = (*shape[:-1], shape[-1] // block * size)
        return gguf.GGMLQuantizationType.Q8_0, np.uint8, byte_shape, int(np.prod(byte_shape))
    return gguf.GGMLQuantizationType.F16, np.float16, shape, numel * 2


def rope_scaling_keys(config: dict, arch: str = "qwen2") -> Dict[str, object]:
    """llama.cpp's RoPE-scaling metadata for a merged ``config.json`` (``{GGUF key: value}``, empty without scaling).

    The keys are the ones llama.cpp's loader reads for every architecture (``llama_model::load_hparams``:
    ``{arch}.rope.scaling.type``, ``.factor``, ``.original_context_length``; its default type is linear with factor
    1), written as its converter writes them from a transformers config (``convert_hf_to_gguf.py``, ``TextModel``):

    - ``yarn``: type ``yarn``, ``factor``, ``original_context_length`` = ``original_max_position_embeddings``
      (llama.cpp's ``n_ctx_orig_yarn``: the window whose frequencies YaRN keeps). llama.cpp then takes YaRN's
      extrapolation factor 1, ``beta_fast`` 32, ``beta_slow`` 1 and the attention factor ``0.1 ln(factor) + 1``
      (llama-context.cpp), transformers' defaults (modeling_rope_utils.py, ``_compute_yarn_parameters``).
    - ``linear``: type ``linear`` and ``factor`` (llama.cpp's ``rope_freq_scale`` = 1 / factor).

    Raises:
        QwenftError: ``dynamic`` (llama.cpp's types are none, linear, yarn and longrope: no NTK-by-length
            scaling), or a YaRN knob set away from the defaults above (``attention_factor``, ``beta_fast``,
            ``beta_slow``, ``mscale``, ``mscale_all_dim``, ``truncate``), which llama.cpp's qwen2 would not read the
            same way; the message names the ``model.rope_scaling`` key.
    """
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {}
    if kind not in ("linear", "yarn"):
        raise QwenftError(f"GGUF export: model.rope_scaling.rope_type={kind} has no llama.cpp equivalent (its "
                          "rope.scaling.type is none, linear, yarn or longrope); merge without merge.gguf, or train "
                          "with rope_type=yarn")
    defaults = {"attention_factor": None, "beta_fast": 32, "beta_slow": 1, "mscale": None, "mscale_all_dim": None,
                "truncate": True}
    for name, default in defaults.items():
        if rope.get(name) is not None and rope[name] != default:
            raise QwenftError(f"GGUF export: model.rope_scaling.{name}={rope[name]} is not written: llama.cpp's "
                              f"qwen2 uses {default if default is not None else 'the value from factor'}; merge "
                              "without merge.gguf, or leave it unset")
    keys: Dict[str, object] = {f"{arch}.rope.scaling.type": kind, f"{arch}.rope.scaling.factor": float(rope["factor"])}
    if kind == "yarn":
        original = rope.get("original_max_position_embeddings") or config["max_position_embeddings"]
        keys[f"{arch}.rope.scaling.original_context_length"] = int(original)
    return keys


def write_gguf(model_dir: Path, path: Path, qtype: str, tokenizer, name: str) -> dict:
    """Write the merged model in ``model_dir`` as one GGUF file ``path``.

    Args:
        model_dir: A saved Qwen2 HF directory (config.json + safetensors).
        path: The .gguf file to write.
        qtype: ``f16`` or ``q8_0``.
        tokenizer: The tokenizer saved with the model.
        name: ``general.name``.

    Returns:
        ``{"file", "type", "tensors", "bytes"}``.

    Raises:
        QwenftError: not a qwen2 model, RoPE scaling llama.cpp has no equivalent for (:func:`rope_scaling_keys`),
            sliding window (not written here), or a weight outside the float16 range.
    """
    import gguf
    import numpy as np
    from safetensors import safe_open
    from tqdm.auto import tqdm

    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if config.get("model_type") != "qwen2":
        raise QwenftError(f"GGUF export writes qwen2 models; {model_dir} is {config.get('model_type')!r}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_keys = rope_scaling_keys(config)
    if config.get("use_sliding_window"):
        raise QwenftError("GGUF export: use_sliding_window=true is not supported by llama.cpp's qwen2")
    rope_theta = rope.get("rope_theta", config.get("rope_theta"))
    n_layers, n_vocab = config["num_hidden_layers"], config["vocab_size"]
    tokens, types, merges, pre = _tokenizer_fields(tokenizer, n_vocab)

    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN2])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    # llama.cpp's n_ctx_train: config.json's max_position_embeddings, which with linear / yarn scaling is already the
    # scaled context (original x factor: qwenft.model.rope.apply_rope_scaling). llama-server's default context (-c 0)
    # is n_ctx_train, so it serves the whole scaled window and warns only past it; YaRN's own window travels in
    # rope.scaling.original_context_length, and transformers reads context_length back as max_position_embeddings.
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(float(rope_theta))
    for key, value in rope_keys.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_float32(key, value)
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "q8_0" else gguf.LlamaFileType.MOSTLY_F16))
    if qtype == "q8_0":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    vocab = tokenizer.get_vocab()
    eot = vocab.get("<|endoftext|>", tokenizer.pad_token_id)
    writer.add_bos_token_id(eot)  # Qwen2.5's own GGUFs name <|endoftext|> as BOS and never add it
    writer.add_eos_token_id(vocab.get("<|im_end|>", tokenizer.eos_token_id))
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, n_layers)
    sources = _safetensors_index(model_dir)
    plan = []
    for hf_name in sources:
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise QwenftError(f"GGUF export: no llama.cpp name for tensor {hf_name}")
        with safe_open(str(sources[hf_name]), framework="pt") as handle:
            shape = tuple(handle.get_slice(hf_name).get_shape())
        ggml_type, np_dtype, byte_shape, nbytes = _plan(shape, qtype)
        writer.add_tensor_info(gguf_name, byte_shape, np.dtype(np_dtype), nbytes, raw_dtype=ggml_type)
        plan.append((hf_name, gguf_name, ggml_type))

    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    total = 0
    for hf_name, gguf_name, ggml_type in tqdm(plan, desc="GGUF", disable=None):
        with safe_open(str(sources[hf_name]), framework="pt") as handle:
            data = handle.get_tensor(hf_name).float().numpy()
        if ggml_type == gguf.GGMLQuantizationType.F32:
            array = data.astype(np.float32)
        elif ggml_type == gguf.GGMLQuantizationType.Q8_0:
            array = gguf.quants.quantize(data, ggml_type)
        else:
            if np.abs(data).max() > FLOAT16_MAX:
                raise QwenftError(f"GGUF export: {hf_name} has values beyond the float16 range; use merge.gguf=q8_0")
            array = data.astype(np.float16)
        writer.write_tensor_data(array)
        total += array.nbytes
    writer.close()
    log.info("wrote %s: %d tensors, %s, %.1f MB", path.name, len(plan), qtype, total / 1e6)
    return {"file": path.name, "type": qtype, "tensors": len(plan), "bytes": path.stat().st_size}
