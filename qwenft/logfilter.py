"""Known-harmless log lines of the stack, turned into debug lines (installed by ``import qwenft``).

bitsandbytes 0.50 tries, on a CPU with AVX512-BF16, to load an optional 4-bit matmul kernel from the ``kernels``
package when it is imported, and logs a WARNING when that package is not installed ("Failed to load CPU
gemm_4bit_forward from kernels-community: No module named 'kernels'. Please make sure you already `pip install
kernels` ..."); it then uses its own CPU kernel. Every command printed that line before its own output, where it
reads like a failure. Only that exact case (the package absent) is demoted; any other failure to load the kernel,
and every other bitsandbytes message, is logged as bitsandbytes logs it.
"""

from __future__ import annotations

import logging

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
