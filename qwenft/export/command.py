"""``python -m qwenft merge adapter=PATH out=DIR``: :func:`qwenft.export.merge.merge`, with its exit codes."""

from __future__ import annotations

import sys

from qwenft.config import Config
from qwenft.export.gguf_quant import QuantizeError
from qwenft.export.merge import merge
from qwenft.export.verify import VerificationError


def merge_command(config: Config) -> None:
    """Entry point of ``python -m qwenft merge``: exit 0 when verified, 1 when the check fails, 2 on a user
    error (raised as :class:`QwenftError` for the CLI to print)."""
    try:
        merge(config)
    except VerificationError as exc:
        print(f"qwenft: error: merge verification failed, nothing written: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except QuantizeError as exc:  # the merge and the artifacts finished before it stay
        print(f"qwenft: error: merge.quantize failed: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
