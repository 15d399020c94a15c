"""Chat facts of Qwen2.5: its special tokens, the ids a generation must stop on and its sampling defaults.

Instruct models end a turn with ``<|im_end|>`` (151645); ``<|endoftext|>`` (151643) is the base model's end and the
pad token. The chat template itself ships with the tokenizer (ChatML; ``apply_chat_template``).
"""

from __future__ import annotations

from typing import List, Optional


END_OF_TEXT = "<|endoftext|>"


IM_END = "<|im_end|>"


IM_START = "<|im_start|>"  # opens a ChatML turn: <|im_start|>role\ncontent<|im_end|>\n


# The default system prompt Qwen2.5's Instruct chat template renders when a conversation has no system turn (the
# Instruct and Coder-Instruct templates; read from the template the embedded Qwen2.5-Coder-0.5B-Instruct GGUF carries).
QWEN_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


# The shorter default of the base models' ChatML template (and of many ChatML templates written for Qwen by other
# tools): accepted for a base model.
PLAIN_SYSTEM_PROMPT = "You are a helpful assistant."


# sha256 of Qwen2.5's Instruct chat template (the UTF-8 text of the embedded model's chat_template.jinja, 2,507
# characters, tools branch included): `qwenft doctor` names a template with this digest as the family's own.
QWEN_TEMPLATE_SHA256 = ("cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f",)


# Qwen2.5 Instruct's sampling defaults (its generation_config.json): the same for every size but the repetition
# penalty, REPETITION_PENALTY by size.
SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}


REPETITION_PENALTY = {"0.5B": 1.1, "7B": 1.05}


def stop_token_ids(tokenizer, generation_config=None) -> List[int]:
    """End-of-sequence ids: the generation_config's EOS list plus ``<|im_end|>`` and ``<|endoftext|>``.

    A base model's generation_config names only ``<|endoftext|>`` while ChatML turns end with
    ``<|im_end|>``; a fine-tuned model must stop on both.
    """
    ids: List[int] = []
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    for value in ([eos] if isinstance(eos, int) else list(eos or [])):
        if value is not None and value not in ids:
            ids.append(int(value))
    for token in (IM_END, END_OF_TEXT):
        found = _token_id(tokenizer, token)
        if found is not None and found not in ids:
            ids.append(found)
    return ids


def _token_id(tokenizer, token: str) -> Optional[int]:
    """The id of ``token`` (added tokens included), None if the vocabulary lacks it. A fast tokenizer answers with
    one lookup: ``get_vocab()`` builds a dict of the whole vocabulary, 0.1 s for Qwen2.5's 151k tokens, paid on
    every sampler call (every request of ``qwenft serve``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.token_to_id(token)
    return tokenizer.get_vocab().get(token)


def set_end_tokens(model, tokenizer) -> None:
    """Make ``model`` stop on every end token and pad with the tokenizer's pad id: its ``generation_config`` gets
    the :func:`stop_token_ids` list and ``pad_token_id``, its config the pad id. Used on every loaded model and on
    every merged model before it is saved, so a tuned model stops on ``<|im_end|>`` as well as ``<|endoftext|>``.
    """
    gen = model.generation_config
    gen.eos_token_id = stop_token_ids(tokenizer, gen)
    gen.pad_token_id = tokenizer.pad_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
