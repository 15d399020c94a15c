"""The architecture numbers a plan needs, read from a config.json (never from weights), and parameter counts.

Where the numbers come from, by ``model.source``:

- ``tiny-random``: :class:`qwenft.config.TinyModelConfig` (the model is built from it).
- ``local``: ``<model.path>/config.json``.
- ``embedded``: the converted model's config.json in the qwenft cache when it exists, else the built-in copy of
  its numbers (the conversion loads weights, so a plan never triggers it).
- ``hub``: the config.json in the local Hugging Face cache, else the family table's numbers for the Qwen2.5
  presets (:mod:`qwenft.model.family`), else (when ``HF_HUB_OFFLINE`` is not set) a download of that one small file.

Parameter counts follow transformers' ``Qwen2ForCausalLM`` (models/qwen2/modeling_qwen2.py): q/k/v projections
with bias, o_proj and the SwiGLU MLP without, two RMSNorms per layer plus a final one, an untied or tied lm_head.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Tuple

from qwenft.config import LoraConfig, ModelConfig, QwenftError


def _builtin_configs() -> Dict[str, dict]:
    """The config.json numbers of every preset's Hugging Face repository, so a plan needs no download: the family
    table (:mod:`qwenft.model.family`, their one home), plus ``embedded``."""
    from qwenft.model.family import MEMBERS

    configs = {repo_id: dict(m.config) for repo_id, m in MEMBERS.items()}
    # The embedded Qwen2.5-Coder-0.5B-Instruct as converted from its GGUF: the GGUF stores a separate output
    # matrix, so the converted model has an untied lm_head (630 M parameters).
    configs["embedded"] = {
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
        "tie_word_embeddings": False, "model_type": "qwen2"}
    return configs


BUILTIN_CONFIGS: Dict[str, dict] = _builtin_configs()
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclass(frozen=True)
class Architecture:
    """The shape of a Qwen2 decoder, as in its config.json.

    ``head_dim`` is ``hidden_size / num_attention_heads`` unless the config gives it; ``attention_bias`` is
    true for Qwen2 (q/k/v projections carry a bias). ``source`` says where the numbers were read.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool = True
    source: str = ""

    @classmethod
    def from_config_dict(cls, data: dict, source: str) -> "Architecture":
        """Read the fields of a transformers Qwen2 config.json dict.

        Raises:
            QwenftError: a required key is missing or not a positive integer (the message names ``source``).
        """
        for key in _REQUIRED:
            if not isinstance(data.get(key), int) or data[key] <= 0:
                raise QwenftError(f"{source}: '{key}' is missing or not a positive integer; a plan needs "
                                  f"{', '.join(_REQUIRED)}")
        heads = data["num_attention_heads"]
        return cls(hidden_size=data["hidden_size"], intermediate_size=data["intermediate_size"],
                   num_hidden_layers=data["num_hidden_layers"], num_attention_heads=heads,
                   num_key_value_heads=int(data.get("num_key_value_heads") or heads),
                   head_dim=int(data.get("head_dim") or data["hidden_size"] // heads),
                   vocab_size=data["vocab_size"], tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
                   max_position_embeddings=int(data.get("max_position_embeddings") or 32768),
                   attention_bias=data.get("model_type", "qwen2") == "qwen2" or bool(data.get("attention_bias")),
                   source=source)

    @property
    def q_dim(self) -> int:
        """Width of the query projection output: ``num_attention_heads * head_dim``."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of each of the key and value projection outputs: ``num_key_value_heads * head_dim`` (GQA)."""
        return self.num_key_value_heads * self.head_dim


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise QwenftError(f"{path}: not readable as a JSON config ({exc})") from None
    if not isinstance(data, dict):
        raise QwenftError(f"{path}: not a JSON object")
    return data


def _hub_config(repo_id: str, revision: str) -> Tuple[dict, str]:
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    if isinstance(cached, str):
        return _read_json(Path(cached)), f"{cached} (HF cache)"
    if repo_id in BUILTIN_CONFIGS:
        return BUILTIN_CONFIGS[repo_id], f"qwenft built-in numbers for {repo_id}"
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise QwenftError(f"model.path={repo_id!r}: its config.json is not in the local Hugging Face cache and "
                          "HF_HUB_OFFLINE is set; fetch it once (`huggingface-cli download "
                          f"{repo_id} config.json`) or use model.source=local")
    from huggingface_hub import hf_hub_download

    try:  # one small JSON file, never weights
        path = hf_hub_download(repo_id, "config.json", revision=revision)
    except Exception as exc:  # network or missing repo: one line for the user
        raise QwenftError(f"model.path={repo_id!r}: could not fetch config.json "
                          f"({type(exc).__name__}: {exc})") from None
    return _read_json(Path(path)), f"{path} (downloaded config.json)"


def resolve_architecture(mcfg: ModelConfig) -> Architecture:
    """The :class:`Architecture` of ``mcfg`` without loading (or downloading) any weights.

    Raises:
        QwenftError: a local directory without a readable config.json; a hub model whose config.json is not
            cached and cannot be fetched; a config without the keys a plan needs.
    """
    if mcfg.source == "tiny-random":
        t = mcfg.tiny
        data = {"hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
                "num_hidden_layers": t.num_hidden_layers, "num_attention_heads": t.num_attention_heads,
                "num_key_value_heads": t.num_key_value_heads, "vocab_size": t.vocab_size,
                "max_position_embeddings": t.max_position_embeddings, "tie_word_embeddings": t.tie_word_embeddings}
        return Architecture.from_config_dict(data, "model.tiny")
    if mcfg.source == "local":
        path = Path(mcfg.path).expanduser() / "config.json"
        if not path.is_file():
            raise QwenftError(f"model.path={mcfg.path!r}: no config.json there (model.source=local needs an HF "
                              "model directory)")
        return Architecture.from_config_dict(_read_json(path), str(path))
    if mcfg.source == "embedded":
        from qwenft.model.sources import EMBEDDED_SHA256
        from qwenft.runtime import cache_dir

        path = cache_dir() / "embedded" / EMBEDDED_SHA256[:16] / "config.json"
        if path.is_file():
            return Architecture.from_config_dict(_read_json(path), str(path))
        return Architecture.from_config_dict(BUILTIN_CONFIGS["embedded"], "qwenft built-in numbers (embedded)")
    data, source = _hub_config(mcfg.path, mcfg.revision)
    return Architecture.from_config_dict(data, source)


def projection_shapes(arch: Architecture) -> Dict[str, Tuple[int, int]]:
    """``{name: (in_features, out_features)}`` of the seven linear projections of one decoder layer."""
    h, i = arch.hidden_size, arch.intermediate_size
    return {"q_proj": (h, arch.q_dim), "k_proj": (h, arch.kv_dim), "v_proj": (h, arch.kv_dim),
            "o_proj": (arch.q_dim, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def parameter_counts(arch: Architecture) -> Dict[str, int]:
    """Parameters by component, and ``total``.

    ``embeddings`` ``V*H``; ``attention`` the q/k/v/o weights ``L*(H*q + 2*H*kv + q*H)``; ``attention_bias``
    ``L*(q + 2*kv)``; ``mlp`` ``L*3*H*I``; ``norms`` ``(2L+1)*H``; ``lm_head`` ``V*H``, or 0 when tied to the
    embeddings (one matrix, counted once). For Qwen2.5-7B-Instruct this gives 7,615,616,512.
    """
    L, h, v = arch.num_hidden_layers, arch.hidden_size, arch.vocab_size
    shapes = projection_shapes(arch)
    attention = L * sum(a * b for name, (a, b) in shapes.items() if name in ("q_proj", "k_proj", "v_proj", "o_proj"))
    counts = {
        "embeddings": v * h,
        "attention": attention,
        "attention_bias": L * (arch.q_dim + 2 * arch.kv_dim) if arch.attention_bias else 0,
        "mlp": L * 3 * h * arch.intermediate_size,
        "norms": (2 * L + 1) * h,
        "lm_head": 0 if arch.tie_word_embeddings else v * h,
    }
    counts["total"] = sum(counts.values())
    return counts


def lora_parameter_count(arch: Architecture, lcfg: LoraConfig) -> int:
    """Trainable parameters of a LoRA adapter with ``lcfg`` on ``arch``.

    Each targeted projection ``W: [out, in]`` gets ``A: [r, in]`` and ``B: [out, r]``, i.e. ``r*(in + out)``
    parameters (Hu et al. 2021, "LoRA", section 4.1); DoRA adds a magnitude vector of ``out`` (Liu et al. 2024,
    section 4); ``bias="all"`` also trains every bias of the model, ``"lora_only"`` the biases of the targeted
    projections (peft ``LoraConfig.bias``). This is the count peft's ``get_nb_trainable_parameters`` reports.
    """
    shapes = projection_shapes(arch)
    biased = {"q_proj": arch.q_dim, "k_proj": arch.kv_dim, "v_proj": arch.kv_dim} if arch.attention_bias else {}
    per_layer = 0
    for name in lcfg.target_modules:
        fan_in, fan_out = shapes[name]
        per_layer += lcfg.r * (fan_in + fan_out) + (fan_out if lcfg.use_dora else 0)
        if lcfg.bias == "lora_only":
            per_layer += biased.get(name, 0)
    if lcfg.bias == "all":
        per_layer += sum(biased.values())
    return arch.num_hidden_layers * per_layer
