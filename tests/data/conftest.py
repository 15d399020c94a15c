"""The data room's tokenizers: the real Qwen2.5 one (the embedded model's) and the tiny-random model's."""

from __future__ import annotations

import pytest

from qwenft.config import TinyModelConfig
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
