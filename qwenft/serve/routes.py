"""The routes, auth, caps, and the bridge from a request to the batcher, over the app's
:class:`~qwenft.serve.state.ServeState` (``app.state.serve``).

A request is checked completely before it is queued (fields, model, caps, context), so what reaches the sampler
can only fail by a fault of the model (500 naming it). The batcher answers a queued request with
:mod:`~qwenft.serve.scheduler` events, which become one JSON body or a stream of ``chat.completion.chunk`` events.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Dict, List, Sequence, Tuple

from fastapi import APIRouter, Request  # at module level: FastAPI reads the routes' annotations from the globals
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from qwenft.config import ConfigError, QwenftError
from qwenft.generation.command import chat_input, peak_memory_bytes
from qwenft.generation.generate import encode_prompts
from qwenft.generation.params import SamplingParams, resolve_params
from qwenft.serve.errors import APIError, job_failure, model_not_found, shutting_down, validation_error
from qwenft.serve.protocol import FINISH_REASONS, ChatRequest, chunk, completion, completion_id, token_logprobs, usage
from qwenft.serve.scheduler import Delta, Done, Event, Failed, Job, QueueFull, Stopping, Token
from qwenft.serve.state import Served, ServeState

POLL_S = 0.5  # how often a non-streaming request checks whether its client is still there (seconds)

router = APIRouter()


def authorized(request: Request) -> ServeState:
    """The app's state, once ``request`` may use it.

    Raises:
        APIError: 401 when ``serve.api_key`` is set and the request does not send ``Authorization: Bearer KEY``.
    """
    state = request.app.state.serve
    if state.limits.api_key:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {state.limits.api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send Authorization: Bearer KEY (serve.api_key)",
                           code="invalid_api_key")
    return state


def model_entry(served: Served, name: str) -> dict:
    """OpenAI's model object for the served model ``name``."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "qwenft",
            "root": "base" if name == "base" else served.tuned, "parent": None if name == "base" else "base"}


@router.get("/", response_class=HTMLResponse)
async def page():
    """The side-by-side page (public: it holds no data and asks for the key)."""
    return HTMLResponse((resources.files("qwenft.serve") / "static" / "index.html").read_text(encoding="utf-8"))


@router.get("/health")
async def health(request: Request):
    """Liveness and the served model ids (public)."""
    return {"status": "ok", "models": request.app.state.serve.served.models}


@router.get("/metrics")
async def prometheus(request: Request):
    """The app's metrics in Prometheus' text format, the peak memory read now."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    state = authorized(request)
    state.metrics.set_peak(peak_memory_bytes(state.device))
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request):
    """OpenAI's model list: ``base`` and the tuned model's id."""
    served = authorized(request).served
    return {"object": "list", "data": [model_entry(served, name) for name in served.models]}


@router.get("/v1/models/{name:path}")
async def model(name: str, request: Request):
    """One served model.

    Raises:
        APIError: 404 when ``name`` is not served.
    """
    served = authorized(request).served
    if name not in served.models:
        raise model_not_found(name, served.models)
    return model_entry(served, name)


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, read up to ``limit`` bytes.

    Raises:
        APIError: 413 when the declared length or the bytes received exceed ``limit``.
    """
    declared = request.headers.get("content-length")
    too_big = APIError(413, f"the request body exceeds serve.max_body_bytes={limit} bytes", code="request_too_large")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_big
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise too_big
    return bytes(body)


def check(state: ServeState, body: bytes) -> Tuple[ChatRequest, str, List[int], Dict[str, Any], SamplingParams]:
    """Parse and check a chat request's body against the served models and the caps.

    Returns:
        ``(request, side, prompt token ids, sampler overrides, resolved sampling params)``.

    Raises:
        APIError: 400 naming the field at fault (context length, caps, sampling settings); 404 for a model not
            served.
    """
    served, limits = state.served, state.limits
    config, tokenizer = served.config, served.tokenizer
    try:
        req = ChatRequest.model_validate_json(body or b"{}")
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None
    req.refuse_unsupported()
    if req.model not in served.models:
        raise model_not_found(req.model, served.models)
    side = "base" if req.model == "base" else "tuned"
    try:
        prompt = encode_prompts(tokenizer, [chat_input({"messages": req.chat()}, True, config.data.system_prompt)])[0]
    except (QwenftError, ValueError) as exc:
        raise APIError(400, f"messages: {exc}", param="messages") from None
    # max_tokens left out: the preset's, within the cap and what the context leaves after the prompt (an
    # answer the client never sized is not refused for its size)
    default = min(config.generate.max_new_tokens, limits.max_tokens, max(served.context_len - len(prompt), 1))
    overrides = req.sampler_overrides(default, config.generate.stop_strings)
    wanted = overrides["max_new_tokens"]
    if wanted > limits.max_tokens:
        raise APIError(400, f"max_tokens={wanted} exceeds this server's cap serve.max_tokens={limits.max_tokens}",
                       param="max_tokens", code="invalid_value")
    if len(prompt) > limits.max_prompt_tokens:
        raise APIError(400, f"the prompt has {len(prompt)} tokens; this server takes at most "
                       f"serve.max_prompt_tokens={limits.max_prompt_tokens}", param="messages",
                       code="context_length_exceeded")
    if len(prompt) + wanted > served.context_len:
        raise APIError(400, f"this model's maximum context length is {served.context_len} tokens; the messages "
                       f"have {len(prompt)} and max_tokens asks for {wanted}", param="messages",
                       code="context_length_exceeded")
    try:
        params = resolve_params(state.settings, getattr(served.engine.model, "generation_config", None), tokenizer,
                                **overrides)
    except ConfigError as exc:
        raise APIError(400, str(exc).replace("generate.", ""), code="invalid_value") from None
    return req, side, prompt, overrides, params


def deliver(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, event: Event) -> None:
    """A job's ``emit``: hand ``event`` from the batcher's thread to the request's queue on ``loop`` (dropped when
    the loop is closed: the server is gone)."""
    try:
        loop.call_soon_threadsafe(events.put_nowait, event)
    except RuntimeError:
        pass


@router.post("/v1/chat/completions")
async def chat(request: Request):
    """A chat completion: one JSON ``chat.completion`` or, with ``stream``, a stream of chunks.

    Raises:
        APIError: 401 without the key; 400/404/413 for a request :func:`check` or :func:`read_body` refuses; 429
            when the queue is full; 503 when the server is shutting down.
    """
    state = authorized(request)
    body = await read_body(request, state.limits.max_body_bytes)
    # in a worker thread: the chat template and tokenizing a 1 MB prompt take a second, during which the event
    # loop would send no other client's tokens
    req, side, prompt, overrides, params = await run_in_threadpool(check, state, body)
    events: asyncio.Queue = asyncio.Queue()
    job = Job(side=side, model=req.model, prompt=prompt, overrides=overrides, params=params,
              logprobs=req.logprob_count(), emit=functools.partial(deliver, asyncio.get_running_loop(), events))
    try:
        state.scheduler.submit(job)
    except QueueFull:
        raise APIError(429, f"the queue is full ({state.limits.max_queue} requests wait); retry later",
                       code="queue_full") from None
    except Stopping:
        raise shutting_down() from None
    if req.stream:
        return stream_response(state, req, job, events)
    return await collect(request, state, req, job, events)


def logprob_entries(tokens: Sequence[Token]) -> List[tuple]:
    """``(id, logprob, alternatives)`` of the tokens that carry logprobs (the input of ``token_logprobs``)."""
    return [(t.id, *t.logprobs) for t in tokens if t.logprobs is not None]


async def collect(request: Request, state: ServeState, req: ChatRequest, job: Job, events: asyncio.Queue):
    """The non-streaming answer: the job's events gathered into one ``chat.completion`` (a 499 without a body when
    the client left first, which cancels the job).

    Raises:
        APIError: 503 when the server stopped the job; 500 for a fault of the model.
    """
    got: List[Token] = []
    try:
        while True:
            try:
                event = await asyncio.wait_for(events.get(), POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    state.scheduler.cancel(job)  # the client left: its row stops costing decode steps
                    return Response(status_code=499)
                continue
            if isinstance(event, Failed):
                raise job_failure(event.error)
            got.extend(event.tokens)
            if isinstance(event, Done):
                seq = event.result
                logprobs = token_logprobs(state.served.tokenizer, logprob_entries(got)) if job.logprobs >= 0 else None
                return JSONResponse(completion(completion_id(), req.model, seq.text, FINISH_REASONS[seq.stop_reason],
                                               seq.prompt_tokens, len(seq.token_ids), logprobs))
    finally:
        state.scheduler.cancel(job)  # a no-op once done; on cancellation the row stops


def sse(body: dict) -> dict:
    """``body`` as an sse-starlette event (one ``data:`` line of JSON)."""
    return {"data": json.dumps(body, ensure_ascii=False)}


@dataclass(frozen=True)
class Chunks:
    """The ``chat.completion.chunk`` events of one streamed answer, sharing its id and creation time (seconds).

    Attributes:
        tokenizer: decodes the tokens of the logprobs.
        req: the request; logprobs: whether it asked for logprobs.
    """

    tokenizer: Any
    req: ChatRequest
    logprobs: bool
    cid: str = field(default_factory=completion_id)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def include_usage(self) -> bool:
        """Whether the request asked for the final usage chunk (``stream_options.include_usage``)."""
        return bool(self.req.stream_options and self.req.stream_options.include_usage)

    def piece(self, delta: dict, tokens: Sequence[Token], finish=None) -> dict:
        """The chunk of ``delta`` and the ``tokens`` it decodes (their entropies; logprobs when asked)."""
        # null in a chunk with no token (the role chunk, often the last), as OpenAI sends it
        logprobs = token_logprobs(self.tokenizer, logprob_entries(tokens)) if self.logprobs and tokens else None
        return sse(chunk(self.cid, self.req.model, self.created, delta, finish, logprobs, [t.entropy for t in tokens],
                         with_usage=self.include_usage))

    def usage_chunk(self, seq) -> dict:
        """The final chunk with ``choices: []`` and the usage of the finished sequence ``seq``."""
        return sse(chunk(self.cid, self.req.model, self.created, None,
                         usage_row=usage(seq.prompt_tokens, len(seq.token_ids)), with_usage=True))


def stream_response(state: ServeState, req: ChatRequest, job: Job, events: asyncio.Queue):
    """The streamed answer: a role chunk, a chunk per event, the usage chunk when asked, then ``data: [DONE]``."""
    from sse_starlette import EventSourceResponse

    chunks = Chunks(state.served.tokenizer, req, job.logprobs >= 0)
    # "\n" between lines (sse-starlette's default "\r\n" broke clients: llama-cpp-python PR #1188)
    return EventSourceResponse(stream_events(chunks, state, job, events), sep="\n")


async def stream_events(chunks: Chunks, state: ServeState, job: Job, events: asyncio.Queue):
    """The events of :func:`stream_response`; an error once the 200 is out goes as a chunk of its own."""
    try:
        yield chunks.piece({"role": "assistant", "content": ""}, [])
        while True:
            event = await events.get()
            if isinstance(event, Delta):
                yield chunks.piece({"content": event.text}, event.tokens)
            elif isinstance(event, Done):
                yield chunks.piece({}, event.tokens, FINISH_REASONS[event.result.stop_reason])
                if chunks.include_usage:
                    yield chunks.usage_chunk(event.result)
                break
            else:
                yield sse(job_failure(event.error).body())
                break
        yield {"data": "[DONE]"}
    finally:
        state.scheduler.cancel(job)  # a no-op once done; a client that left stops its row
