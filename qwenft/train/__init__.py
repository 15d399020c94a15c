"""``qwenft train``: the run (:mod:`~qwenft.train.run`), the Trainer subclass and its arguments
(:mod:`~qwenft.train.trainer`), callbacks (:mod:`~qwenft.train.callbacks`), the loss without a logits tensor
(:mod:`~qwenft.train.loss`) and several processes (:mod:`~qwenft.train.dist`).

This room may import :mod:`qwenft.model`, :mod:`qwenft.data`, :mod:`qwenft.evaluate` (the evaluation after
training), :mod:`qwenft.kernels`, :mod:`qwenft.runtime`, :mod:`qwenft.files` and :mod:`qwenft.config`.
"""

__all__ = ["main", "run"]


def __getattr__(name: str):
    """``main`` and ``run``, imported when first asked for: importing a light part of the room
    (:mod:`~qwenft.train.dist`, for the CLI's launch checks) does not import the Trainer, peft and torch."""
    if name in __all__:
        import importlib

        module = importlib.import_module("qwenft.train.run")
        globals().update(main=module.main, run=module.run)  # the functions, as the eager import bound them
        return globals()[name]
    raise AttributeError(f"module 'qwenft.train' has no attribute {name!r}")
