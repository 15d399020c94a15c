"""A small OpenAI-compatible judge on 127.0.0.1 that answers by a fixed rule, for the judge's tests.

Rule: the question holds a tag ``#N``; the answer (A or B) holding the same tag wins, both or neither: a tie (so
a right answer is one that names its question's tag, and another prompt's reference is wrong). Other behaviours, set on
the server: ``mode`` ``"A"`` (always [[A]]: a judge with a position bias), ``"garbage"`` (no verdict), ``"json"``
(a JSON verdict), ``"both"`` (names [[A]] and [[B]] in its reasons, its verdict on a later line); ``fail`` the number of requests answered
HTTP ``fail_status`` before the rule takes over; ``sleep`` seconds before each answer; ``key`` the only API key
accepted (401 otherwise); ``deny_after`` the number of chat requests answered before every later one is refused
with HTTP 401 (an endpoint that goes away mid-run). Every request's body is kept in ``requests``.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional

_SECTION = re.compile(r"\[Answer ([AB])\]\n(.*?)(?=\n\[Answer [AB]\]\n|\Z)", re.S)
_QUESTION = re.compile(r"\[Question\]\n(.*?)\n\n\[", re.S)
_TAG = re.compile(r"#\d+")


def rule_verdict(prompt: str) -> str:
    """"A", "B" or "C" by the tag rule (module docstring)."""
    question = _QUESTION.search(prompt)
    tags = _TAG.findall(question.group(1)) if question else []
    answers = dict(_SECTION.findall(prompt))
    if not tags:
        return "C"
    a, b = (tags[0] in _TAG.findall(answers.get(side, "")) for side in ("A", "B"))
    return "A" if a and not b else "B" if b and not a else "C"


class JudgeServer:
    """The rule-based judge as a context manager: ``url`` is its base URL (ending in /v1)."""

    def __init__(self, mode: str = "rule", fail: int = 0, fail_status: int = 500, sleep: float = 0.0,
                 key: Optional[str] = None, models: tuple = ("rule-judge",), deny_after: Optional[int] = None):
        self.mode, self.fail, self.fail_status, self.sleep, self.key, self.models = (mode, fail, fail_status, sleep,
                                                                                     key, models)
        self.deny_after = deny_after
        self.requests: List[Dict[str, Any]] = []
        self.lock = threading.Lock()

    def __enter__(self) -> "JudgeServer":
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, body: Dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                if judge.key is None or self.headers.get("Authorization") == f"Bearer {judge.key}":
                    return True
                self._send(401, {"error": {"message": "bad key", "type": "invalid_request_error"}})
                return False

            def do_GET(self) -> None:
                if not self._authorized():
                    return
                if self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in judge.models]})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if not self._authorized():
                    return
                if self.path.rstrip("/") != "/v1/chat/completions":
                    self._send(404, {"error": {"message": "not found"}})
                    return
                with judge.lock:
                    judge.requests.append(body)
                    failing = judge.fail > 0
                    judge.fail -= failing
                    denied = judge.deny_after is not None and len(judge.requests) > judge.deny_after
                if denied:
                    self._send(401, {"error": {"message": "key revoked"}})
                    return
                if judge.sleep:
                    time.sleep(judge.sleep)
                if failing:
                    self._send(judge.fail_status, {"error": {"message": "try again"}})
                    return
                self._send(200, {"id": "x", "object": "chat.completion", "created": 0, "model": body.get("model"),
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant",
                                                          "content": judge.reply(body["messages"][-1]["content"])}}]})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def reply(self, prompt: str) -> str:
        if self.mode == "A":
            return "Both are fine, but the first reads better. [[A]]"
        if self.mode == "garbage":
            return "I cannot decide between these."
        verdict = rule_verdict(prompt)
        if self.mode == "json":
            return json.dumps({"reason": "by the rule", "verdict": verdict})
        if self.mode == "both":
            return f"One might say [[A]] or [[B]].\nBy the rule the verdict is:\n[[{verdict}]]\n"
        return f"By the rule. [[{verdict}]]"

    def judged(self) -> List[str]:
        """The prompts (user messages) of the chat requests received, the preflight left out."""
        return [r["messages"][-1]["content"] for r in self.requests if "[Answer A]" in r["messages"][-1]["content"]]

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
