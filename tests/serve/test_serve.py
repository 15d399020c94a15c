"""``qwenft serve`` on tiny-random, driven by the ``openai`` client (max_retries=0) on 127.0.0.1: models, greedy
answers equal to ``qwenft generate`` token for token (base and tuned, plain and streamed), OpenAI-shaped errors and
a server that keeps serving after each, the caps and the API key."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

import httpx  # noqa: E402  (a dependency of openai)
import openai  # noqa: E402

from tests.conftest import ROOT  # noqa: E402
from tests.serve.conftest import LiveServer, make_adapter, metric, served  # noqa: E402

PROMPTS = ["Hello there, how are you", "春天来了", "0 1 2 3"]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return make_adapter(tmp_path_factory.mktemp("adapter"))


@pytest.fixture(scope="module")
def tiny_served(adapter):
    return served(adapter)


@pytest.fixture(scope="module")
def live(tiny_served):
    with LiveServer(tiny_served) as server:
        yield server


def generate_file(tmp_path, adapter, prompts, max_new_tokens):
    """``qwenft generate prompts_file=...`` in this process: each prompt's ``token_ids`` and ``output``."""
    from qwenft.generation.command import generate_command
    from tests.serve.conftest import serve_config

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}, ensure_ascii=False) + "\n" for p in prompts), encoding="utf-8")
    out = tmp_path / f"out-{bool(adapter)}.jsonl"
    config = serve_config(adapter, f"prompts_file={path}", f"out={out}",
                          f"generate.max_new_tokens={max_new_tokens}", "generate.do_sample=false",
                          "generate.batch_size=1")
    config.command = "generate"
    generate_command(config)
    return [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]


def test_models_list_base_and_the_run(live, tiny_served):
    ids = [m.id for m in live.client().models.list().data]
    assert ids == ["base", tiny_served.tuned] == tiny_served.models
    assert tiny_served.tuned.endswith("/RUN")  # named after the run: RUN/adapter -> its last two folders
    assert live.client().models.retrieve(tiny_served.tuned).id == tiny_served.tuned
    with pytest.raises(openai.NotFoundError):
        live.client().models.retrieve("gpt-4")


def test_greedy_equals_qwenft_generate_token_for_token(live, adapter, tmp_path, tiny_served):
    """Base (adapter disabled) and tuned, non-streamed and streamed: the same tokens as ``qwenft generate``."""
    client, tokenizer = live.client(), live.app.state.served.tokenizer
    answers = {}
    for side, model in (("base", "base"), ("tuned", tiny_served.tuned)):
        expected = generate_file(tmp_path, adapter if side == "tuned" else None, PROMPTS, 12)
        answers[side] = [row["output"] for row in expected]
        for prompt, row in zip(PROMPTS, expected):
            reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                   temperature=0, max_tokens=12, logprobs=True, top_logprobs=2)
            choice = reply.choices[0]
            assert choice.message.content == row["output"]
            assert [t.token for t in choice.logprobs.content] == [tokenizer.decode([i]) for i in row["token_ids"]]
            assert reply.usage.completion_tokens == row["completion_tokens"]
            assert reply.usage.prompt_tokens == row["prompt_tokens"]
            assert choice.finish_reason == {"eos": "stop", "length": "length"}[row["stop_reason"]]
            assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
            stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                    temperature=0, max_tokens=12, stream=True,
                                                    stream_options={"include_usage": True})
            chunks = list(stream)
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == row["output"]
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == row["completion_tokens"]
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert answers["base"] != answers["tuned"]  # the adapter is on for one side only


def test_stream_ends_with_done_and_plain_newlines(live):
    body = {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, timeout=60) as response:
        raw = "".join(response.iter_text())
    assert response.status_code == 200 and "\r" not in raw
    events = [line for line in raw.split("\n") if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and raw.endswith("\n\n")
    assert all("entropies" in json.loads(e[6:]).get("qwenft", {}) for e in events[:-1])


@pytest.mark.parametrize("body,status,param", [
    ({"model": "base", "messages": [{"role": "user", "content": "hi"}], "temperature": 5}, 400, "temperature"),
    ({"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "base", "messages": [{"role": "user", "content": "hi"}], "top_p": "x"}, 400, "top_p"),
    ({"model": "base", "messages": []}, 400, "messages"),
    ({"model": "base"}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    ({"model": "base", "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
    ({"model": "base", "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ({"model": "base", "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 1}, 400,
     "presence_penalty"),
    ({"model": "base", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ({"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 6}, 400, "max_tokens"),
    ({"model": "base", "messages": [{"role": "user", "content": "hi"}], "stop": ["", "x"]}, 400, "stop"),
    ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ({"model": "/tmp/RUN/adapter", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),  # no paths
    ([1, 2], 400, None),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(live, body, status, param):
    response = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60)
    error = response.json()["error"]
    assert response.status_code == status, error
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    ok = live.client().chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_malformed_bodies_routes_and_caps(live, tiny_served):
    url = f"{live.url}/v1/chat/completions"
    for content in (b"{not json", b"", "\udcff".encode("utf-8", "surrogatepass"), b"\xff\xfe"):
        response = httpx.post(url, content=content, headers={"content-type": "application/json"}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(url, timeout=60).status_code == 405
    missing = httpx.get(f"{live.url}/v1/nothing", timeout=60)
    assert missing.status_code == 404 and "error" in missing.json()
    cap = tiny_served.config.serve.max_body_bytes
    big = {"model": "base", "messages": [{"role": "user", "content": "x" * (cap + 10)}]}
    response = httpx.post(url, json=big, timeout=60)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    context = tiny_served.context_len
    long_prompt = {"model": "base", "messages": [{"role": "user", "content": "a " * context}], "max_tokens": 8}
    response = httpx.post(url, json=long_prompt, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert httpx.get(f"{live.url}/health", timeout=60).json()["models"] == tiny_served.models


def test_api_key_is_required_when_set(tiny_served):
    from tests.serve.conftest import with_serve

    with LiveServer(with_serve(tiny_served, api_key="s3cret-key")) as server:
        with pytest.raises(openai.AuthenticationError):
            server.client().models.list()
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key="wrong-key").chat.completions.create(
                model="base", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert httpx.get(f"{server.url}/metrics", timeout=60).status_code == 401
        assert [m.id for m in server.client(api_key="s3cret-key").models.list().data] == tiny_served.models
        assert httpx.get(f"{server.url}/", timeout=60).status_code == 200  # the page asks for the key itself


def test_queue_full_is_429_and_sampled_extras_are_taken(tiny_served):
    import threading

    from tests.serve.conftest import with_serve

    with LiveServer(with_serve(tiny_served, max_queue=1)) as server:
        client, results = server.client(), []
        message = [{"role": "user", "content": "hi"}]
        with server.scheduler.paused():
            waiting = threading.Thread(target=lambda: results.append(client.chat.completions.create(
                model=tiny_served.tuned, messages=message, max_tokens=3, temperature=0.8, seed=1,
                extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2})))
            waiting.start()
            while not server.scheduler._waiting:
                waiting.join(0.02)
            with pytest.raises(openai.RateLimitError):
                client.chat.completions.create(model="base", messages=message, max_tokens=3)
        waiting.join(60)
        assert results and results[0].usage.completion_tokens <= 3
        text = httpx.get(f"{server.url}/metrics", timeout=60).text
        assert metric(text, "qwenft:request_success_total", model=tiny_served.tuned) == 1


def test_non_local_host_without_key_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "qwenft", "serve", "model=tiny-random", "serve.host=0.0.0.0"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("qwenft: error: serve.host='0.0.0.0'") and "serve.api_key" in lines[0]
    assert not (tmp_path / "outputs").exists() and ROOT.is_dir()


def test_a_model_fault_is_a_500_naming_it_and_the_server_keeps_serving(live, tiny_served):
    """NaN logits (an fp16 overflow, here a hook): 500 with the sampler's message, JSON and mid-stream."""
    model = tiny_served.engine.model
    handle = model.get_output_embeddings().register_forward_hook(lambda module, args, out: out * float("nan"))
    message = [{"role": "user", "content": "hi"}]
    try:
        with pytest.raises(openai.InternalServerError) as caught:
            live.client().chat.completions.create(model="base", messages=message, max_tokens=3)
        error = caught.value.body
        assert error["code"] == "non_finite_logits" and "NaN logits at prefill (step 0)" in error["message"]
        body = {"model": "base", "messages": message, "max_tokens": 3, "stream": True}
        with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, timeout=60) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[-2])["error"]["code"] == "non_finite_logits" and events[-1] == "[DONE]"
    finally:
        handle.remove()
    ok = live.client().chat.completions.create(model="base", messages=message, max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def test_the_command_serves_and_stops_cleanly_on_sigterm(tmp_path):
    """`python -m qwenft serve serve.port=0`: the line naming the address, a request answered, then SIGTERM while
    a long stream runs: the stream ends (finished or cancelled), the process exits 0."""
    import os
    import queue
    import signal
    import threading

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "qwenft", "serve", "model=tiny-random", "quant=none",
                             "serve.port=0", "serve.shutdown_timeout_s=3"], cwd=tmp_path, env=env,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: "queue.Queue[str]" = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    try:
        seen = []
        while True:
            line = lines.get(timeout=240)
            seen.append(line)
            if line.startswith("qwenft serve: http://127.0.0.1:"):
                break
        url = line.split()[2].rstrip("/")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        assert client.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3).usage.completion_tokens >= 1
        ended = []

        def long_stream():
            body = {"model": "base", "messages": [{"role": "user", "content": "go"}], "max_tokens": 1900,
                    "stream": True, "temperature": 1.0, "repetition_penalty": 1.0}
            try:
                with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
                    ended.append([line for line in response.iter_lines() if line.startswith("data: ")])
            except httpx.HTTPError as exc:  # the connection closed by the shutdown
                ended.append(exc)

        streamer = threading.Thread(target=long_stream)
        streamer.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        streamer.join(60)
        assert ended and not streamer.is_alive()
        rest = []
        while not lines.empty():
            rest.append(lines.get())
        assert "qwenft serve: stopped" in "".join(rest), "".join(seen + rest)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


ODD_VALUES = [None, -1, 0, 1e-300, 1e308, -1e308, 10 ** 30, -(10 ** 30), "x", "", [], {}, True, [1], "\u0000"]
FIELDS = ["temperature", "top_p", "max_tokens", "seed", "stop", "logprobs", "top_logprobs", "stream", "n",
          "top_k", "min_p", "repetition_penalty", "stream_options", "max_completion_tokens", "messages", "model",
          "response_format", "tools", "frequency_penalty"]


def test_no_value_of_any_field_gets_a_500(live):
    """Every field set to each of a set of odd values: a 2xx or a 4xx in OpenAI's shape, never a 500."""
    url = f"{live.url}/v1/chat/completions"
    for name in FIELDS:
        for value in ODD_VALUES:
            body = {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, name: value}
            if name == "stream" and value is True:
                body["stream"] = False  # streams are covered elsewhere; a body read here must be JSON
            response = httpx.post(url, json=body, timeout=60)
            assert response.status_code < 500, (name, value, response.text)
            if response.status_code >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}, (name, value)
