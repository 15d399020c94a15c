"""The FastAPI app: routes, auth, caps, and the bridge from a request to the batcher.

Routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/chat/completions`` (JSON or an SSE stream),
``GET /metrics`` (Prometheus text), ``GET /health``, ``GET /`` (the side-by-side page). With ``serve.api_key`` set,
``/v1/*`` and ``/metrics`` need ``Authorization: Bearer KEY`` (401 otherwise); the page itself is public (it
holds no data) and asks for the key.

A request is checked completely before it is queued (fields, model, caps, context), so what reaches the sampler
can only fail by a fault of the model (500 naming it). The app is built by :func:`create_app` from a model already
prepared for decoding; :func:`qwenft.serve.command.serve_command` loads it, and the tests build several apps in
one process (each with its own metrics registry).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any, List, Optional

from fastapi import FastAPI, Request  # at module level: FastAPI reads the routes' annotations from the globals
from fastapi.responses import HTMLResponse, JSONResponse, Response

from qwenft.config import Config, ConfigError, QwenftError
from qwenft.serve.errors import APIError, install, model_fault
from qwenft.serve.metrics import ServeMetrics
from qwenft.serve.protocol import FINISH_REASONS, ChatRequest, chunk, completion, completion_id, token_logprobs, usage
from qwenft.serve.scheduler import Job, QueueFull, Scheduler, Stopping

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often a non-streaming request checks whether its client is still there (seconds)


@dataclass
class Served:
    """What the app serves: an :class:`~qwenft.generation.engine.Engine` (its ``side("base")`` disables the
    adapter), the tokenizer, the validated config, and the tuned model's id (None: the base alone)."""

    engine: Any
    tokenizer: Any
    config: Config
    tuned: Optional[str] = None

    @property
    def models(self) -> List[str]:
        return ["base"] + ([self.tuned] if self.tuned else [])

    @property
    def context_len(self) -> int:
        """Positions the model takes (its ``max_position_embeddings``)."""
        return int(getattr(self.engine.model.config, "max_position_embeddings", 32768))


def kv_bytes_per_token(model) -> int:
    """KV-cache bytes of one cached token in the model's dtype (the planner's formula)."""
    from qwenft.generation.engine import architecture
    from qwenft.plan.memory import kv_cache_bytes

    dtype = next(model.parameters()).dtype
    size = dtype.itemsize if dtype.is_floating_point else 2
    return kv_cache_bytes(architecture(model), 1, bytes_per_value=size)


def memory_capacity(device: str) -> int:
    """The device's memory in bytes: the GPU's on CUDA, physical RAM on a CPU."""
    import os

    import torch

    if device == "cuda":
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def create_app(served: Served):
    """Build the app for ``served``; the batcher starts and stops with the app's lifespan.

    Returns:
        A FastAPI app (``app.state.scheduler`` and ``app.state.metrics`` hold the batcher and the metrics).
    """
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from qwenft.generation.command import chat_input, peak_memory_bytes
    from qwenft.generation.generate import Sampler, encode_prompts
    from qwenft.generation.params import resolve_params

    config, engine, tokenizer = served.config, served.engine, served.tokenizer
    scfg = config.serve
    settings = engine.settings(config.generate)
    device = next(engine.model.parameters()).device.type
    per_token = kv_bytes_per_token(engine.model)
    capacity = per_token * scfg.max_batch * min(served.context_len, scfg.max_prompt_tokens + scfg.max_tokens)
    metrics = ServeMetrics(served.models, scfg.decode_floor_tokens_per_s, capacity, memory_capacity(device))
    samplers = {}

    def run_batch(side, prompts, overrides, on_text, control):
        with engine.side(side) as ready:
            if side not in samplers:
                samplers[side] = Sampler(ready, tokenizer, settings)
            return samplers[side].generate(prompts, on_text=on_text, control=control, **overrides)

    scheduler = Scheduler(run_batch, metrics, scfg.max_batch, scfg.max_queue, per_token,
                          lambda: peak_memory_bytes(device), scfg.batch_wait_ms / 1000)

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:  # after uvicorn's graceful wait: what still runs is cancelled
            await asyncio.get_running_loop().run_in_executor(None, scheduler.stop, scfg.shutdown_timeout_s)

    app = FastAPI(title="qwenft serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.metrics, app.state.served = scheduler, metrics, served
    install(app)

    def authorize(request: Request) -> None:
        if not scfg.api_key:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {scfg.api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send Authorization: Bearer KEY (serve.api_key)",
                           code="invalid_api_key")

    def model_entry(name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "qwenft",
                "root": "base" if name == "base" else served.tuned, "parent": None if name == "base" else "base"}

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse((resources.files("qwenft.serve") / "static" / "index.html").read_text(encoding="utf-8"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "models": served.models}

    @app.get("/metrics")
    async def prometheus(request: Request):
        authorize(request)
        metrics.set_peak(peak_memory_bytes(device))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [model_entry(name) for name in served.models]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):
        authorize(request)
        if name not in served.models:
            raise APIError(404, f"model '{name}' does not exist; served: {', '.join(served.models)}",
                           param="model", code="model_not_found")
        return model_entry(name)

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        too_big = APIError(413, f"the request body exceeds serve.max_body_bytes={scfg.max_body_bytes} bytes",
                           code="request_too_large")
        if declared and declared.isdigit() and int(declared) > scfg.max_body_bytes:
            raise too_big
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > scfg.max_body_bytes:
                raise too_big
        return bytes(body)

    def check(request_body: bytes) -> tuple:
        """The request parsed and checked: ``(request, side, prompt ids, overrides, params)``."""
        from pydantic import ValidationError

        from qwenft.serve.errors import validation_error

        try:
            req = ChatRequest.model_validate_json(request_body or b"{}")
        except ValidationError as exc:
            raise validation_error(exc.errors(include_url=False)) from None
        req.refuse_unsupported()
        if req.model not in served.models:
            raise APIError(404, f"model '{req.model}' does not exist; served: {', '.join(served.models)}",
                           param="model", code="model_not_found")
        side = "base" if req.model == "base" else "tuned"
        try:
            prompt = encode_prompts(tokenizer, [chat_input({"messages": req.chat()}, True, config.data.system_prompt)])[0]
        except (QwenftError, ValueError) as exc:
            raise APIError(400, f"messages: {exc}", param="messages") from None
        # max_tokens left out: the preset's, within the cap and what the context leaves after the prompt (an
        # answer the client never sized is not refused for its size)
        default = min(config.generate.max_new_tokens, scfg.max_tokens, max(served.context_len - len(prompt), 1))
        overrides = req.sampler_overrides(default, config.generate.stop_strings)
        wanted = overrides["max_new_tokens"]
        if wanted > scfg.max_tokens:
            raise APIError(400, f"max_tokens={wanted} exceeds this server's cap serve.max_tokens={scfg.max_tokens}",
                           param="max_tokens", code="invalid_value")
        if len(prompt) > scfg.max_prompt_tokens:
            raise APIError(400, f"the prompt has {len(prompt)} tokens; this server takes at most "
                           f"serve.max_prompt_tokens={scfg.max_prompt_tokens}", param="messages",
                           code="context_length_exceeded")
        if len(prompt) + wanted > served.context_len:
            raise APIError(400, f"this model's maximum context length is {served.context_len} tokens; the messages "
                           f"have {len(prompt)} and max_tokens asks for {wanted}", param="messages",
                           code="context_length_exceeded")
        try:
            params = resolve_params(settings, getattr(engine.model, "generation_config", None), tokenizer, **overrides)
        except ConfigError as exc:
            raise APIError(400, str(exc).replace("generate.", ""), code="invalid_value") from None
        return req, side, prompt, overrides, params

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        from starlette.concurrency import run_in_threadpool

        authorize(request)
        body = await read_body(request)
        # in a worker thread: the chat template and tokenizing a 1 MB prompt take a second, during which the event
        # loop would send no other client's tokens
        req, side, prompt, overrides, params = await run_in_threadpool(check, body)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def emit(event: tuple) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop is closed: the server is gone
                pass

        job = Job(side=side, model=req.model, prompt=prompt, overrides=overrides, params=params,
                  logprobs=req.logprob_count(), emit=emit)
        try:
            scheduler.submit(job)
        except QueueFull:
            raise APIError(429, f"the queue is full ({scfg.max_queue} requests wait); retry later",
                           code="queue_full") from None
        except Stopping:
            raise APIError(503, "the server is shutting down", code="shutting_down") from None
        if req.stream:
            return stream_response(req, job, events)
        return await collect(request, req, job, events)

    def entries(tokens) -> List[tuple]:
        return [(t, lp[0], lp[1]) for t, _, lp in tokens if lp is not None]

    async def collect(request: Request, req: ChatRequest, job: Job, events: asyncio.Queue):
        got: list = []
        try:
            while True:
                try:
                    event = await asyncio.wait_for(events.get(), POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        scheduler.cancel(job)  # the client left: its row stops costing decode steps
                        return Response(status_code=499)
                    continue
                if event[0] == "error":
                    raise (APIError(503, "the server is shutting down", code="shutting_down")
                           if isinstance(event[1], Stopping) else model_fault(event[1]))
                got.extend(event[-1])
                if event[0] == "done":
                    seq = event[1]
                    logprobs = token_logprobs(tokenizer, entries(got)) if job.logprobs >= 0 else None
                    return JSONResponse(completion(completion_id(), req.model, seq.text,
                                                   FINISH_REASONS[seq.stop_reason], seq.prompt_tokens,
                                                   len(seq.token_ids), logprobs))
        finally:
            scheduler.cancel(job)  # a no-op once done; on cancellation the row stops

    def stream_response(req: ChatRequest, job: Job, events: asyncio.Queue):
        from sse_starlette import EventSourceResponse

        include = bool(req.stream_options and req.stream_options.include_usage)
        cid, created = completion_id(), int(time.time())

        def data(body: dict) -> dict:
            return {"data": json.dumps(body, ensure_ascii=False)}

        def piece(delta: dict, tokens, finish=None) -> dict:
            # null in a chunk with no token (the role chunk, often the last), as OpenAI sends it
            logprobs = token_logprobs(tokenizer, entries(tokens)) if job.logprobs >= 0 and tokens else None
            return data(chunk(cid, req.model, created, delta, finish, logprobs, [e for _, e, _ in tokens],
                              with_usage=include))

        async def generate():
            try:
                yield piece({"role": "assistant", "content": ""}, [])
                while True:
                    event = await events.get()
                    if event[0] == "delta":
                        yield piece({"content": event[1]}, event[2])
                    elif event[0] == "done":
                        seq = event[1]
                        yield piece({}, event[2], FINISH_REASONS[seq.stop_reason])
                        if include:
                            yield data(chunk(cid, req.model, created, None, usage_row=usage(
                                seq.prompt_tokens, len(seq.token_ids)), with_usage=True))
                        break
                    else:  # the 200 is out: the error goes as a chunk of its own, then [DONE]
                        error = (APIError(503, "the server is shutting down", code="shutting_down")
                                 if isinstance(event[1], Stopping) else model_fault(event[1]))
                        yield data(error.body())
                        break
                yield {"data": "[DONE]"}
            finally:
                scheduler.cancel(job)  # a no-op once done; a client that left stops its row

        # "\n" between lines (sse-starlette's default "\r\n" broke clients: llama-cpp-python PR #1188)
        return EventSourceResponse(generate(), sep="\n")

    return app
