"""Evaluation: perplexity, generation metrics, and the base-vs-tuned report.

- :mod:`~qwenft.evaluate.perplexity`: sliding-window perplexity and supervised-token perplexity.
- :mod:`~qwenft.evaluate.metrics`: exact match of the final number, character F1, ROUGE-L, distinct-2.
- :mod:`~qwenft.evaluate.run`: base (adapter off) vs tuned (adapter on) in one process.
- :mod:`~qwenft.evaluate.command`: ``python -m qwenft eval``.
- :mod:`~qwenft.evaluate.report`: metrics.json, generations.jsonl, report.md and PNG plots.
- :mod:`~qwenft.evaluate.verdict`: ``eval.gates`` judged (PASS / FAIL, exit 3) and ``eval.score``;
  :mod:`~qwenft.evaluate.flips`: the rows and questions that went right -> wrong and wrong -> right (flips.jsonl).

A command room: it may import :mod:`qwenft.generation` (the sampler), :mod:`qwenft.model`, :mod:`qwenft.data`,
:mod:`qwenft.chat`, :mod:`qwenft.runtime`, :mod:`qwenft.files` and :mod:`qwenft.config`.
"""

from qwenft.evaluate.run import check_settings, evaluate, evaluate_and_report, generate_preset

__all__ = ["check_settings", "evaluate", "evaluate_and_report", "generate_preset"]
