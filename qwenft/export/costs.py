"""The cost table: what each artifact of a merge costs against the 16-bit merge, on the run's own held-out data.

Every artifact is measured on the same inputs, built once from the run (:func:`qwenft.export.quantize.run_inputs`):

- size: the weights on disk (the safetensors files of a directory, or the GGUF file), in bytes;
- perplexity of each group :func:`qwenft.evaluate.run.perplexity_rows` builds (the held-out answers of every source,
  and each ``eval.ppl_sources`` text) and of all held-out answers together (:func:`with_all_answers`), and its ratio to
  the 16-bit merge's;
- each held-out source's primary metric (:func:`qwenft.evaluate.verdict.primary_metric`) on greedy answers: its
  mean, the rows it counts as right (:func:`~qwenft.evaluate.verdict.is_right`) and how many of the 16-bit merge's
  right rows stay right (``kept``: the facts the 16-bit merge states that survive the rounding);
- greedy token agreement: along each held-out prompt followed by the 16-bit merge's greedy answer, the share of
  answer positions where the artifact's argmax is the 16-bit merge's argmax (teacher-forced, so one early difference
  does not hide the rest, as in :mod:`qwenft.export.llama_check`);
- decode tokens/s: batch 1, :data:`~qwenft.export.llama_eval.SPEED_TOKENS` greedy tokens after the first held-out
  prompt; transformers for safetensors directories (compressed-tensors decompresses W4A16 on load, so its speed is
  the 16-bit model's), llama.cpp on 2 threads for GGUF.

The transformers side runs the project's evaluation (:func:`qwenft.evaluate.run.evaluate`, greedy, no benchmarks);
the llama.cpp side scores the same token ids (:mod:`qwenft.export.llama_eval`) with the same metric functions.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from qwenft.config import Config
from qwenft.evaluate.metrics import score
from qwenft.evaluate.run import evaluate, perplexity_rows, summarise
from qwenft.evaluate.verdict import is_right, primary_metric

log = logging.getLogger(__name__)

REFERENCE = "16-bit"


@dataclass
class Inputs:
    """What every artifact is measured on: the eval config (greedy, no benchmarks), the data bundle with the
    held-out rows, the tokenizer, the prompts (per source, ``prompt_ids``), the perplexity rows and the EOS ids."""

    config: Config
    bundle: Any
    tokenizer: Any
    eos: List[int]
    rows: Dict[str, List[dict]] = field(default_factory=dict)
    ppl: Dict[str, list] = field(default_factory=dict)

    def __post_init__(self) -> None:
        limit = self.config.eval.max_eval_prompts
        held = self.bundle.eval_rows if self.bundle is not None else {}
        self.rows = {name: [r for r in rows if r["messages"]][:limit] for name, rows in held.items()}
        self.rows = {name: rows for name, rows in self.rows.items() if rows}
        self.ppl = perplexity_rows(self.tokenizer, self.config, self.bundle)

    def prompts(self) -> List[List[int]]:
        return [list(r["prompt_ids"]) for rows in self.rows.values() for r in rows]


def weights_bytes(path: Path) -> int:
    """Bytes of the weights: a GGUF file's size, or a directory's ``*.safetensors`` files summed."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def _answer_ids(tokenizer, result: dict, eos: List[int]) -> List[int]:
    """A greedy answer as token ids: its text encoded (``add_special_tokens=False``), then the end token when it
    stopped on one (the sampler's text leaves it out)."""
    ids = list(tokenizer(result["text"], add_special_tokens=False)["input_ids"])
    return ids + [eos[0]] if result["stop_reason"] == "eos" and eos else ids


def forced_argmax(model, sequences: List[Tuple[List[int], List[int]]]) -> List[List[int]]:
    """The model's argmax at every answer position of each ``(prompt, answer)`` (``answer`` fed as the context of the
    next position), one forward pass per sequence, only the answer positions projected onto the vocabulary.

    Returns:
        ``[len(answer)]`` ids per sequence.
    """
    import torch

    from qwenft.evaluate.perplexity import causal_parts

    body, head = causal_parts(model)
    device = head.device
    out = []
    with torch.no_grad():
        for prompt, answer in sequences:
            ids = torch.tensor([prompt + answer[:-1]], device=device)
            hidden = body(input_ids=ids, use_cache=False).last_hidden_state[0, len(prompt) - 1:]
            out.append((hidden.to(head.dtype) @ head.T).argmax(-1).tolist())
    return out


def _decode_speed(model, tokenizer, prompt: List[int]) -> float:
    """Greedy decode tokens/s, batch 1, :data:`~qwenft.export.llama_eval.SPEED_TOKENS` tokens (EOS not honoured)."""
    from qwenft.config import GenerateConfig
    from qwenft.export.llama_eval import SPEED_TOKENS
    from qwenft.generation import Sampler

    sampler = Sampler(model, tokenizer, GenerateConfig(do_sample=False, max_new_tokens=SPEED_TOKENS,
                                                       min_new_tokens=SPEED_TOKENS, compile="false"))
    return sampler.generate([prompt]).stats.decode_tokens_per_s


def _sources(config: Config, results: Dict[str, List[dict]], summaries: Dict[str, dict],
             reference: Optional[Dict[str, dict]]) -> Dict[str, dict]:
    """Per source: the primary metric's mean, the rows right, and (against ``reference``) how many of its right
    rows stay right."""
    out = {}
    for name, rows in results.items():
        metric = primary_metric(config, name, {"base": summaries[name]}, [{"base": r} for r in rows])
        if metric is None:
            continue
        right = [is_right(metric, r.get(metric), config.eval.correct_threshold) for r in rows]
        entry = {"metric": metric, "mean": summaries[name].get(metric), "right": sum(bool(x) for x in right),
                 "rows": len(rows), "right_rows": [i for i, x in enumerate(right) if x]}
        if reference is not None and name in reference:
            theirs = set(reference[name]["right_rows"])
            entry["kept"] = len(theirs & set(entry["right_rows"]))
            entry["of"] = len(theirs)
        out[name] = entry
    return out


ALL_ANSWERS = "answers:all"


def with_all_answers(ppl: Dict[str, dict]) -> Dict[str, dict]:
    """``ppl`` (:meth:`qwenft.evaluate.perplexity.Perplexity.as_dict` by group) plus :data:`ALL_ANSWERS`, the perplexity
    of every source's held-out answers together (token-weighted: ``exp(sum(mean_nll * tokens) / sum(tokens))``), when
    there are several sources."""
    answers = [v for name, v in ppl.items() if name.startswith("answers:")]
    if len(answers) < 2:
        return dict(ppl)
    tokens = sum(v["tokens"] for v in answers)
    nll = sum(v["mean_nll"] * v["tokens"] for v in answers)
    return {**ppl, ALL_ANSWERS: {"perplexity": math.exp(nll / tokens), "mean_nll": nll / tokens, "tokens": tokens}}


def _finish(entry: dict, ppl: Dict[str, dict], reference: Optional[dict]) -> dict:
    entry["perplexity"] = {}
    for name, value in with_all_answers(ppl).items():
        ratio = value["perplexity"] / reference["perplexity"][name]["perplexity"] if reference else 1.0
        entry["perplexity"][name] = {"perplexity": value["perplexity"], "tokens": value["tokens"], "ratio": ratio}
    return entry


def measure_hf(path: Path, inputs: Inputs, dtype: str, device: str, reference: Optional[dict], label: str) -> dict:
    """Measure a safetensors directory (the 16-bit merge when ``reference`` is None, else a compressed-tensors one)
    with transformers and the project's evaluation (its progress bars name ``label``: ``measure gptq (domain)``).

    Returns:
        The table entry; the 16-bit merge's also holds ``sequences`` (prompt and greedy answer ids) and ``argmax``
        (its own argmax along them), which the other artifacts are compared with.
    """
    from transformers import AutoModelForCausalLM

    from qwenft.runtime import torch_dtype

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype), device_map={"": device})
    model.eval()
    report = evaluate(model, inputs.tokenizer, inputs.config, inputs.bundle, ["base"], progress=f"measure {label}")
    results = {name: [slot["base"] for slot in rows] for name, rows in report["rows"].items()}
    summaries = {name: by_side["base"] for name, by_side in report["sources"].items()}
    ppl = {name: by_side["base"] for name, by_side in report["perplexity"].items()}
    entry = {"backend": "transformers", "bytes": weights_bytes(path)}
    if reference is None:
        entry["sequences"] = [(list(r["prompt_ids"]), _answer_ids(inputs.tokenizer, res, inputs.eos))
                              for name, rows in inputs.rows.items() for r, res in zip(rows, results[name])]
        entry["sequences"] = [(p, a) for p, a in entry["sequences"] if a]
    sequences = entry.get("sequences") or reference["sequences"]
    argmax = forced_argmax(model, sequences)
    if reference is None:
        entry["argmax"] = argmax
    entry["agreement"] = _agreement(argmax, reference["argmax"] if reference else argmax)
    entry["sources"] = _sources(inputs.config, results, summaries, reference and reference["sources"])
    prompts = inputs.prompts()
    entry["decode_tokens_per_s"] = _decode_speed(model, inputs.tokenizer, prompts[0]) if prompts else None
    del model
    gc.collect()
    entry["seconds"] = time.perf_counter() - start
    return _finish(entry, ppl, reference)


def measure_gguf_file(path: Path, inputs: Inputs, reference: dict, label: str) -> dict:
    """Measure a GGUF with llama.cpp (:func:`qwenft.export.llama_eval.measure_gguf`, its progress bar named
    ``measure LABEL (llama.cpp)``) against ``reference``; the entry's ``llama_report`` (not recorded) holds llama.cpp's
    report, for :mod:`qwenft.export.llama_check`'s rules."""
    from qwenft.evaluate.perplexity import Perplexity
    from qwenft.export.llama_eval import measure_gguf

    start = time.perf_counter()
    config = inputs.config
    max_new = _max_new_tokens(config)
    got = measure_gguf(path, inputs.ppl, inputs.prompts(), inputs.eos, max_new, reference["sequences"],
                       reference["argmax"], desc=f"measure {label} (llama.cpp)")
    results, k = {}, 0
    for name, rows in inputs.rows.items():
        results[name] = []
        for row in rows:
            ids = got["generated"][k]
            k += 1
            stopped = bool(ids) and ids[-1] in inputs.eos
            text = inputs.tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=True)
            results[name].append({"text": text, "stop_reason": "eos" if stopped else "length", "tokens": len(ids),
                                  **score(text, row["messages"][-1]["content"], config.eval.metrics, row.get("meta"))})
    summaries = {name: summarise(res, config.eval.metrics) for name, res in results.items()}
    ppl = {name: Perplexity(math.exp(nll / count) if count else float("nan"), nll, count).as_dict()
           for name, (nll, count) in got["ppl"].items()}
    entry = {"backend": "llama.cpp", "bytes": weights_bytes(path),
             "agreement": _agreement(got["forced_argmax"], reference["argmax"]),
             "sources": _sources(config, results, summaries, reference["sources"]),
             "decode_tokens_per_s": got["decode_tokens_per_s"], "seconds": time.perf_counter() - start,
             "llama_report": got}
    return _finish(entry, ppl, reference)


def _max_new_tokens(config: Config) -> int:
    from qwenft.evaluate.run import generate_preset

    return generate_preset(config).max_new_tokens


def _agreement(got: List[List[int]], expected: List[List[int]]) -> dict:
    """``identical`` of ``compared`` answer positions where ``got``'s argmax equals ``expected``'s."""
    identical = sum(a == b for g, e in zip(got, expected) for a, b in zip(g, e))
    compared = sum(len(e) for e in expected)
    return {"identical": identical, "compared": compared, "share": identical / compared if compared else None}


def stamp() -> str:
    """Now, as a cost table row records when it was measured (UTC, to the second)."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def public(entry: dict, measured: str) -> dict:
    """The entry as recorded (``qwenft_merge.json``): without the reference's token lists and row indices, with
    ``measured`` (:func:`stamp`: the same for every row one run measures)."""
    out = {k: v for k, v in entry.items() if k not in ("sequences", "argmax", "llama_report")}
    out["sources"] = {name: {k: v for k, v in s.items() if k != "right_rows"} for name, s in entry["sources"].items()}
    return {**out, "measured": measured}
