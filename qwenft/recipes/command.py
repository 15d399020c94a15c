"""``qwenft recipes``: list the built-in recipes, and copy one out to edit (as torchtune's ``tune cp`` does).

::

    qwenft recipes                          # each recipe with the first line of its header comment
    qwenft recipes cp quickstart my/        # -> my/quickstart.yaml; run it: +recipe=my/quickstart.yaml
    qwenft recipes cp quickstart mine.yaml  # a file name of your choosing; --force overwrites an existing file
    qwenft recipes cp sweeps/lora_rank .    # a W&B sweep spec (wandb sweep lora_rank.yaml)

The recipes are the package's own (:func:`qwenft.resources.recipe_dir`), so this works from any directory after
``pip install``. The copy names the project's data as ``${qwenft_root:}/data/...``, which stays valid wherever it is.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import List, Optional, Sequence

from qwenft.config import QwenftError
from qwenft.files import atomic_write_bytes
from qwenft.resources import available_recipes, recipe_dir

SWEEPS = "sweeps"  # recipes/sweeps/: W&B sweep specs, copied as sweeps/NAME


def summary(path: Path) -> str:
    """The first line of a recipe's header comment (its ``# @package`` line skipped); empty when it has none."""
    for line in path.read_text(encoding="utf-8").splitlines():
        text = line.strip()
        if not text.startswith("#"):
            break
        text = text.lstrip("#").strip()
        if text and not text.startswith("@package"):
            return text.rstrip(":")
    return ""


def sweep_names() -> List[str]:
    """The W&B sweep specs under ``recipes/sweeps/``, as ``sweeps/NAME``."""
    return sorted(f"{SWEEPS}/{p.stem}" for p in (recipe_dir() / SWEEPS).glob("*.yaml"))


def listing() -> str:
    """What ``qwenft recipes`` prints: each recipe (and sweep spec) with its one-line summary."""
    names = available_recipes()
    sweeps = sweep_names()
    width = max(map(len, names + sweeps), default=0)
    lines = ["recipes (python -m qwenft train +recipe=NAME; a copy to edit: qwenft recipes cp NAME DIR):"]
    lines += [f"  {name:<{width}}  {summary(recipe_dir() / f'{name}.yaml')}" for name in names]
    if sweeps:
        lines.append("W&B sweep specs (qwenft recipes cp sweeps/NAME DIR, then: wandb sweep NAME.yaml):")
        lines += [f"  {name:<{width}}  {summary(recipe_dir() / f'{name}.yaml')}" for name in sweeps]
    return "\n".join(lines)


def copy_recipe(name: str, dest: str, force: bool = False) -> Path:
    """Copy the built-in recipe ``name`` (or ``sweeps/NAME``) to ``dest``: a ``.yaml`` / ``.yml`` file name, or
    a folder (made if missing) that gets ``NAME.yaml``. Written through a temporary file and a rename.

    Returns:
        The path written.

    Raises:
        QwenftError: an unknown recipe (the available ones listed), or ``dest`` already holds that file and
            ``force`` is not set; one line naming the recipe and the path.
    """
    if name not in available_recipes() + sweep_names():
        raise QwenftError(f"recipes cp: unknown recipe '{name}'; available recipes: "
                          f"{', '.join(available_recipes() + sweep_names())}")
    source = recipe_dir() / f"{name}.yaml"
    target = Path(dest).expanduser()
    if not dest.endswith((".yaml", ".yml")):
        target = target / source.name
    if target.is_dir():
        raise QwenftError(f"recipes cp {name}: {target} is a directory; give a folder or a .yaml file name")
    if target.exists() and not force:
        raise QwenftError(f"recipes cp {name}: {target} already exists; add --force to overwrite it")
    try:
        return atomic_write_bytes(target, source.read_bytes())
    except QwenftError as exc:  # a parent of dest is a file
        raise QwenftError(f"recipes cp {name}: {exc}") from None
    except OSError as exc:
        raise QwenftError(f"recipes cp {name}: cannot write {target} ({exc.strerror or type(exc).__name__})") from None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, through the CLI's error path, not argparse's usage block
        raise QwenftError(f"recipes: {message} (usage: qwenft recipes [cp NAME DIR [--force]])")


def recipes_command(argv: Optional[Sequence[str]] = None) -> None:
    """``qwenft recipes [cp NAME DEST [--force]]``: print the listing, or copy one recipe and say how to run it.

    Raises:
        QwenftError: bad arguments, or what :func:`copy_recipe` raises.
    """
    parser = _Parser(prog="qwenft recipes", description="List the built-in recipes, or copy one to edit.")
    sub = parser.add_subparsers(dest="action")
    cp = sub.add_parser("cp", help="copy a recipe to edit", description="Copy a built-in recipe to edit.")
    cp.add_argument("name", help="a recipe (qwenft recipes lists them) or sweeps/NAME")
    cp.add_argument("dest", help="a folder (NAME.yaml is written in it) or a .yaml file name")
    cp.add_argument("-f", "--force", action="store_true", help="overwrite an existing file")
    args = parser.parse_args(list(argv or []))
    if args.action is None:
        print(listing())
        return
    target = copy_recipe(args.name, args.dest, force=args.force)
    run = f"wandb sweep {target}" if args.name.startswith(f"{SWEEPS}/") else f"python -m qwenft train +recipe={target}"
    print(f"copied recipe '{args.name}' to {target}; run it with: {run}")
