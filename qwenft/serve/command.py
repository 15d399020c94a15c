"""``python -m qwenft serve``: load the model once and serve it (:mod:`qwenft.serve.app`) with uvicorn.

::

    python -m qwenft serve adapter=RUN/adapter [serve.port=8000] [serve.name=my-model] [generate=precise]
    python -m qwenft serve adapter=RUN/adapter serve.host=0.0.0.0 serve.api_key=SECRET

The adapter is fixed when the server starts (requests name ``base`` or the tuned id, never a path). On SIGTERM
(or Ctrl-C) uvicorn stops accepting connections and lets running requests finish for ``serve.shutdown_timeout_s``
seconds; what still runs then is cancelled, and the batcher stops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Optional

from qwenft.config import Config, QwenftError

log = logging.getLogger(__name__)

PACKAGES = ("fastapi", "uvicorn", "sse_starlette", "prometheus_client")


def check_packages() -> None:
    """Raises QwenftError naming the extra when a package the server needs is missing."""
    missing = [name for name in PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise QwenftError(f"qwenft serve needs {', '.join(missing)}: pip install 'qwenft[serve]'")


def tuned_name(config: Config) -> Optional[str]:
    """The tuned model's id: ``serve.name``, else the run the adapter comes from (``RUN/adapter`` ->
    the last two folders of ``RUN``, e.g. ``quickstart/2026-12-02_08-15-00_4242``); None without an adapter."""
    if not config.adapter:
        return None
    if config.serve.name:
        return config.serve.name
    path = Path(config.adapter).expanduser().resolve()
    run = path.parent if path.name == "adapter" else path
    return "/".join(run.parts[-2:]) if len(run.parts) >= 2 else run.name


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free one).

    Raises:
        QwenftError: the address is in use or cannot be bound, naming serve.host / serve.port.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise QwenftError(f"serve.host={host} serve.port={port}: cannot listen there ({exc.strerror or exc}); "
                          "choose another port (serve.port=0 picks a free one)") from None
    sock.listen(128)
    return sock


def inference_settings(config: Config) -> Config:
    """``config`` for serving: the LoRA delta is never folded (base and tuned alternate from batch to batch) and the
    decode step is not compiled unless ``generate.compile=true`` (every batch has its own shape)."""
    generate = dataclasses.replace(config.generate, fold_lora="false",
                                   compile="false" if config.generate.compile == "auto" else config.generate.compile)
    return dataclasses.replace(config, generate=generate)


def load_served(config: Config):
    """Load the model of a validated ``serve`` config and prepare it for decoding: the base plus the adapter
    (:func:`qwenft.model.lora.load_for_inference`), on the path ``qwenft generate`` takes
    (:func:`qwenft.generation.engine.prepare_for_decoding`), with :func:`inference_settings`.

    Returns:
        A :class:`qwenft.serve.state.Served`.

    Raises:
        QwenftError: ``generate.compile=true`` off CUDA (:func:`qwenft.generation.generate.check_supported`); a
            missing adapter (:func:`qwenft.model.lora.prepare_inference`); both before anything loads.
    """
    from qwenft.generation.engine import prepare_for_decoding
    from qwenft.generation.generate import check_supported
    from qwenft.model.lora import load_for_inference, prepare_inference
    from qwenft.runtime import default_device
    from qwenft.serve.state import Served

    config = inference_settings(config)
    tuned = tuned_name(config)  # RUN and RUN/adapter name the same run
    check_supported(config.generate)
    config = prepare_inference(config)  # the adapter directory checked first, before anything loads
    model, tokenizer = load_for_inference(config, device=default_device())
    scfg = config.serve
    engine = prepare_for_decoding(model, config, cache_len=scfg.max_prompt_tokens + scfg.max_tokens,
                                  prompt_len=scfg.max_prompt_tokens)
    return Served(engine=engine, tokenizer=tokenizer, config=config, settings=engine.settings(config.generate),
                  tuned=tuned)


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that the SIGTERM / SIGINT it shut down on is not raised again afterwards (uvicorn
        re-raises it, so the process would die of it): the command prints its last line and exits 0."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server


def serve_command(config: Config) -> None:
    """Run ``qwenft serve`` for a validated config (blocks until SIGTERM / Ctrl-C).

    Raises:
        QwenftError: a missing package (the ``serve`` extra), a missing adapter, an address that cannot be bound;
            all before the model is loaded.
    """
    check_packages()
    sock = bind(config.serve.host, config.serve.port)  # a taken port fails before minutes of loading
    try:
        import uvicorn

        from qwenft.serve.app import create_app

        served = load_served(config)
    except BaseException:
        sock.close()
        raise
    app = create_app(served)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"qwenft serve: http://{shown}:{port}/ (models: {', '.join(served.models)}; OpenAI base_url "
          f"http://{shown}:{port}/v1; metrics /metrics)", file=sys.stderr, flush=True)
    server = _server_class()(uvicorn.Config(app, log_level="info", lifespan="on", access_log=False,
                                           timeout_graceful_shutdown=config.serve.shutdown_timeout_s))
    server.run(sockets=[sock])
    print("qwenft serve: stopped", file=sys.stderr, flush=True)
