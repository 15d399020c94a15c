"""OpenAI's chat-completions shapes: the request as read and checked, its conversion to the sampler's settings, and
the response and stream chunks. Apart from the handlers (as vLLM's ``entrypoints/openai/protocol.py`` is), so the
conversion to :class:`~qwenft.config.GenerateConfig` fields is written and tested once.

qwenft's own sampler controls come as extra fields (``top_k``, ``min_p``, ``repetition_penalty``), as vLLM takes
them; the OpenAI Python client sends them with ``extra_body=``. Fields OpenAI defines that qwenft cannot honour
(``n`` > 1, non-zero presence/frequency penalties, tools, a JSON response format) are refused with 400 naming them,
never silently ignored; fields it does not know are ignored, as OpenAI's API ignores ``user`` or ``metadata``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from qwenft.serve.errors import APIError

FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "length": "length", "cancelled": "abort"}
MIN_TEMPERATURE = 1e-3  # a logit of 100 divided by it stays far inside fp32 (3.4e38)


class Message(BaseModel):
    """A chat turn. ``content`` is a string or OpenAI's list of parts, of which only ``{"type": "text", "text"}``
    is accepted (read into one string here, so a bad part is named by its index, not by a pydantic union branch)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]  # developer: OpenAI's newer name for system
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value):
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of text parts ({\"type\": \"text\", \"text\": ...})")
        texts = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"part {i}: only {{\"type\": \"text\", \"text\": STRING}} parts are supported"
                                 + (f" (got type {kind!r})" if isinstance(kind, str) and kind != "text" else ""))
            texts.append(part["text"])
        return "".join(texts)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatRequest(BaseModel):
    """``POST /v1/chat/completions``. ``max_tokens`` counts generated tokens (the end token included)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # NaN / Infinity: "should be a finite number"
    model: str
    messages: List[Message] = Field(min_length=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    stop: Union[None, str, List[str]] = None
    seed: Optional[int] = Field(None, ge=-(2 ** 63), le=2 ** 64 - 1)  # torch.Generator.manual_seed's range
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    tools: Optional[Any] = None
    response_format: Optional[Dict[str, Any]] = None
    # qwenft's sampler controls (vLLM's extra fields); top_k -1 means disabled, as in vLLM
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, ge=0.01, le=10)  # scores times 100 at most: finite

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("give at most 16 non-empty stop strings")
        return stops

    def refuse_unsupported(self) -> None:
        """Raise 400 for a field OpenAI defines that qwenft does not implement (named in ``param``)."""
        if self.n != 1:
            raise APIError(400, f"n={self.n}: qwenft returns one choice per request", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported; use repetition_penalty (CTRL's, > 1 discourages "
                               "repetition)", param=name)
        if self.tools:
            raise APIError(400, "tools are not supported by qwenft serve", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format {\"type\": \"text\"} is supported", param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")

    def chat(self) -> List[Dict[str, str]]:
        """The messages as the chat template takes them (a ``developer`` turn, which newer OpenAI clients send in
        place of ``system``, is the system turn)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.content} for m in self.messages]

    def sampler_overrides(self, default_max_tokens: int, config_stops: Sequence[str]) -> Dict[str, Any]:
        """The :class:`~qwenft.config.GenerateConfig` fields this request sets, for ``Sampler.params``.

        A field left out keeps the server's preset (``generate=...``) and then the model's generation_config,
        exactly as ``qwenft generate`` resolves it. ``temperature`` given: below :data:`MIN_TEMPERATURE` (0
        included) is greedy, above samples.

        Args:
            default_max_tokens: used when neither ``max_tokens`` nor ``max_completion_tokens`` is given.
            config_stops: the preset's ``stop_strings``; the request's ``stop`` adds to them.
        """
        out: Dict[str, Any] = {"max_new_tokens": self.max_tokens or self.max_completion_tokens or default_max_tokens}
        if self.temperature is not None:  # below MIN_TEMPERATURE, scores / t overflow fp32: greedy is that limit
            out["do_sample"] = self.temperature >= MIN_TEMPERATURE
            if out["do_sample"]:
                out["temperature"] = self.temperature
        for name in ("top_p", "min_p", "repetition_penalty", "seed"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.top_k is not None:
            out["top_k"] = max(self.top_k, 0)
        if self.stop:
            out["stop_strings"] = list(dict.fromkeys([*config_stops, *self.stop]))
        return out

    def logprob_count(self) -> int:
        """-1: no logprobs; else the number of alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else -1


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> Dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def token_logprobs(tokenizer, entries: Sequence[Tuple[int, float, Sequence[Tuple[int, float]]]]) -> List[dict]:
    """OpenAI's ``logprobs.content``: per token ``{token, logprob, bytes, top_logprobs}`` (UTF-8 bytes of the
    token's own text; a token holding part of a character shows U+FFFD, as OpenAI's do)."""

    def one(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [{**one(t, lp), "top_logprobs": [one(i, v) for i, v in top]} for t, lp, top in entries]


def completion(cid: str, model: str, text: str, finish: str, prompt_tokens: int, completion_tokens: int,
               logprobs: Optional[List[dict]]) -> dict:
    """The non-streaming response body."""
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None if logprobs is None else {"content": logprobs}, "finish_reason": finish}],
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk(cid: str, model: str, created: int, delta: Optional[dict], finish: Optional[str] = None,
          logprobs: Optional[List[dict]] = None, entropies: Optional[List[float]] = None,
          usage_row: Optional[dict] = None, with_usage: bool = False) -> dict:
    """One ``chat.completion.chunk``. ``delta`` None: the usage-only chunk (``choices: []``). ``entropies``: the
    entropy (nats) of each token behind this delta, an extra ``qwenft`` field (the page colours text by it)."""
    body: Dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "system_fingerprint": None, "choices": []}
    if delta is not None:
        body["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish,
                            "logprobs": None if logprobs is None else {"content": logprobs}}]
    if entropies is not None:
        body["qwenft"] = {"entropies": [round(e, 4) for e in entropies]}
    if with_usage:
        body["usage"] = usage_row
    return body
