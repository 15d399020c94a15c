"""The server's batching (requests that wait join one batch, base and tuned apart, batched greedy equal to alone,
a client that leaves stops costing decode steps) and its Prometheus side (/metrics names and labels, the shipped
alert rules under promtool, the Grafana dashboard's queries)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from importlib import resources

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

import httpx  # noqa: E402

from tests.serve.conftest import LiveServer, make_adapter, metric, served, with_serve  # noqa: E402

ISSUE_NAMES = ["prompt_tokens_total", "generation_tokens_total", "request_success_total", "num_requests_running",
               "num_requests_waiting", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
               "e2e_request_latency_seconds_bucket", "token_entropy_nats_bucket", "decode_tokens_per_second",
               "kv_cache_usage_bytes", "kv_cache_capacity_bytes", "peak_memory_bytes"]
MONITORING = resources.files("qwenft.serve") / "monitoring"


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    """tiny-random with its output layer x20 (argmax gaps far above the float noise of another batch shape)."""
    return served(make_adapter(tmp_path_factory.mktemp("adapter")), sharpen=20.0)


@pytest.fixture(scope="module")
def live(sharp):
    with LiveServer(with_serve(sharp, max_batch=4)) as server:
        yield server


def ask(client, model, prompt, max_tokens):
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                           temperature=0, max_tokens=max_tokens)
    return reply.choices[0].message.content, reply.usage.completion_tokens


def test_waiting_requests_join_one_batch_and_equal_their_answers_alone(live, sharp):
    client, tuned = live.client(), sharp.tuned
    jobs = [("base", f"question {i} " * (i + 1), 4 + i) for i in range(5)] + \
        [(tuned, f"question {i} " * (i + 1), 6) for i in range(2)]
    alone = [ask(client, *job) for job in jobs]  # one at a time: batches of one
    assert all(rows == 1 for _, rows in live.scheduler.batches)
    live.scheduler.batches.clear()
    results = [None] * len(jobs)

    def run(i):
        results[i] = ask(client, *jobs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    with live.scheduler.paused():  # all seven wait before the next batch starts
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while len(live.scheduler._waiting) < len(jobs) and time.monotonic() < deadline:
            time.sleep(0.02)
        waiting = httpx.get(f"{live.url}/metrics", timeout=60).text
        assert metric(waiting, "qwenft:num_requests_waiting", model="base") == 5
        assert metric(waiting, "qwenft:num_requests_waiting", model=tuned) == 2
    for thread in threads:
        thread.join(120)
    assert results == alone  # batched greedy answers (each with its own max_tokens) equal the answers alone
    assert sorted(live.scheduler.batches) == [("base", 1), ("base", 4), ("tuned", 2)]  # max_batch 4; sides apart
    text = httpx.get(f"{live.url}/metrics", timeout=60).text
    assert metric(text, "qwenft:batch_size_count", model="base") >= 2


def test_requests_sent_together_share_a_batch_after_the_batch_wait(sharp):
    """serve.batch_wait_ms: the first of three requests sent at once does not start a batch of one."""
    with LiveServer(with_serve(sharp, max_batch=4, batch_wait_ms=3000)) as server:
        client = server.client()
        threads = [threading.Thread(target=ask, args=(client, "base", f"q{i}", 3)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert server.scheduler.batches == [("base", 3)]


def test_a_client_that_leaves_stops_costing_decode_steps(live):
    body = {"model": "base", "messages": [{"role": "user", "content": "tell a long story"}], "max_tokens": 1500,
            "stream": True, "temperature": 0.9, "repetition_penalty": 1.0}
    before = metric(httpx.get(f"{live.url}/metrics", timeout=60).text, "qwenft:generation_tokens_total", model="base")
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for line in lines:  # the role chunk and one content chunk, then the client hangs up
            if '"content": "' in line and '"content": ""' not in line:
                break
    deadline = time.monotonic() + 60
    while True:
        text = httpx.get(f"{live.url}/metrics", timeout=60).text
        if metric(text, "qwenft:request_success_total", model="base", finished_reason="abort") >= 1:
            break
        assert time.monotonic() < deadline, "the abandoned request never ended"
        time.sleep(0.05)
    spent = metric(text, "qwenft:generation_tokens_total", model="base") - before
    assert 1 <= spent < 1500 and metric(text, "qwenft:num_requests_running", model="base") == 0
    time.sleep(0.3)
    again = httpx.get(f"{live.url}/metrics", timeout=60).text
    assert metric(again, "qwenft:generation_tokens_total", model="base") - before == spent  # nothing decodes on


def test_metrics_carry_the_issue_names_for_both_models(live, sharp):
    ask(live.client(), sharp.tuned, "hello", 3)
    text = httpx.get(f"{live.url}/metrics", timeout=60).text
    for model in ("base", sharp.tuned):
        for name in ISSUE_NAMES:
            assert f'qwenft:{name}{{' in text and re.search(rf'qwenft:{name}{{[^}}]*model="{re.escape(model)}"', text), \
                (name, model)
    assert metric(text, "qwenft:kv_cache_capacity_bytes", model="base") > 0
    assert metric(text, "qwenft:decode_tokens_per_second_floor", model="base") == sharp.config.serve.decode_floor_tokens_per_s
    assert metric(text, "qwenft:token_entropy_nats_count", model=sharp.tuned) >= 3
    assert metric(text, "qwenft:time_to_first_token_seconds_count", model=sharp.tuned) >= 1


def metric_names(expr: str):
    return set(re.findall(r"qwenft:[A-Za-z0-9_:]+", expr))


def exposed(live):
    from qwenft.serve.metrics import exposed_names

    return set(exposed_names(httpx.get(f"{live.url}/metrics", timeout=60).text))


def test_every_dashboard_query_names_an_exposed_metric(live):
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text(encoding="utf-8"))
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queries += [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    names = exposed(live)
    assert len(queries) >= 10
    for query in queries:
        used = metric_names(query)
        assert used and used <= names, (query, used - names)


def promtool():
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return path


def test_alert_rules_pass_promtool_and_fire_at_the_thresholds(live, tmp_path):
    import yaml

    rules = MONITORING / "alerts.yaml"
    target = tmp_path / "alerts.yaml"
    target.write_text(rules.read_text(encoding="utf-8"), encoding="utf-8")
    check = subprocess.run([promtool(), "check", "rules", str(target)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    groups = yaml.safe_load(target.read_text(encoding="utf-8"))["groups"]
    recorded = {rule["record"] for group in groups for rule in group["rules"] if "record" in rule}
    for rule in (r for group in groups for r in group["rules"]):
        assert metric_names(rule["expr"]) <= exposed(live) | recorded, rule["expr"]
    # promtool's unit test: entropy means of 9 and 1 nats fire the two entropy alerts, 5 fires neither; 0.5
    # tokens/s under a floor of 1 fires the decode alert
    series = []
    for model, mean in (("hot", 9.0), ("cold", 1.0), ("fine", 5.0)):
        series += [{"series": f'qwenft:token_entropy_nats_sum{{model="{model}"}}', "values": f"0+{mean * 60}x20"},
                   {"series": f'qwenft:token_entropy_nats_count{{model="{model}"}}', "values": "0+60x20"}]
    series += [{"series": 'qwenft:decode_tokens_per_second{model="hot"}', "values": "0.5x20"},
               {"series": 'qwenft:decode_tokens_per_second_floor{model="hot"}', "values": "1x20"},
               {"series": 'qwenft:generation_tokens_total{model="hot"}', "values": "0+30x20"}]

    descriptions = {r["alert"]: r["annotations"]["description"] for g in groups for r in g["rules"] if "alert" in r}

    def fired(name, model=None, summary=None):
        expected = [{"exp_labels": {"severity": "warning", "model": model},
                     "exp_annotations": {"summary": summary, "description": descriptions[name]}}]
        return {"eval_time": "15m", "alertname": name, "exp_alerts": expected if model else []}

    test = {"rule_files": ["alerts.yaml"], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": [
                fired("QwenftEntropyHigh", "hot", "hot: mean token entropy 9.00 nats > 8 (chaotic output)"),
                fired("QwenftEntropyLow", "cold", "cold: mean token entropy 1.00 nats < 2 (little diversity)"),
                fired("QwenftDecodeSlow", "hot", "hot: decode at 0.5 tokens/s, under the floor"),
                fired("QwenftMemoryPeak")]}]}
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test), encoding="utf-8")
    unit = subprocess.run([promtool(), "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert unit.returncode == 0, unit.stdout + unit.stderr
