"""The data room's tokenizers (the real Qwen2.5 one, the embedded model's, and the tiny-random model's) and the
row-by-row reference encoding the batched map is checked against."""

from __future__ import annotations

from typing import List, Optional

import pytest

from qwenft.config import TinyModelConfig
from qwenft.data.formats import DataError
from qwenft.data.template import _tokenize, assemble, cut, end_of_text_id, with_system
from qwenft.model import load_tokenizer


@pytest.fixture(scope="module")
def qwen(embedded_dir):
    """The real Qwen2.5 tokenizer of the embedded model (about a second to load)."""
    return load_tokenizer(str(embedded_dir))


@pytest.fixture(scope="module")
def tiny():
    """The tiny-random model's tokenizer (Qwen2's vocabulary and chat template on a small model)."""
    from qwenft.model.tiny import tiny_model_dir

    return load_tokenizer(str(tiny_model_dir(TinyModelConfig())))


def encode_many(tokenizer, items, *, max_seq_len: int, train_on: str, system_prompt: Optional[str],
                cutter=cut) -> List[object]:
    """The reference :func:`qwenft.data.encode.encode_batch` is checked against: each ``(messages, text)`` item (a
    conversation with ``text`` None, or a text row) cut by ``cutter`` (:func:`qwenft.data.template.cut`, or a
    :class:`qwenft.data.render.TemplateCache`), its pieces tokenized and joined by
    :func:`qwenft.data.template.assemble`, one item at a time.

    Returns:
        One entry per item: the :func:`qwenft.data.encode_example` / :func:`qwenft.data.encode_text` dict plus
        ``prompt_len`` (tokens before the last answer; 0 for text), or the DataError it raised.
    """
    out: List[object] = []
    for messages, text in items:
        if text is not None:
            pieces, prompt_chars = [(text, True)], 0
        else:
            try:
                pieces, prompt_chars = cutter(tokenizer, with_system(messages or [], system_prompt), train_on)
            except DataError as exc:
                out.append(exc)
                continue
        piece_ids = _tokenize(tokenizer, [piece for piece, _ in pieces])
        if text is not None:
            piece_ids = [piece_ids[0] + [end_of_text_id(tokenizer)]]
        example = assemble(piece_ids, [flag for _, flag in pieces], max_seq_len)
        if example["overflow"] == 0 and example["supervised"] == 0:
            out.append(DataError("no supervised tokens"))
            continue
        chars = prompt_len = 0
        for (piece, _), ids in zip(pieces, piece_ids):  # the prompt ends on a piece boundary
            if chars >= prompt_chars:
                break
            chars, prompt_len = chars + len(piece), prompt_len + len(ids)
        out.append({**example, "prompt_len": prompt_len})
    return out
