"""What ``qwenft doctor`` reads: which kind of artifact PATH is, and its metadata (JSON files, the tokenizer's facts,
safetensors headers), without loading any weights.

A safetensors file starts with an 8-byte little-endian header length, then a JSON header naming every tensor's dtype,
shape and byte range (huggingface/safetensors, "Format"); doctor reads only that header, and for one check the bytes
of two tensors, in chunks.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from qwenft.chat import END_OF_TEXT, IM_END, IM_START
from qwenft.config import QwenftError

MAX_HEADER = 100 << 20  # bytes: a safetensors header beyond this is a corrupt file (real ones are under 1 MB)
GGUF_MAGIC = b"GGUF"


def read_json(path: Path, required: bool = True) -> Optional[dict]:
    """A JSON object file; None when it is absent and not ``required``.

    Raises:
        QwenftError: the file is missing (``required``), unreadable, not JSON or not an object; one line naming it.
    """
    if not path.is_file():
        if required:
            raise QwenftError(f"{path}: missing")
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise QwenftError(f"{path}: not readable as JSON ({exc})") from None
    if not isinstance(value, dict):
        raise QwenftError(f"{path}: not a JSON object")
    return value


@dataclass
class Tensor:
    """One tensor of a safetensors file: ``dtype`` (``BF16``, ``F32``, ``U8`` ...), ``shape``, where its bytes are."""

    dtype: str
    shape: List[int]
    file: Path
    start: int  # absolute byte offset of its data in ``file``
    end: int


def safetensors_header(path: Path) -> Dict[str, Tensor]:
    """The tensors a safetensors file holds, from its header alone.

    Raises:
        QwenftError: not a safetensors file (too short, a header length past the file, not JSON).
    """
    try:
        with open(path, "rb") as handle:
            raw = handle.read(8)
            size = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if size < 2 or size > min(MAX_HEADER, path.stat().st_size - 8):
                raise QwenftError(f"{path}: not a safetensors file (header length {size})")
            header = json.loads(handle.read(size))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise QwenftError(f"{path}: not a readable safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise QwenftError(f"{path}: not a safetensors file (its header is not a JSON object)")
    tensors = {}
    for name, item in header.items():
        if name == "__metadata__" or not isinstance(item, dict):
            continue
        begin, end = item.get("data_offsets", (0, 0))
        tensors[name] = Tensor(str(item.get("dtype")), list(item.get("shape", [])), path, 8 + size + begin,
                               8 + size + end)
    want, have = max((t.end for t in tensors.values()), default=8 + size), path.stat().st_size
    if have < want:  # the header is intact but the data stops early: every read past the end is garbage
        raise QwenftError(f"{path}: truncated: its header promises {want} bytes but the file has {have}: an "
                          "interrupted download or copy?")
    return tensors


def _shards_listed(directory: Path) -> None:
    """Every shard model.safetensors.index.json lists is there.

    Raises:
        QwenftError: a listed shard is missing (the first one named).
    """
    index = read_json(directory / "model.safetensors.index.json", required=False)
    weight_map = (index or {}).get("weight_map")
    if not isinstance(weight_map, dict):
        return
    missing = sorted({str(f) for f in weight_map.values()} - {p.name for p in directory.glob("*.safetensors")})
    if missing:
        raise QwenftError(f"{directory / missing[0]}: missing, though model.safetensors.index.json lists it"
                          + (f" ({len(missing)} shards missing)" if len(missing) > 1 else "")
                          + ": an interrupted download or copy?")


def weight_headers(directory: Path, prefix: str = "") -> Optional[Dict[str, Tensor]]:
    """Every tensor of the safetensors files in ``directory`` (``prefix*.safetensors``); None when it has none."""
    if not prefix:
        _shards_listed(directory)
    files = sorted(directory.glob(f"{prefix}*.safetensors"))
    if not files:
        return None
    tensors: Dict[str, Tensor] = {}
    for path in files:
        tensors.update(safetensors_header(path))
    return tensors


def same_bytes(a: Tensor, b: Tensor, chunk: int = 16 << 20) -> bool:
    """Whether two tensors hold the same values: same dtype, shape and bytes (read ``chunk`` bytes at a time)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.end - a.start != b.end - b.start:
        return False
    with open(a.file, "rb") as fa, open(b.file, "rb") as fb:
        fa.seek(a.start)
        fb.seek(b.start)
        left = a.end - a.start
        while left > 0:
            n = min(chunk, left)
            if fa.read(n) != fb.read(n):
                return False
            left -= n
    return True


@dataclass
class Tokenizer:
    """The tokenizer facts doctor reads from tokenizer.json / tokenizer_config.json / chat_template.jinja.

    ``ids``: the id of each Qwen special token found; ``size``: ``len(tokenizer)`` (vocabulary plus added tokens),
    None without tokenizer.json; ``template``: the chat template text (None: none), ``template_from`` the file.
    """

    template: Optional[str] = None
    template_from: str = ""
    eos: Optional[str] = None
    pad: Optional[str] = None
    ids: Dict[str, int] = field(default_factory=dict)
    size: Optional[int] = None


def _token_text(value) -> Optional[str]:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...} (older tokenizer_config.json)
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_tokenizer(directory: Path) -> Optional[Tokenizer]:
    """The tokenizer facts of ``directory``; None when it holds no tokenizer file at all.

    Raises:
        QwenftError: a tokenizer file that is not valid JSON (named).
    """
    config = read_json(directory / "tokenizer_config.json", required=False)
    backend = read_json(directory / "tokenizer.json", required=False)
    jinja = directory / "chat_template.jinja"
    if config is None and backend is None and not jinja.is_file():
        return None
    facts = Tokenizer()
    config = config or {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
        template = named.get("default")
    if jinja.is_file():  # transformers 5 saves it beside tokenizer_config.json and prefers it
        facts.template, facts.template_from = jinja.read_text(encoding="utf-8"), jinja.name
    elif isinstance(template, str):
        facts.template, facts.template_from = template, "tokenizer_config.json"
    facts.eos, facts.pad = _token_text(config.get("eos_token")), _token_text(config.get("pad_token"))
    wanted = (END_OF_TEXT, IM_START, IM_END)
    for key, item in (config.get("added_tokens_decoder") or {}).items():
        if isinstance(item, dict) and item.get("content") in wanted and str(key).isdigit():
            facts.ids[item["content"]] = int(key)
    if backend is not None:
        vocab = (backend.get("model") or {}).get("vocab") or {}
        ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))
        for item in backend.get("added_tokens") or []:
            if isinstance(item, dict) and isinstance(item.get("id"), int):
                ids.add(item["id"])
                if item.get("content") in wanted:
                    facts.ids[item["content"]] = item["id"]
        for token in wanted:
            if token not in facts.ids and isinstance(vocab, dict) and token in vocab:
                facts.ids[token] = vocab[token]
        facts.size = len(ids)
    return facts


@dataclass
class ModelFiles:
    """An HF model directory as doctor reads it (a merged model, or an adapter's base).

    ``config``: config.json; ``generation``: generation_config.json (None: absent); ``tensors``: the safetensors
    headers (None: no safetensors there, or only the family table's numbers); ``names``: the names it goes by (its
    path, ``_name_or_path``), to tell Instruct from base; ``where``: how it was found.
    """

    path: Optional[Path]
    config: dict
    generation: Optional[dict]
    tokenizer: Optional[Tokenizer]
    tensors: Optional[Dict[str, Tensor]]
    names: List[str] = field(default_factory=list)
    where: str = "local directory"


def read_model_dir(directory: Path, where: str = "local directory") -> ModelFiles:
    """Read a model directory's metadata.

    Raises:
        QwenftError: config.json missing or corrupt, another JSON file or a safetensors header corrupt (named).
    """
    config = read_json(directory / "config.json")
    names = [str(directory)] + [str(config[k]) for k in ("_name_or_path", "_model_name_or_path") if config.get(k)]
    return ModelFiles(directory, config, read_json(directory / "generation_config.json", required=False),
                      read_tokenizer(directory), weight_headers(directory), names, where)


def kind_of(path: Path) -> str:
    """``adapter``, ``model`` or ``gguf``: what PATH is.

    Raises:
        QwenftError: PATH does not exist, or is none of the three (one line saying what was expected).
    """
    wanted = "give an adapter directory, a model directory or a .gguf file"
    if not path.exists():
        raise QwenftError(f"{path}: does not exist; {wanted}")
    if not path.is_dir() and not path.is_file():
        raise QwenftError(f"{path}: {_special_file(path)}, not a directory or a file; {wanted}")
    if path.is_file():
        try:
            with open(path, "rb") as handle:
                magic = handle.read(4)
        except OSError as exc:
            raise QwenftError(f"{path}: cannot be read ({exc.strerror})") from None
        if magic == GGUF_MAGIC:
            return "gguf"
        if path.suffix == ".safetensors" or path.name.endswith(".safetensors.index.json"):
            raise QwenftError(f"{path}: a safetensors file, one part of a model or adapter; pass its directory "
                              f"({path.parent})")
        said = "an empty file" if not magic else "not a GGUF file (it does not start with 'GGUF')"
        raise QwenftError(f"{path}: {said}; {wanted}")
    if (path / "adapter_config.json").is_file():
        return "adapter"
    if (path / "config.json").is_file():
        return "model"
    raise QwenftError(f"{path}: a directory with neither adapter_config.json (an adapter) nor config.json (a model); "
                      f"{wanted}")


def _special_file(path: Path) -> str:
    """What a path that is neither a directory nor a regular file is, in words."""
    import stat

    mode = path.stat().st_mode
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file"
