"""From Hydra's composed ``DictConfig`` to the typed :class:`~qwenft.config.Config`, once, at the entry: unknown
keys named with the key meant, OmegaConf's messages in one line, literal ``${`` kept."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, List, Optional, Sequence

from qwenft.config.base import ConfigError
from qwenft.config.schema import Config


def _unknown_keys(node: Any, schema_type: Any, prefix: str) -> List[str]:
    """Keys of ``node`` that ``schema_type`` does not define, as dotted paths.

    ``node``: the composed config as plain containers (``OmegaConf.to_container(cfg, resolve=False)``), in which an
    interpolation is still its ``${...}`` text and a missing value ``???``: neither is looked into, nor is None.
    """
    found: List[str] = []
    if dataclasses.is_dataclass(schema_type) and isinstance(node, dict):
        fields = {f.name: f for f in dataclasses.fields(schema_type)}
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in fields:
                found.append(unknown_key_message(path))
                continue
            found.extend(_unknown_keys(value, _field_type(schema_type, str(key)), path))
    elif isinstance(node, list) and getattr(schema_type, "__origin__", None) in (list, List):
        (item_type,) = schema_type.__args__
        for i, item in enumerate(node):
            found.extend(_unknown_keys(item, item_type, f"{prefix}[{i}]"))
    return found


# Names other tools use for a key (peft, transformers' TrainingArguments, torchtune, axolotl) -> qwenft's name.
KEY_ALIASES = {"rank": "r", "lora_r": "r", "alpha": "lora_alpha", "dropout": "lora_dropout",
               "learning_rate": "lr", "num_train_epochs": "epochs", "num_epochs": "epochs",
               "per_device_train_batch_size": "batch_size", "micro_batch_size": "batch_size",
               "gradient_accumulation": "grad_accum", "gradient_accumulation_steps": "grad_accum",
               "max_length": "max_seq_len", "sequence_len": "max_seq_len", "seq_len": "max_seq_len",
               "max_tokens": "max_new_tokens", "topk": "top_k", "topp": "top_p", "minp": "min_p"}


def unknown_key_message(path: str) -> str:
    """One line for a key the schema does not define: a likely intended key (another tool's name for it, or a
    close spelling) and the keys accepted at that level, e.g. ``unknown key 'lora.alpha'; did you mean
    lora.lora_alpha? accepted keys in lora: r, lora_alpha, ...``."""
    import difflib

    parts = [p for p in re.split(r"\.|(?=\[)", path) if p]  # data.sources[0].x -> data, sources, [0], x
    cls: Any = Config
    for part in parts[:-1]:
        if part.startswith("[") or part.isdigit():  # a list index: the item type
            cls = cls.__args__[0] if getattr(cls, "__origin__", None) in (list, List) else None
            continue
        if not dataclasses.is_dataclass(cls) or part not in {f.name for f in dataclasses.fields(cls)}:
            return f"unknown key '{path}'"
        cls = _field_type(cls, part)
    if not dataclasses.is_dataclass(cls):
        return f"unknown key '{path}'"
    names = [f.name for f in dataclasses.fields(cls)]
    last = parts[-1]
    if cls is Config:  # a bare key: the section that has it (lr -> train.lr)
        wanted = KEY_ALIASES.get(last, last)
        sections = {n: _field_type(Config, n) for n in names if dataclasses.is_dataclass(_field_type(Config, n))}
        homes = [f"{n}.{wanted}" for n, t in sections.items() if wanted in {f.name for f in dataclasses.fields(t)}]
        if homes:
            return (f"unknown key '{path}' (did you mean {' or '.join(homes)}?); keys live in sections: "
                    f"{', '.join(sections)}")
    prefix = path[: len(path) - len(last)].rstrip(".")
    guess = KEY_ALIASES.get(last) if KEY_ALIASES.get(last) in names else None
    guess = guess or next(iter(difflib.get_close_matches(last, names, n=1, cutoff=0.6)), None)
    hint = f" (did you mean {prefix + '.' if prefix else ''}{guess}?)" if guess else ""
    return f"unknown key '{path}'{hint}; accepted keys{' in ' + prefix if prefix else ''}: {', '.join(names)}"


def _field_type(cls: Any, name: str) -> Any:
    import typing

    hints = typing.get_type_hints(cls)
    hint = hints[name]
    # Optional[X] -> X
    if getattr(hint, "__origin__", None) is typing.Union:
        args = [a for a in hint.__args__ if a is not type(None)]
        hint = args[0] if len(args) == 1 else hint
    return hint


def escape_interpolations(tree: Any) -> Any:
    """Escape ``${`` in already-resolved strings, so the structured merge does not resolve them a second time.

    After ``to_container(resolve=True)`` a ``${`` left in a string is literal text (e.g. a prompt about shell
    variables); OmegaConf reads ``\\${`` as a literal ``${``.
    """
    if isinstance(tree, dict):
        return {key: escape_interpolations(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [escape_interpolations(value) for value in tree]
    if isinstance(tree, str) and "${" in tree:  # backslashes right before it pair up in OmegaConf's grammar
        return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", tree)
    return tree


def to_config(cfg: Any) -> Config:
    """Validate a composed OmegaConf config and convert it to :class:`Config`.

    Rejects keys the schema does not define however they arrived (``+key=value`` included), wrong
    types and impossible values.

    Raises:
        ConfigError: with one line naming the offending key and what is accepted.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    problems = _unknown_keys(OmegaConf.to_container(cfg, resolve=False), Config, "")
    if problems:
        raise ConfigError(problems[0])
    plain = None
    try:
        plain = escape_interpolations(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True))
        _check_presets(plain)
        merged = OmegaConf.merge(OmegaConf.structured(Config), plain)
        return OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except OmegaConfBaseException as exc:  # type errors from the structured merge
        raise ConfigError(source_message(plain) or omegaconf_message(exc)) from None


def _check_presets(plain: Any) -> None:
    """Check each sampler preset of ``generate_presets`` on its own, so that an impossible value is named by its own
    key (``generate_presets.precise.max_new_tokens``), not by the ``generate`` section's whose checks it shares.

    Raises:
        ConfigError: one line naming the preset's key.
    """
    from omegaconf import OmegaConf

    from qwenft.config.generate import GenerateConfig

    presets = plain.get("generate_presets") if isinstance(plain, dict) else None
    for name, preset in (presets or {}).items():
        try:
            OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(GenerateConfig), preset))
        except ConfigError as exc:
            text = str(exc)
            raise ConfigError(f"generate_presets.{name}.{text.removeprefix('generate.')}"
                              if text.startswith("generate.") else text) from None


def source_message(plain: Any) -> Optional[str]:
    """The error of the first ``data.sources`` entry of ``plain`` that does not merge into :class:`DataSource`,
    its key written in full (``data.sources.0.max_rows``: OmegaConf names a list item's key alone); else None."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from qwenft.config.data import DataSource

    sources = (plain.get("data") or {}).get("sources") if isinstance(plain, dict) else None
    for index, source in enumerate(sources if isinstance(sources, list) else []):
        try:
            OmegaConf.merge(OmegaConf.structured(DataSource), source)
        except OmegaConfBaseException as exc:
            message = omegaconf_message(exc)
            key = getattr(exc, "full_key", None)
            return f"data.sources.{index}.{message}" if key and message.startswith(f"{key}: ") else message
        except ConfigError:  # a value check of DataSource itself: reported by the whole merge the same way
            return None
    return None


def omegaconf_message(exc: BaseException) -> str:
    """One line from an OmegaConf error: the full key and the reason."""
    key = getattr(exc, "full_key", None)  # OmegaConfBaseException's
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if key and names_an_unknown_key(first):  # suggest the intended one
        return unknown_key_message(str(key))
    if key and "is not a ListConfig, list or tuple" in first:  # OmegaConf's words for a single value given a list
        value = getattr(exc, "value", None)
        return f"{key}={value}: a list is expected, in brackets: {key}=[{value}]"
    if key:
        return f"{key}: {first}"
    return first


def names_an_unknown_key(message: str) -> bool:
    """Whether the first line of an OmegaConf error is about a key its typed or struct config does not have.

    Only the wording tells: OmegaConf 2.3 (``DictConfig._validate_get``) raises it as ``ConfigAttributeError`` or
    ``ConfigKeyError``, "Key 'k' not in 'LoraConfig'" (typed) or "Key 'k' is not in struct", and the same classes
    carry other failures too ("Missing key k", "Key not found: 'k'").
    """
    return re.match(r"Key '[^']*' (is )?not in", message) is not None


def sources_override_message(overrides: Sequence[str]) -> Optional[str]:
    """The error of a ``data.sources=[...]`` override's entry that is not a valid source, its key in full
    (``data.sources.0.max_rows: ...``; Hydra names a list item's key alone), else None."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for item in overrides:
        if item.partition("=")[0].lstrip("+~") != "data.sources":
            continue
        try:
            value = OverridesParser.create().parse_override(item).value()
        except Exception:  # not parsable: the compose error says so
            return None
        return source_message({"data": {"sources": value}})
    return None
