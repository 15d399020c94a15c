"""The FastAPI app: :func:`create_app` builds it from a model already prepared for decoding.

Routes (:mod:`qwenft.serve.routes`): ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/chat/completions``
(JSON or an SSE stream), ``GET /metrics`` (Prometheus text), ``GET /health``, ``GET /`` (the side-by-side page).
With ``serve.api_key`` set, ``/v1/*`` and ``/metrics`` need ``Authorization: Bearer KEY`` (401 otherwise); the page
itself is public (it holds no data) and asks for the key.

:func:`qwenft.serve.command.serve_command` loads the model; the tests build several apps in one process (each with
its own metrics registry).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI

from qwenft.serve.errors import install
from qwenft.serve.routes import router
from qwenft.serve.state import Served, ServeState


@asynccontextmanager
async def lifespan(app: FastAPI):
    """Run the app's batcher while the app runs; at shutdown, after uvicorn's graceful wait, cancel what still runs
    and wait up to ``serve.shutdown_timeout_s`` seconds for it to end."""
    state: ServeState = app.state.serve
    state.scheduler.start()
    try:
        yield
    finally:
        await asyncio.get_running_loop().run_in_executor(None, state.scheduler.stop, state.limits.shutdown_timeout_s)


def create_app(served: Served):
    """Build the app for ``served``; the batcher starts and stops with the app's lifespan.

    Returns:
        A FastAPI app (``app.state.serve`` holds its :class:`~qwenft.serve.state.ServeState`;
        ``app.state.scheduler``, ``app.state.metrics`` and ``app.state.served`` the batcher, the metrics and
        ``served``).
    """
    state = ServeState.build(served)
    app = FastAPI(title="qwenft serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    app.state.scheduler, app.state.metrics, app.state.served = state.scheduler, state.metrics, served
    install(app)
    app.include_router(router)
    return app
