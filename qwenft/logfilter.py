"""What reaches the user's streams: known-harmless log lines of the stack turned into debug lines (installed by
``import qwenft``), and the console a command prints its result on (:func:`result_console`).

bitsandbytes 0.50 tries, on a CPU with AVX512-BF16, to load an optional 4-bit matmul kernel from the ``kernels``
package when it is imported, and logs a WARNING when that package is not installed ("Failed to load CPU
gemm_4bit_forward from kernels-community: No module named 'kernels'. Please make sure you already `pip install
kernels` ..."); it then uses its own CPU kernel. Every command printed that line before its own output, where it
reads like a failure. Only that exact case (the package absent) is demoted; any other failure to load the kernel,
and every other bitsandbytes message, is logged as bitsandbytes logs it.
"""

from __future__ import annotations

import logging
import os

BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"  # the module that logs it, at import
KERNELS_MISSING = "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'"


class OptionalKernelsMissing(logging.Filter):
    """Turns bitsandbytes' "kernels package not installed" warning into a DEBUG record (dropped unless its logger
    is enabled for DEBUG); passes every other record unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(KERNELS_MISSING):
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_known_warnings() -> None:
    """Install :class:`OptionalKernelsMissing` on bitsandbytes' CPU logger (idempotent). It must run before
    bitsandbytes is imported, which logs the line at import; ``qwenft/__init__.py`` calls it."""
    logger = logging.getLogger(BNB_CPU_LOGGER)
    if not any(isinstance(f, OptionalKernelsMissing) for f in logger.filters):
        logger.addFilter(OptionalKernelsMissing())


WIDE = 10_000  # columns of a result printed to a file or a pipe without COLUMNS: no table cell cut, no line wrapped


def result_console(**kwargs):
    """The ``rich.console.Console`` a command prints its result (tables, summary lines) on, stdout.

    On a terminal it is rich's own (the terminal's width). Not a terminal (``plan > plan.txt``, a pipe, a log) it is
    ``$COLUMNS`` wide when set, else :data:`WIDE`: rich's default there is 80 columns, which cut table cells to
    ``2.16e…`` and wrapped long lines. The tables add their columns with ``overflow="fold"`` so that a narrow width
    folds a value onto the next line instead of cutting it. ``kwargs`` go to ``Console`` (e.g. ``highlight=False``).
    """
    from rich.console import Console

    console = Console(**kwargs)
    if not console.is_terminal:  # the width read here: rich reads COLUMNS from the os.environ it saw at import,
        columns = os.environ.get("COLUMNS", "").strip()  # which a library that replaced os.environ leaves stale
        console = Console(width=int(columns) if columns.isdigit() else WIDE, **kwargs)
    return console
