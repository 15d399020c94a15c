"""The KV-cached sampler, split along torchtune's seams.

- :mod:`~qwenft.generation.params`: :class:`SamplingParams` and their resolution (call > config > model).
- :mod:`~qwenft.generation.sampling`: the logits processors and token selection.
- :mod:`~qwenft.generation.kv_cache`: the cache, left padding, position ids.
- :mod:`~qwenft.generation.text`: incremental detokenization, stop strings, streaming deltas.
- :mod:`~qwenft.generation.generate`: :class:`Sampler`, the prefill + decode loop (dynamic, static or compiled).
- :mod:`~qwenft.generation.results`: what one call returns.
- :mod:`~qwenft.generation.batches`: many prompts in sorted batches padded to at most 3 compiled shapes.
- :mod:`~qwenft.generation.engine`: the inference path for the device and memory (dequantize, fold, compile) and
  ``eval.batch_size=auto``.
- :mod:`~qwenft.generation.command`: ``python -m qwenft generate``.

A command room whose sampler the evaluation also uses: it may import :mod:`qwenft.model`, :mod:`qwenft.data`
(the chat template's prompt ids), :mod:`qwenft.chat`, :mod:`qwenft.runtime`, :mod:`qwenft.files`,
:mod:`qwenft.config` and the planner's byte formulas (:mod:`qwenft.plan`, which loads no weights).
"""

from qwenft.generation.generate import (GenerationOutput, GenerationStats, Sampler, SequenceResult, TextStream,
                                        encode_prompts)
from qwenft.generation.params import SamplingParams, resolve_params

__all__ = ["GenerationOutput", "GenerationStats", "Sampler", "SamplingParams", "SequenceResult", "TextStream",
           "encode_prompts", "resolve_params"]
