"""``python -m qwenft inspect``: the per-layer trace of one forward pass (:mod:`~qwenft.inspect.trace`) and the
command that prints and writes it (:mod:`~qwenft.inspect.command`).

A command room: it may import :mod:`qwenft.model`, :mod:`qwenft.data` (the sampler's prompt), :mod:`qwenft.plan`
(the KV-cache formula), :mod:`qwenft.logfilter` and :mod:`qwenft.config`.
"""
