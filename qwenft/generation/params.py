"""Sampling parameters: :class:`SamplingParams` and how they are resolved from the config and the model.

Precedence, highest first: keyword overrides of a call, the ``generate`` section of the config
(``conf/generate/*.yaml`` presets, ``generate.KEY=VALUE`` overrides), then the model's
``generation_config`` (Qwen2.5 ships temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.1 and the
EOS list), then the neutral value (no filtering, no penalty, greedy).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from qwenft.config import GenerateConfig


@dataclass(frozen=True)
class SamplingParams:
    """Fully resolved controls of one sampler call (no None left).

    Attributes:
        max_new_tokens: most tokens generated per sequence (the stop token included).
        min_new_tokens: stop tokens are suppressed, and stop strings/sequences ignored, until this many
            tokens were generated.
        do_sample: draw from the distribution; False means greedy.
        temperature: divides the scores; 0 means greedy.
        top_k: keep the k most likely tokens; 0 disables.
        top_p: nucleus mass; 1.0 disables.
        min_p: relative probability floor; 0.0 disables.
        repetition_penalty: CTRL penalty on prompt and generated tokens; 1.0 disables.
        stop_token_ids: ids that end a sequence (reason ``eos``); not part of the text.
        stop_strings: texts that end a sequence (reason ``stop_string``); the text is cut before them.
        stop_sequences: token-id sequences that end a sequence (reason ``stop_string``).
        seed: seeds a private ``torch.Generator``; None draws from torch's global RNG.
    """

    max_new_tokens: int = 256
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: Tuple[int, ...] = ()
    stop_strings: Tuple[str, ...] = ()
    stop_sequences: Tuple[Tuple[int, ...], ...] = ()
    seed: Optional[int] = None

    @property
    def greedy(self) -> bool:
        """Greedy decoding: ``do_sample`` is false or ``temperature`` is 0."""
        return not self.do_sample or self.temperature == 0


def _pick(value: Any, generation_config: Any, name: str, neutral: Any) -> Any:
    if value is not None:
        return value
    from_model = getattr(generation_config, name, None) if generation_config is not None else None
    return neutral if from_model is None else from_model


def resolve_params(config: Optional[GenerateConfig], generation_config: Any, tokenizer: Any = None,
                   **overrides: Any) -> SamplingParams:
    """Resolve the controls of one call.

    Args:
        config: the ``generate`` section (None: all defaults of :class:`qwenft.config.GenerateConfig`).
        generation_config: the model's ``GenerationConfig`` (or None).
        tokenizer: used for the default stop list (:func:`qwenft.chat.stop_token_ids`: the
            generation_config's EOS list plus ``<|im_end|>`` and ``<|endoftext|>``).
        **overrides: any :class:`GenerateConfig` field, e.g. ``max_new_tokens=16, do_sample=False``.

    Returns:
        The resolved :class:`SamplingParams`.

    Raises:
        ConfigError: an override names an unknown field or has an impossible value (checked by
            :class:`GenerateConfig`), or a stop token id is outside the tokenizer's vocabulary.
    """
    from qwenft.config import ConfigError
    from qwenft.chat import stop_token_ids

    config = config or GenerateConfig()
    known = {f.name for f in dataclasses.fields(GenerateConfig)}
    for key in overrides:
        if key not in known:
            raise ConfigError(f"unknown sampler setting '{key}'; accepted: {', '.join(sorted(known))}")
    if overrides:
        config = dataclasses.replace(config, **overrides)  # re-runs GenerateConfig.__post_init__ checks
    gc = generation_config
    if hasattr(tokenizer, "__len__"):  # an id no token has can never be sampled as a stop: a typo, said now
        size = len(tokenizer)
        for key, ids in (("stop_token_ids", config.stop_token_ids or []),
                         ("stop_sequences", [t for seq in config.stop_sequences for t in seq])):
            bad = [int(t) for t in ids if not 0 <= int(t) < size]
            if bad:
                raise ConfigError(f"generate.{key}: token id {bad[0]} is outside the vocabulary (0..{size - 1})")
    if config.stop_token_ids is not None:
        stops = [int(t) for t in config.stop_token_ids]
    elif tokenizer is not None:
        stops = stop_token_ids(tokenizer, gc)
    else:
        eos = getattr(gc, "eos_token_id", None)
        stops = [eos] if isinstance(eos, int) else list(eos or [])
    top_k = int(_pick(config.top_k, gc, "top_k", 0))
    return SamplingParams(
        max_new_tokens=int(config.max_new_tokens),
        min_new_tokens=int(config.min_new_tokens),
        do_sample=bool(_pick(config.do_sample, gc, "do_sample", False)),
        temperature=float(_pick(config.temperature, gc, "temperature", 1.0)),
        top_k=max(top_k, 0),
        top_p=float(_pick(config.top_p, gc, "top_p", 1.0)),
        min_p=float(_pick(config.min_p, gc, "min_p", 0.0)),
        repetition_penalty=float(_pick(config.repetition_penalty, gc, "repetition_penalty", 1.0)),
        stop_token_ids=tuple(dict.fromkeys(stops)),
        stop_strings=tuple(s for s in config.stop_strings if s),
        stop_sequences=tuple(tuple(int(t) for t in seq) for seq in config.stop_sequences if seq),
        seed=config.seed,
    )
