"""The ``inspect`` section: what ``qwenft inspect`` traces and keeps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from qwenft.config.base import _check


@dataclass
class InspectConfig:
    """``qwenft inspect``: which layers to trace and what to keep.

    ``layers``: decoder layer indices (negative counts from the end; null = all), e.g. ``inspect.layers=[0,12,23]``.
    ``top_k``: next-token candidates shown. ``top_positions``: most-attended prompt positions shown per layer
    for the last token. ``top_moved``: with an adapter, how many most-changed layers to list. ``out``: a JSON
    file for the whole trace.
    """

    layers: Optional[List[int]] = None
    top_k: int = 10
    top_positions: int = 3
    top_moved: int = 5
    out: Optional[str] = None

    def __post_init__(self) -> None:
        _check(self.layers is None or len(self.layers) > 0, "inspect.layers", self.layers,
               "must name at least one layer, e.g. inspect.layers=[0,-1], or be null for all layers")
        _check(self.top_k >= 1, "inspect.top_k", self.top_k, "must be >= 1")
        _check(self.top_positions >= 1, "inspect.top_positions", self.top_positions, "must be >= 1")
        _check(self.top_moved >= 1, "inspect.top_moved", self.top_moved, "must be >= 1")
        _check(self.out is None or bool(self.out), "inspect.out", self.out, "must be a file path or null")
