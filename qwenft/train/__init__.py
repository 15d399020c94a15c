"""``qwenft train``: the run (:mod:`~qwenft.train.run`), the Trainer subclass and its arguments
(:mod:`~qwenft.train.trainer`), callbacks (:mod:`~qwenft.train.callbacks`), the loss without a logits tensor
(:mod:`~qwenft.train.loss`) and several processes (:mod:`~qwenft.train.dist`).

This room may import :mod:`qwenft.model`, :mod:`qwenft.data`, :mod:`qwenft.evaluate` (the evaluation after
training), :mod:`qwenft.kernels`, :mod:`qwenft.runtime`, :mod:`qwenft.files` and :mod:`qwenft.config`.
"""

from qwenft.train.run import main, run

__all__ = ["main", "run"]
