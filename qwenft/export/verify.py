"""Check a merged directory before it is called done: reload it with plain transformers and compare.

The reference is adapter-on-base (the unmerged ``PeftModel`` on exactly the base the merge used), run on
fixed chat prompts before the merge. The check runs in a subprocess that imports only torch, transformers
and safetensors (never qwenft), so it sees what a user of the directory sees: it loads the directory with
``AutoModelForCausalLM`` / ``AutoTokenizer``, renders the prompts with the saved chat template, and returns
the logits and greedy generations. With a GGUF it loads that file too (``gguf_file=``). transformers' GGUF reader
does not read qwen2's ``rope.scaling.*`` keys: the check reads them with ``gguf``'s own reader, requires llama.cpp's
keys for config.json's RoPE scaling (:func:`qwenft.export.gguf_file.rope_scaling_keys`), and loads the GGUF's weights
with config.json's ``rope_parameters`` (llama.cpp, ``merge.verify_gguf``, then runs the keys themselves).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from qwenft.config import QwenftError
from qwenft.chat import stop_token_ids

PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the sum of two numbers.",
    "春天来了，用一句话描述公园。",
)
MAX_NEW_TOKENS = 8

# Tolerances are relative: the largest accepted max |delta logit| is ``RTOL[dtype] * max(1, max|z|)``, z the
# reference logits (prompt positions and greedy steps, every vocabulary entry); both sides run in the merge dtype.
# float32: 1e-5 (about 80 float32 ulps, eps = 2^-23): the merged product (W + s*B@A) @ x and the two-path sum
# W@x + s*B@(A@x) differ by rounding only; measured 3.9e-7 on tiny-random (|z| < 1) and 1.5e-4 at max|z| = 32.6
# on the 0.5B model (4.5e-6 of it).
# bfloat16: 2^-3. Two valid bfloat16 evaluations of one function already disagree by this order: every layer's
# activations are rounded to 8 significant bits, and Qwen's first positions carry very large activations.
# On the 0.5B model, adapter-on-base in bfloat16 is 0.65 away from float32 (2% of max|z| = 32); merged vs
# unmerged, both bfloat16, measured 0.38 to 2.1 over eight random adapters (r=8 on all projections, B with std
# 0.01-0.02: 1.2% to 7% of max|z| = 30-33), the largest ones inside the shared system prompt. The merge itself
# adds one rounding of W + dW (the float32 merge shows the rest is exact). float16: 3 more mantissa bits, 2^-6.
# Outside float32 the check therefore only catches errors larger than 16-bit evaluation noise (a broken file, a
# wrong base, an adapter lost whose effect exceeds that noise); merge.dtype=float32 gives the strict check.
RTOL = {"float32": 1e-5, "bfloat16": 2.0 ** -3, "float16": 2.0 ** -6}
# GGUF loaded back through transformers vs the merged directory, both evaluated in the merge dtype: the merge
# dtype's own RTOL plus the rounding of the GGUF weight format. f16 from bfloat16 or float16 weights: + 0 (exact:
# bfloat16 values are float16 values, up to float16 subnormals below 6e-5; measured 0 on tiny-random). f16 from
# float32: + 2^-8 (11 significant bits per weight; measured 3.2e-4 to 5.9e-4 on tiny-random, |z| < 1). q8_0:
# + 2^-4 (8 bits per weight, a float16 scale per block of 32; measured 0.61 at max|z| = 32.75 on the 0.5B model
# in bfloat16, 0.018 of it, bfloat16 noise included).
GGUF_RTOL = {(q, d): RTOL[d] + {"f16": 0.0 if d != "float32" else 2.0 ** -8, "q8_0": 2.0 ** -4}[q]
             for q in ("f16", "q8_0") for d in RTOL}


class VerificationError(QwenftError):
    """The merged model does not reproduce adapter-on-base (``qwenft merge`` exits 1)."""


@dataclass
class Reference:
    """Adapter-on-base outputs on the fixed prompts.

    Attributes:
        texts: The user messages (:data:`PROMPTS`).
        prompts: Token ids of each rendered chat prompt, ``[seq]`` each.
        logits: ``[seq, vocab]`` float32 per prompt.
        generated: Greedy continuation ids per prompt (at most ``MAX_NEW_TOKENS``).
        step_logits: ``[steps, vocab]`` float32 raw logits of each greedy step.
        eos_token_id: The stop list the generations used.
    """

    texts: List[str]
    prompts: List[List[int]]
    logits: list
    generated: List[List[int]]
    step_logits: list
    eos_token_id: List[int]


@dataclass
class Verdict:
    """Result of comparing one model's outputs with the reference."""

    max_delta: float
    tolerance: float
    rtol: float
    greedy: List[str]
    problems: List[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        return {"max_abs_logit_delta": self.max_delta, "tolerance": self.tolerance, "rtol": self.rtol,
                "greedy": self.greedy, "passed": self.passed, "problems": self.problems}


def render(tokenizer, text: str) -> List[int]:
    """Token ids of ``text`` as one user turn with the generation prompt (the chat template, no extra BOS)."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def greedy(model, ids, max_new_tokens, eos):
    """Greedy decoding with the KV cache: one prefill of ``ids``, then one token per step (pure argmax, no
    logits processors), stopping after an id in ``eos`` or ``max_new_tokens`` tokens.

    Self-contained (imports only torch): its source also runs inside the reload check's subprocess.

    Returns:
        ``(prompt_logits [seq, vocab], generated ids, step_logits [steps, vocab])``, logits float32 on CPU;
        ``step_logits[k]`` are the logits token ``k`` was picked from.
    """
    import torch

    device = next(model.parameters()).device
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids], device=device), use_cache=True)
        prompt_logits, last = out.logits[0].float().cpu(), out.logits[0, -1]
        generated, steps = [], []
        while True:
            steps.append(last.float().cpu())
            generated.append(int(last.argmax()))
            if generated[-1] in eos or len(generated) == max_new_tokens:
                break
            out = model(input_ids=torch.tensor([[generated[-1]]], device=device),
                        cache=out.cache, use_cache=True)
            last = out.logits[0, -1]
    return prompt_logits, generated, torch.stack(steps)


def compute_reference(model, tokenizer, max_new_tokens: int = MAX_NEW_TOKENS) -> Reference:
    """Run ``model`` (the adapter on the base) on :data:`PROMPTS`: full logits and greedy generations."""
    eos = stop_token_ids(tokenizer, model.generation_config)
    ref = Reference(list(PROMPTS), [], [], [], [], eos)
    for text in PROMPTS:
        ids = render(tokenizer, text)
        logits, generated, steps = greedy(model, ids, max_new_tokens, eos)
        ref.prompts.append(ids)
        ref.logits.append(logits)
        ref.generated.append(generated)
        ref.step_logits.append(steps)
    return ref


def _max_abs_delta(got, expected) -> float:
    delta = float((got.float() - expected.float()).abs().max())
    return delta if delta == delta else float("inf")  # NaN counts as infinitely far


def compare(ref: Reference, logits: Dict[str, object], step_logits: Dict[str, object], generated: List[List[int]],
            rtol: float) -> Verdict:
    """Max |delta logit| against ``rtol * max(1, max|z|)`` and a greedy verdict per prompt.

    Compared: every prompt position, and every greedy step up to and including the first step where the two
    generations differ (before it both saw the same prefix). A generation that diverges while all those
    logits are within the tolerance is a ``near-tie`` (rounding flipped a near-equal top two), otherwise it
    ``differs`` (and the logits are out of tolerance too). Identical generations are ``equal``.
    """
    scale = max(1.0, max(float(z.abs().max()) for z in [*ref.logits, *ref.step_logits] if z.numel()))
    tolerance = rtol * scale
    deltas, greedy, problems = [(0.0, "-")], [], []
    for i, expected in enumerate(ref.logits):
        got = logits[str(i)]
        if tuple(got.shape) != tuple(expected.shape):
            problems.append(f"prompt {i}: logits {tuple(got.shape)} vs {tuple(expected.shape)}")
            continue
        deltas.append((_max_abs_delta(got, expected), f"prompt {i}"))
        a, b = ref.generated[i], generated[i]
        first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        steps = min(first + 1, len(a), len(b))
        step_delta = _max_abs_delta(step_logits[str(i)][:steps], ref.step_logits[i][:steps]) if steps else 0.0
        deltas.append((step_delta, f"prompt {i} greedy steps"))
        greedy.append("equal" if a == b else "near-tie" if step_delta <= tolerance else "differs")
    worst, where = max(deltas, key=lambda item: item[0])
    verdict = Verdict(worst, tolerance, rtol, greedy, problems)
    if not worst <= tolerance:
        verdict.problems.append(f"max |delta logit| {worst:.3g} > tolerance {tolerance:.3g} "
                                f"({rtol:g} x max|z| {scale:.3g}), at {where}")
    return verdict


# Runs in a fresh interpreter after the source of greedy(): only torch, transformers and safetensors.
# argv[1]: spec JSON, argv[2]: the folder for report.json and the logits.
CHECK_SCRIPT = r'''
import json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

spec = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
out = Path(sys.argv[2])
dtype = getattr(torch, spec["dtype"])
report = {}

def prompt_ids(tok):
    rendered = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                for t in spec["texts"]]
    return [list(tok(r, add_special_tokens=False)["input_ids"]) for r in rendered]

def run(model, prefix):
    logits, steps, generated = {}, {}, []
    for i, ids in enumerate(spec["prompts"]):
        logits[str(i)], tokens, steps[str(i)] = greedy(model, ids, spec["max_new_tokens"], spec["eos_token_id"])
        generated.append(tokens)
    save_file({k: v.contiguous() for k, v in logits.items()}, str(out / f"{prefix}_logits.safetensors"))
    save_file({k: v.contiguous() for k, v in steps.items()}, str(out / f"{prefix}_steps.safetensors"))
    report[f"{prefix}_generated"] = generated

tok = AutoTokenizer.from_pretrained(spec["model_dir"])
report["chat_template"] = bool(tok.chat_template)
report["prompt_ids"] = prompt_ids(tok)
model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype, attn_implementation=spec["attn"],
                                             device_map={"": spec["device"]})
model.eval()
report["class"] = type(model).__name__
report["quantization_config"] = getattr(model.config, "quantization_config", None) is not None
report["tie_word_embeddings"] = bool(model.config.tie_word_embeddings)
report["shares_storage"] = (model.get_output_embeddings().weight.data_ptr()
                            == model.get_input_embeddings().weight.data_ptr())
report["eos_token_id"] = model.generation_config.eos_token_id
run(model, "hf")
if spec["long_new_tokens"]:  # the longer greedy runs the llama.cpp check compares with
    long_steps, report["hf_long_generated"] = {}, []
    for i, ids in enumerate(spec["prompts"]):
        _, tokens, long_steps[str(i)] = greedy(model, ids, spec["long_new_tokens"], spec["eos_token_id"])
        report["hf_long_generated"].append(tokens)
    save_file(long_steps, str(out / "hf_long_steps.safetensors"))
del model
if spec.get("gguf_file"):
    from gguf import GGUFReader
    from transformers import AutoConfig

    fields = GGUFReader(str(Path(spec["model_dir"]) / spec["gguf_file"])).fields
    report["gguf_rope"] = {k: f.contents() for k, f in fields.items() if ".rope.scaling." in k}
    gtok = AutoTokenizer.from_pretrained(spec["model_dir"], gguf_file=spec["gguf_file"])
    report["gguf_prompt_ids"] = prompt_ids(gtok)
    report["gguf_chat_template"] = gtok.chat_template == tok.chat_template
    gconfig = AutoConfig.from_pretrained(spec["model_dir"], gguf_file=spec["gguf_file"])
    if spec["rope_parameters"]:  # transformers' GGUF reader skips qwen2's rope.scaling keys (read above instead)
        gconfig.rope_parameters = spec["rope_parameters"]
    gmodel = AutoModelForCausalLM.from_pretrained(spec["model_dir"], gguf_file=spec["gguf_file"], config=gconfig,
                                                  dtype=dtype, attn_implementation=spec["attn"],
                                                  device_map={"": spec["device"]})
    gmodel.eval()
    report["gguf_tie_word_embeddings"] = bool(gmodel.config.tie_word_embeddings)
    run(gmodel, "gguf")
report["qwenft_imported"] = any(m == "qwenft" or m.startswith("qwenft.") for m in sys.modules)
(out / "report.json").write_text(json.dumps(report), encoding="utf-8")
'''


def run_reload_check(model_dir: Path, ref: Reference, dtype: str, device: str, attn_implementation: str,
                     gguf_file: Optional[str] = None, long_new_tokens: int = 0) -> dict:
    """Reload ``model_dir`` (and ``gguf_file`` in it) in a fresh interpreter without qwenft.

    With ``long_new_tokens``, the merged model also generates that many greedy tokens per prompt (for
    :mod:`qwenft.export.llama_check`): ``hf_long_generated`` and ``hf_long_steps`` (``[steps, vocab]`` logits).

    Returns:
        The subprocess report (``prompt_ids``, ``hf_generated``, config facts, ...) with the logits under
        ``hf_logits`` / ``gguf_logits`` (dicts of ``[seq, vocab]`` float32 tensors, keyed by prompt index).

    Raises:
        VerificationError: the subprocess failed (its last lines are in the message).
    """
    from safetensors.torch import load_file

    from qwenft.export.gguf_file import rope_scaling_keys

    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    rope = config.get("rope_parameters") or {}
    spec = {"model_dir": str(model_dir), "dtype": dtype, "device": device, "attn": attn_implementation,
            "texts": ref.texts, "prompts": ref.prompts, "max_new_tokens": MAX_NEW_TOKENS,
            "eos_token_id": ref.eos_token_id, "gguf_file": gguf_file, "long_new_tokens": long_new_tokens,
            "rope_parameters": rope if rope.get("rope_type", "default") != "default" else None}
    with tempfile.TemporaryDirectory(prefix="qwenft-verify-") as work:
        work_path = Path(work)
        (work_path / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the check must not find qwenft
        script = inspect.getsource(greedy) + CHECK_SCRIPT
        result = subprocess.run([sys.executable, "-c", script, str(work_path / "spec.json"), work],
                                cwd=work, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
            raise VerificationError(f"reloading {model_dir} with plain transformers failed: " + " | ".join(tail))
        report = json.loads((work_path / "report.json").read_text(encoding="utf-8"))
        for prefix in ("hf", "gguf") if gguf_file else ("hf",):
            report[f"{prefix}_logits"] = load_file(str(work_path / f"{prefix}_logits.safetensors"))
            report[f"{prefix}_steps"] = load_file(str(work_path / f"{prefix}_steps.safetensors"))
        if long_new_tokens:
            report["hf_long_steps"] = load_file(str(work_path / "hf_long_steps.safetensors"))
    if gguf_file:
        report["gguf_rope_expected"] = rope_scaling_keys(config)
    return report


def check_report(ref: Reference, report: dict, dtype: str, tied: bool, gguf_type: Optional[str] = None) -> dict:
    """Turn the subprocess report into verdicts; the directory passes when every list of problems is empty.

    Returns:
        ``{"merge": Verdict, "gguf": Verdict or None, "problems": [str]}``.
    """
    merged = compare(ref, report["hf_logits"], report["hf_steps"], report["hf_generated"], RTOL[dtype])
    problems = list(merged.problems)
    if report["qwenft_imported"]:
        problems.append("the reload check imported qwenft")
    if report["quantization_config"]:
        problems.append("config.json has a quantization_config")
    if not report["chat_template"]:
        problems.append("the saved tokenizer has no chat template")
    if report["prompt_ids"] != ref.prompts:
        problems.append("the saved tokenizer renders the prompts to other token ids")
    if report["tie_word_embeddings"] != tied or report["shares_storage"] != tied:
        problems.append(f"tie_word_embeddings reloads as {report['tie_word_embeddings']} (shared storage: "
                        f"{report['shares_storage']}), saved as {tied}")
    if not set(ref.eos_token_id) <= set(report["eos_token_id"] or []):
        problems.append(f"generation_config eos_token_id {report['eos_token_id']} lacks {ref.eos_token_id}")
    gguf = None
    if gguf_type:
        # The GGUF is compared with the merged directory it was written from, not with the reference.
        indices = [str(i) for i in range(len(ref.prompts))]
        hf_ref = Reference(ref.texts, ref.prompts, [report["hf_logits"][i] for i in indices], report["hf_generated"],
                           [report["hf_steps"][i] for i in indices], ref.eos_token_id)
        gguf = compare(hf_ref, report["gguf_logits"], report["gguf_steps"], report["gguf_generated"],
                       GGUF_RTOL[(gguf_type, dtype)])
        problems += [f"gguf: {p}" for p in gguf.problems]
        if report["gguf_prompt_ids"] != ref.prompts:
            problems.append("gguf: its tokenizer renders the prompts to other token ids")
        if not report["gguf_chat_template"]:
            problems.append("gguf: its chat template differs from the tokenizer's")
        if report["gguf_rope"] != report["gguf_rope_expected"]:
            problems.append(f"gguf: its RoPE scaling keys {report['gguf_rope']} are not config.json's "
                            f"{report['gguf_rope_expected']}")
        if report["gguf_tie_word_embeddings"] != tied:
            problems.append(f"gguf: tie_word_embeddings loads as {report['gguf_tie_word_embeddings']}")
    return {"merge": merged, "gguf": gguf, "problems": problems}
