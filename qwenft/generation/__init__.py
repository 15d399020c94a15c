"""The KV-cached sampler, split along torchtune's seams.

- :mod:`~qwenft.generation.params`: :class:`SamplingParams` and their resolution (call > config > model).
- :mod:`~qwenft.generation.sampling`: the logits processors and token selection.
- :mod:`~qwenft.generation.kv_cache`: the cache, left padding, position ids.
- :mod:`~qwenft.generation.text`: incremental detokenization, stop strings, streaming deltas.
- :mod:`~qwenft.generation.generate`: :class:`Sampler`, the prefill + decode loop.
- :mod:`~qwenft.generation.command`: ``python -m qwenft generate``.

A command room whose sampler the evaluation also uses: it may import :mod:`qwenft.model`, :mod:`qwenft.data`
(the chat template's prompt ids), :mod:`qwenft.chat`, :mod:`qwenft.runtime`, :mod:`qwenft.files` and
:mod:`qwenft.config`.
"""

from qwenft.generation.generate import (GenerationOutput, GenerationStats, Sampler, SequenceResult, TextStream,
                                        encode_prompts)
from qwenft.generation.params import SamplingParams, resolve_params

__all__ = ["GenerationOutput", "GenerationStats", "Sampler", "SamplingParams", "SequenceResult", "TextStream",
           "encode_prompts", "resolve_params"]
