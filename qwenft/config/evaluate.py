"""The ``eval`` section: evaluation after training and ``qwenft eval`` (held-out generation, perplexity,
benchmarks, the verdict's gates)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from qwenft.config.base import _check, _check_choice
from qwenft.config.gates import check_gate_values


@dataclass
class EvalConfig:
    """Evaluation after training (and ``qwenft eval``): perplexity and generation metrics."""

    after_train: bool = True
    ppl_sources: List[str] = field(default_factory=list)
    ppl_window: int = 1024
    ppl_stride: int = 512
    ppl_max_tokens: int = 4096
    # Prompts per generation batch (and windows per perplexity batch): a number, or auto = sized from the KV-cache
    # and logits bytes for the free GPU memory on CUDA (qwenft.generation.engine.auto_batch_sizes), 8 on a CPU.
    batch_size: Any = "auto"
    max_eval_prompts: int = 50
    metrics: List[str] = field(default_factory=lambda: ["exact_match_number", "char_f1", "rouge_l"])
    generate: str = "precise"
    max_new_tokens: Optional[int] = None
    samples_in_report: int = 5
    # Benchmarks (qwenft.evaluate.bench): lm-evaluation-harness tasks scored base vs tuned in the same process.
    # Built in and offline: mmlu, ceval (5-shot, the answer letter's log-likelihood), gsm8k (5-shot, greedy, final
    # number), read from the first directory of bench_data (then of $QWENFT_BENCH_DATA) holding NAME/: qwenft ships
    # no benchmark data. bench_missing: error (refuse the run) or skip (warn, say so in report.md) when none holds it.
    # Any other lm-eval task name loads its own data (online), and bench_tasks=DIR adds a directory of task YAMLs.
    benchmarks: List[str] = field(default_factory=list)
    bench_data: List[str] = field(default_factory=list)
    bench_missing: str = "error"
    bench_tasks: Optional[str] = None
    bench_limit: Optional[int] = None   # questions per benchmark, sampled across subjects (seeded), same both sides
    bench_subtasks: Optional[int] = None  # draw the questions from this many subtasks (subjects; seeded) at most:
    # a subject's 5 shots are computed once for all its questions, so fewer subjects cost less per question
    bench_seed: int = 0
    bench_chat_template: bool = False   # render benchmark prompts through the chat template (lm-eval's option)
    bench_max_gen_tokens: Optional[int] = None  # cap on generated tokens for generative tasks (null: the task's)
    # The verdict (qwenft.evaluate.verdict): gates per source / benchmark / retention, e.g.
    # {domain: {metric: contains_fact, min_delta: 0.2}, retention: {max_drop: 0.02}}; fail_on_gate: exit 3 after
    # writing everything when a gate fails. A held-out row is right when its primary metric is 1 (contains_fact,
    # exact_match_number) or >= correct_threshold (char_f1, rouge_l).
    gates: Dict[str, Any] = field(default_factory=dict)
    fail_on_gate: bool = False
    correct_threshold: float = 0.5

    def __post_init__(self) -> None:
        _check(self.bench_limit is None or self.bench_limit >= 1, "eval.bench_limit", self.bench_limit,
               "must be null (every question) or >= 1")
        _check(self.bench_subtasks is None or self.bench_subtasks >= 1, "eval.bench_subtasks", self.bench_subtasks,
               "must be null (every subtask) or >= 1")
        _check(self.bench_max_gen_tokens is None or self.bench_max_gen_tokens >= 1, "eval.bench_max_gen_tokens",
               self.bench_max_gen_tokens, "must be null (the task's) or >= 1")
        _check_choice("eval.bench_missing", self.bench_missing, ("error", "skip"))
        _check(0.0 <= self.correct_threshold <= 1.0, "eval.correct_threshold", self.correct_threshold,
               "must be in [0, 1]")
        check_gate_values(self.gates)
        for name in self.metrics:
            _check_choice("eval.metrics", name, ("exact_match_number", "char_f1", "rouge_l", "contains_fact"))
        _check(self.max_new_tokens is None or self.max_new_tokens >= 1, "eval.max_new_tokens", self.max_new_tokens,
               "must be null (the preset's) or >= 1")
        _check(self.ppl_max_tokens >= 2, "eval.ppl_max_tokens", self.ppl_max_tokens, "must be >= 2 tokens")
        _check(self.ppl_window >= 2, "eval.ppl_window", self.ppl_window, "must be >= 2 tokens")
        _check(1 <= self.ppl_stride <= self.ppl_window, "eval.ppl_stride", self.ppl_stride,
               "must be in [1, eval.ppl_window]")
        if isinstance(self.batch_size, str) and self.batch_size.isdigit():
            self.batch_size = int(self.batch_size)
        _check(self.batch_size == "auto" or (isinstance(self.batch_size, int) and not isinstance(self.batch_size, bool)
                                             and self.batch_size >= 1),
               "eval.batch_size", self.batch_size, "must be auto or an integer >= 1")
        _check(self.max_eval_prompts >= 0, "eval.max_eval_prompts", self.max_eval_prompts, "must be >= 0")
        _check(self.samples_in_report >= 0, "eval.samples_in_report", self.samples_in_report, "must be >= 0")
