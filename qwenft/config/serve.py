"""The ``serve`` section: where ``python -m qwenft serve`` listens, who may call it, and the caps on a request."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Optional

from qwenft.config.base import _check

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def is_local_host(host: str) -> bool:
    """Whether ``host`` binds the loopback interface only (``127.0.0.0/8``, ``::1`` or ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class ServeConfig:
    """``qwenft serve``: an OpenAI-compatible server over the base and the tuned model (:mod:`qwenft.serve`).

    ``host``/``port``: where it listens (port 0: a free port, printed when the server is up); a host other than the
    loopback needs ``api_key``, which every ``/v1`` and ``/metrics`` request must then send as
    ``Authorization: Bearer KEY``. ``name``: the tuned model's id in ``/v1/models`` (null: the run's name, the last
    two folders of ``RUN`` in ``adapter=RUN/adapter``). ``max_batch``: requests decoded together at most.
    ``batch_wait_ms``: a batch that could start with fewer rows waits until no request arrived for this long (at
    most ``max_batch`` such windows), so that clients sending together share it; a lone request waits it once.
    ``max_queue``: requests waiting for a batch at most (more are answered 429). ``max_body_bytes``,
    ``max_tokens`` and ``max_prompt_tokens`` cap a request (400/413 beyond). ``decode_floor_tokens_per_s``: the
    decode speed under which the shipped Prometheus alert fires (exposed as a gauge the rule compares against).
    ``shutdown_timeout_s``: on SIGTERM, how long running requests may finish before they are cancelled.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    name: Optional[str] = None
    api_key: Optional[str] = None
    max_batch: int = 8
    max_queue: int = 64
    batch_wait_ms: float = 50.0  # 8 clients' requests arrived 3-25 ms apart under load (2 cores, load 4.6)
    max_body_bytes: int = 1_000_000
    max_tokens: int = 2048
    max_prompt_tokens: int = 8192
    decode_floor_tokens_per_s: float = 1.0
    shutdown_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "serve.port", self.port, "must be in 0..65535 (0: a free port)")
        _check(bool(self.host), "serve.host", self.host, "must name an interface, e.g. 127.0.0.1")
        _check(self.api_key is None or len(str(self.api_key)) >= 8, "serve.api_key", "***",
               "must be at least 8 characters (or null on 127.0.0.1)")
        _check(is_local_host(self.host) or bool(self.api_key), "serve.host", self.host,
               "a host other than 127.0.0.1 exposes the model to the network: set serve.api_key=SECRET (clients send "
               "Authorization: Bearer SECRET), or keep serve.host=127.0.0.1")
        _check(self.name is None or (bool(self.name) and self.name != "base"), "serve.name", self.name,
               "must be a non-empty model id other than 'base' (the model without the adapter)")
        _check(1 <= self.max_batch <= 256, "serve.max_batch", self.max_batch, "must be in 1..256")
        _check(0 <= self.batch_wait_ms <= 10_000, "serve.batch_wait_ms", self.batch_wait_ms, "must be in 0..10000 ms")
        _check(self.max_queue >= 1, "serve.max_queue", self.max_queue, "must be >= 1")
        _check(self.max_body_bytes >= 1024, "serve.max_body_bytes", self.max_body_bytes, "must be >= 1024 bytes")
        _check(self.max_tokens >= 1, "serve.max_tokens", self.max_tokens, "must be >= 1")
        _check(self.max_prompt_tokens >= 1, "serve.max_prompt_tokens", self.max_prompt_tokens, "must be >= 1")
        _check(self.decode_floor_tokens_per_s >= 0, "serve.decode_floor_tokens_per_s", self.decode_floor_tokens_per_s,
               "must be >= 0 tokens/s")
        _check(self.shutdown_timeout_s >= 0, "serve.shutdown_timeout_s", self.shutdown_timeout_s, "must be >= 0 s")
