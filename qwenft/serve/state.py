"""What one app serves and what its routes read: :class:`Served` (the model) and :class:`ServeState` (the model, the
batcher and the metrics, in ``app.state.serve``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from qwenft.config import Config
from qwenft.generation.command import peak_memory_bytes
from qwenft.generation.generate import Sampler
from qwenft.serve.metrics import ServeMetrics
from qwenft.serve.scheduler import Scheduler


@dataclass
class Served:
    """What the app serves: an :class:`~qwenft.generation.engine.Engine` (its ``side("base")`` disables the
    adapter), the tokenizer, the validated config, and the tuned model's id (None: the base alone)."""

    engine: Any
    tokenizer: Any
    config: Config
    settings: Any  # the GenerateConfig the engine decodes with (Engine.settings of config.generate)
    tuned: Optional[str] = None

    @property
    def models(self) -> List[str]:
        return ["base"] + ([self.tuned] if self.tuned else [])

    @property
    def context_len(self) -> int:
        """Positions the model takes (its ``max_position_embeddings``)."""
        return int(getattr(self.engine.model.config, "max_position_embeddings", 32768))


def kv_bytes_per_token(model) -> int:
    """KV-cache bytes of one cached token in the model's dtype (the planner's formula)."""
    from qwenft.generation.engine import architecture
    from qwenft.plan.memory import kv_cache_bytes

    dtype = next(model.parameters()).dtype
    size = dtype.itemsize if dtype.is_floating_point else 2
    return kv_cache_bytes(architecture(model), 1, bytes_per_value=size)


def memory_capacity(device: str) -> int:
    """The device's memory in bytes: the GPU's on CUDA, physical RAM on a CPU."""
    import os

    import torch

    if device == "cuda":
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


class SideSamplers:
    """The batcher's ``run_batch``: one batch through the engine on one side, with one
    :class:`~qwenft.generation.generate.Sampler` per side, built on the side's first batch.

    Args:
        engine: the :class:`~qwenft.generation.engine.Engine`; tokenizer: its tokenizer.
        settings: the generation settings (``engine.settings(config.generate)``).
    """

    def __init__(self, engine, tokenizer, settings):
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        self.samplers: Dict[str, Any] = {}

    def __call__(self, side: str, prompts: List[List[int]], overrides: Dict[str, Any], on_text, control):
        """Run ``prompts`` (token ids) on ``side`` (``base`` or ``tuned``) with the sampler ``overrides``.

        Returns:
            The sampler's :class:`~qwenft.generation.results.GenerationOutput`.
        """
        with self.engine.side(side) as ready:
            if side not in self.samplers:
                self.samplers[side] = Sampler(ready, self.tokenizer, self.settings)
            return self.samplers[side].generate(prompts, on_text=on_text, control=control, **overrides)


@dataclass
class ServeState:
    """What the routes of one app read (``app.state.serve``), built by :meth:`build`.

    Attributes:
        served: the model, its tokenizer and config.
        settings: the generation settings (``engine.settings(config.generate)``).
        device: where the model runs (``cuda`` or ``cpu``).
        metrics: the app's :class:`~qwenft.serve.metrics.ServeMetrics` (its own registry).
        scheduler: the batcher; the app's lifespan starts and stops it.
    """

    served: Served
    settings: Any
    device: str
    metrics: ServeMetrics
    scheduler: Scheduler

    @property
    def limits(self):
        """The ``serve`` config section: the key, the caps on a request, the batcher's sizes."""
        return self.served.config.serve

    @classmethod
    def build(cls, served: Served) -> ServeState:
        """The state for ``served``: its metrics sized by the KV cache of ``serve.max_batch`` full rows, and a
        batcher (not started) over those metrics."""
        config, engine = served.config, served.engine
        limits = config.serve
        settings = served.settings
        device = next(engine.model.parameters()).device.type
        per_token = kv_bytes_per_token(engine.model)
        capacity = per_token * limits.max_batch * min(served.context_len, limits.max_prompt_tokens + limits.max_tokens)
        metrics = ServeMetrics(served.models, limits.decode_floor_tokens_per_s, capacity, memory_capacity(device))
        scheduler = Scheduler(SideSamplers(engine, served.tokenizer, settings), metrics, limits.max_batch,
                              limits.max_queue, per_token, functools.partial(peak_memory_bytes, device),
                              limits.batch_wait_ms / 1000)
        return cls(served, settings, device, metrics, scheduler)
