"""The doctor room's artifacts, built once per session: the tiny-random model as transformers saves it, an adapter
saved by plain peft on it, qwenft's own tiny train + merge + GGUF, and family-shaped directories and GGUFs whose
weights are only headers (a sparse file: the bytes a header promises are a hole, never read)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from qwenft.chat import QWEN_SYSTEM_PROMPT
from qwenft.config import TinyModelConfig

# A ChatML template written here with Qwen2.5's default system prompt (renders as Qwen2.5's does for plain chat)
CHATML = ("{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\n" + QWEN_SYSTEM_PROMPT
          + "<|im_end|>\\n' }}{%- endif %}{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + "
          "m['content'] + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
          "{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def edit_json(path: Path, **changes) -> None:
    """Set (value) or delete (None) top-level keys of a JSON file."""
    data = json.loads(path.read_text(encoding="utf-8"))
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def header_only_safetensors(path: Path, tensors: dict) -> None:
    """A safetensors file whose header names ``{name: (dtype, shape)}`` and whose data is a hole (sparse)."""
    sizes = {"BF16": 2, "F16": 2, "F32": 4}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for dim in shape:
            n *= dim
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw)
        handle.truncate(8 + len(raw) + offset)


def family_dir(path: Path, repo_id: str = "Qwen/Qwen2.5-0.5B-Instruct", template: str = CHATML, head: bool = True,
               **config) -> Path:
    """A directory shaped like a family member: its config.json and generation_config.json from the family table,
    a tokenizer_config.json with ``template`` and the special tokens, header-only weights (``head``: an lm_head.weight
    when untied); ``config`` overrides config.json keys."""
    from qwenft.model.family import member

    known = member(repo_id)
    path.mkdir(parents=True)
    cfg = {**known.config, "architectures": ["Qwen2ForCausalLM"], "_name_or_path": repo_id, **config}
    (path / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    (path / "generation_config.json").write_text(json.dumps(known.generation), encoding="utf-8")
    decoder = {str(i): {"content": t, "special": True} for i, t in
               ((151643, "<|endoftext|>"), (151644, "<|im_start|>"), (151645, "<|im_end|>"))}
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "added_tokens_decoder": decoder}), encoding="utf-8")
    rows, hidden = cfg["vocab_size"], cfg["hidden_size"]
    tensors = {"model.embed_tokens.weight": ("BF16", (rows, hidden)), "model.norm.weight": ("BF16", (hidden,))}
    if not cfg["tie_word_embeddings"] and head:
        tensors["lm_head.weight"] = ("BF16", (rows, hidden))
    header_only_safetensors(path / "model.safetensors", tensors)
    return path


def rewrite_gguf(src: Path, dst: Path, drop=(), set_values=None, token_types=None, tokens=None) -> Path:
    """A copy of a GGUF with keys dropped, scalar keys set (``{key: (value, GGUFValueType)}``), token types or token
    texts changed (``{index: type}``, ``{index: text}``): what a hand-edited or badly converted file looks like."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    set_values = dict(set_values or {})
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop or name in set_values:
            continue
        value = field.contents()
        if name == "tokenizer.ggml.token_type" and token_types:
            value = [token_types.get(i, v) for i, v in enumerate(value)]
        if name == "tokenizer.ggml.tokens" and tokens:
            value = [tokens.get(i, v) for i, v in enumerate(value)]
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub)
    for name, (value, vtype) in set_values.items():
        writer.add_key_value(name, value, vtype)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_shape=list(reversed([int(d) for d in tensor.shape])),
                          raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    """The tiny-random model as transformers saved it (untied)."""
    from qwenft.model.tiny import tiny_model_dir

    return tiny_model_dir(TinyModelConfig())


@pytest.fixture(scope="session")
def tied_tiny_dir() -> Path:
    from qwenft.model.tiny import tiny_model_dir

    return tiny_model_dir(TinyModelConfig(tie_word_embeddings=True))


def peft_adapter(base: Path, out: Path, **lora) -> Path:
    """An adapter saved by plain peft (no qwenft code) on ``base``: what a hand-written script writes."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(**{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                           "task_type": "CAUSAL_LM", **lora})
    get_peft_model(model, config).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def plain_adapter(tmp_path_factory, tiny_dir) -> Path:
    return peft_adapter(tiny_dir, tmp_path_factory.mktemp("peft") / "adapter")


@pytest.fixture(scope="session")
def qwenft_outputs(tmp_path_factory) -> dict:
    """qwenft's own tiny outputs: a 4-step train's adapter, its merge (float32) and the merge's f16 GGUF."""
    from qwenft.export.merge import merge
    from tests.conftest import compose_config, run_train, train_overrides

    root = tmp_path_factory.mktemp("qwenft_outputs")
    result = run_train(train_overrides(root, root / "run", "train.max_steps=4", "train.save_steps=4",
                                       "train.eval_steps=4"))
    assert result.returncode == 0, result.stderr[-2000:]
    adapter = root / "run" / "adapter"
    config = compose_config(f"adapter={adapter}", f"out={root / 'merged'}", "merge.dtype=float32", "merge.gguf=f16",
                            "merge.verify_gguf=false", command="merge")
    merge(config, device="cpu")
    return {"adapter": adapter, "merged": root / "merged", "gguf": next((root / "merged").glob("*.gguf"))}
