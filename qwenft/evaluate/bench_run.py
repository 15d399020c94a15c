"""Benchmarks base vs tuned in the evaluation's process: per-question results, means, and the paired difference's CI.

Both sides answer the same questions (:mod:`qwenft.evaluate.bench_tasks`) through the same loaded model
(:class:`qwenft.evaluate.bench_lm.QwenftLM` over the side :class:`qwenft.generation.engine.Engine` yields), so the
difference tuned - base is paired by question. Its 95% confidence interval is Newcombe's paired score interval over
the questions' 2x2 table (right / wrong on each side; :func:`qwenft.evaluate.intervals.paired_interval`), the one the
verdict's gates are judged on.

The cost the user sees is measured while it runs: each side's wall time over the benchmark (lm-eval's request
building, the scorer, the answers' bookkeeping) and that time over the questions asked, ``seconds_per_question``; the
same questions in blocks per subject cost far less each than spread over many subjects
(:mod:`qwenft.evaluate.bench_sample`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

from qwenft.config.gates import metric_label
from qwenft.evaluate.bench_tasks import Benchmark
from qwenft.evaluate.intervals import paired_interval

log = logging.getLogger(__name__)



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
            log.info("benchmark %s (%s): %d questions in %.1f s, %.2f s a question (%d subjects)", bench.name, side,
                     bench.questions, seconds, seconds / max(1, bench.questions), bench.subjects)

    def report(self) -> Tuple[Dict[str, Any], Dict[str, List[dict]]]:
        """``(benchmarks, bench_rows)`` for the evaluation report (keys documented in :mod:`qwenft.evaluate.run`).

        Each benchmark's entry also holds its cost: ``seconds`` (wall seconds by side) and ``seconds_per_question``
        (those seconds over ``n``, by side), and how its questions were drawn: ``subtasks`` (subjects asked) and
        ``categories`` (subjects asked per category, :func:`qwenft.evaluate.bench_sample.category_of`; ``""``:
        uncategorised).
        """
        summary: Dict[str, Any] = {}
        rows_out: Dict[str, List[dict]] = {}
        for bench in self.benchmarks:
            by_side = self.results.get(bench.name, {})
            if not by_side:
                continue
            ids = sorted(next(iter(by_side.values())))
            seconds = self.seconds.get(bench.name, {})
            entry: Dict[str, Any] = {"metric": metric_label(bench.metric, bench.filter),
                                     "n": len(ids), "subtasks": bench.subjects, "shots": bench.shots,
                                     "source": bench.source, "seconds": seconds,
                                     "seconds_per_question": {side: s / len(ids) for side, s in seconds.items()
                                                              if ids},
                                     "categories": dict(sorted(Counter(bench.categories.values()).items()))}
            scores = {}
            for side, rows in by_side.items():
                scores[side] = [1.0 if rows[i]["correct"] else 0.0 for i in ids]
                entry[side] = sum(scores[side]) / len(ids) if ids else None
            if "base" in scores and "tuned" in scores and ids:
                entry["delta"] = entry["tuned"] - entry["base"]
                interval, entry["ci_method"] = paired_interval(scores["base"], scores["tuned"], self.seed)
                entry["ci95"] = list(interval)
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
