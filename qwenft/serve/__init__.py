"""``python -m qwenft serve``: base and tuned behind one OpenAI-compatible endpoint, with Prometheus metrics and a
side-by-side page.

- :mod:`~qwenft.serve.protocol`: OpenAI's request and response shapes, and a request's sampler settings.
- :mod:`~qwenft.serve.errors`: OpenAI's error envelope; every exception's HTTP status in one place.
- :mod:`~qwenft.serve.scheduler`: the bounded queue and the batcher feeding :class:`qwenft.generation.Sampler`.
- :mod:`~qwenft.serve.metrics`: the ``qwenft:`` metrics (vLLM's names, and the inference monitor).
- :mod:`~qwenft.serve.state`: what is served and the app's state; :mod:`~qwenft.serve.routes`: the handlers (auth,
  caps, streaming) over that state; :mod:`~qwenft.serve.app`: the FastAPI app and its lifespan;
  :mod:`~qwenft.serve.command`: the command.
- ``static/index.html``: the page; ``monitoring/``: Prometheus alert rules and a Grafana dashboard (package data).

A command room like :mod:`qwenft.generation`, whose engine and sampler it runs: it imports generation, model,
runtime, plan (byte formulas) and config; nothing imports it but the CLI.
"""
