"""The ``eval.judge`` section: a pairwise judge of base vs tuned answers (:mod:`qwenft.evaluate.judge`).

The judge is either an OpenAI-compatible chat endpoint (``url`` and ``model``; its API key is read from the
environment variable named by ``api_key_env`` when a request is sent, never stored) or a conf/model preset run in
this process by qwenft's own sampler (``local``). Neither set: no judging.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from qwenft.config.base import _check, _check_choice

COMPARISONS = ("base", "reference")  # tuned vs base; tuned vs the held-out reference answer


@dataclass
class JudgeConfig:
    """A pairwise judge: each held-out prompt's two answers judged in both orders (docs/eval.md, "A judge")."""

    url: Optional[str] = None  # base URL of an OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1
    model: Optional[str] = None  # the model name each request sends (null: the endpoint's only model, from /models)
    local: Optional[str] = None  # or: a conf/model preset (e.g. qwen2.5-7b-instruct) run in process, 16-bit
    api_key_env: str = "OPENAI_API_KEY"  # the environment variable holding the key (unset: no key is sent)
    compare: List[str] = field(default_factory=lambda: ["base"])  # base (tuned vs base), reference (tuned vs it)
    reference: bool = True  # show the held-out reference answer to the judge when it compares tuned vs base
    rubric: Optional[str] = None  # a file replacing the default rubric: {question}, {answer_a}, {answer_b},
    # optionally {reference}; the judge ends its reply with [[A]], [[B]] or [[C]] (a tie), or is a JSON object
    # {"verdict": "A" | "B" | "C"}
    sources: Optional[List[str]] = None  # held-out sources judged (null: every source with generated answers)
    sanity_n: int = 20  # prompts of the sanity set (reference vs another prompt's reference); 0: none
    sanity_threshold: float = 0.8  # a judge below this sanity accuracy is flagged as not to be trusted
    concurrency: int = 4  # requests in flight at once
    timeout: float = 120.0  # seconds a request may take before it is retried
    retries: int = 3  # retries of a request on a timeout, HTTP 429 or 5xx (exponential backoff, the openai client's)
    max_tokens: int = 512  # tokens of a judge's reply at most
    temperature: float = 0.0
    cache: bool = True  # reuse a reply judged before with the same judge, rubric, prompt and answers
    cache_dir: Optional[str] = None  # where the replies are kept (null: $QWENFT_CACHE/judge, ~/.cache/qwenft/judge)
    examples: int = 5  # prompts in report.md where the judge most clearly preferred each side
    seed: int = 0  # which rows make the sanity set, and which wrong answer each meets

    @property
    def enabled(self) -> bool:
        return bool(self.url or self.local)

    def __post_init__(self) -> None:
        _check(not (self.url and self.local), "eval.judge.local", self.local,
               "a judge is an endpoint (eval.judge.url) or a local preset (eval.judge.local), not both")
        if self.url is not None:
            _check(isinstance(self.url, str) and self.url.startswith(("http://", "https://")), "eval.judge.url",
                   self.url, "must be an http:// or https:// base URL, e.g. http://127.0.0.1:8000/v1")
            from urllib.parse import urlsplit

            _check(urlsplit(self.url).password is None and urlsplit(self.url).username is None, "eval.judge.url",
                   "(hidden: it holds a user or password)", "a URL with credentials would be written to the run's "
                   "config and report: give the key in the environment variable eval.judge.api_key_env names")
        _check(isinstance(self.api_key_env, str) and bool(self.api_key_env), "eval.judge.api_key_env",
               self.api_key_env, "must name an environment variable (the key itself is never written in a config)")
        _check(not self.api_key_env.startswith(("sk-", "Bearer")), "eval.judge.api_key_env", "(hidden)",
               "is the NAME of the environment variable that holds the key, not the key: "
               "export OPENAI_API_KEY=... and leave eval.judge.api_key_env=OPENAI_API_KEY")
        _check(bool(self.compare), "eval.judge.compare", self.compare, "must name at least one of: base, reference")
        for name in self.compare:
            _check_choice("eval.judge.compare", name, COMPARISONS)
        _check(len(set(self.compare)) == len(self.compare), "eval.judge.compare", self.compare, "lists a name twice")
        _check(self.sanity_n >= 0, "eval.judge.sanity_n", self.sanity_n, "must be >= 0 (0: no sanity set)")
        _check(0.0 <= self.sanity_threshold <= 1.0, "eval.judge.sanity_threshold", self.sanity_threshold,
               "must be in [0, 1]")
        _check(self.concurrency >= 1, "eval.judge.concurrency", self.concurrency, "must be >= 1")
        _check(self.timeout > 0, "eval.judge.timeout", self.timeout, "must be > 0 seconds")
        _check(self.retries >= 0, "eval.judge.retries", self.retries, "must be >= 0")
        _check(self.max_tokens >= 1, "eval.judge.max_tokens", self.max_tokens, "must be >= 1")
        _check(0.0 <= self.temperature <= 2.0, "eval.judge.temperature", self.temperature, "must be in [0, 2]")
        _check(self.examples >= 0, "eval.judge.examples", self.examples, "must be >= 0")
