"""An adapter directory and what it records: ``qwenft.json`` (the base it was trained on, its quantization, LoRA
and data), the check that a directory is one, and the rule for which base an adapter runs on.

Which base an adapter belongs to: the ``qwenft.json`` that ``qwenft train`` writes beside every adapter (for one
made by another tool, its adapter_config.json's ``base_model_name_or_path``: :mod:`qwenft.model.foreign`).

``merge`` folds the adapter into that base (:func:`resolve_base`); ``eval``, ``generate`` and ``inspect`` load it
under the adapter (:func:`inference_config`), so ``adapter=PATH`` alone runs on the model the adapter was trained on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from qwenft.config import (Config, ConfigError, DataSource, ModelConfig, QuantConfig, QwenftError, RopeScalingConfig,
                           TinyModelConfig)
from qwenft.files import atomic_write_text
from qwenft.model.eval_record import eval_record, restore_eval
from qwenft.runtime import resolve_dtype

log = logging.getLogger(__name__)


def check_adapter_dir(adapter_dir: str) -> Path:
    """The adapter directory as a Path; call it before loading a model so a typo fails at once.

    A finished run directory (``<run dir>``, which holds ``adapter/``) stands for its ``<run dir>/adapter``: the
    returned path is that one, and one INFO line says so.

    Raises:
        QwenftError: ``adapter_dir`` does not exist, is a file, or holds no adapter_config.json (and no
            ``adapter/`` with one); the message gives its absolute path and what to pass instead.
    """
    path = Path(adapter_dir).expanduser()
    where = path.absolute()
    if (path / "adapter_config.json").is_file():
        return path
    if (path / "adapter" / "adapter_config.json").is_file():
        log.info("adapter=%s is a run directory: using its adapter %s", adapter_dir, path / "adapter")
        return path / "adapter"
    expected = ("pass the directory a training run wrote (<run dir>/adapter, or the run directory itself), or run "
                "`python -m qwenft train` first")
    if not path.exists():
        raise QwenftError(f"adapter={adapter_dir}: {where} does not exist; {expected}")
    if not path.is_dir():
        raise QwenftError(f"adapter={adapter_dir}: {where} is a file, not a directory; {expected}")
    if (path / "checkpoints").is_dir():  # a run directory whose training has not finished
        raise QwenftError(f"adapter={adapter_dir}: {where} is a run directory without adapter/ (its training has "
                          "not finished): continue it with `python -m qwenft train out_dir=<that directory> "
                          "train.resume=auto`, or pass one of its checkpoints (<run dir>/checkpoints/checkpoint-N)")
    raise QwenftError(f"adapter={adapter_dir}: {where} holds no adapter_config.json (nor an adapter/ directory with "
                      f"one); {expected}")


ADAPTER_META = "qwenft.json"


def save_adapter_meta(adapter_dir, config: Config, data_stats: Optional[dict] = None) -> None:
    """Write ``qwenft.json`` beside a saved adapter: what it was trained on, for ``qwenft merge`` and ``eval``.

    Holds the model config (``dataclasses.asdict(config.model)``), the quant, LoRA, train and pref configs and the
    ``init_adapter`` the run started from, the run
    name, the data (``data``: the data config that decides the held-out rows, a local file's path made absolute;
    ``data_sources``: name and path) and the system prompt trained with (``system_prompt``, with its
    ``system_prompt_share`` of the training examples and ``system_prompt_from``: ``rows`` when most rows carried
    their own system turn, else ``data.system_prompt``), the eval settings (``eval`` and ``eval_preset``,
    :func:`qwenft.model.eval_record.eval_record`); ``model.dtype`` and ``quant.compute_dtype`` are stored
    resolved (``auto`` -> what this machine uses, :func:`resolve_dtype`). Written atomically (temp name, then
    ``os.replace``). Call it in the training process.

    Args:
        adapter_dir: The adapter directory (the one holding adapter_config.json); created if missing.
        config: The run's validated config.
        data_stats: the training data's ``DataBundle.stats``: its ``system_prompt`` (``{"text", "share"}``, the
            system prompt most training examples carried) and each source's ``eval`` (the rows actually held out,
            recorded as that source's ``eval_rows``: a recipe's default larger than the file was clamped); None:
            ``data.system_prompt`` and the configured ``eval_rows`` are recorded.
    """
    from qwenft import __version__

    path = Path(adapter_dir).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    # Record the dtypes this run resolved ("auto" depends on the machine; a merge must redo what training did).
    model = dict(dataclasses.asdict(config.model), dtype=resolve_dtype(config.model.dtype))
    quant = dict(dataclasses.asdict(config.quant), compute_dtype=resolve_dtype(config.quant.compute_dtype))
    stats = data_stats or {}
    system = stats.get("system_prompt") or {"text": config.data.system_prompt, "share": None}
    meta = {
        "format": 1,
        "qwenft_version": __version__,
        "run_name": config.run_name,
        "model": model,
        "quant": quant,
        "lora": dataclasses.asdict(config.lora),
        "train": dataclasses.asdict(config.train),
        "pref": dataclasses.asdict(config.pref),
        "init_adapter": config.init_adapter,
        "data_sources": [{"name": s.name, "path": s.path} for s in config.data.sources],
        "data": _data_record(config, stats.get("sources") or {}),
        "system_prompt": system["text"],
        "system_prompt_share": system["share"],
        "system_prompt_from": "data.system_prompt" if system["text"] == config.data.system_prompt else "rows",
        **eval_record(config),  # eval, eval_preset: what a later `qwenft eval` of this adapter starts from
    }
    atomic_write_text(path / ADAPTER_META, json.dumps(meta, indent=2, ensure_ascii=False) + "\n")


# The data settings that decide which rows are held out and how they are tokenized (not how training ran).
HELD_OUT_KEYS = ("seed", "max_seq_len", "overlong", "train_on", "on_bad_row")


def _data_record(config: Config, built: Dict[str, dict]) -> dict:
    """``data.sources`` (a local file's path absolute, so ``eval`` finds it from any directory; ``eval_rows`` the
    rows the build held out, ``built[name]["eval"]``, when known) and :data:`HELD_OUT_KEYS` of ``config.data``."""
    sources = []
    for source in config.data.sources:
        record = dataclasses.asdict(source)
        held = (built.get(source.name) or {}).get("eval")
        if isinstance(held, int) and source.weight > 0:
            record["eval_rows"] = held
        local = Path(source.path).expanduser()
        if local.exists():  # a file read from disk (a Hub dataset id is kept as it is)
            record["path"] = str(local.resolve())
        sources.append(record)
    return {"sources": sources, **{key: getattr(config.data, key) for key in HELD_OUT_KEYS}}


def recorded_lora(adapter_dir) -> Dict[str, Any]:
    """The LoRA settings an adapter directory records: peft's ``adapter_config.json`` (``r``, ``lora_alpha``,
    ``target_modules``, ...) over the ``lora`` entry of its ``qwenft.json``; {} when neither holds them. A missing or
    unreadable file counts as empty (an adapter written by another tool has no ``qwenft.json``)."""
    from qwenft.model.vllm_lora import read_adapter_config

    try:
        meta = json.loads((Path(adapter_dir).expanduser() / ADAPTER_META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        meta = {}
    lora = meta.get("lora") if isinstance(meta, dict) else None
    return {**(lora if isinstance(lora, dict) else {}), **read_adapter_config(adapter_dir)}


def read_adapter_meta(adapter_dir) -> Optional[dict]:
    """The ``qwenft.json`` written by :func:`save_adapter_meta`, or None when the adapter has none.

    Raises:
        QwenftError: the file exists but is not a JSON object with a ``model`` entry.
    """
    path = Path(adapter_dir).expanduser() / ADAPTER_META
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise QwenftError(f"{path}: not readable as JSON ({exc}); it is written by `python -m qwenft train`") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
        raise QwenftError(f"{path}: no 'model' entry; it is written by `python -m qwenft train`")
    return meta


MODEL_IDENTITY_KEYS = ("source", "path", "revision", "tiny")  # what names the weights under model.*


QUANT_TRAINED_KEYS = ("method", "double_quant", "compute_dtype")  # how the adapter's base was quantized


def typed_overrides() -> Optional[List[str]]:
    """The overrides of the running Hydra job (what the user typed, plus the CLI's own ``command=...``), or None
    outside a Hydra job (a direct library call): a recipe's or preset's values are never among them."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return [str(item) for item in HydraConfig.get().overrides.task]


def typed_keys(typed: Sequence[str]) -> Set[str]:
    """The keys of override strings: ``model=tiny-random`` -> ``model``, ``++quant.method=none`` -> ``quant.method``."""
    return {item.partition("=")[0].lstrip("+~") for item in typed}


def _typed(keys: Set[str], section: str, names: Sequence[str]) -> List[str]:
    """Which of ``section``'s ``names`` were typed: all of them for a group choice (``quant=none``), else the ones
    typed as ``section.name`` or below (``model.tiny.hidden_size`` counts for ``tiny``)."""
    if section in keys:
        return list(names)
    return [name for name in names if any(k == f"{section}.{name}" or k.startswith(f"{section}.{name}.")
                                          for k in keys)]


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


def _model_typed(model: ModelConfig, typed: Optional[Sequence[str]]) -> bool:
    """Whether the user named other weights: typed ``model=...`` or ``model.source/path/revision/tiny...``; for a
    direct library call (``typed`` None), whether ``model`` names other weights than the default preset."""
    if typed is None:
        return _identity(model) != _identity(ModelConfig())
    return bool(_typed(typed_keys(typed), "model", MODEL_IDENTITY_KEYS))


def resolve_base(model: ModelConfig, quant: QuantConfig, adapter_dir: Path,
                 typed: Optional[Sequence[str]] = None) -> Tuple[ModelConfig, QuantConfig, str]:
    """The base model an adapter is merged into, and how it was trained (NF4 or 16-bit).

    Rule: the adapter's ``qwenft.json`` (written by ``qwenft train``) names the base and its quantization.
    Only a ``model=...`` the user typed wins: ``model=PRESET`` or a ``model.source`` / ``path`` / ``revision`` /
    ``tiny.*`` override; a recipe's or preset's default never does, nor a setting that does not change the
    weights (``model.dtype``, ``model.attn_implementation``). Without ``qwenft.json`` (an adapter made by another
    tool) the base is adapter_config.json's ``base_model_name_or_path`` unless ``model=...`` was typed, on its
    16-bit weights unless ``quant=...`` was typed (:func:`qwenft.model.foreign.foreign_base`).

    Args:
        typed: the override strings the user typed; None: those of the running Hydra job
            (:func:`typed_overrides`); outside one (a library call) a ``model`` other than the default preset
            counts as typed.

    Returns:
        ``(model, quant, why)``: ``why`` is a short phrase for the log and the model card.

    Raises:
        QwenftError: ``qwenft.json`` is unreadable or holds invalid values; without it, a base path that is gone.
    """
    typed = typed_overrides() if typed is None else typed
    meta = read_adapter_meta(adapter_dir)
    if meta is None:
        from qwenft.model.foreign import foreign_base

        keys = typed_keys(typed) if typed is not None else None
        quant_typed = (any(getattr(quant, k) != getattr(QuantConfig(), k) for k in QUANT_TRAINED_KEYS) if keys is None
                       else bool(_typed(keys, "quant", QUANT_TRAINED_KEYS)))
        return foreign_base(model, quant, adapter_dir, _model_typed(model, typed), quant_typed)
    source = adapter_dir / ADAPTER_META
    saved_quant = _from_meta("quant", QuantConfig, meta.get("quant") or {"method": "none"}, source)
    if _model_typed(model, typed):
        return model, saved_quant, f"model={model.name} typed on the command line (overrides {ADAPTER_META})"
    return _from_meta("model", ModelConfig, meta["model"], source), saved_quant, f"from the adapter's {ADAPTER_META}"


def _same_path(path: str) -> str:
    local = Path(path).expanduser()
    return str(local.resolve()) if local.exists() else path


def data_mismatch(config: Config, meta: Optional[dict]) -> Optional[str]:
    """The adapter's training data (``name (path)``, comma-separated) when ``config.data.sources`` reads other
    files than the ones ``meta`` (its ``qwenft.json``) records; None when they are the same or nothing is recorded."""
    trained = [d for d in (meta or {}).get("data_sources") or [] if isinstance(d, dict)]
    if not trained:
        return None
    if sorted(_same_path(str(d.get("path"))) for d in trained) == sorted(_same_path(s.path) for s in
                                                                          config.data.sources):
        return None
    return ", ".join(f"{d.get('name')} ({d.get('path')})" for d in trained)


def eval_data(config: Config, meta: dict, source: Path, keys: Optional[Set[str]]) -> Config:
    """``eval`` with an adapter: the data it was trained on (``qwenft.json``'s ``data``: its sources and
    :data:`HELD_OUT_KEYS`, so the held-out rows are the run's own), unless ``data.sources...``, ``data=`` or a
    ``+recipe=`` was typed (``keys`` None, a library call: counts as typed); then ``config``'s data is evaluated,
    with a warning when it is not what the adapter was trained on. A typed ``data.KEY`` of the held-out keys wins.
    With the run's data comes its ``train.objective`` (unless typed): SimPO's and ORPO's held-out pairs are ranked
    per answer token (:mod:`qwenft.evaluate.preference`).

    Raises:
        QwenftError: a recorded source file that no longer exists, or invalid recorded values.
    """
    recorded = meta.get("data") if isinstance(meta.get("data"), dict) else None
    typed = keys is None or bool({"data", "recipe"} & keys) or any(k.startswith("data.sources") for k in keys)
    if recorded is None or typed:
        trained = data_mismatch(config, meta)
        if trained:
            log.warning("NOT THE ADAPTER'S DATA: it was trained on %s, but this evaluation reads %s (%s); drop "
                        "data.sources / +recipe to evaluate on the run's own held-out rows", trained,
                        ", ".join(f"{s.name} ({s.path})" for s in config.data.sources),
                        "typed on the command line" if recorded is not None else f"{source} records no data")
        return config
    sources = [_from_meta("data.sources", DataSource, s, source) for s in recorded.get("sources") or []]
    for i, src in enumerate(sources):
        if Path(src.path).is_absolute() and not Path(src.path).exists():
            raise QwenftError(f"{source}: the adapter was trained on data source {src.name!r} at {src.path}, which "
                              f"no longer exists; evaluate on other data with data.sources.{i}.path=FILE (or the "
                              "run's +recipe)")
    held = {k: recorded[k] for k in HELD_OUT_KEYS if k in recorded and f"data.{k}" not in keys}
    try:
        data = dataclasses.replace(config.data, sources=sources, **held)
    except (ConfigError, TypeError) as exc:
        raise QwenftError(f"{source}: 'data' is not a valid data config ({exc})") from None
    log.info("eval data from the adapter's %s (what it was trained on): %s", ADAPTER_META,
             ", ".join(f"{s.name} ({s.path}, {s.eval_rows} rows held out)" for s in sources))
    objective = (meta.get("train") or {}).get("objective")
    if isinstance(objective, str) and "train.objective" not in keys:  # how the held-out pairs' margins are read
        return dataclasses.replace(config, data=data, train=dataclasses.replace(config.train, objective=objective))
    return dataclasses.replace(config, data=data)


def inference_config(config: Config, typed: Optional[Sequence[str]] = None) -> Config:
    """``config`` with the model (and quantization) the adapter was trained on, for eval / generate / inspect.

    Only what the user typed overrides what the adapter records; a recipe's or preset's default never does.
    The model follows :func:`resolve_base`'s rule (``qwenft.json`` unless a typed ``model=...`` names other
    weights), but ``model.attn_implementation`` is kept (it chooses how to run the weights, not which), and so are
    ``model.dtype`` (for ``eval`` only when typed, else the dtype the adapter's run used, recorded resolved, so
    the numbers are its own) and a typed ``model.rope_scaling`` (else the trained one); for a library call
    (``typed`` None) a value other than the default counts as typed. The quantization
    (method, double quant, compute dtype) is the trained one except the keys typed (``quant=none`` runs the
    adapter on a 16-bit base); the inference-only ``quant`` keys always come from ``config``. The system prompt
    the adapter was trained with (``qwenft.json``'s ``system_prompt``: ``data.system_prompt``, or the system turn
    most training rows carried) is used unless ``data.system_prompt`` was typed. ``eval`` reads the data the
    adapter was trained on unless data or a recipe was typed (:func:`eval_data`), and starts from the eval settings
    its run recorded, typed keys on top (:func:`qwenft.model.eval_record.restore_eval`). Without ``adapter``,
    ``config`` as it is; without ``qwenft.json``, only the model and quantization :func:`resolve_base` gives.

    Args:
        typed: the override strings the user typed; None: those of the running Hydra job
            (:func:`typed_overrides`); outside one (a library call), values that differ from the defaults count
            as typed.

    Raises:
        QwenftError: ``qwenft.json`` is unreadable or holds invalid values, or recorded eval settings that do not
            fit this evaluation.
    """
    if not config.adapter:
        return config
    typed = typed_overrides() if typed is None else typed
    keys = typed_keys(typed) if typed is not None else None
    adapter_dir = Path(config.adapter).expanduser()
    meta = read_adapter_meta(adapter_dir)
    if meta is None:  # made by another tool: the base its adapter_config.json names, 16-bit (resolve_base)
        if config.command == "eval":
            config.check_gates()  # not checked at composition: see Config.__post_init__
        model, quant, why = resolve_base(config.model, config.quant, adapter_dir, typed=typed)
        if model != config.model or quant != config.quant:
            log.info("base model %s (%s), quant=%s", model.name, why, quant.method)
        return dataclasses.replace(config, model=model, quant=quant)
    if config.command == "eval":  # the run's held-out rows, then its eval settings (its gates name those sources)
        config = eval_data(config, meta, adapter_dir / ADAPTER_META, keys)
        config = restore_eval(config, meta, adapter_dir / ADAPTER_META, keys)
    trained_system = meta.get("system_prompt")
    system_typed = config.data.system_prompt is not None if keys is None else "data.system_prompt" in keys
    if not system_typed and isinstance(trained_system, str):
        share = meta.get("system_prompt_share")
        carried = (f", the system turn of {share:.0%} of its training rows" if meta.get("system_prompt_from") == "rows"
                   and isinstance(share, (int, float)) else "")
        log.info("system prompt from the adapter's %s%s: %r", ADAPTER_META, carried, trained_system)
        config = dataclasses.replace(config, data=dataclasses.replace(config.data, system_prompt=trained_system))
    model, saved_quant, why = resolve_base(config.model, config.quant, adapter_dir, typed=typed)
    # eval: the dtype the adapter's run evaluated in (recorded resolved), as quant.compute_dtype; a preset's dtype
    # (the default model's, not the adapter's) would change the numbers. A typed model.dtype wins; generate,
    # inspect and serve run in this command's dtype (auto: what this machine runs best).
    dtype_typed = config.command != "eval" or (config.model.dtype != ModelConfig().dtype if keys is None
                                               else bool(_typed(keys, "model", ("dtype",))))
    model = dataclasses.replace(model, dtype=config.model.dtype if dtype_typed else model.dtype,
                                attn_implementation=config.model.attn_implementation)
    rope_typed = (config.model.rope_scaling != ModelConfig().rope_scaling if keys is None
                  else bool(_typed(keys, "model", ("rope_scaling",))))
    if rope_typed:
        model = dataclasses.replace(model, rope_scaling=config.model.rope_scaling)
    quant = config.quant
    defaults = QuantConfig()
    if keys is None:  # a library call: any trained key changed from the defaults keeps all of them
        kept = list(QUANT_TRAINED_KEYS) if any(getattr(quant, k) != getattr(defaults, k)
                                               for k in QUANT_TRAINED_KEYS) else []
    else:
        kept = _typed(keys, "quant", QUANT_TRAINED_KEYS)
    quant = dataclasses.replace(quant, **{k: getattr(saved_quant, k) for k in QUANT_TRAINED_KEYS if k not in kept})
    if model != config.model or quant != config.quant:
        log.info("base model %s (%s), quant=%s", model.name, why, quant.method)
    return dataclasses.replace(config, model=model, quant=quant)
