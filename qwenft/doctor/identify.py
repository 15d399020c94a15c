"""Which Qwen2.5 family member a config is, and whether it is Instruct or base.

The shape comes from :func:`qwenft.model.family.identify`; a config that matches no member exactly is compared on
the architecture alone (every shape key but ``vocab_size`` and ``tie_word_embeddings``, which are what a broken
save changes), so a shrunk vocabulary or a lost tie is still recognised as that member with a difference.
Instruct or base is told by the names the artifact goes by (``...-Instruct``), then by its generation_config
(Instruct models sample by default and stop on ``<|im_end|>``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from qwenft.model.family import MEMBERS, SHAPE_KEYS, Member, identify

ARCH_KEYS = tuple(k for k in SHAPE_KEYS if k not in ("vocab_size", "tie_word_embeddings"))
IM_END_ID = 151645  # Qwen2.5's <|im_end|> (DESIGN.md, "Facts to get right")


@dataclass
class Identity:
    """``member``: the family member (None: not one); ``exact``: every shape key equal; ``differs``: the shape keys
    that differ (``key: value here vs member``); ``instruct``: True / False / None (unknown); ``why``: how the
    variant was told; ``candidates``: every member of that shape."""

    member: Optional[Member]
    exact: bool = False
    differs: List[str] = field(default_factory=list)
    instruct: Optional[bool] = None
    why: str = ""
    candidates: List[Member] = field(default_factory=list)


def _eos_list(generation: Optional[dict]) -> List[int]:
    eos = (generation or {}).get("eos_token_id")
    return [eos] if isinstance(eos, int) else [e for e in (eos or []) if isinstance(e, int)]


def variant(names: Sequence[str], generation: Optional[dict]) -> tuple:
    """``(instruct, why)``: True/False/None and the evidence."""
    for name in names:
        lowered = str(name).lower()
        if "instruct" in lowered or "-chat" in lowered:
            return True, f"the name {name!r}"
    if generation:
        if generation.get("do_sample") and IM_END_ID in _eos_list(generation):
            return True, "its generation_config (sampling, stops on <|im_end|>)"
        if not generation.get("do_sample") and _eos_list(generation) == [151643]:
            return False, "its generation_config (greedy, stops on <|endoftext|> only)"
    return None, "neither its names nor its generation_config tell"


def _pick(candidates: List[Member], names: Sequence[str], instruct: Optional[bool]) -> Member:
    """The candidate the names point at (its repo name in one of them), else the first of the right variant,
    plain Qwen2.5 before Coder and Math (same shapes, other lines)."""
    lowered = " ".join(str(n).lower().replace(" ", "-") for n in names)
    named = [m for m in candidates if m.repo_id.split("/")[-1].lower() in lowered]
    if named:
        return max(named, key=lambda m: len(m.repo_id))  # Qwen2.5-7B-Instruct over Qwen2.5-7B
    pick = [m for m in candidates if instruct is None or m.instruct == instruct] or candidates
    return sorted(pick, key=lambda m: m.line != "Qwen2.5")[0]


def identify_config(config: dict, names: Sequence[str] = (), generation: Optional[dict] = None) -> Identity:
    """The family member ``config`` (a config.json dict) is; see the module docstring."""
    instruct, why = variant(names, generation)
    exact = identify(config)
    if exact:
        return Identity(_pick(exact, names, instruct), True, [], instruct, why, exact)
    near = [m for m in MEMBERS.values() if all(m.config.get(k) == config.get(k) for k in ARCH_KEYS)]
    if not near:
        return Identity(None, False, [], instruct, why)
    chosen = _pick(near, names, instruct)
    values = dict(config)
    values.setdefault("tie_word_embeddings", False)
    differs = [f"{k}: {values.get(k)} here vs {chosen.config.get(k)}" for k in ("vocab_size", "tie_word_embeddings")
               if values.get(k) != chosen.config.get(k)]
    return Identity(chosen, False, differs, instruct, why, near)


def describe(identity: Identity) -> str:
    """The info line naming what the artifact is."""
    if identity.member is None:
        return "not one of the Qwen2.5 family's shapes (qwenft's family table): the family checks are skipped"
    m = identity.member
    kind = {True: "Instruct", False: "base", None: "Instruct or base: unknown"}[identity.instruct]
    text = f"Qwen2.5 family: {m.line} {m.size} ({kind}, told by {identity.why}); shape of {m.repo_id}"
    if identity.differs:
        text += " but for " + "; ".join(identity.differs)
    others = [c.repo_id for c in identity.candidates if c is not m]
    if others:
        text += f" (same shape: {', '.join(others)})"
    return text
