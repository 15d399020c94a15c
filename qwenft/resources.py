"""Where qwenft's own files are: the Hydra config tree (``conf/``), the recipes (``recipes/``, which ``conf/recipe``
links to, so Hydra finds ``+recipe=NAME`` as an option of the ``recipe`` group) and the project's data (``data/``).

They stay at the top of the repository. A wheel carries them as package data under ``qwenft/_project/`` with the
same layout (pyproject.toml maps ``conf/`` and ``data/`` onto the packages ``qwenft._project.conf`` and
``qwenft._project.data``; the recipes go with ``conf/recipe``); they are found there through
:mod:`importlib.resources`, or beside the package in a checkout (an editable install, or ``PYTHONPATH``).
Every other module asks this one.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path
from typing import List

from qwenft.config import QwenftError


@functools.lru_cache(maxsize=None)
def project_root() -> Path:
    """The folder that holds ``conf/`` (with ``conf/recipe/``) and ``data/``: ``qwenft/_project`` in an installed
    wheel, else the checkout the package is imported from. ``${qwenft_root:}`` in a config is this folder.

    Raises:
        QwenftError: neither exists (a package built without its data).
    """
    packaged = resources.files("qwenft") / "_project"
    if packaged.is_dir():  # a regular package on disk: files() is a pathlib.Path, as Hydra needs
        return Path(str(packaged))
    checkout = Path(__file__).resolve().parents[1]  # <checkout>/qwenft/resources.py
    if (checkout / "conf" / "config.yaml").is_file():
        return checkout
    raise QwenftError(f"qwenft's config files are missing (no {packaged}, no {checkout / 'conf'}): reinstall qwenft")


def conf_dir() -> Path:
    """The Hydra config tree (``conf/``: ``config.yaml`` and its groups)."""
    return project_root() / "conf"


def recipe_dir() -> Path:
    """The built-in recipes (``recipes/`` in a checkout, reached through its link ``conf/recipe``)."""
    return (conf_dir() / "recipe").resolve()


def available_recipes() -> List[str]:
    """Names accepted by ``+recipe=NAME``: the YAML files directly under :func:`recipe_dir`."""
    return sorted(p.stem for p in recipe_dir().glob("*.yaml"))
