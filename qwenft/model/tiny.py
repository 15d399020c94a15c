"""The ``tiny-random`` model: a randomly initialised Qwen2 built in code, with no download.

Same architecture as Qwen2.5 (GQA, q/k/v bias, RMSNorm, SwiGLU, RoPE base 1e6) at a toy size, and a
small byte-level BPE tokenizer trained here on a fixed text, with the three Qwen special tokens and a
ChatML chat template. As in the real models, the embedding matrix has more rows than the tokenizer has
tokens. Built once per shape into the qwenft cache and loaded like any local model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

from qwenft.chat import REPETITION_PENALTY, SAMPLING_DEFAULTS
from qwenft.config import TinyModelConfig
from qwenft.files import publish_dir, staging_dir

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, as Qwen2.5 renders it (system turn first, default system prompt when none is given).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Fine-tuning a language model with LoRA trains two small matrices per projection.",
    "What is the capital of France? The capital of France is Paris.",
    "Question: how many legs does a spider have? Answer: eight.",
    "The answer is 42. #### 42",
    "user assistant system You are a helpful assistant.",
    "春天来了，花开了。我们一起去公园散步吧。",
    "中华人民共和国的首都是北京。法律规定合同应当遵守诚实信用原则。",
    "def add(a, b):\n    return a + b\n",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 -7",
]


def _tokenizer_vocab_size(tcfg: TinyModelConfig) -> int:
    # Leave spare embedding rows, as Qwen2.5 does (151,665 tokens, 151,936 rows).
    return max(300, tcfg.vocab_size - 32)


def build_tokenizer(tcfg: TinyModelConfig):
    """A byte-level BPE tokenizer (``PreTrainedTokenizerFast``) trained deterministically on a fixed text.

    Any UTF-8 text encodes (byte fallback through the 256 byte symbols). Pad is ``<|endoftext|>``,
    EOS is ``<|im_end|>``, as in Qwen2.5-Instruct.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=_tokenizer_vocab_size(tcfg), special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(tcfg: TinyModelConfig, tokenizer):
    """A Qwen2ForCausalLM with random weights (seeded by ``tcfg.seed``) and Qwen-like generation defaults."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    eot, im_end = tokenizer.convert_tokens_to_ids("<|endoftext|>"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2Config(
        vocab_size=tcfg.vocab_size, hidden_size=tcfg.hidden_size, intermediate_size=tcfg.intermediate_size,
        num_hidden_layers=tcfg.num_hidden_layers, num_attention_heads=tcfg.num_attention_heads,
        num_key_value_heads=tcfg.num_key_value_heads, max_position_embeddings=tcfg.max_position_embeddings,
        rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=tcfg.tie_word_embeddings,
        bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tcfg.seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=eot, pad_token_id=eot, eos_token_id=[im_end, eot],
                                               **SAMPLING_DEFAULTS, repetition_penalty=REPETITION_PENALTY["7B"])
    return model


def tiny_model_dir(tcfg: TinyModelConfig) -> Path:
    """Build (once per shape and seed) and return the cached HF directory of the tiny-random model."""
    from qwenft.runtime import cache_dir

    key = hashlib.sha256(json.dumps(dataclasses.asdict(tcfg), sort_keys=True).encode()).hexdigest()[:16]
    final = cache_dir() / "tiny-random" / key
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(tcfg)
    model = build_model(tcfg, tokenizer)
    work = staging_dir(final.parent)
    try:
        model.save_pretrained(work, safe_serialization=True)
        tokenizer.save_pretrained(work)
        publish_dir(work, final, replace=False)  # another process may have finished first: theirs is identical
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final
