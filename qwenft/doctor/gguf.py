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

import re
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
        QwenftError: the gguf package refuses the file (truncated, corrupt); one line naming it.
    """
    import gguf

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
