"""The eval settings a training run records beside its adapter, and the rule by which a later ``qwenft eval`` of
that adapter starts from them: the same adapter gets the same verdict.

``qwenft train`` writes into the adapter's ``qwenft.json`` (:func:`qwenft.model.adapter.save_adapter_meta`):

- ``eval``: the whole ``eval`` section as the run used it (``dataclasses.asdict(config.eval)``: gates, metrics,
  ``max_new_tokens``, the preset's name, ``max_eval_prompts``, benchmarks and ``bench_*``, ``correct_threshold``,
  and any key the section gains later), a local path of :data:`PATH_KEYS` made absolute;
- ``eval_preset``: the values of that sampler preset (``config.generate_presets[eval.generate]``), resolved, so a
  later change to conf/generate or a ``generate_presets.NAME.KEY`` typed for the run is reproduced too.

``qwenft eval adapter=PATH`` starts from them, then applies what was typed (:func:`restore_eval`), and report.md
and metrics.json (``eval.settings_from``) say where the settings came from (:func:`settings_origin`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Set

from qwenft.config import Config, ConfigError, EvalConfig, GenerateConfig, QwenftError

log = logging.getLogger(__name__)

# Keys of the eval section a later eval does not take from the record: after_train only says whether `train`
# evaluates at all; judge names an endpoint a later eval should not contact unasked (type eval.judge.url again;
# a recorded gate of the judge's win rate is dropped when this eval has no judge). Every other key is restored, eval.batch_size too (with a sampling preset the batches decide
# which draws each row gets; `auto` is sized again for this machine).
NOT_RESTORED = ("after_train", "judge")
PATH_KEYS = ("ppl_sources", "bench_data", "bench_tasks")  # local paths: recorded absolute when they exist
TYPED_GROUPS = ("recipe", "eval")  # typed `+recipe=NAME` or `eval=NAME`: that config's eval section is used


def _absolute(path: Any) -> Any:
    """``path`` made absolute (``~`` expanded, relative to the current directory) when it names something that
    exists here; anything else as it is."""
    if not isinstance(path, str) or not path:
        return path
    local = Path(path).expanduser()  # relative: to the current directory, as the data files' reader reads it
    return str(local.resolve()) if local.exists() else path


def eval_settings(eval_config: EvalConfig) -> Dict[str, Any]:
    """The eval section as recorded: ``dataclasses.asdict``, a local path of :data:`PATH_KEYS` absolute."""
    values = dataclasses.asdict(eval_config)
    for key in PATH_KEYS:
        value = values.get(key)
        values[key] = [_absolute(p) for p in value] if isinstance(value, list) else _absolute(value)
    return values


def eval_record(config: Config) -> Dict[str, Any]:
    """``qwenft.json``'s ``eval`` (:func:`eval_settings`) and ``eval_preset`` (the values of the preset
    ``eval.generate`` names; None when ``config.generate_presets`` holds no such preset)."""
    preset = config.generate_presets.get(config.eval.generate)
    return {"eval": eval_settings(config.eval),
            "eval_preset": dataclasses.asdict(preset) if preset is not None else None}


def _typed_paths(keys: Set[str], section: str) -> List[List[str]]:
    """The typed keys under ``section`` as paths below it: ``eval.gates.domain.min_delta`` ->
    ``["gates", "domain", "min_delta"]`` (sorted, so the result does not depend on the order typed)."""
    prefix = section + "."
    return [key[len(prefix):].split(".") for key in sorted(keys) if key.startswith(prefix)]


def _overlay(recorded: Dict[str, Any], current: Dict[str, Any], path: List[str]) -> None:
    """Put ``current``'s value at ``path`` (a typed key) into ``recorded``, in place: within a mapping on both
    sides (``gates``) only the typed entry changes; a key ``current`` lacks (removed with ``~``) is removed."""
    key, rest = path[0], path[1:]
    if key not in current:
        recorded.pop(key, None)
        return
    if rest and isinstance(current[key], dict) and isinstance(recorded.get(key), dict):
        _overlay(recorded[key], current[key], rest)
    else:
        recorded[key] = copy.deepcopy(current[key])


def _recorded(meta: dict) -> Optional[Dict[str, Any]]:
    values = meta.get("eval")
    return values if isinstance(values, dict) else None


def _differs(config: Config, recorded: Dict[str, Any], preset: Optional[dict]) -> List[str]:
    """The keys (``eval.KEY``, ``generate_presets.NAME``) in which ``config``'s eval settings differ from the
    recorded ones; :data:`NOT_RESTORED` and keys only one side knows are left out."""
    current = eval_settings(config.eval)
    keys = [f"eval.{k}" for k in current if k in recorded and k not in NOT_RESTORED and current[k] != recorded[k]]
    name = config.eval.generate
    if preset is not None and name == recorded.get("generate") and name in config.generate_presets:
        if dataclasses.asdict(config.generate_presets[name]) != preset:
            keys.append(f"generate_presets.{name}")
    return keys


def settings_origin(config: Config, meta: Optional[dict], source: Optional[Path],
                    keys: Optional[Set[str]]) -> Dict[str, Any]:
    """Where an evaluation's eval settings come from, as metrics.json's ``eval.settings_from`` records it.

    Args:
        config: the config evaluated (for ``train``: the run's; for ``eval``: after :func:`restore_eval`).
        meta: the adapter's ``qwenft.json`` (None: no adapter, or one without the file).
        source: the path of that ``qwenft.json``.
        keys: the typed keys (:func:`qwenft.model.adapter.typed_keys`); None: a library call.

    Returns:
        ``{"from", "file", "typed", "not_recorded", "differs", "why"}``: ``from`` is ``run`` (``train``: this
        run's own config, which it records), ``adapter`` (the settings the adapter's run recorded, ``typed``:
        the ``eval.*`` / ``generate_presets.NAME.*`` keys typed on top, ``not_recorded``: keys of this version's
        eval section the record lacks, taken from this command) or ``command`` (this command's settings;
        ``why`` says why, ``differs`` the keys in which they differ from a record).
    """
    origin: Dict[str, Any] = {"from": "command", "file": str(source) if source else None, "typed": [],
                              "not_recorded": [], "differs": [], "why": ""}
    if config.command == "train":
        return dict(origin, **{"from": "run", "file": str(Path(config.out_dir) / "adapter" / "qwenft.json"),
                               "why": "this run's config, recorded beside its adapter for a later eval"})
    recorded = _recorded(meta or {})
    if not config.adapter:
        return dict(origin, why="no adapter")
    if recorded is None:
        return dict(origin, why="the adapter's qwenft.json records no eval settings: an older run, or another "
                                "tool")
    if keys is None:
        return dict(origin, why="a library call: the caller's config")
    groups = [g for g in TYPED_GROUPS if g in keys]
    if groups:
        typed = " and ".join("+recipe=" if g == "recipe" else "eval=" for g in groups)
        return dict(origin, differs=_differs(config, recorded, (meta or {}).get("eval_preset")),
                    why=f"{typed} typed: that config's eval settings, not the ones the adapter's run recorded")
    name = config.eval.generate
    typed = [f"eval.{'.'.join(p)}" for p in _typed_paths(keys, "eval")]
    if "eval.generate" not in typed and isinstance((meta or {}).get("eval_preset"), dict):
        typed += [f"generate_presets.{name}.{'.'.join(p)}" for p in _typed_paths(keys, f"generate_presets.{name}")]
    not_recorded = [f"eval.{f.name}" for f in dataclasses.fields(EvalConfig) if f.name not in recorded
                    and f.name not in NOT_RESTORED]
    return dict(origin, **{"from": "adapter", "typed": typed, "not_recorded": not_recorded,
                           "why": "the settings the adapter's run recorded"})


def restore_eval(config: Config, meta: dict, source: Path, keys: Optional[Set[str]]) -> Config:
    """``eval`` of an adapter: the eval settings its run recorded (``meta``, its ``qwenft.json``: ``eval`` and
    ``eval_preset``), then the keys typed on top.

    The rule, as :func:`qwenft.model.adapter.eval_data`'s for the data: a typed ``+recipe=`` or ``eval=NAME`` means
    that config's eval section is used (a warning names the keys in which it differs from the record); a typed
    ``eval.KEY`` (or ``eval.gates.NAME...``, only that entry) wins over the recorded value; with the recorded preset
    (``eval.generate`` not typed) its recorded values are used, a typed ``generate_presets.NAME.KEY`` on top.
    :data:`NOT_RESTORED` keys and keys the record lacks (an older run) are this command's. No record, or ``keys``
    None (a library call): ``config`` as it is.

    Raises:
        QwenftError: recorded values that are not a valid eval section or preset, or recorded settings that do
            not fit this command's data (a gate naming a source it does not evaluate), naming ``source``.
    """
    recorded = _recorded(meta)
    if recorded is None or keys is None:
        config.check_gates()  # this command's gates against the data evaluated (not checked at composition)
        return config
    if any(g in keys for g in TYPED_GROUPS):
        differs = _differs(config, recorded, meta.get("eval_preset"))
        if differs:
            log.warning("NOT THE RUN'S EVAL SETTINGS: %s typed, so this evaluation uses that config's eval section, "
                        "which differs from what the adapter's run recorded (%s) in %s; drop it to reproduce the run's "
                        "verdict", " and ".join("+recipe=" if g == "recipe" else "eval=" for g in TYPED_GROUPS
                                                if g in keys), source, ", ".join(differs))
        config.check_gates()
        return config
    current = dataclasses.asdict(config.eval)
    known = {f.name for f in dataclasses.fields(EvalConfig)}
    values = {k: copy.deepcopy(v) for k, v in recorded.items() if k in known and k not in NOT_RESTORED}
    values.update({k: current[k] for k in known if k not in values})  # not restored, or not recorded
    if isinstance(values.get("gates"), dict):  # a recorded gate of a judge this eval does not run: dropped
        from qwenft.config.gates import JUDGE_ITEMS, judge_items

        absent = set(JUDGE_ITEMS.values()) - set(judge_items(config.eval.judge))
        values["gates"] = {k: v for k, v in values["gates"].items() if k not in absent}
    for path in _typed_paths(keys, "eval"):  # a typed judge gate stays, and is refused below without its judge
        _overlay(values, current, path)
    values["judge"] = config.eval.judge  # never restored (NOT_RESTORED): this command's, typed or not
    unknown = sorted(set(recorded) - known)
    if unknown:
        log.info("%s: eval settings this version does not know, ignored: %s", source, ", ".join(unknown))
    try:
        eval_config = EvalConfig(**values)
    except (ConfigError, TypeError) as exc:
        raise QwenftError(f"{source}: 'eval' is not a valid eval section ({exc})") from None
    presets = dict(config.generate_presets)
    preset = meta.get("eval_preset")
    name = eval_config.generate
    if "eval.generate" not in keys and isinstance(preset, dict) and name == recorded.get("generate"):
        own = dataclasses.asdict(presets[name]) if name in presets else {}
        fields = {f.name for f in dataclasses.fields(GenerateConfig)}
        preset_values = {**own, **{k: copy.deepcopy(v) for k, v in preset.items() if k in fields}}
        for path in _typed_paths(keys, f"generate_presets.{name}"):
            _overlay(preset_values, own, path)
        try:
            presets[name] = GenerateConfig(**preset_values)
        except (ConfigError, TypeError) as exc:
            raise QwenftError(f"{source}: 'eval_preset' is not a valid preset {name!r} ({exc})") from None
    try:
        restored = dataclasses.replace(config, eval=eval_config, generate_presets=presets)
        restored.check_gates()
    except ConfigError as exc:
        if any(k.startswith(("eval.gates", "eval.targets", "eval.judge")) for k in keys):
            raise  # the user's own gate or target: the one line names it
        raise QwenftError(f"{source}: the eval settings the adapter's run recorded do not fit this evaluation "
                          f"({exc}); type the keys to change (eval.gates=...), or eval=default for this command's "
                          "eval settings") from None
    origin = settings_origin(restored, meta, source, keys)
    log.info("eval settings from the adapter's %s (what its run used)%s", source.name,
             f"; typed on top: {', '.join(origin['typed'])}" if origin["typed"] else "")
    return restored
