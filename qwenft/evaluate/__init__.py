"""Evaluation: perplexity, generation metrics, and the base-vs-tuned report.

- :mod:`~qwenft.evaluate.perplexity`: sliding-window perplexity and supervised-token perplexity.
- :mod:`~qwenft.evaluate.metrics`: exact match of the final number, character F1, ROUGE-L, distinct-2.
- :mod:`~qwenft.evaluate.run`: base (adapter off) vs tuned (adapter on) in one process; ``qwenft eval``.
- :mod:`~qwenft.evaluate.report`: metrics.json, generations.jsonl, report.md and PNG plots.
"""

from qwenft.evaluate.run import eval_command, evaluate, generate_preset, run_after_train

__all__ = ["eval_command", "evaluate", "generate_preset", "run_after_train"]
