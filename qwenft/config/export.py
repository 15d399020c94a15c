"""The ``merge`` section: how an adapter is folded into its base and exported, and which deployable 4-bit (and
8-bit) artifacts are made from the merge (``merge.quantize``, :mod:`qwenft.export.quantize`).

The packages each quantization method needs, at the versions tested (:data:`QUANTIZE_PACKAGES`), are checked here,
when the config is validated: a missing or untested one stops the command with one line (exit 2) before any model
is loaded. Reading a distribution's version imports nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from qwenft.config.base import _check, _check_choice

# merge.quantize: llama.cpp's quantizer on the merge's f16 GGUF, or llm-compressor's W4A16 (compressed-tensors).
GGUF_METHODS = ("gguf-q8_0", "gguf-q6_k", "gguf-q5_k_m", "gguf-q4_k_m")
W4A16_METHODS = ("gptq", "awq")
QUANTIZE_METHODS = GGUF_METHODS + W4A16_METHODS
QUANTIZE_KEYS = ("quantize", "calibration_rows", "calibration_seed")  # what is made from a merge, not how it is made

# The tested versions (docs/merge.md "Installing"; `None`: any version). llm-compressor 0.14.0.1's metadata pins
# transformers<=5.17 and auto-round; qwenft ships transformers 5.24 and the GPTQ/AWQ paths import neither auto-round
# nor anything else it pins, so it is installed with --no-deps (the `quantize` extra brings compressed-tensors and
# loguru, its imports on those paths).
LLAMA_CPP = ("llama-cpp-python", "0.3.36")
QUANTIZE_PACKAGES: Dict[str, List[Tuple[str, Optional[str]]]] = {
    "gguf": [LLAMA_CPP],
    "w4a16": [("llmcompressor", "0.14.0.1"), ("compressed-tensors", "0.19.0"), ("loguru", None)],
}
INSTALL = {"gguf": "pip install 'qwenft[gguf-check]'",
           "w4a16": "pip install 'qwenft[quantize]' && pip install --no-deps llmcompressor==0.14.0.1"}


def method_family(method: str) -> str:
    """``gguf`` for the llama.cpp methods, ``w4a16`` for GPTQ and AWQ."""
    return "gguf" if method in GGUF_METHODS else "w4a16"


def installed_version(distribution: str) -> Optional[str]:
    """The installed version of ``distribution`` (its metadata; nothing imported), or None when it is missing."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def missing_packages(family: str) -> List[str]:
    """The packages of ``family`` (:data:`QUANTIZE_PACKAGES`) that are missing or at an untested version, each as
    ``name==tested (installed: X)`` or ``name (not installed)``; empty when all are as tested."""
    problems = []
    for name, tested in QUANTIZE_PACKAGES[family]:
        have = installed_version(name)
        if have is None:
            problems.append(f"{name}{'==' + tested if tested else ''} (not installed)")
        elif tested is not None and have != tested:
            problems.append(f"{name}=={tested} (installed: {have}, untested)")
    return problems


@dataclass
class MergeConfig:
    """``qwenft merge``: how the adapter is folded into the base and exported (see :mod:`qwenft.export`).

    ``dtype``: of the merged weights. ``base``: for an adapter trained on an NF4 base, ``dequantized`` merges
    into the NF4-dequantized weights (what training saw), ``original`` into the original 16-bit weights.
    ``overwrite``: replace a non-empty ``out``. ``gguf``: also write a llama.cpp GGUF (``f16`` or ``q8_0``).
    ``verify_gguf``: load that GGUF in llama.cpp and compare it with the merged model
    (:mod:`qwenft.export.llama_check`); null = when llama-cpp-python (the ``qwenft[gguf-check]`` extra) is
    installed, true = required (refused here when it is not installed).
    ``quantize``: artifacts made from the finished merge, any of :data:`QUANTIZE_METHODS` (the ``gguf-*`` ones
    from the f16 GGUF, so ``gguf=f16``), each measured against the 16-bit merge (:mod:`qwenft.export.quantize`).
    ``calibration_rows``: training rows of the run GPTQ and AWQ calibrate on (fewer when the run has fewer),
    drawn with ``calibration_seed``.
    """

    dtype: str = "bfloat16"
    max_shard_size: str = "5GB"
    overwrite: bool = False
    base: str = "dequantized"
    gguf: str = "none"
    verify_gguf: Optional[bool] = None
    quantize: List[str] = field(default_factory=list)
    calibration_rows: int = 128
    calibration_seed: int = 0

    def __post_init__(self) -> None:
        _check_choice("merge.dtype", self.dtype, ("bfloat16", "float16", "float32"))
        _check_choice("merge.base", self.base, ("dequantized", "original"))
        kquant = "gguf-" + self.gguf.removeprefix("gguf-")  # merge.gguf=q4_k_m: a K-quant asked for in the wrong key
        _check(self.gguf in ("none", "f16", "q8_0"), "merge.gguf", self.gguf, "choose one of: none, f16, q8_0" + (
            f" (a {kquant[5:]} GGUF is made from the f16 one: merge.gguf=f16 'merge.quantize=[{kquant}]')"
            if kquant in GGUF_METHODS else ""))
        if self.verify_gguf:
            import importlib.util

            _check(self.gguf != "none", "merge.verify_gguf", self.verify_gguf,
                   "it checks the GGUF file: also pass merge.gguf=f16 or merge.gguf=q8_0")
            _check(importlib.util.find_spec("llama_cpp") is not None, "merge.verify_gguf", self.verify_gguf,
                   "llama-cpp-python is not installed: pip install 'qwenft[gguf-check]' (builds llama.cpp, "
                   "minutes), or pass merge.verify_gguf=null")
        _check(re.fullmatch(r"[0-9]+(KB|MB|GB|KiB|MiB|GiB)", self.max_shard_size) is not None, "merge.max_shard_size",
               self.max_shard_size, "must be an integer and a unit: KB, MB, GB, KiB, MiB or GiB (e.g. 5GB)")
        _check(self.calibration_rows >= 1, "merge.calibration_rows", self.calibration_rows, "must be >= 1")
        self._check_quantize()

    def _check_quantize(self) -> None:
        for method in self.quantize:
            _check_choice("merge.quantize", method, QUANTIZE_METHODS)
        _check(len(set(self.quantize)) == len(self.quantize), "merge.quantize", self.quantize,
               "names a method twice")
        ggufs = [m for m in self.quantize if m in GGUF_METHODS]
        why = "no GGUF is written (merge.gguf=none)" if self.gguf == "none" else \
            f"llama.cpp warns that requantizing a {self.gguf} GGUF loses quality"
        _check(not ggufs or self.gguf == "f16", "merge.quantize", ggufs[0] if ggufs else None,
               f"llama.cpp quantizes the merge's f16 GGUF and {why}: also pass merge.gguf=f16 (a finished merge "
               "without it is redone: add merge.overwrite=true)")
        for family in dict.fromkeys(method_family(m) for m in self.quantize):
            problems = missing_packages(family)
            methods = [m for m in self.quantize if method_family(m) == family]
            _check(not problems, "merge.quantize", methods[0] if len(methods) == 1 else methods,
                   f"needs {', '.join(problems)}: {INSTALL[family]}")
