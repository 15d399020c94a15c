"""Who answers the judge's prompts: an OpenAI-compatible chat endpoint or a local model, behind a reply cache.

- :class:`EndpointJudge`: the ``openai`` client (its timeout, and its retries with exponential backoff on a timeout,
  a dropped connection, HTTP 408 / 409 / 429 / 5xx, honouring ``Retry-After``), ``eval.judge.concurrency`` requests
  in flight from a thread pool. The API key is read from ``$`` ``eval.judge.api_key_env`` when the client is made
  and kept in memory only. An endpoint that cannot be reached or refuses the key or the model
  or the request (HTTP 400 / 401 / 403 / 404 / 413 / 422) stops the judging with :class:`JudgeUnavailable` (one line, exit 2); a request that still
  fails after its retries is recorded as an error for its match, which is counted, not dropped.
- :class:`LocalJudge`: a conf/model preset loaded in this process (16-bit) and qwenft's own sampler, batched.
- :class:`ReplyCache`: one JSON file per reply under ``$QWENFT_CACHE/judge``, keyed by the SHA-256 of (judge, prompt
  sent, which holds the rubric, the question and both answers, temperature, max_tokens), so a re-run asks only for
  what changed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from qwenft.config import Config, JudgeConfig, QwenftError

log = logging.getLogger(__name__)

# the endpoint refuses the key, the route, the model or the request itself (max_tokens above its cap, a prompt too
# long): asking again, or asking the next prompt, will not help
FATAL_STATUS = (400, 401, 403, 404, 413, 422)


for _name in ("httpx", "httpx2", "openai"):  # a line per request at INFO would bury the progress bar
    logging.getLogger(_name).setLevel(logging.WARNING)


class JudgeUnavailable(QwenftError):
    """The judge endpoint is down or refuses the key / the model: one line naming the URL and the HTTP status."""


class ReplyCache:
    """Judge replies on disk, one file per key (written to a temp name, then renamed), under ``root``."""

    def __init__(self, root: Optional[Path]):
        self.root = root

    @staticmethod
    def key(judge_id: str, prompt: str, judge: JudgeConfig) -> str:
        """SHA-256 of the judge's identity, the prompt (rubric, question, answers) and the reply settings."""
        blob = json.dumps([judge_id, prompt, judge.temperature, judge.max_tokens], ensure_ascii=False)
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str) -> Optional[str]:
        if self.root is None:
            return None
        try:
            return json.loads(self._path(key).read_text(encoding="utf-8"))["reply"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, reply: str) -> None:
        """Keep one reply; a cache that cannot be written (disk full, permissions) is given up with one warning,
        never at the cost of the judging."""
        if self.root is None:
            return
        from qwenft.files import atomic_write_text

        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps({"reply": reply}, ensure_ascii=False))
        except OSError as exc:
            log.warning("the judge's reply cache %s cannot be written (%s): judging on without it", self.root, exc)
            self.root = None


def check_cache_dir(root: Optional[Path]) -> None:
    """A usable cache directory (made when missing).

    Raises:
        ConfigError: naming ``eval.judge.cache_dir`` when it is a file or cannot be made or written.
    """
    if root is None:
        return
    from qwenft.config import ConfigError

    try:
        root.mkdir(parents=True, exist_ok=True)
        usable = root.is_dir() and os.access(root, os.W_OK)
    except OSError:
        usable = False
    if not usable:
        raise ConfigError(f"eval.judge.cache_dir={str(root)!r}: not a directory qwenft can write (the judge's reply "
                          "cache; eval.judge.cache=false runs without one)")


def cache_root(judge: JudgeConfig) -> Optional[Path]:
    """``eval.judge.cache_dir``, else ``$QWENFT_CACHE/judge`` (:func:`qwenft.runtime.cache_dir`); None with
    ``eval.judge.cache=false``."""
    from qwenft.runtime import cache_dir

    if not judge.cache:
        return None
    return Path(judge.cache_dir).expanduser() if judge.cache_dir else cache_dir() / "judge"


def _said(exc) -> str:
    """The endpoint's own error message, one line of at most 200 characters."""
    body = getattr(exc, "body", None)
    message = body.get("message") if isinstance(body, dict) else None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = body["error"].get("message")
    text = " ".join(str(message or getattr(exc, "message", "") or "no message").split())
    return text[:200]


class EndpointJudge:
    """An OpenAI-compatible ``/chat/completions`` endpoint as the judge."""

    def __init__(self, judge: JudgeConfig):
        from openai import OpenAI

        self.judge = judge
        self.url = judge.url.rstrip("/")
        key = os.environ.get(judge.api_key_env) or "none"  # local servers take any key; never stored
        self.client = OpenAI(base_url=self.url, api_key=key, timeout=judge.timeout, max_retries=judge.retries)
        self.model = judge.model

    @property
    def id(self) -> str:
        return f"{self.url}#{self.model}"

    def describe(self) -> str:
        return f"model {self.model!r} at {self.url}"

    def _unavailable(self, exc: Exception) -> JudgeUnavailable:
        from openai import APIStatusError

        if isinstance(exc, APIStatusError):
            status = exc.status_code
            if status in (401, 403):
                env = self.judge.api_key_env
                hint = (f"the API key was refused (read from ${env})" if os.environ.get(env) else
                        f"the endpoint wants an API key and ${env} is not set (eval.judge.api_key_env names it)")
            elif status == 404:
                hint = (f"no such route or model {self.model!r} (a base URL usually ends in /v1; "
                        f"{self._models_served()})")
            elif status in (400, 413, 422):
                hint = f"the request was refused: {_said(exc)} (eval.judge.max_tokens={self.judge.max_tokens})"
            else:
                hint = f"the endpoint failed: {_said(exc)}"
            return JudgeUnavailable(f"judge endpoint {self.url}: HTTP {status}, {hint}")
        reason = str(exc).splitlines()[0] if str(exc) else "connection failed"
        tls = " (an https:// URL for an http:// server?)" if self.url.startswith("https://") else ""
        return JudgeUnavailable(f"judge endpoint {self.url}: no HTTP response ({type(exc).__name__}: {reason}){tls}")

    def _models_served(self) -> str:
        """``models served: a, b`` from ``/models``, or what could not be learned."""
        try:
            names = [m.id for m in self.client.with_options(max_retries=0, timeout=10.0).models.list().data]
        except Exception:  # the hint only: the error being reported is the 404
            return "the endpoint does not list its models"
        return f"models served: {', '.join(names) or 'none'}"

    def resolve(self) -> None:
        """``eval.judge.model`` when null: the endpoint's only model, from ``/models``.

        Raises:
            JudgeUnavailable: no HTTP response, an HTTP error status, or not exactly one model served.
        """
        from openai import APIConnectionError, APIStatusError

        if self.model is not None:
            return
        try:
            names = [m.id for m in self.client.models.list().data]
        except (APIConnectionError, APIStatusError) as exc:
            raise self._unavailable(exc) from None
        if len(names) != 1:
            raise JudgeUnavailable(f"judge endpoint {self.url} serves {len(names)} models "
                                   f"({', '.join(names) or 'none'}): name one with eval.judge.model=NAME")
        self.model = names[0]

    def preflight(self) -> None:
        """Reach the endpoint before any model loads (before training, in ``train``): :meth:`resolve`, then one
        short request with the judging's ``max_tokens`` (a server whose cap is lower refuses it now, not after the
        evaluation), with the configured timeout and retries (a busy endpoint is not a down one).

        Raises:
            JudgeUnavailable: no HTTP response, or an HTTP error status (after the retries of a 429 / 5xx).
        """
        from openai import APIConnectionError, APIStatusError

        self.resolve()
        try:
            self.client.chat.completions.create(model=self.model, max_tokens=self.judge.max_tokens, temperature=0.0,
                                                messages=[{"role": "user", "content": "Reply with the one word OK."}])
        except (APIConnectionError, APIStatusError) as exc:
            raise self._unavailable(exc) from None
        log.info("judge: %s answered; it judges after the evaluation", self.describe())

    def complete(self, prompt: str) -> Dict[str, str]:
        """One reply: ``{"reply": text}``, or ``{"error": "..."}`` after the retries of a timeout, a 429 or a 5xx.

        Raises:
            JudgeUnavailable: no HTTP response, or HTTP 400 / 401 / 403 / 404 / 413 / 422 (the request or the key
                refused: the next prompt would be refused too).
        """
        from openai import APIConnectionError, APIStatusError, APITimeoutError

        try:
            response = self.client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": prompt}],
                max_tokens=self.judge.max_tokens, temperature=self.judge.temperature)
        except APITimeoutError:
            return {"error": f"timed out after {self.judge.timeout:g} s, {self.judge.retries} retries"}
        except APIStatusError as exc:
            if exc.status_code in FATAL_STATUS:
                raise self._unavailable(exc) from None
            return {"error": f"HTTP {exc.status_code} after {self.judge.retries} retries"}
        except APIConnectionError as exc:
            raise self._unavailable(exc) from None
        choices = getattr(response, "choices", None) or []
        content = choices[0].message.content if choices and choices[0].message else None
        if content is None:
            return {"error": "the response held no message content"}
        return {"reply": content}

    def complete_all(self, prompts: Sequence[str], desc: str, on_result: Callable[[int, Dict[str, str]], None]
                     ) -> List[Dict[str, str]]:
        """:meth:`complete` for every prompt, ``eval.judge.concurrency`` at a time, with a progress bar; results in
        input order, each also handed to ``on_result(index, result)`` as it arrives (the cache keeps what was
        answered before a failure). A :class:`JudgeUnavailable` cancels what has not started and is raised."""
        from tqdm.auto import tqdm

        results: List[Optional[Dict[str, str]]] = [None] * len(prompts)
        pool = ThreadPoolExecutor(max_workers=self.judge.concurrency)
        try:
            futures = {pool.submit(self.complete, prompt): i for i, prompt in enumerate(prompts)}
            with tqdm(total=len(prompts), desc=desc, unit="request", leave=False) as bar:
                for future in as_completed(futures):
                    index = futures[future]
                    results[index] = future.result()
                    on_result(index, results[index])
                    bar.update(1)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        return results  # type: ignore[return-value]


class LocalJudge:
    """A conf/model preset run in this process (``eval.judge.local``), 16-bit, by qwenft's sampler: greedy at
    temperature 0, else sampled with ``eval.judge.seed``."""

    def __init__(self, config: Config):
        import dataclasses

        from qwenft.config import QuantConfig
        from qwenft.generation import Sampler
        from qwenft.generation.engine import prepare_for_decoding
        from qwenft.model.lora import load_for_inference

        self.judge = config.eval.judge
        self.preset = preset_model(self.judge.local)
        local = dataclasses.replace(config, model=self.preset, quant=QuantConfig(method="none"), adapter=None)
        model, self.tokenizer = load_for_inference(local)
        self.engine = prepare_for_decoding(model, local, cache_len=4096 + self.judge.max_tokens, prompt_len=4096)
        from qwenft.config import GenerateConfig

        greedy = self.judge.temperature == 0
        settings = GenerateConfig(max_new_tokens=self.judge.max_tokens, do_sample=not greedy,
                                  temperature=None if greedy else self.judge.temperature, seed=self.judge.seed)
        self.sampler = Sampler(self.engine.model, self.tokenizer, self.engine.settings(settings))
        self.batch_size = 8

    @property
    def id(self) -> str:
        return f"local:{self.preset.name}:{self.preset.path}:{self.preset.revision}"

    def describe(self) -> str:
        return f"{self.preset.name} (local, in this process)"

    def preflight(self) -> None:
        """Nothing to reach: the model is loaded."""

    def resolve(self) -> None:
        """Nothing to resolve: the preset names the model."""

    def complete_all(self, prompts: Sequence[str], desc: str, on_result: Callable[[int, Dict[str, str]], None]
                     ) -> List[Dict[str, str]]:
        """Every prompt's reply, generated in batches of similar length; each handed to ``on_result`` too."""
        from qwenft.generation.batches import generate_many

        ids = [self.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False) for p in prompts]
        sequences, _ = generate_many(self.sampler, ids, self.batch_size, desc=desc)
        results = [{"reply": seq.text} for seq in sequences]
        for index, result in enumerate(results):
            on_result(index, result)
        return results


def preset_model(name: str):
    """The :class:`~qwenft.config.ModelConfig` of conf/model/NAME.yaml.

    Raises:
        ConfigError: no such preset (the presets are listed).
    """
    from omegaconf import OmegaConf

    from qwenft.config import ConfigError, ModelConfig
    from qwenft.resources import conf_dir

    folder = conf_dir() / "model"
    path = folder / f"{name}.yaml"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in folder.glob("*.yaml")))
        raise ConfigError(f"eval.judge.local={name!r}: no such model preset; presets: {names}")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path)))


def make_judge(config: Config):
    """The judge ``eval.judge`` names: an :class:`EndpointJudge` (not yet contacted) or a loaded :class:`LocalJudge`."""
    return EndpointJudge(config.eval.judge) if config.eval.judge.url else LocalJudge(config)
