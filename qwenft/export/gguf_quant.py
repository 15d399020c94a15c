"""GGUF K-quants by llama.cpp's own quantizer, and the Ollama ``Modelfile`` written beside every GGUF.

``merge.quantize=[gguf-q4_k_m, ...]`` turns the merge's f16 GGUF (:mod:`qwenft.export.gguf_file`) into the named type
with ``llama_model_quantize`` (llama-cpp-python, the ``gguf-check`` extra), as ``llama-quantize IN OUT Q4_K_M`` does:
llama.cpp quantizes from 16-bit and warns that requantizing a quantized file loses quality, so only the f16 GGUF is a
source. Where a row is not a multiple of a K-quant's 256-value super-block (the 0.5B model's width 896), llama.cpp
falls back to a legacy type for that tensor (q5_0, q8_0, ...); the types the file ended up with are counted from its
tensor table (:func:`tensor_types`) and recorded.

The Modelfile: Ollama applies no chat template of its own to a GGUF, and one without ``TEMPLATE`` answers nonsense for
Qwen (LLaMA-Factory #6020, #6320). It holds ``FROM`` the file (relative: ``ollama create NAME -f FILE.Modelfile`` from
any directory), Qwen2.5's ChatML as a Go template (as Ollama's own qwen2.5 template writes it, tools left out), the
system prompt the model was trained with (else the one the chat template inserts), ``stop`` for ``<|im_end|>`` and
``<|endoftext|>``, and the generation_config's temperature / top_p / top_k / repetition_penalty (Ollama's
``repeat_penalty``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Dict, Optional

from qwenft.chat import END_OF_TEXT, IM_END, IM_START

# merge.quantize method -> llama.cpp's file type (llama_ftype LLAMA_FTYPE_MOSTLY_<name>), as llama-quantize names it
GGUF_TYPES = {"gguf-q8_0": "Q8_0", "gguf-q6_k": "Q6_K", "gguf-q5_k_m": "Q5_K_M", "gguf-q4_k_m": "Q4_K_M"}
THREADS = 2  # the quantizer's threads (the result does not depend on them)

# Runs in a fresh interpreter (a crash in llama.cpp stays there): argv[1] source, argv[2] target, argv[3] type name.
QUANTIZE_SCRIPT = r'''
import ctypes, sys
import llama_cpp

params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
params.nthread = int(sys.argv[4])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
'''

# Qwen2.5's ChatML (tokenizer_config.json's chat_template without tools) in Ollama's Go template language: the system
# turn, then every user / assistant turn closed by <|im_end|>, and an open assistant turn after the last user turn.
# The second branch serves Ollama versions that render .Prompt / .Response instead of .Messages.
CHATML_TEMPLATE = (
    '{{- if .Messages }}'
    '{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}'
    '{{- range $i, $_ := .Messages }}'
    '{{- $last := eq (len (slice $.Messages $i)) 1 }}'
    '{{- if eq .Role "user" }}<|im_start|>user\n{{ .Content }}<|im_end|>\n'
    '{{ else if eq .Role "assistant" }}<|im_start|>assistant\n{{ .Content }}{{ if not $last }}<|im_end|>\n{{ end }}'
    '{{- end }}'
    '{{- if and (ne .Role "assistant") $last }}<|im_start|>assistant\n{{ end }}'
    '{{- end }}'
    '{{- else }}'
    '{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}'
    '{{- if .Prompt }}<|im_start|>user\n{{ .Prompt }}<|im_end|>\n{{ end }}<|im_start|>assistant\n'
    '{{ end }}{{ .Response }}{{ if .Response }}<|im_end|>{{ end }}')

# generation_config.json key -> Ollama PARAMETER name
SAMPLING_PARAMETERS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                       "repetition_penalty": "repeat_penalty"}


class QuantizeError(Exception):
    """A quantizer (llama.cpp, llm-compressor) failed on valid input; ``qwenft merge`` exits 1 with the message."""


def quantize_gguf(source: Path, target: Path, method: str) -> None:
    """Write ``target`` as ``source`` (an f16 GGUF) quantized by llama.cpp to ``method``'s type (:data:`GGUF_TYPES`).

    Raises:
        QuantizeError: llama.cpp returned an error (its last output lines are in the message).
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", QUANTIZE_SCRIPT, str(source), str(target), GGUF_TYPES[method],
                             str(THREADS)], env=env, capture_output=True, text=True)
    if result.returncode != 0 or not target.is_file():
        tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        raise QuantizeError(f"llama.cpp could not quantize {source.name} to {GGUF_TYPES[method]} "
                            f"(exit {result.returncode}): " + " | ".join(tail))


def tensor_types(path: Path) -> Dict[str, int]:
    """How many tensors of a GGUF file have each ggml type (``{"Q4_K": 120, "Q5_0": 48, "F32": 121, ...}``), read from
    its tensor table (nothing is dequantized)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return dict(sorted(Counter(t.tensor_type.name for t in reader.tensors).items()))


def default_system_prompt(tokenizer) -> Optional[str]:
    """The system prompt the chat template inserts when a conversation has none (Qwen2.5's "You are Qwen, created by
    Alibaba Cloud. ..."), or None when it inserts none."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                         add_generation_prompt=False)
    head = f"{IM_START}system\n"
    if not text.startswith(head) or IM_END not in text:
        return None
    return text[len(head):text.index(IM_END)]


def _quoted(text: str) -> str:
    """A Modelfile argument in triple quotes (the form that may span lines); refused when it holds three quotes."""
    if '"""' in text:
        raise ValueError(f"cannot write {text[:40]!r}... in a Modelfile: it contains triple quotes")
    return f'"""{text}"""'


def modelfile(gguf_name: str, generation_config: dict, system_prompt: Optional[str]) -> str:
    """The Ollama Modelfile text for ``gguf_name`` (a file in the same directory).

    Args:
        gguf_name: The GGUF file's name (``FROM ./NAME``).
        generation_config: The merged model's generation_config.json; its sampling values become PARAMETER lines
            (:data:`SAMPLING_PARAMETERS`; a value not set there is left to Ollama's default).
        system_prompt: The SYSTEM line (the one trained with, else :func:`default_system_prompt`); None: no line.

    Raises:
        ValueError: a system prompt that holds ``\"\"\"`` (a Modelfile cannot quote it).
    """
    lines = [f"# Ollama: ollama create NAME -f {Path(gguf_name).stem}.Modelfile && ollama run NAME",
             f"FROM ./{gguf_name}", f"TEMPLATE {_quoted(CHATML_TEMPLATE)}"]
    if system_prompt:
        lines.append(f"SYSTEM {_quoted(system_prompt)}")
    lines += [f'PARAMETER stop "{IM_END}"', f'PARAMETER stop "{END_OF_TEXT}"']
    for key, name in SAMPLING_PARAMETERS.items():
        value = generation_config.get(key)
        if value is not None:
            lines.append(f"PARAMETER {name} {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def write_modelfile(directory: Path, gguf_name: str, system_prompt: Optional[str], tokenizer) -> str:
    """Write ``directory/NAME.Modelfile`` for the GGUF ``gguf_name`` there (:func:`modelfile`, the sampling values of
    ``directory/generation_config.json``, ``system_prompt`` or else :func:`default_system_prompt`); returns its name."""
    from qwenft.files import atomic_write_text

    generation = json.loads((directory / "generation_config.json").read_text(encoding="utf-8"))
    name = modelfile_name(gguf_name)
    atomic_write_text(directory / name, modelfile(gguf_name, generation, system_prompt or
                                                  default_system_prompt(tokenizer)))
    return name


def modelfile_name(gguf_name: str) -> str:
    """``NAME.gguf`` -> ``NAME.Modelfile`` (one beside each GGUF)."""
    return f"{Path(gguf_name).stem}.Modelfile"


def staged_gguf(directory: Path, name: str) -> Path:
    """A temporary path in ``directory`` for a GGUF being written (``.NAME.tmp-XXXX``), renamed to ``NAME`` when
    complete; leftovers of a killed run carry the prefix ``.`` and ``.tmp-`` and are removed by the next one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.tmp-", dir=directory)
    os.close(fd)
    return Path(tmp)
