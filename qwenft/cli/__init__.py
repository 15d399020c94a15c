"""The command line, ``python -m qwenft COMMAND [overrides]``: :mod:`~qwenft.cli.dispatch` (the command table, the
checks before Hydra, the run under ``@hydra.main``), :mod:`~qwenft.cli.overrides` (Hydra's flags and the spellings
its grammar refuses), :mod:`~qwenft.cli.recipe_files` (``+recipe=NAME`` or a file), :mod:`~qwenft.cli.compose`
(the config composed and validated before anything loads), :mod:`~qwenft.cli.rundir` (a refused command's run
directory left as it was), :mod:`~qwenft.cli.usage` (``COMMAND --help``) and :mod:`~qwenft.cli.grid` (a ``-m``
grid's index).

The entry room: it may import any room; no room imports it.
"""

from qwenft.cli.dispatch import main

__all__ = ["main"]
