"""Check a written GGUF with llama.cpp itself (``merge.verify_gguf``; the ``qwenft[gguf-check]`` extra).

:mod:`qwenft.export.verify` loads the GGUF back through transformers, which reads the tensors and the tokenizer
with its own code; this check loads it in llama.cpp (llama-cpp-python, in a subprocess that imports only
``llama_cpp`` and numpy), as ``llama-server -m FILE.gguf`` would, and compares it with the merged directory
reloaded by plain transformers:

- Greedy tokens on :data:`~qwenft.export.verify.PROMPTS`: the prompt ids come from the HF tokenizer with the chat
  template; transformers generates :data:`NEW_TOKENS` greedy tokens (stopping on the EOS list), and llama.cpp is
  fed that same prompt and, one at a time, the same tokens (its KV cache, one decode per token), its argmax taken
  at every step. Up to the first difference this is exactly llama.cpp's own greedy generation; after it, each step
  still compares the two models on one shared prefix, so ``identical`` counts agreeing steps out of ``compared``.
- The chat template: a two-turn conversation rendered from the GGUF's ``tokenizer.chat_template`` by
  llama-cpp-python's own ``Jinja2ChatFormatter`` (with the GGUF's EOS/BOS texts, as ``Llama`` sets it up) and
  tokenized by llama.cpp as its chat handler does (``add_bos`` on, special tokens parsed) equals
  ``apply_chat_template`` and the HF tokenizer's ids.
- The end tokens: the GGUF's EOS and EOT ids are in the generation_config's EOS list, and llama.cpp ends a
  generation (``llama_vocab_is_eog``) on every id of that list.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

NEW_TOKENS = 32
THREADS = 2  # fixed: llama.cpp's results then do not depend on the machine (greedy needs no seed)
# The share of identical greedy steps required. On the embedded 0.5B model (float32, max|z| 28) llama.cpp's logits
# on these steps are within 0.024 (f16) and 0.48 (q8_0) of transformers'; a step can flip only where transformers'
# top two are closer than that: 1 of its 56 steps for f16 (margin 0.018), 7 for q8_0.
# f16: all (the rule; measured 54/54 with a random r=8 adapter, 56/56 without, 96/96 on tiny-random); a
# flip at a near-tie fails the merge, the two models' gaps at it in the message.
# q8_0: 90%, room for those near-ties (3 flips in 32 tokens; measured 54/54 with the adapter, 56/56 without).
# K-quants (merge.quantize, qwenft.export.quantize: teacher-forced along the 16-bit merge's greedy answers to the
# run's held-out prompts). Measured 2026-12-02: quickstart merge (475 answer tokens) q8_0 473, q6_k 473, q5_k_m 472,
# q4_k_m 470 (98.9%); tiny-random (width 64, no 256-value super-block: q4_k_m falls back to Q5_0; 100 tokens) q8_0
# 98, q4_k_m 94. q6_k and q5_k_m: 90%, as q8_0; q4_k_m: 85%, room for the tiny model's 6 flips and near-ties on
# short answers (a 3 x 8-token check: 3 flips of 24).
MIN_IDENTICAL = {"f16": 1.0, "q8_0": 0.9, "q6_k": 0.9, "q5_k_m": 0.9, "q4_k_m": 0.85}
# A step where llama.cpp picks another token that transformers scores within TIE_NATS of its own is a tie, not a
# difference: f16 stores each weight to 11 significant bits (relative error up to 2^-11 = 4.9e-4), so logits of a
# few nats move by about 1e-3 and two that close can swap honestly. Random tiny models are full of such ties (a
# new-user pass: tiny-random f16 at 94/96 with transformers' gap 0.0000 at each difference); the 0.5B has none.
TIE_NATS = 1e-3
# A merged model checked in a 16-bit dtype returns 16-bit logits: transformers' own scores are then only known to one
# unit in the last place of that dtype (bfloat16 keeps 8 significant bits: 2^-9 = 0.002 at |z| in [0.25, 0.5)), and
# two tokens that far apart are a tie as well (seen on an AVX2-only CPU: tiny-random merged to bfloat16, f16 GGUF,
# transformers' gap 0.002, one bfloat16 step; the same flip does not happen where bf16 matmuls are native).


def logit_resolution(dtype: str, *logits: float) -> float:
    """One unit in the last place of ``dtype`` at the largest of ``logits`` (nats): the finest difference between
    two logits that a model computing and returning ``dtype`` can express (``torch.finfo(dtype).eps`` times the power
    of two at or below the magnitude)."""
    import torch

    from qwenft.runtime import torch_dtype

    magnitude = max(abs(z) for z in logits)
    return torch.finfo(torch_dtype(dtype)).eps * 2.0 ** math.floor(math.log2(magnitude)) if magnitude > 0 else 0.0
TWO_TURNS = [{"role": "user", "content": "Name one prime number."},
             {"role": "assistant", "content": "7 is a prime number."},
             {"role": "user", "content": "And one more, bigger than 7?"}]


def available() -> bool:
    """Whether llama-cpp-python is installed (found, not imported: importing it loads libllama)."""
    return importlib.util.find_spec("llama_cpp") is not None


@dataclass
class LlamaVerdict:
    """Result of the llama.cpp check of one GGUF (``as_dict`` is what ``qwenft_merge.json`` records)."""

    qtype: str
    prompts: List[dict]
    identical: int
    compared: int
    chat: dict
    seconds: float
    problems: List[str] = field(default_factory=list)
    ties: int = 0

    @property
    def passed(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        return {"type": self.qtype, "new_tokens": NEW_TOKENS, "identical": self.identical, "compared": self.compared,
                "ties": self.ties, "required": MIN_IDENTICAL[self.qtype], "prompts": self.prompts, "chat": self.chat,
                "seconds": round(self.seconds, 1), "passed": self.passed, "problems": self.problems}

    def summary(self) -> str:
        """One line: the counts per prompt and the chat/EOS result."""
        parts = [f"{p['identical']}/{p['compared']}" + (f" (first difference at token {p['first_difference']})"
                                                       if p["first_difference"] is not None else "")
                 for p in self.prompts]
        chat = "chat template and EOS ids as in HF" if not self.chat["problems"] else "chat template/EOS differ"
        ties = f", {self.ties} more a tie in transformers' own logits" if self.ties else ""
        return (f"{self.identical}/{self.compared} greedy tokens identical to the merged model{ties} "
                f"(per prompt: {', '.join(parts)}); {chat}; {self.seconds:.1f} s")


def agreement(expected: Sequence[int], got: Sequence[int]) -> dict:
    """Compare two greedy token lists position by position (``got[k]`` was chosen after ``expected[:k]``).

    Returns:
        ``{"identical": count of equal positions, "compared": len(expected), "first_difference": the first index
        where they differ, or None}``; a missing token of ``got`` counts as a difference.
    """
    first = next((k for k, token in enumerate(expected) if k >= len(got) or got[k] != token), None)
    identical = sum(1 for k, token in enumerate(expected) if k < len(got) and got[k] == token)
    return {"identical": identical, "compared": len(expected), "first_difference": first}


def hf_chat(tokenizer) -> dict:
    """The HF side of the template check: :data:`TWO_TURNS` rendered by ``apply_chat_template`` (with the
    generation prompt) and its ids (``add_special_tokens=False``: the template writes every special token)."""
    text = tokenizer.apply_chat_template(TWO_TURNS, tokenize=False, add_generation_prompt=True)
    return {"text": text, "ids": list(tokenizer(text, add_special_tokens=False)["input_ids"])}


# llama.cpp's AMX matmul (Intel CPUs with AMX_INT8, Sapphire Rapids and later) crashes on quantized weights: a
# segfault in ggml_backend_amx_mul_mat (ggml-org/llama.cpp#20824, open), seen here on q8_0 / Q4_K_M / Q5_K_M / Q6_K
# GGUFs of tiny-random with llama-cpp-python 0.3.36, f16 unaffected. On such a CPU the child loads the weights without
# llama.cpp's extra buffer types (AMX, REPACK: use_extra_bufts=false), into plain CPU buffers; report["extra_bufts"]
# says which way it ran. Put right after ``import llama_cpp`` in a child script, before any Llama(...).
PLAIN_BUFFERS = r'''
report_extra_bufts = b"AMX_INT8 = 1" not in llama_cpp.llama_print_system_info()
if not report_extra_bufts:
    _model_defaults = llama_cpp.llama_cpp.llama_model_default_params

    def _plain_buffers():
        params = _model_defaults()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama_cpp.llama_model_default_params = _plain_buffers  # what Llama.__init__ calls
'''

# The chat-template and end-token facts of a loaded GGUF (``llm``) into ``report``: run inside a llama.cpp child script,
# here and in qwenft.export.llama_eval. Reads spec["messages"] and spec["eos_token_id"].
CHAT_SCRIPT = r'''
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

vocab = llama_cpp.llama_model_get_vocab(llm.model)
eos, bos = llm.token_eos(), llm.token_bos()
text = lambda i: llm.detokenize([i], special=True).decode("utf-8", "replace") if i != -1 else ""
template = llm.metadata.get("tokenizer.chat_template")
report["has_template"] = template is not None
if template is not None:  # as Llama.__init__ builds its chat handler, and as the handler tokenizes
    rendered = Jinja2ChatFormatter(template=template, eos_token=text(eos), bos_token=text(bos),
                                   stop_token_ids=[eos])(messages=spec["messages"])
    report["chat_text"] = rendered.prompt
    report["chat_ids"] = llm.tokenize(rendered.prompt.encode("utf-8"), add_bos=not rendered.added_special,
                                      special=True)
report["eos"] = eos
report["eot"] = int(llama_cpp.llama_vocab_eot(vocab))
report["eog"] = {str(i): bool(llama_cpp.llama_vocab_is_eog(vocab, i)) for i in spec["eos_token_id"]}
'''

# Runs in a fresh interpreter: only llama_cpp, numpy and the standard library. argv[1]: spec JSON, argv[2]: report.
LLAMA_SCRIPT = r'''
import json, sys, time
from pathlib import Path
import numpy as np
import llama_cpp
''' + PLAIN_BUFFERS + r'''

spec = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
start = time.perf_counter()
n_ctx = max(len(p) + len(t) for p, t in zip(spec["prompts"], spec["forced"])) + 8
llm = llama_cpp.Llama(model_path=spec["gguf"], n_ctx=max(n_ctx, 64), n_threads=spec["threads"],
                      n_threads_batch=spec["threads"], n_gpu_layers=0, seed=0, logits_all=False, verbose=False)
n_vocab = llm.n_vocab()
report = {"n_vocab": n_vocab, "load_seconds": time.perf_counter() - start, "argmax": [], "gaps": [],
          "extra_bufts": report_extra_bufts}
for prompt, forced in zip(spec["prompts"], spec["forced"]):
    llm.reset()
    llm.eval(prompt)
    picked, gaps = [], []
    for token in forced:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        best = int(np.argmax(logits))
        picked.append(best)
        gaps.append(float(logits[best] - logits[token]))  # how far llama.cpp prefers its token to HF's
        llm.eval([token])
    report["argmax"].append(picked)
    report["gaps"].append(gaps)
report["decode_seconds"] = time.perf_counter() - start - report["load_seconds"]
''' + CHAT_SCRIPT + r'''
Path(sys.argv[2]).write_text(json.dumps(report), encoding="utf-8")
llm.close()  # before the interpreter tears down the module llama_cpp frees it with
'''


def run_llama(gguf_path: Path, prompts: List[List[int]], forced: List[List[int]], eos_token_id: List[int]) -> dict:
    """Run :data:`LLAMA_SCRIPT` on ``gguf_path`` in a fresh interpreter (a crash in llama.cpp stays there).

    Args:
        gguf_path: The .gguf file.
        prompts: Prompt token ids, ``[seq]`` each.
        forced: The tokens fed after each prompt (transformers' greedy tokens), ``[steps]`` each.
        eos_token_id: The generation_config's EOS list.

    Returns:
        The script's report: ``argmax`` and ``gaps`` per prompt (``[steps]``), ``chat_text``/``chat_ids``,
        ``eos``, ``eot``, ``eog``, ``load_seconds``, ``decode_seconds``.

    Raises:
        VerificationError: llama.cpp failed to load or run the file (its last lines are in the message).
    """
    from qwenft.export.verify import VerificationError

    spec = {"gguf": str(gguf_path), "prompts": prompts, "forced": forced, "eos_token_id": eos_token_id,
            "messages": TWO_TURNS, "threads": THREADS}
    with tempfile.TemporaryDirectory(prefix="qwenft-llama-") as work:
        spec_path, report_path = Path(work) / "spec.json", Path(work) / "report.json"
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        result = subprocess.run([sys.executable, "-c", LLAMA_SCRIPT, str(spec_path), str(report_path)],
                                cwd=work, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
            raise VerificationError(f"llama.cpp could not run {gguf_path.name}: " + " | ".join(tail))
        return json.loads(report_path.read_text(encoding="utf-8"))


def check_llama(report: dict, hf_generated: List[List[int]], chat: dict, hf_eos: List[int], qtype: str,
                hf_gaps: Optional[List[List[float]]] = None,
                tie_nats: Optional[List[List[float]]] = None) -> LlamaVerdict:
    """Judge the llama.cpp report against the merged HF model.

    Args:
        report: :func:`run_llama`'s report.
        hf_generated: transformers' greedy tokens per prompt (what was fed to llama.cpp).
        chat: :func:`hf_chat` of the saved tokenizer.
        hf_eos: The saved generation_config's EOS list.
        qtype: the GGUF type, a key of :data:`MIN_IDENTICAL` (its threshold).
        hf_gaps: Per prompt and step, how far transformers prefers its token to the one llama.cpp picked (for
            the message at a first difference, and a difference within :data:`TIE_NATS` counts as a tie), or None.
        tie_nats: Per prompt and step, the tie threshold to use instead of :data:`TIE_NATS` where it is larger
            (:func:`verify_with_llama`: the resolution of transformers' 16-bit logits), or None.

    Returns:
        The verdict; ``problems`` lists every failed rule.
    """
    problems, prompts = [], []
    for i, (expected, got) in enumerate(zip(hf_generated, report["argmax"])):
        counts = {**agreement(expected, got), "hf_tokens": list(expected)}
        k = counts["first_difference"]
        if k is not None and k < len(got):
            counts["at_first_difference"] = {"hf": expected[k], "llama_cpp": got[k],
                                             "llama_cpp_gap": round(report["gaps"][i][k], 4)}
            if hf_gaps is not None:
                counts["at_first_difference"]["hf_gap"] = round(hf_gaps[i][k], 4)
        prompts.append(counts)
    identical, compared = sum(p["identical"] for p in prompts), sum(p["compared"] for p in prompts)
    ties = 0 if hf_gaps is None else sum(  # differences transformers itself scores as a tie
        1 for i, (expected, got) in enumerate(zip(hf_generated, report["argmax"]))
        for k, (a, b) in enumerate(zip(expected, got))
        if a != b and abs(hf_gaps[i][k]) <= max(TIE_NATS, tie_nats[i][k] if tie_nats is not None else 0.0))
    required = MIN_IDENTICAL[qtype]
    if identical + ties < required * compared:
        where = "; ".join(f"prompt {i}: token {p['first_difference']} of {p['compared']} "
                          f"{p.get('at_first_difference', '')}" for i, p in enumerate(prompts)
                          if p["first_difference"] is not None)
        problems.append(f"llama.cpp: {identical}/{compared} greedy tokens identical to the merged model"
                        + (f" ({ties} more tied within {TIE_NATS} nats or one step of transformers' logits)"
                           if ties else "")
                        + f", {required:.0%} required for {qtype} (first differences: {where})")

    chat_problems = []
    if not report["has_template"]:
        chat_problems.append("the GGUF has no tokenizer.chat_template")
    else:
        if report["chat_text"] != chat["text"]:
            chat_problems.append("its chat template renders a two-turn conversation differently from "
                                 "apply_chat_template")
        if report["chat_ids"] != chat["ids"]:
            chat_problems.append("llama.cpp tokenizes the two-turn conversation to other ids than the HF tokenizer")
    eos_ids = {"eos": report["eos"], "eot": report["eot"]}
    for name, value in eos_ids.items():
        if value != -1 and value not in hf_eos:
            chat_problems.append(f"the GGUF's {name} id {value} is not in generation_config's EOS list {hf_eos}")
    missing = [int(i) for i, is_eog in report["eog"].items() if not is_eog]
    if missing:
        chat_problems.append(f"llama.cpp does not end a generation on {missing} (generation_config EOS {hf_eos})")
    chat_record = {**eos_ids, "hf_eos": list(hf_eos), "problems": chat_problems}
    problems += [f"llama.cpp: {p}" for p in chat_problems]
    seconds = report["load_seconds"] + report["decode_seconds"]
    return LlamaVerdict(qtype, prompts, identical, compared, chat_record, seconds, problems, ties)


def verify_with_llama(gguf_path: Path, prompts: List[List[int]], report: dict, tokenizer, qtype: str,
                      dtype: str = "float32") -> LlamaVerdict:
    """The whole check: llama.cpp on ``gguf_path`` against the reload check's report of the merged directory.

    Args:
        gguf_path: The written .gguf.
        prompts: The prompt ids (the reference's, which the reload check confirmed the saved tokenizer renders).
        report: :func:`qwenft.export.verify.run_reload_check`'s report, run with ``long_new_tokens``.
        tokenizer: The tokenizer saved with the model.
        qtype: ``f16`` or ``q8_0``.
        dtype: The dtype transformers ran the merged model in (``merge.dtype``): a flip within one unit in the last
            place of its logits (:func:`logit_resolution`) is a tie.

    Raises:
        VerificationError: llama.cpp failed to load or run the file.
    """
    eos = report["eos_token_id"]
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    forced = report["hf_long_generated"]
    result = run_llama(gguf_path, prompts, forced, eos)
    steps = report["hf_long_steps"]
    hf_gaps, tie_nats = [], []
    for i, tokens in enumerate(forced):
        pairs = [(float(steps[str(i)][k, token]), float(steps[str(i)][k, picked]))
                 for k, (token, picked) in enumerate(zip(tokens, result["argmax"][i]))]
        hf_gaps.append([ours - theirs for ours, theirs in pairs])
        tie_nats.append([logit_resolution(dtype, *pair) for pair in pairs])
    return check_llama(result, forced, hf_chat(tokenizer), eos, qtype, hf_gaps, tie_nats)


def wanted(gguf: str, verify_gguf: Optional[bool]) -> bool:
    """Whether ``qwenft merge`` runs this check: a GGUF is written and ``merge.verify_gguf`` is true, or null
    (auto) with llama-cpp-python installed."""
    return gguf != "none" and (verify_gguf if verify_gguf is not None else available())
