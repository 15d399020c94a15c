"""``qwenft train``: the command (:mod:`~qwenft.train.command`), the run (:mod:`~qwenft.train.run`), its directory
checked before anything is written (:mod:`~qwenft.train.rundir`), the Trainer subclass and its arguments
(:mod:`~qwenft.train.trainer`), callbacks (:mod:`~qwenft.train.callbacks`), the loss without a logits tensor
(:mod:`~qwenft.train.loss`) and several processes (:mod:`~qwenft.train.dist`).

A command room: it may import :mod:`qwenft.model`, :mod:`qwenft.data`, :mod:`qwenft.evaluate` (the evaluation after
training), :mod:`qwenft.kernels`, :mod:`qwenft.runtime`, :mod:`qwenft.memory`, :mod:`qwenft.files` and
:mod:`qwenft.config`. Nothing is imported here: the CLI's launch checks import :mod:`~qwenft.train.dist` alone,
without the Trainer, peft and torch.
"""
