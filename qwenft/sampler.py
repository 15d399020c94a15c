"""The KV-cached sampler and its logits processors (the public entry point; code in :mod:`qwenft.generation`).

>>> from qwenft.sampler import Sampler
>>> out = Sampler(model, tokenizer, config.generate).generate(["春天"], chat=True, max_new_tokens=32)
"""

from qwenft.generation import (GenerationOutput, GenerationStats, Sampler, SamplingParams, SequenceResult,
                               TextStream, encode_prompts, resolve_params)

__all__ = ["GenerationOutput", "GenerationStats", "Sampler", "SamplingParams", "SequenceResult", "TextStream",
           "encode_prompts", "resolve_params", "generate_command"]


def generate_command(config):
    """``python -m qwenft generate``: see :func:`qwenft.generation.command.generate_command`."""
    from qwenft.generation.command import generate_command as run

    return run(config)
