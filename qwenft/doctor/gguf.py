"""A GGUF file as ``qwenft doctor`` reads it: its key-values and tensor infos through the ``gguf`` package's
``GGUFReader`` (a memory map; no tensor is dequantized or read), and the checks llama.cpp depends on.

Keys read (gguf-py ``gguf/constants.py``, ``Keys``): ``general.architecture`` / ``name`` / ``basename`` /
``finetune``; ``{arch}.context_length``, ``embedding_length``, ``block_count``, ``feed_forward_length``,
``attention.head_count`` / ``head_count_kv``, ``rope.scaling.type`` / ``factor`` / ``original_context_length``;
``tokenizer.ggml.tokens`` / ``token_type`` / ``eos_token_id`` / ``eot_token_id`` / ``padding_token_id``,
``tokenizer.chat_template``. llama.cpp ends generation on the EOS / EOT ids (its end-of-generation set,
llama-vocab.cpp), and treats a special token as such only when its type is CONTROL (3).
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from qwenft.chat import END_OF_TEXT, IM_END, IM_START
from qwenft.config import QwenftError
from qwenft.doctor.checks import FAMILY_IDS, rope_of, rope_problem
from qwenft.doctor.findings import Report
from qwenft.doctor.identify import Identity, describe, identify_config
from qwenft.doctor.template import check_template, ends_turns_with_im_end

CONTROL = 3  # gguf.TokenType.CONTROL
# llama.cpp's converter fills ids the tokenizer has no token for with "[PAD{id}]" (type UNUSED): text never
# tokenizes to them and a model cannot emit an id past its rows, so placeholders past the rows are harmless
PLACEHOLDER = re.compile(r"\[PAD\d+\]")


@dataclass
class GgufFacts:
    """What doctor reads of a GGUF: ``values`` (scalar and string keys), ``tokens`` / ``types`` of the special tokens
    (``{text: (id, type)}``), the vocabulary size, the tensor names and ``token_embd`` rows."""

    path: Path
    values: Dict[str, object]
    special: Dict[str, tuple] = field(default_factory=dict)
    n_tokens: int = 0
    tensors: List[str] = field(default_factory=list)
    embed_rows: Optional[int] = None
    beyond: int = 0  # tokens at ids >= embed_rows, [PADn] placeholders not counted

    @property
    def arch(self) -> str:
        return str(self.values.get("general.architecture", ""))

    def key(self, name: str):
        """An architecture key: ``key("context_length")`` reads ``{arch}.context_length``."""
        return self.values.get(f"{self.arch}.{name}")


def read_gguf(path: Path) -> GgufFacts:
    """Read a GGUF's metadata.

    Raises:
        QwenftError: the header claims more bytes than the file has (:func:`scan_header`), or the gguf package
            refuses the file (truncated, corrupt); one line naming it.
    """
    import gguf

    scan_header(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 -- gguf raises ValueError, struct.error, IndexError... on a bad file
        # numpy's reshape / view of a memory map that ends early, or an index past its end: the file stops short
        short = isinstance(exc, (IndexError, ValueError)) and any(
            text in str(exc) for text in ("reshape", "divisor", "out of bounds", "mmap length"))
        raise QwenftError(f"{path}: not a readable GGUF file: " + (
            f"truncated (it ends, at {path.stat().st_size} bytes, before the data its header describes): an "
            "interrupted download or copy?" if short else f"{type(exc).__name__}: {exc}")) from None
    values: Dict[str, object] = {}
    facts = GgufFacts(path, values)
    for name, item in reader.fields.items():
        if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                    "tokenizer.ggml.scores"):
            continue
        try:
            if item.types and item.types[0] != gguf.GGUFValueType.ARRAY:
                values[name] = item.contents()
        except (ValueError, IndexError, UnicodeDecodeError):
            continue
    tokens, types = reader.fields.get("tokenizer.ggml.tokens"), reader.fields.get("tokenizer.ggml.token_type")
    if tokens is not None:
        facts.n_tokens = len(tokens.data)
        wanted = {END_OF_TEXT, IM_START, IM_END}
        sizes = {len(t.encode()) for t in wanted}
        for index, part in enumerate(tokens.data):
            raw = tokens.parts[part]
            if raw.size not in sizes:  # a cheap length test first: a real vocabulary has 151k tokens
                continue
            text = bytes(raw).decode("utf-8", errors="replace")
            if text in wanted:
                kind = int(types.parts[types.data[index]][0]) if types is not None else None
                facts.special[text] = (index, kind)
    for tensor in reader.tensors:
        facts.tensors.append(tensor.name)
        if tensor.name == "token_embd.weight":
            facts.embed_rows = int(tensor.shape[-1]) if len(tensor.shape) else None  # ggml order: [cols, rows]
    if tokens is not None and facts.embed_rows is not None:  # the few tokens past the rows, placeholders not counted
        texts = (bytes(tokens.parts[part]).decode("utf-8", errors="replace") for part in
                 tokens.data[facts.embed_rows:])
        facts.beyond = sum(1 for text in texts if not PLACEHOLDER.fullmatch(text))
    return facts


# GGUF value types (gguf-py GGUFValueType; ggml's gguf.h): the fixed sizes, STRING = uint64 length + bytes,
# ARRAY = uint32 item type + uint64 count + items; the smallest a key-value (key length, type, a uint8) and a tensor
# info (name length, n_dims, type, offset) can be
SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
              8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}
MIN_KV, MIN_TENSOR = 8 + 4 + 1, 8 + 4 + 4 + 8


class _Header:
    """A walk over a GGUF header's bytes that refuses, before reading it, any length the rest of the file cannot
    hold: what ``GGUFReader`` would otherwise loop over (an array of 2^40 items) or read short without a word."""

    def __init__(self, path: Path, data, order: str):
        self.path, self.data, self.order, self.pos, self.key = path, data, order, 0, None

    def need(self, claimed: int, what: str) -> None:
        available = len(self.data) - self.pos
        if claimed > available:
            where = f"key {self.key!r}: " if self.key is not None else ""
            raise QwenftError(f"{self.path}: corrupt or truncated GGUF: {where}{what}: {claimed} bytes claimed at "
                              f"offset {self.pos}, only {available} available (the file has {len(self.data)})")

    def number(self, fmt: str, what: str) -> int:
        size = struct.calcsize(fmt)
        self.need(size, what)
        value = struct.unpack_from(self.order + fmt, self.data, self.pos)[0]
        self.pos += size
        return value

    def string(self, what: str) -> bytes:
        length = self.number("Q", f"{what}'s length")
        self.need(length, what)
        start, self.pos = self.pos, self.pos + length
        return bytes(self.data[start:self.pos])

    def _strings(self, count: int) -> None:
        length, data, pos, end = struct.Struct(self.order + "Q").unpack_from, self.data, self.pos, len(self.data)
        for index in range(count):
            if pos + 8 > end or pos + 8 + length(data, pos)[0] > end:
                self.pos = pos
                self.string(f"string {index} of the array")  # says which and how long
            pos += 8 + length(data, pos)[0]
        self.pos = pos

    def value(self, kind: int) -> None:
        if kind in SIZES:
            self.need(SIZES[kind], f"a {TYPE_NAMES[kind]} value")
            self.pos += SIZES[kind]
        elif kind == STRING:
            self.string("a string")
        elif kind == ARRAY:
            item = self.number("I", "an array's item type")
            count = self.number("Q", "an array's count")
            if item not in TYPE_NAMES:
                raise QwenftError(f"{self.path}: corrupt GGUF: key {self.key!r}: an array of value type {item}, not a "
                                  "GGUF type (0-12)")
            smallest = SIZES.get(item, 8 if item == STRING else 12)  # a string's length; an array's type and count
            self.need(count * smallest, f"an array of {count} {TYPE_NAMES[item]}")
            if item in SIZES:
                self.pos += count * smallest  # fixed-size items: seek over them
            elif item == STRING:  # a vocabulary's 152k strings: each length read, in one tight loop
                self._strings(count)
            else:
                for _ in range(count):
                    self.value(item)
        else:
            raise QwenftError(f"{self.path}: corrupt GGUF: key {self.key!r} has value type {kind}, not a GGUF type "
                              "(0-12)")


def scan_header(path: Path) -> None:
    """Walk a GGUF's header (magic, version, tensor and key-value counts, each key-value's type tags and lengths,
    each tensor info) without reading a value or any tensor data, refusing a count or length the file cannot hold.
    A file with another magic or version is left to ``GGUFReader`` to refuse. A 0.5B model's header (a 151,936-token
    vocabulary, read one length at a time) takes about 0.1 s.

    Raises:
        QwenftError: a length or count past the end of the file; one line naming the file, the key and both sizes.
    """
    with open(path, "rb") as handle:
        if path.stat().st_size < 4 + 4 + 8 + 8:
            magic = handle.read(4)
            if magic == b"GGUF":
                raise QwenftError(f"{path}: corrupt or truncated GGUF: {path.stat().st_size} bytes, shorter than "
                                  "the 24-byte header")
            return
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"GGUF":
                return
            version = struct.unpack_from("<I", data, 4)[0]
            order = ">" if version & 0xFFFF == 0 else "<"  # as GGUFReader: a file written big-endian
            if struct.unpack_from(order + "I", data, 4)[0] not in (2, 3):
                return
            header = _Header(path, data, order)
            header.pos = 8
            tensors, kvs = header.number("Q", "the tensor count"), header.number("Q", "the key-value count")
            header.need(kvs * MIN_KV, f"the header's {kvs} key-values (at least {MIN_KV} bytes each)")
            header.need(tensors * MIN_TENSOR, f"the header's {tensors} tensor infos (at least {MIN_TENSOR} bytes "
                                              "each)")
            for index in range(kvs):
                header.key = None
                raw = header.string(f"key-value {index}'s key")
                header.key = raw.decode("utf-8", errors="replace")
                header.value(header.number("I", "the value type"))
            header.key = None
            header.need(tensors * MIN_TENSOR, f"the header's {tensors} tensor infos (at least {MIN_TENSOR} bytes "
                                              "each)")
            for index in range(tensors):
                name = header.string(f"tensor info {index}'s name")
                header.key = f"tensor {name.decode('utf-8', errors='replace')}"
                dims = header.number("I", "its dimension count")
                header.need(dims * 8 + 4 + 8, f"{dims} dimensions, a type and an offset")
                header.pos += dims * 8 + 4 + 8


def config_of(facts: GgufFacts) -> dict:
    """The config.json keys the family table compares, from a qwen2 GGUF (tied: no ``output.weight`` tensor)."""
    return {"model_type": "qwen2", "hidden_size": facts.key("embedding_length"),
            "intermediate_size": facts.key("feed_forward_length"), "num_hidden_layers": facts.key("block_count"),
            "num_attention_heads": facts.key("attention.head_count"),
            "num_key_value_heads": facts.key("attention.head_count_kv"),
            "vocab_size": facts.embed_rows or facts.n_tokens,
            "tie_word_embeddings": "output.weight" not in facts.tensors,
            "max_position_embeddings": facts.key("context_length")}


def check_gguf(facts: GgufFacts, report: Report) -> Identity:
    """Every check of a GGUF file."""
    if facts.arch != "qwen2":
        report.note(f"not a Qwen2 model (general.architecture {facts.arch!r}): no Qwen2.5 check applies")
        return Identity(None)
    names = [str(facts.values.get(k)) for k in ("general.name", "general.basename", "general.finetune")
             if facts.values.get(k)] + [facts.path.name]
    identity = identify_config(config_of(facts), names, None)
    report.note(describe(identity))
    template = facts.values.get("tokenizer.chat_template")
    check_template(report, template if isinstance(template, str) else None, "tokenizer.chat_template", True,
                   identity.member, identity.instruct, missing_fix=(
                       "write it into a copy with the gguf package's gguf-new-metadata (gguf_new_metadata.py): "
                       "gguf-new-metadata IN.gguf OUT.gguf --chat-template-file chat_template.jinja (or "
                       "--chat-template-config tokenizer_config.json), or convert again from a model directory "
                       "whose tokenizer has the template"))
    _special_tokens(facts, report, identity, ends_turns_with_im_end(template if isinstance(template, str) else None))
    _rows(facts, report, identity)
    kind = facts.key("rope.scaling.type")
    problem = rope_problem(kind, facts.key("rope.scaling.factor"), facts.key("context_length"),
                           facts.key("rope.scaling.original_context_length"))
    if problem:
        report.add("rope-scaling-inconsistent", f"{facts.path.name}: {problem}",
                   f"write {facts.arch}.rope.scaling.type/factor/original_context_length consistently (llama.cpp's "
                   "converter writes them from config.json's rope_scaling)")
    return identity


def _special_tokens(facts: GgufFacts, report: Report, identity: Identity, chatml: bool) -> None:
    """``gguf-special-token-type``, ``gguf-special-token-id``, ``gguf-eos-not-end``, ``pad-is-im-end``."""
    for token in (END_OF_TEXT, IM_START, IM_END):
        found = facts.special.get(token)
        if found is None:
            if chatml or token == END_OF_TEXT:
                report.add("gguf-special-token-type", f"{token} is not in the GGUF's vocabulary",
                           "convert again from the model directory with its tokenizer (tokenizer.json) beside it")
            continue
        index, kind = found
        if kind != CONTROL:
            report.add("gguf-special-token-type", f"{token} (id {index}) has token type {kind}, not CONTROL (3): "
                       "llama.cpp splits or prints it as text", "convert again with a tokenizer that marks it "
                       "special (tokenizer.json's added_tokens: \"special\": true)")
        if identity.member is not None and index != FAMILY_IDS[token]:
            report.add("gguf-special-token-id", f"{token} has id {index}; Qwen2.5's is {FAMILY_IDS[token]}",
                       "convert again from the original tokenizer (tokenizer.json) of the Qwen2.5 model")
    ends = {facts.special[t][0] for t in (IM_END, END_OF_TEXT) if t in facts.special}
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = facts.values.get(key)
        if value is not None and ends and int(value) not in ends:
            report.add("gguf-eos-not-end", f"{key} is {int(value)}, not <|im_end|> or <|endoftext|> "
                       f"({', '.join(map(str, sorted(ends)))}): llama.cpp stops on the wrong token",
                       f"set {key} to the id of <|im_end|> (gguf's gguf_new_metadata.py --special-token eos "
                       "'<|im_end|>')")
    im_end = facts.special.get(IM_END, (None,))[0]
    pad = facts.values.get("tokenizer.ggml.padding_token_id")
    if pad is not None and im_end is not None and int(pad) == im_end:
        report.add("pad-is-im-end", "tokenizer.ggml.padding_token_id is <|im_end|>, the token that ends a turn: a "
                   "training collator that masked padding by id also masked every answer's end",
                   "set the pad token to <|endoftext|>; retrain if the labels were masked by pad id")


def _rows(facts: GgufFacts, report: Report, identity: Identity) -> None:
    """``embedding-rows-shrunk`` (a family member), ``tokens-beyond-rows``."""
    rows = facts.embed_rows
    if rows is None:
        return
    member = identity.member
    want = member.config.get("vocab_size") if member is not None else None
    if isinstance(want, int) and rows < want:
        report.add("embedding-rows-shrunk", f"token_embd has {rows} rows; {member.repo_id} has {want}",
                   f"convert again from a model whose embeddings keep all {want} rows")
    elif facts.beyond:
        report.add("tokens-beyond-rows", f"{facts.n_tokens} tokens but token_embd has {rows} rows ({facts.beyond} "
                   "real tokens past them, [PADn] placeholders not counted)",
                   "convert again from the model directory the tokenizer belongs to")


def compare_rope(config: dict, facts: GgufFacts, report: Report) -> None:
    """``rope-gguf-mismatch``: a GGUF beside a config.json whose RoPE scaling it does not carry."""
    rope = rope_of(config)
    here = (rope.get("rope_type"), rope.get("factor"))
    kind = facts.key("rope.scaling.type")
    there = (None if kind in (None, "none") else kind, facts.key("rope.scaling.factor") if kind not in (None, "none")
             else None)
    if here[0] is None and there[0] is None:
        return
    # the GGUF stores the factor as float32: equal within its rounding (2^-24 relative)
    if here[0] != there[0] or (here[1] is not None and there[1] is not None
                               and abs(float(here[1]) - float(there[1])) > 1e-6 * abs(float(here[1]))):
        report.add("rope-gguf-mismatch", f"config.json has RoPE scaling {here[0] or 'none'} (factor {here[1]}) but "
                   f"{facts.path.name} has {there[0] or 'none'} (factor {there[1]})",
                   "convert the GGUF again from this directory (llama.cpp's converter, or qwenft merge merge.gguf=f16)")
