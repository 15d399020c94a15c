"""The doctor's checks inside ``qwenft train`` and ``qwenft merge``: on what they load (the base, an adapter: the
findings logged as warnings) and on what they write (the adapter, the merged directory and its GGUF: logged too, and
refused when qwenft itself would have made it wrong).

What is refused: :data:`OWN_FAULTS` found in what was written and not already in what was loaded (a fault the base
brings along is the base's, warned about at load; the same fault appearing in qwenft's output is qwenft's bug, and
the output would be silently wrong: a model that never stops, an output layer lost on reload).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable, Optional, Set

from qwenft.config import QwenftError
from qwenft.doctor.findings import Report

log = logging.getLogger("qwenft.doctor")

# The codes whose presence in qwenft's own output would be qwenft's bug (each is set or checked where it is written:
# qwenft.chat.set_end_tokens, qwenft.export.build.save_merged / retie_, qwenft.export.gguf_file.write_gguf)
OWN_FAULTS = frozenset({"eos-missing-im-end", "quantization-config-leftover", "tied-lm-head-differs",
                        "lm-head-missing", "tokens-beyond-rows", "embedding-rows-shrunk", "rope-scaling-inconsistent",
                        "rope-theta-lost", "rope-gguf-mismatch", "gguf-special-token-type", "gguf-special-token-id", "gguf-eos-not-end",
                        "template-missing"})

# Not warned about at load: what qwenft sets right in everything it writes (the stop list, a generation_config),
# and what `merge` and `eval` already say in their own words (vLLM's rules)
FIXED_ON_WRITE = frozenset({"eos-missing-im-end", "generation-config-missing", "vllm-lora-unsupported"})


class DoctorRefused(QwenftError):
    """What qwenft wrote has a fault it must never have (:data:`OWN_FAULTS`)."""


def check_loaded(path, what: str) -> Set[str]:
    """Run the doctor on a directory a command loads; log its findings as warnings (but :data:`FIXED_ON_WRITE`).

    Args:
        path: the base's directory or an adapter directory; a hub id or a missing path is skipped.
        what: how the log names it (``the base``, ``the adapter``).

    Returns:
        The codes found (every one, for :func:`check_written`'s ``inherited``); empty when not checked.
    """
    from qwenft.doctor.command import diagnose

    local = Path(str(path)).expanduser()
    if not local.exists():
        return set()
    try:
        report = diagnose(local)
    except QwenftError as exc:  # the loader itself says what it cannot read
        log.debug("doctor: %s not checked (%s)", what, exc)
        return set()
    for finding in report.findings:
        if finding.code not in FIXED_ON_WRITE:
            log.warning("doctor on %s (%s): %s", what, local, finding.line())
    return set(report.codes())


def check_written(path, what: str, inherited: Optional[Iterable[str]] = None) -> Report:
    """Run the doctor on a directory a command wrote; log its findings as warnings.

    Args:
        path: the adapter or merged directory (still under its temporary name: nothing is published yet).
        what: how messages name it (``the merged model``, ``the adapter``).
        inherited: codes found on what was loaded (:func:`check_loaded`); not refused when found again, but
            :data:`FIXED_ON_WRITE` (qwenft writes those right whatever it loaded).

    Raises:
        DoctorRefused: a code of :data:`OWN_FAULTS` that is not inherited; the message names the codes.
    """
    from qwenft.doctor.command import diagnose

    report = diagnose(Path(path))
    for finding in report.findings:
        log.warning("doctor on %s: %s", what, finding.line())
    base_faults = set(inherited or ()) - FIXED_ON_WRITE  # qwenft fixes these whatever the base had
    own = [f for f in report.findings if f.code in OWN_FAULTS and f.code not in base_faults]
    if own:
        raise DoctorRefused(f"{what} would be written with {'; '.join(f'{f.code}: {f.message}' for f in own)}; "
                            "nothing was published. This is a bug in qwenft: please report it with this line")
    return report
