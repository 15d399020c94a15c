"""Benchmarks base vs tuned in the evaluation's process: per-question results, means, and the paired difference's CI.

Both sides answer the same questions (:mod:`qwenft.evaluate.bench_tasks`) through the same loaded model
(:class:`qwenft.evaluate.bench_lm.QwenftLM` over the side :class:`qwenft.generation.engine.Engine` yields), so the
difference tuned - base is paired by question. Its 95% confidence interval is a paired bootstrap: the per-question
differences ``d_i = right_tuned_i - right_base_i`` are resampled with replacement ``RESAMPLES`` times (seeded by
``eval.bench_seed``) and the 2.5th and 97.5th percentiles of the resampled means are reported (Efron & Tibshirani,
"An Introduction to the Bootstrap", 1993, the percentile interval; Koehn 2004, "Statistical Significance Tests for
Machine Translation Evaluation", for paired resampling of one test set).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from qwenft.config.gates import metric_label
from qwenft.evaluate.bench_tasks import Benchmark

log = logging.getLogger(__name__)

RESAMPLES = 10_000
CI_METHOD = f"paired bootstrap, {RESAMPLES:,} resamples, percentile 95% interval"


def paired_ci(base: Sequence[float], tuned: Sequence[float], seed: int = 0,
              resamples: int = RESAMPLES) -> Tuple[float, float]:
    """95% percentile-bootstrap interval of ``mean(tuned) - mean(base)`` over paired items (module docstring).

    Args:
        base, tuned: per-item scores (1/0 for right/wrong), the same items in the same order.
        seed: seeds numpy's generator (same inputs and seed, same interval).
        resamples: bootstrap resamples.

    Returns:
        ``(low, high)``; ``(d, d)`` when every difference is the same ``d``.

    Raises:
        ValueError: lengths differ or no items.
    """
    import numpy as np

    if len(base) != len(tuned) or not base:
        raise ValueError(f"paired_ci needs equal, non-empty lists; got {len(base)} and {len(tuned)} items")
    diff = np.asarray(tuned, dtype=np.float64) - np.asarray(base, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    step = max(1, 2_000_000 // len(diff))  # resamples per block: at most ~2 M indices (16 MB) at once
    for start in range(0, resamples, step):
        count = min(step, resamples - start)
        means[start:start + count] = diff[rng.integers(0, len(diff), size=(count, len(diff)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def _choice_text(task, doc, index) -> str:
    choices = task.doc_to_choice(doc)
    try:
        return str(choices[int(index)])
    except (TypeError, ValueError, IndexError):
        return str(index)


def _question_rows(bench: Benchmark, samples: Dict[str, List[dict]]) -> Dict[str, dict]:
    """One row per question of ``bench`` from lm-eval's logged samples (the benchmark's filter only)."""
    rows = {}
    for task_name, logged in samples.items():
        task = bench.tasks[task_name]
        for sample in logged:
            if sample.get("filter") != bench.filter:
                continue
            doc = sample["doc"]
            if task.OUTPUT_TYPE == "multiple_choice":
                scores = [r[0] if isinstance(r, (tuple, list)) else r for r in sample["filtered_resps"]]
                answer = _choice_text(task, doc, max(range(len(scores)), key=scores.__getitem__))
                reference = _choice_text(task, doc, sample["target"])
            else:
                answer = str(sample["filtered_resps"][0])
                raw = sample["resps"][0][0] if sample["resps"] and sample["resps"][0] else ""
                answer = f"{answer} | {' '.join(str(raw).split())[:300]}" if raw else answer
                target = str(sample["target"])
                reference = target.split("####")[-1].strip() if "####" in target else target
            question = task.doc_to_text(doc)
            rows[f"{task_name}/{sample['doc_id']}"] = {
                "task": task_name, "doc_id": int(sample["doc_id"]),
                "question": question if isinstance(question, str) else str(doc.get("question", question)),
                "reference": reference, "answer": answer, "correct": float(sample[bench.metric]) > 0.5}
    return rows


class BenchRunner:
    """Runs ``benchmarks`` on each side and collects what the report needs.

    Args:
        benchmarks: from :func:`qwenft.evaluate.bench_tasks.prepare`.
        tokenizer, sampler: the evaluation's (the sampler's model is replaced per side).
        batch_size: rows per forward / prompts per generation batch.
        chat_template: render prompts through the chat template (``eval.bench_chat_template``).
        max_gen_tokens: ``eval.bench_max_gen_tokens``.
        seed: ``eval.bench_seed`` (the bootstrap's seed).
    """

    def __init__(self, benchmarks: List[Benchmark], tokenizer, sampler, *, batch_size: int,
                 chat_template: bool = False, max_gen_tokens: Optional[int] = None, seed: int = 0):
        from qwenft.evaluate.bench_lm import QwenftLM

        self.benchmarks = benchmarks
        self.chat_template = chat_template
        self.seed = seed
        self.lm = QwenftLM(sampler.model, tokenizer, sampler, batch_size=batch_size, max_gen_tokens=max_gen_tokens,
                           progress=_bar)
        self.results: Dict[str, Dict[str, Dict[str, dict]]] = {}  # benchmark -> side -> question id -> row
        self.seconds: Dict[str, Dict[str, float]] = {}

    def run_side(self, side: str, model) -> None:
        """Answer every benchmark's questions with ``model`` (the side's, as the engine yields it)."""
        from lm_eval.evaluator import evaluate

        self.lm.use(model)
        for bench in self.benchmarks:
            started = time.perf_counter()
            out = evaluate(self.lm, {"tasks": bench.tasks, "groups": {}}, samples=bench.samples, log_samples=True,
                           bootstrap_iters=0, apply_chat_template=self.chat_template,
                           fewshot_as_multiturn=self.chat_template, verbosity="WARNING")
            seconds = time.perf_counter() - started
            self.results.setdefault(bench.name, {})[side] = _question_rows(bench, out["samples"])
            self.seconds.setdefault(bench.name, {})[side] = seconds
            log.info("benchmark %s (%s): %d questions in %.1f s", bench.name, side, bench.questions, seconds)

    def report(self) -> Tuple[Dict[str, Any], Dict[str, List[dict]]]:
        """``(benchmarks, bench_rows)`` for the evaluation report (keys documented in :mod:`qwenft.evaluate.run`)."""
        summary: Dict[str, Any] = {}
        rows_out: Dict[str, List[dict]] = {}
        for bench in self.benchmarks:
            by_side = self.results.get(bench.name, {})
            if not by_side:
                continue
            ids = sorted(next(iter(by_side.values())))
            entry: Dict[str, Any] = {"metric": metric_label(bench.metric, bench.filter),
                                     "n": len(ids), "subtasks": bench.subjects, "shots": bench.shots,
                                     "source": bench.source, "seconds": self.seconds.get(bench.name, {})}
            scores = {}
            for side, rows in by_side.items():
                scores[side] = [1.0 if rows[i]["correct"] else 0.0 for i in ids]
                entry[side] = sum(scores[side]) / len(ids) if ids else None
            if "base" in scores and "tuned" in scores and ids:
                entry["delta"] = entry["tuned"] - entry["base"]
                entry["ci95"] = list(paired_ci(scores["base"], scores["tuned"], self.seed))
                entry["ci_method"] = CI_METHOD
            summary[bench.name] = entry
            rows_out[bench.name] = []
            for i in ids:
                first = next(iter(by_side.values()))[i]
                row = {"id": i, "task": first["task"], "doc_id": first["doc_id"], "question": first["question"],
                       "reference": first["reference"]}
                for side, rows in by_side.items():
                    row[side] = {"answer": rows[i]["answer"], "correct": rows[i]["correct"]}
                rows_out[bench.name].append(row)
        return summary, rows_out


def _bar(desc: str, total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="request", leave=False)
