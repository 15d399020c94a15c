"""Recipes named on the command line: ``+recipe=NAME`` checked against the built-in ones, and a recipe file of the
user's own (``+recipe=./my.yaml``) registered in Hydra's ConfigStore so that it composes like a built-in one."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from qwenft.config import ConfigError
from qwenft.resources import available_recipes

log = logging.getLogger("qwenft")


_FILE_RECIPES: Dict[str, Path] = {}  # a recipe file's option name in Hydra's ConfigStore -> the file
_FILE_GROUP = "file"  # ./my.yaml is composed as +recipe=file/my: a name no built-in recipe (recipes/*.yaml) has
_NOTED: set = set()  # built-in recipes whose same-named file in the current directory was pointed out


def recipe_problem(overrides: Sequence[str]) -> Optional[str]:
    """The one-line problem with the ``recipe`` overrides (``recipe=`` without ``+``, an unknown name), else None."""
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "recipe":
            return f"{item}: a recipe is added with a leading +: +recipe={value}"
        if key.lstrip("+~") == "recipe" and value and value not in available_recipes() and value not in _FILE_RECIPES:
            return (f"unknown recipe '{value}' (+recipe={value}); available recipes: {', '.join(available_recipes())}"
                    "; or a recipe file: +recipe=./FILE.yaml")
    return None


def recipe_overrides(overrides: Sequence[str]) -> List[str]:
    """Rewrite ``+recipe=`` so that a recipe file outside the package composes like a built-in one.

    ``+recipe=NAME`` is the built-in ``recipes/NAME.yaml`` or, when there is none, ``NAME.yaml`` in the current
    directory; ``+recipe=PATH`` (a value ending in ``.yaml`` / ``.yml`` or holding a ``/``, relative to the current
    directory or absolute) is that file. A file is registered in Hydra's ConfigStore as the ``recipe`` option
    ``file/<stem>`` (package ``_global_`` unless its ``# @package`` header says otherwise) and the override
    rewritten to it; anything else (a built-in, an unknown name, a sweep ``a,b``) is returned as it was.
    Idempotent.

    Raises:
        ConfigError: the file is missing, not YAML, or not a mapping; one line naming it.
    """
    out = []
    for item in overrides:
        key, _, value = item.partition("=")
        path = _recipe_file(value) if key.startswith("+") and key.lstrip("+") == "recipe" else None
        out.append(f"{key}={_register_recipe_file(path, value)}" if path is not None else item)
    return out

def _recipe_file(value: str) -> Optional[Path]:
    """The file ``+recipe=value`` names, or None for a built-in recipe, an unknown name or a sweep."""
    if not value or "," in value or value in _FILE_RECIPES:
        return None
    if value in available_recipes():
        if Path(f"{value}.yaml").is_file() and value not in _NOTED:  # a copy from `qwenft recipes cp`?
            _NOTED.add(value)
            log.warning(f"+recipe={value} is the built-in recipe; ./{value}.yaml here is not used "
                        f"(+recipe=./{value}.yaml uses it)")
        return None
    if value.endswith((".yaml", ".yml")) or "/" in value or "\\" in value:
        return Path(value).expanduser()
    return next((p for p in (Path(f"{value}.yaml"), Path(f"{value}.yml")) if p.is_file()), None)

def _register_recipe_file(path: Path, value: str) -> str:
    """Load the recipe file ``path`` into Hydra's ConfigStore; returns its option name in the ``recipe`` group."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import DictConfig, OmegaConf

    if path.is_dir():
        raise ConfigError(f"recipe file {value} is a directory (+recipe={value}); name a YAML file in it")
    if not path.is_file():
        hint = next((f"; did you mean +recipe={value}{ext}?" for ext in (".yaml", ".yml")
                     if Path(f"{path}{ext}").is_file()), "")
        raise ConfigError(f"recipe file {value} not found (+recipe={value}, resolved to {path.resolve()}){hint}; "
                          f"built-in recipes: {', '.join(available_recipes())}")
    try:
        text = path.read_text(encoding="utf-8")
        node = OmegaConf.create(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"recipe file {path}: cannot be read ({exc})") from None
    except Exception as exc:  # PyYAML's MarkedYAMLError says where; OmegaConf's own errors are one line
        mark = getattr(exc, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
        raise ConfigError(f"recipe file {path}{where}: not valid YAML ({problem})") from None
    if not isinstance(node, DictConfig) or not len(node):  # an empty file would silently run the defaults
        raise ConfigError(f"recipe file {path}: expected a mapping of config keys, as recipes/*.yaml hold")
    leading = re.match(r"(\s*#[^\n]*\n)*", text).group(0)  # Hydra reads the header in the leading comments only
    header = re.search(r"^\s*#\s*@package\s+(\S+)", leading, re.MULTILINE)
    option = re.sub(r"[^A-Za-z0-9_-]", "_", path.stem)  # a plain name for Hydra's override grammar
    ConfigStore.instance().store(group=f"recipe/{_FILE_GROUP}", name=option, node=node,
                                 package=header.group(1) if header else "_global_")
    _FILE_RECIPES[f"{_FILE_GROUP}/{option}"] = path.resolve()
    return f"{_FILE_GROUP}/{option}"


def where_in_recipe_file(message: str, overrides: Sequence[str]) -> str:
    """`` (in recipe file PATH)`` when the key a validation message names is set by a recipe file in use, else ''."""
    from omegaconf import OmegaConf

    found = re.match(r"([A-Za-z0-9_.]+)[:=]", message) or re.search(r"key '([A-Za-z0-9_.\[\]]+)'", message)
    if not found:
        return ""
    key = found.group(1)
    for item in overrides:
        option = item.partition("=")[2]
        path = _FILE_RECIPES.get(option)
        if path is None:
            continue
        try:
            node = OmegaConf.load(path)
        except Exception:  # read when registered; a file changed since is not worth a second error
            continue
        top = key.split(".")[0]
        if top in node and (OmegaConf.select(node, key, default=None) is not None or "." not in key):
            return f" (in recipe file {path})"
    return ""
