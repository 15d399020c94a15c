"""``qwenft merge``: a standalone 16-bit model from base + adapter, verified, with GGUF and 4-bit artifacts measured
against it. :mod:`~qwenft.export.command` is the command, :mod:`~qwenft.export.merge` the merge.

A command room (modules: :mod:`~qwenft.export.merge`, :mod:`~qwenft.export.build`, :mod:`~qwenft.export.verify`,
:mod:`~qwenft.export.gguf_file`, :mod:`~qwenft.export.llama_check`, :mod:`~qwenft.export.card`,
:mod:`~qwenft.export.quantize`, :mod:`~qwenft.export.gguf_quant`, :mod:`~qwenft.export.w4a16`,
:mod:`~qwenft.export.costs`, :mod:`~qwenft.export.llama_eval`): it may import :mod:`qwenft.model`, :mod:`qwenft.chat`,
:mod:`qwenft.runtime`, :mod:`qwenft.runlock`, :mod:`qwenft.files`, :mod:`qwenft.config`, and :mod:`qwenft.evaluate`
and :mod:`qwenft.data` for the cost table (the project's own evaluation, on the run's data).
"""
