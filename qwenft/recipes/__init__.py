"""``qwenft recipes``: the built-in recipes listed and copied out to edit (:mod:`~qwenft.recipes.command`).

A command room without a Hydra config: it may import :mod:`qwenft.resources`, :mod:`qwenft.files` and
:mod:`qwenft.config`.
"""
