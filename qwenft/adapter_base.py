"""Which base an adapter belongs to: the ``qwenft.json`` that ``qwenft train`` writes beside every adapter.

``merge`` folds the adapter into that base (:func:`resolve_base`); ``eval``, ``generate`` and ``inspect`` load it
under the adapter (:func:`inference_config`), so ``adapter=PATH`` alone runs on the model the adapter was trained on.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Tuple

from qwenft.config import (Config, ConfigError, ModelConfig, QuantConfig, QwenftError, RopeScalingConfig,
                           TinyModelConfig)
from qwenft.model import ADAPTER_META, read_adapter_meta

log = logging.getLogger(__name__)


def _identity(mcfg: ModelConfig) -> tuple:
    """What names the weights (not how they are run): source, path, revision and, for tiny-random, its shape."""
    return mcfg.source, mcfg.path, mcfg.revision, (mcfg.tiny if mcfg.source == "tiny-random" else None)


def _from_meta(section: str, cls: Any, values: dict, source: Path) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    try:
        kwargs = {k: v for k, v in values.items() if k in known}
        if cls is ModelConfig and isinstance(kwargs.get("tiny"), dict):
            kwargs["tiny"] = TinyModelConfig(**{k: v for k, v in kwargs["tiny"].items()
                                                if k in {f.name for f in dataclasses.fields(TinyModelConfig)}})
        if cls is ModelConfig and isinstance(kwargs.get("rope_scaling"), dict):
            kwargs["rope_scaling"] = RopeScalingConfig(**kwargs["rope_scaling"])
        return cls(**kwargs)
    except (ConfigError, TypeError) as exc:
        raise QwenftError(f"{source}: '{section}' is not a valid {section} config ({exc})") from None


def resolve_base(model: ModelConfig, quant: QuantConfig, adapter_dir: Path) -> Tuple[ModelConfig, QuantConfig, str]:
    """The base model an adapter is merged into, and how it was trained (NF4 or 16-bit).

    Rule: the adapter's ``qwenft.json`` (written by ``qwenft train``) names the base and its quantization.
    A ``model=...`` on the command line wins when it names *other weights* than the default preset, i.e.
    when its source, path, revision (or tiny-random shape) differ from :class:`ModelConfig`'s defaults;
    settings that do not change the weights (``model.dtype``, ``model.attn_implementation``) never count.
    Without ``qwenft.json`` the command line's ``model`` and ``quant`` are used as given (the same defaults
    ``train`` uses), so pass the ones the adapter was trained with.

    Returns:
        ``(model, quant, why)``: ``why`` is a short phrase for the log and the model card.

    Raises:
        QwenftError: ``qwenft.json`` is unreadable or holds invalid values.
    """
    meta = read_adapter_meta(adapter_dir)
    if meta is None:
        return model, quant, f"from the command line (no {ADAPTER_META} beside the adapter)"
    source = adapter_dir / ADAPTER_META
    saved_quant = _from_meta("quant", QuantConfig, meta.get("quant") or {"method": "none"}, source)
    if _identity(model) != _identity(ModelConfig()):
        return model, saved_quant, f"model={model.name} from the command line (overrides {ADAPTER_META})"
    return _from_meta("model", ModelConfig, meta["model"], source), saved_quant, f"from the adapter's {ADAPTER_META}"


def inference_config(config: Config) -> Config:
    """``config`` with the model (and quantization) the adapter was trained on, for eval / generate / inspect.

    The model follows :func:`resolve_base`'s rule (``qwenft.json`` unless ``model=...`` names other weights
    than the default preset), but the command line's ``model.dtype`` and ``model.attn_implementation`` are kept
    (they choose how to run the weights, not which), and so is a ``model.rope_scaling`` set there (else the
    trained one). The quantization (method, double quant, compute dtype) is
    the trained one unless the command line changed one of them from the defaults (e.g. ``quant=none`` to run
    the adapter on a 16-bit base); the inference-only ``quant`` keys always come from the command line.
    The system prompt the adapter was trained with (``data.system_prompt``) is used unless the command line
    sets one. Without ``adapter``, or without ``qwenft.json``, ``config`` is returned as it is.

    Raises:
        QwenftError: ``qwenft.json`` is unreadable or holds invalid values.
    """
    if not config.adapter:
        return config
    adapter_dir = Path(config.adapter).expanduser()
    meta = read_adapter_meta(adapter_dir)
    if meta is None:
        return config
    trained_on = sorted(str(d.get("path")) for d in meta.get("data_sources") or [] if isinstance(d, dict))
    now = sorted(str(s.path) for s in config.data.sources)
    if trained_on and now != trained_on and config.command == "eval":
        log.warning("the adapter was trained on %s; this evaluation reads %s (set data.sources or the run's "
                    "+recipe to evaluate on the run's own held-out rows)", ", ".join(trained_on), ", ".join(now))
    trained_system = meta.get("system_prompt")
    if config.data.system_prompt is None and isinstance(trained_system, str):
        log.info("system prompt from the adapter's %s: %r", ADAPTER_META, trained_system)
        config = dataclasses.replace(config, data=dataclasses.replace(config.data, system_prompt=trained_system))
    model, saved_quant, why = resolve_base(config.model, config.quant, adapter_dir)
    model = dataclasses.replace(model, dtype=config.model.dtype, attn_implementation=config.model.attn_implementation)
    if config.model.rope_scaling != ModelConfig().rope_scaling:  # asked for on the command line: it wins
        model = dataclasses.replace(model, rope_scaling=config.model.rope_scaling)
    quant = config.quant
    trained_keys = ("method", "double_quant", "compute_dtype")
    defaults = QuantConfig()
    if all(getattr(quant, k) == getattr(defaults, k) for k in trained_keys):
        quant = dataclasses.replace(quant, **{k: getattr(saved_quant, k) for k in trained_keys})
    if model != config.model or quant != config.quant:
        log.info("base model %s (%s), quant=%s", model.name, why, quant.method)
    return dataclasses.replace(config, model=model, quant=quant)
