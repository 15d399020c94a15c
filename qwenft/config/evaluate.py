"""The ``eval`` section: evaluation after training and ``qwenft eval`` (held-out generation, perplexity,
benchmarks, the verdict's gates)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from qwenft.config.base import _check, _check_choice
from qwenft.config.gates import check_gate_values
from qwenft.config.judge import JudgeConfig


# eval.bench_limit=auto by device kind: the n a 2-point retention gate needs on a GPU (docs/eval.md, "How many
# questions a gate needs": n > 9,604 f at flip share f), a sample a CPU pays for in about half a minute a side
BENCH_LIMIT_AUTO = {"cuda": 1000, "cpu": 64}


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
    # questions per benchmark, seeded, the same on both sides: N, null (all) or auto (BENCH_LIMIT_AUTO: 1,000 on a GPU,
    # enough for a 2-point retention gate to decide when up to ~10% of answers flip; 64 on a CPU, ~30 s a side for
    # the 0.5B, where a 2-point gate reads INCONCLUSIVE unless the change is large)
    bench_limit: Any = None
    bench_subtasks: Optional[int] = None  # draw the questions from this many subtasks (subjects; seeded) at most:
    # a subject's 5 shots are computed once for all its questions, so fewer subjects cost less per question
    bench_block: int = 16  # questions per subject at most: bench_limit comes in blocks from the fewest subjects,
    # one category after another (qwenft.evaluate.bench_sample); blocks grow past it only when bench_subtasks caps
    bench_seed: int = 0
    bench_chat_template: bool = False   # render benchmark prompts through the chat template (lm-eval's option)
    bench_max_gen_tokens: Optional[int] = None  # cap on generated tokens for generative tasks (null: the task's)
    # The verdict (qwenft.evaluate.verdict). targets: the held-out sources the run exists to improve (null: the
    # first held-out source; []: none); every other source and every benchmark is retention. gates: per source /
    # benchmark, and `target` (every target without a gate of its own) and `retention` (every other item without
    # one): delta > min_delta (improved by more than), delta >= -max_drop (dropped no more than), tuned >= min,
    # each judged on the 95% interval: PASS when all of it meets the condition, FAIL when none does, else
    # INCONCLUSIVE, as is a gate judged on fewer than min_n rows. fail_on_gate: exit 3 after writing everything
    # when a gate fails; fail_on_inconclusive: exit 4 when none failed but one is inconclusive. A held-out row is
    # right (flips.jsonl) when its primary metric is 1 (contains_fact, exact_match_number) or >= correct_threshold.
    targets: Optional[List[str]] = None
    gates: Dict[str, Any] = field(default_factory=lambda: {"target": {"min_delta": 0.0},
                                                           "retention": {"max_drop": 0.02}})
    min_n: int = 20
    fail_on_gate: bool = False
    fail_on_inconclusive: bool = False
    correct_threshold: float = 0.5
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # a pairwise judge of base vs tuned (eval.judge.url)

    def __post_init__(self) -> None:
        if isinstance(self.bench_limit, str) and self.bench_limit.isdigit():
            self.bench_limit = int(self.bench_limit)
        _check(self.bench_limit is None or self.bench_limit == "auto"
               or (isinstance(self.bench_limit, int) and not isinstance(self.bench_limit, bool)
                   and self.bench_limit >= 1), "eval.bench_limit", self.bench_limit,
               "must be null (every question), auto (1,000 on a GPU, 64 on a CPU) or an integer >= 1")
        _check(self.bench_subtasks is None or self.bench_subtasks >= 1, "eval.bench_subtasks", self.bench_subtasks,
               "must be null (every subtask) or >= 1")
        _check(self.bench_block >= 1, "eval.bench_block", self.bench_block, "must be >= 1 (questions per subject)")
        _check(self.bench_max_gen_tokens is None or self.bench_max_gen_tokens >= 1, "eval.bench_max_gen_tokens",
               self.bench_max_gen_tokens, "must be null (the task's) or >= 1")
        _check_choice("eval.bench_missing", self.bench_missing, ("error", "skip"))
        _check(0.0 <= self.correct_threshold <= 1.0, "eval.correct_threshold", self.correct_threshold,
               "must be in [0, 1]")
        self.gates = {name: gate for name, gate in self.gates.items() if gate is not None}  # NAME=null drops it
        check_gate_values(self.gates)
        _check(isinstance(self.min_n, int) and not isinstance(self.min_n, bool) and self.min_n >= 1, "eval.min_n",
               self.min_n, "must be an integer >= 1 (the fewest rows a gate may be decided on)")
        _check(self.targets is None or (isinstance(self.targets, list) and all(isinstance(t, str) and t
                                                                              for t in self.targets)),
               "eval.targets", self.targets, "must be null (the first held-out source), [] or a list of source names")
        for name in self.metrics:
            _check_choice("eval.metrics", name, ("exact_match_number", "char_f1", "rouge_l", "contains_fact",
                                                 "pref_accuracy"))
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
