"""The Qwen2.5 family: the published facts of every model qwenft has a preset for, each in one place.

One :class:`Member` per Hugging Face repository: its ``config.json`` numbers (the architecture a plan and ``qwenft
doctor`` read) and its ``generation_config.json`` defaults (the end tokens and sampling defaults). Each entry names
the files it was read from. ``conf/model/<preset>.yaml`` points at the repository; the numbers live here only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

# config.json keys that fix a model's shape: two models with equal values here have interchangeable weights
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "vocab_size", "tie_word_embeddings")


@dataclass(frozen=True)
class Member:
    """One published Qwen2.5 model.

    ``repo_id``: the Hugging Face id (``Qwen/Qwen2.5-7B-Instruct``); ``preset``: its ``conf/model`` name
    (``model=qwen2.5-7b-instruct``); ``line``: ``Qwen2.5``, ``Qwen2.5-Coder`` or ``Qwen2.5-Math``; ``size``: ``7B``;
    ``instruct``: an Instruct (chat) model, else a base model. ``config``: the keys of its config.json qwenft reads
    (``SHAPE_KEYS``, ``rope_theta``, ``max_position_embeddings``, ``rms_norm_eps``, ``sliding_window``,
    ``use_sliding_window``, ``max_window_layers``, ``model_type``). ``generation``: its generation_config.json
    (``bos_token_id``, ``eos_token_id`` (int or list), ``pad_token_id``, and for Instruct models ``do_sample``,
    ``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``). ``sources``: the files read. ``unverified``: the
    keys no copy of those files showed (``generation.`` for generation_config.json's), kept at DESIGN.md's values.
    """

    repo_id: str
    preset: str
    line: str
    size: str
    instruct: bool
    config: Dict[str, object]
    generation: Dict[str, object]
    sources: tuple = field(default_factory=tuple)
    unverified: tuple = field(default_factory=tuple)

    def shape(self) -> tuple:
        """The values of :data:`SHAPE_KEYS`, in that order."""
        return tuple(self.config.get(key) for key in SHAPE_KEYS)


def _hf(repo_id: str) -> tuple:
    return (f"https://huggingface.co/{repo_id}/blob/main/config.json",
            f"https://huggingface.co/{repo_id}/blob/main/generation_config.json")


MEMBERS: Dict[str, Member] = {}


def _add(member: Member) -> None:
    MEMBERS[member.repo_id] = member


def _build() -> None:
    """Fill :data:`MEMBERS` from :data:`qwenft.model.family_table.ROWS` (the numbers live there, once)."""
    import qwenft.model.family_table as table  # not from qwenft.model (a cycle via foreign.py)

    for (name, line, size, instruct, positions, theta, eps, window, window_layers, penalty, unverified,
         refs) in table.ROWS:
        config = dict(zip(SHAPE_KEYS, table.SHAPES[size]))
        config.update({"rope_theta": theta, "max_position_embeddings": positions, "rms_norm_eps": eps,
                       "use_sliding_window": False, "model_type": "qwen2"})
        if window is not None:  # left out where no copy of the config.json was read (never guessed)
            config.update({"sliding_window": window, "max_window_layers": window_layers})
        else:
            unverified = unverified + ("sliding_window", "max_window_layers")
        if instruct:
            generation = dict(table.INSTRUCT_GENERATION, repetition_penalty=penalty)
            guessed = table.GEN_UNVERIFIED if "gen7" in refs else table.GEN_UNVERIFIED + ("temperature", "top_p")
        else:
            generation, guessed = dict(table.BASE_GENERATION), ("do_sample",)
        repo_id = f"Qwen/{name}"
        sources = _hf(repo_id) + tuple(table.REFS[ref].format(repo=repo_id) for ref in refs)
        _add(Member(repo_id, name.lower(), line, size, instruct, config, generation, sources,
                    tuple(unverified) + tuple(f"generation.{key}" for key in guessed)))


_build()


def member(repo_id: str) -> Optional[Member]:
    """The :class:`Member` of a Hugging Face id (case-insensitive), None for a model outside the family table."""
    found = MEMBERS.get(repo_id)
    if found is None:
        lowered = repo_id.lower()
        found = next((m for m in MEMBERS.values() if m.repo_id.lower() == lowered), None)
    return found


def by_preset(preset: str) -> Optional[Member]:
    """The :class:`Member` a ``conf/model`` preset name points at, None if no member has that preset."""
    return next((m for m in MEMBERS.values() if m.preset == preset), None)


def identify(config: dict) -> List[Member]:
    """The members whose shape (:data:`SHAPE_KEYS`) equals ``config``'s (a config.json dict), in table order.

    Several can match (an Instruct model and its base share a shape; so do some Coder and plain models): the caller
    tells them apart by what else it reads (the chat template, generation_config, the names it was given).
    A config without ``tie_word_embeddings`` is read as untied (transformers' Qwen2 default).
    """
    values = dict(config)
    values.setdefault("tie_word_embeddings", False)
    shape = tuple(values.get(key) for key in SHAPE_KEYS)
    return [m for m in MEMBERS.values() if m.shape() == shape]
