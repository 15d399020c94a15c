"""The pairwise judge (qwenft.evaluate.judge, judging, judge_client): parsing, the two orders, ties, the interval, the
sanity set, the cache, retries, timeouts, a refused key, gates, against a rule-based judge on 127.0.0.1
(tests/evaluate/judge_server.py). No request leaves 127.0.0.1."""

from __future__ import annotations

import json

import pytest

from qwenft.config import ConfigError
from qwenft.evaluate.judge import (LOSS, TIE, UNPARSED, WIN, load_rubric, match, parse_verdict, render,
                                   sanity_matches, sanity_summary, settle, summarise)
from qwenft.evaluate.intervals import wilson
from qwenft.evaluate.judge_client import JudgeUnavailable
from qwenft.evaluate.judging import run_judge
from tests.conftest import compose_config
from tests.evaluate.judge_server import JudgeServer


def slots(n: int, right_tuned=lambda i: i % 3 != 0, right_base=lambda i: i % 5 == 0, source: str = "s"):
    """Evaluation rows (``report["rows"][source]``): question ``#i``; a side is right when it names the tag."""
    return [{"source": source, "row": i, "prompt": f"What is item #{i}?", "reference": f"It is item #{i}.",
             "tuned": {"text": f"tuned says #{i}" if right_tuned(i) else "tuned does not know", "tokens": 3},
             "base": {"text": f"base says #{i}" if right_base(i) else "base does not know at all", "tokens": 5}}
            for i in range(n)]


def report_of(rows):
    return {"rows": {"s": rows}, "sources": {}, "perplexity": {}}


def config_for(server, tmp_path, *extra):
    return compose_config("model=tiny-random", f"eval.judge.url={server.url}", f"eval.judge.cache_dir={tmp_path}",
                          *extra)


# --- parsing and rendering ---

@pytest.mark.parametrize("reply, expected", [
    ("Answer A is right. [[A]]", "A"),
    ("[[B]]", "B"),
    ("A tie. [[C]]", "C"),
    ("Some would say [[A]].\nBut B is right:\n[[B]]\nThanks.", "B"),  # the last verdict line, not the first marker
    ("[[A]] if answer A is better, [[B]] if answer B is better, [[C]] if they are equally good.", None),  # an echo
    ("Between [[A]] and [[B]], [[B]]", None),  # one line naming two verdicts
    ("Let me see.\n[[A]] if answer A is better.", None),  # a part of the rubric repeated: no verdict
    ("[[B]] ... yes, [[B]]", "B"),
    ('{"reason": "x", "verdict": "A"}', "A"),
    ('```json\n{"verdict": "[[B]]"}\n```', "B"),
    ('{"verdict": "tie"}', "C"),
    ('{"verdict": "D"}', None),
    ('{"verdict": 1}', None),
    ("A is better.", None),  # no marker: unparsed, never guessed
    ("[[D]]", None),
    ("", None),
    (None, None),
])
def test_parse_verdict(reply, expected):
    assert parse_verdict(reply) == expected


def test_render_fills_each_placeholder_once_and_leaves_braces_in_answers():
    text = render(None, "Q?", "uses {answer_b} and {reference}", "B", "REF")
    assert "uses {answer_b} and {reference}" in text  # an answer's braces are not placeholders
    assert "[Reference answer]\nREF" in text
    assert "[Reference answer]" not in render(None, "Q?", "a", "b", None)
    custom = "Q={question} A={answer_a} B={answer_b} R={reference}"
    assert render(custom, "q", "a", "b", None) == "Q=q A=a B=b R=(no reference answer is given for this comparison)"


def test_load_rubric_refuses_a_missing_file_and_missing_placeholders(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_rubric(str(tmp_path / "none.txt"))
    bad = tmp_path / "bad.txt"
    bad.write_text("Judge {question} and {answer_a}.", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"has no \{answer_b\}"):
        load_rubric(str(bad))
    good = tmp_path / "good.txt"
    good.write_text("{question} {answer_a} {answer_b}", encoding="utf-8")
    assert load_rubric(str(good)) == "{question} {answer_a} {answer_b}"


# --- one match, both orders ---

def _settled(reply_x_first, reply_x_second):
    m = match("base", {"source": "s", "row": 0, "prompt": "q"}, "tuned", "base", "T", "B", None, None)
    return settle(m, [{"reply": reply_x_first}, {"reply": reply_x_second}])


@pytest.mark.parametrize("first, second, verdict, consistent", [
    ("[[A]]", "[[B]]", WIN, True),     # tuned picked in both orders
    ("[[B]]", "[[A]]", LOSS, True),    # base picked in both
    ("[[A]]", "[[A]]", TIE, False),    # slot A both times: the orders disagree, a tie
    ("[[C]]", "[[B]]", TIE, False),    # a tie and a win: a tie
    ("[[C]]", "[[C]]", TIE, True),
    ("[[A]]", "no verdict", UNPARSED, None),
])
def test_a_win_needs_both_orders(first, second, verdict, consistent):
    m = _settled(first, second)
    assert (m["verdict"], m["consistent"]) == (verdict, consistent)


def test_identical_answers_are_a_tie_without_asking():
    m = match("base", {"source": "s", "row": 0, "prompt": "q"}, "tuned", "base", "same ", " same", None, None)
    assert settle(m, [None, None])["verdict"] == TIE and m["identical"]


def test_summary_counts_rate_and_position_bias():
    ms = [_settled("[[A]]", "[[B]]"), _settled("[[A]]", "[[B]]"), _settled("[[B]]", "[[A]]"),
          _settled("[[A]]", "[[A]]"), _settled("x", "[[A]]")]
    s = summarise(ms, lengths={"x": [10, 10, 10, 10, 10], "y": [5, 5, 20, 5, 5]})
    assert (s["n"], s["wins"], s["losses"], s["ties"], s["unparsed"]) == (4, 2, 1, 1, 1)
    assert s["win_rate"] == pytest.approx((2 + 0.5) / 4)
    assert s["position_bias"] == pytest.approx(1 / 4) and s["favoured_slot"] == {"A": 2, "B": 0}
    assert s["ci95"] == pytest.approx(list(wilson(2.5, 4)))  # Wilson's score interval, a tie half a success
    assert s["longer_won"] == pytest.approx(1.0)  # both wins had the longer answer, the loss the shorter one
    all_ties = summarise([_settled("[[C]]", "[[C]]")] * 4)
    assert all_ties["win_rate"] == 0.5 and all_ties["ci95"][0] < 0.25 and all_ties["ci95"][1] > 0.75  # never [0.5, 0.5]


def test_sanity_set_meets_another_prompts_reference_of_the_same_source():
    rows = slots(6) + slots(3, source="t")
    ms = sanity_matches(rows, 5, seed=1, rubric=None)
    assert len(ms) == 5
    for m in ms:
        assert m["answers"]["reference"] != m["answers"]["other"]
        assert m["other_row"]["source"] == m["source"] and m["other_row"]["row"] != m["row"]
        assert m["reference"] is None  # the judge is not told which one is the reference
    assert sanity_matches(slots(1), 5, seed=0, rubric=None) == []  # one reference: nothing to compare it with
    unparsed = [settle(m, [{"reply": "?"}, {"reply": "?"}]) for m in sanity_matches(rows, 4, 0, None)]
    summary = sanity_summary(unparsed, 0.8)
    assert summary["accuracy"] == 0.0 and summary["trusted"] is False  # a judge that cannot answer is not trusted


# --- against the rule-based judge on 127.0.0.1 ---

def test_judge_counts_match_the_rule_and_every_game_is_kept(tmp_path):
    rows = slots(30)
    with JudgeServer() as server:
        config = config_for(server, tmp_path, "eval.judge.compare=[base,reference]", "eval.judge.sanity_n=10")
        summary, judgments = run_judge(config, report_of(rows))
    base = summary["comparisons"]["base"]
    tuned_right = [i % 3 != 0 for i in range(30)]
    base_right = [i % 5 == 0 for i in range(30)]
    assert base["wins"] == sum(t and not b for t, b in zip(tuned_right, base_right))
    assert base["losses"] == sum(b and not t for t, b in zip(tuned_right, base_right))
    assert base["wins"] + base["ties"] + base["losses"] == base["n"] == 30 and base["position_bias"] == 0
    assert summary["comparisons"]["reference"]["wins"] == 0  # the reference always names the tag
    assert summary["sanity"]["accuracy"] == 1.0 and summary["sanity"]["trusted"]
    assert len(judgments) == 30 + 30 + 10
    first = judgments[0]
    assert set(first["answers"]) == {"tuned", "base"} and len(first["games"]) == 2
    assert all(g["reply"].startswith("By the rule.") for g in first["games"])
    # every distinct prompt asked once, the preflight besides
    assert len(server.judged()) == len({p for p in server.judged()}) == 2 * (30 + 30 + 10)


def test_a_position_biased_judge_ties_everything_and_fails_its_sanity_check(tmp_path):
    from qwenft.evaluate.verdict import judge as verdict

    with JudgeServer(mode="A") as server:
        config = config_for(server, tmp_path, "+eval.gates.judge={min: 0.5}", "eval.min_n=5")
        summary, _ = run_judge(config, report_of(slots(12)))
    base = summary["comparisons"]["base"]
    assert base["ties"] == base["n"] == 12 and base["position_bias"] == 1.0
    assert base["favoured_slot"] == {"A": 24, "B": 0}
    assert summary["sanity"]["trusted"] is False
    gate = verdict(config, {**report_of(slots(12)), "judge": summary})["gates"]["judge"]
    assert gate["status"] == "inconclusive" and "sanity check" in gate["items"][0]["reason"]


@pytest.mark.parametrize("mode", ["json", "both"])
def test_json_and_last_marker_replies_parse(tmp_path, mode):
    with JudgeServer(mode=mode) as server:
        summary, _ = run_judge(config_for(server, tmp_path, "eval.judge.sanity_n=0"), report_of(slots(10)))
    assert summary["comparisons"]["base"]["unparsed"] == 0 and summary["comparisons"]["base"]["wins"] > 0


def test_unparsed_replies_are_recorded_never_guessed(tmp_path):
    with JudgeServer(mode="garbage") as server:
        summary, judgments = run_judge(config_for(server, tmp_path), report_of(slots(8)))
    base = summary["comparisons"]["base"]
    assert (base["n"], base["unparsed"], base["win_rate"]) == (0, 8, None)
    assert all(j["verdict"] == UNPARSED and j["games"][0]["reply"] for j in judgments)


def test_gates_read_the_win_rate(tmp_path):
    from qwenft.config import GatesFailed
    from qwenft.evaluate.verdict import enforce, judge as verdict

    with JudgeServer() as server:
        good = config_for(server, tmp_path, "+eval.gates.judge={min_delta: 0.1}", "eval.min_n=20")
        summary, _ = run_judge(good, report_of(slots(40, right_tuned=lambda i: True, right_base=lambda i: False)))
        assert verdict(good, {**report_of([]), "judge": summary})["gates"]["judge"]["status"] == "pass"
        bad = config_for(server, tmp_path, "+eval.gates.judge={min: 0.5}", "eval.min_n=20", "eval.fail_on_gate=true")
        summary, _ = run_judge(bad, report_of(slots(40, right_tuned=lambda i: False, right_base=lambda i: True)))
    result = verdict(bad, {**report_of([]), "judge": summary})
    assert result["gates"]["judge"]["status"] == "fail" and result["failed"] == ["judge"]
    with pytest.raises(GatesFailed, match="judge"):
        enforce(bad, {"eval": result}, tmp_path)


def test_the_cache_asks_only_for_what_changed(tmp_path):
    rows = slots(6)
    with JudgeServer() as server:
        config = config_for(server, tmp_path, "eval.judge.sanity_n=3")
        first, _ = run_judge(config, report_of(rows))
        again, judgments = run_judge(config, report_of(rows))
        assert first["requests"]["asked"] == 18 and again["requests"] == {"games": 18, "asked": 0, "cached": 18}
        assert again["comparisons"] == first["comparisons"] and all(g["cached"] for g in judgments[0]["games"])
        rows[2]["tuned"]["text"] = "a new answer #2"
        changed, _ = run_judge(config, report_of(rows))
        assert changed["requests"]["asked"] == 2  # the one changed match, in both orders
        rubric = tmp_path / "rubric.txt"
        rubric.write_text("{question}\n[Answer A]\n{answer_a}\n[Answer B]\n{answer_b}", encoding="utf-8")
        other, _ = run_judge(config_for(server, tmp_path, f"eval.judge.rubric={rubric}", "eval.judge.sanity_n=3"),
                             report_of(rows))
        assert other["requests"]["asked"] == 18  # another rubric: every prompt is new


def _asked(server, tmp_path, rows, *extra):
    """The matches of ``rows`` settled by ``server`` without the preflight (which would spend the failures)."""
    from qwenft.evaluate.judging import ask, build_matches
    from qwenft.evaluate.judge_client import EndpointJudge

    config = config_for(server, tmp_path, "eval.judge.sanity_n=0", *extra)
    client = EndpointJudge(config.eval.judge)
    client.model = "rule-judge"
    matches = build_matches(config, rows)
    ask(client, config, matches)
    return matches


def test_a_500_is_retried_and_a_lasting_one_is_counted_as_an_error(tmp_path, caplog):
    with JudgeServer(fail=2) as server:  # the first game fails twice, then passes on its second retry
        matches = _asked(server, tmp_path, slots(3), "eval.judge.retries=2", "eval.judge.concurrency=1")
    assert len(server.requests) == 6 + 2 and summarise(matches["base"])["n"] == 3
    with JudgeServer(fail=2, fail_status=503) as server:  # without retries the first two games stay failed
        matches = _asked(server, tmp_path / "b", slots(3), "eval.judge.retries=0", "eval.judge.concurrency=1")
    summary = summarise(matches["base"])
    assert (summary["errors"], summary["n"]) == (1, 2)  # both failed games were the first prompt's: outside n
    assert "HTTP 503" in matches["base"][0]["games"][0]["error"]
    assert "2 of 6 requests failed" in caplog.text  # said, not dropped
    with JudgeServer(fail=1000, fail_status=503) as server:  # nothing answered: as good as down
        with pytest.raises(JudgeUnavailable, match=r"all 4 requests failed after their retries \(first: HTTP 503"):
            _asked(server, tmp_path / "c", slots(2), "eval.judge.retries=0")


def test_a_slow_judge_times_out(tmp_path):
    with JudgeServer(sleep=1.5) as server:
        with pytest.raises(JudgeUnavailable, match="timed out after 0.3 s"):
            _asked(server, tmp_path, slots(1), "eval.judge.timeout=0.3", "eval.judge.retries=0")


def test_a_sanity_set_whose_requests_failed_decides_no_gate():
    from qwenft.evaluate.judging import judge_item

    comparison = {"item": "judge", "n": 30, "win_rate": 0.9, "ci95": [0.8, 0.95]}
    item = judge_item("judge", comparison, {"trusted": None, "errors": 20, "asked": 20})
    assert "not judged" in item["distrust"]
    assert judge_item("judge", comparison, None)["distrust"] is None  # eval.judge.sanity_n=0: the user's choice


def test_a_refused_key_is_one_line_naming_the_url_and_status(tmp_path, monkeypatch):
    monkeypatch.setenv("JUDGE_TEST_KEY", "right-key")
    with JudgeServer(key="right-key") as server:
        config = config_for(server, tmp_path, "eval.judge.api_key_env=JUDGE_TEST_KEY", "eval.judge.sanity_n=0")
        summary, _ = run_judge(config, report_of(slots(2)))  # the key from the environment is sent
        assert summary["comparisons"]["base"]["n"] == 2
        monkeypatch.setenv("JUDGE_TEST_KEY", "wrong-key")
        with pytest.raises(JudgeUnavailable) as caught:
            run_judge(config, report_of(slots(3)))
    message = str(caught.value)
    assert server.url in message and "HTTP 401" in message and "$JUDGE_TEST_KEY" in message
    assert "wrong-key" not in message and "\n" not in message


def test_judge_config_errors():
    with pytest.raises(ConfigError, match="eval.gates.judge"):
        compose_config("model=tiny-random", "+eval.gates.judge={min: 0.5}")  # no judge to read it from
    with pytest.raises(ConfigError, match="eval.judge.url"):
        compose_config("model=tiny-random", "eval.judge.url=127.0.0.1:8000")
    with pytest.raises(ConfigError, match="NAME of the environment variable"):
        compose_config("model=tiny-random", "eval.judge.url=http://127.0.0.1:1/v1", "eval.judge.api_key_env=sk-abc")
    with pytest.raises(ConfigError, match="eval.judge.compare"):
        compose_config("model=tiny-random", "eval.judge.url=http://127.0.0.1:1/v1", "eval.judge.compare=[tuned]")
    with pytest.raises(ConfigError, match="eval.gates.judge_reference"):
        compose_config("model=tiny-random", "eval.judge.url=http://127.0.0.1:1/v1",
                       "+eval.gates.judge_reference={min: 0.3}")
    with pytest.raises(ConfigError, match="holds a user or password"):
        compose_config("model=tiny-random", "eval.judge.url=http://me:secret@127.0.0.1:1/v1")
    with pytest.raises(ConfigError, match="no such model preset"):
        from qwenft.evaluate.judge_client import preset_model

        preset_model("qwen9-1t")


def test_an_unusable_cache_dir_is_refused_before_any_request(tmp_path):
    from qwenft.evaluate.judging import check_judge

    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    config = compose_config("model=tiny-random", "eval.judge.url=http://127.0.0.1:9/v1", "eval.judge.model=m",
                            f"eval.judge.cache_dir={a_file}")
    with pytest.raises(ConfigError, match="eval.judge.cache_dir=.*not a directory qwenft can write"):
        check_judge(config)


def test_a_key_the_endpoint_wants_but_is_not_set_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("JUDGE_UNSET_KEY", raising=False)
    with JudgeServer(key="k") as server:
        config = config_for(server, tmp_path, "eval.judge.api_key_env=JUDGE_UNSET_KEY", "eval.judge.model=m")
        with pytest.raises(JudgeUnavailable, match=r"HTTP 401, the endpoint wants an API key and \$JUDGE_UNSET_KEY is "
                                                   "not set"):
            from qwenft.evaluate.judge_client import EndpointJudge

            EndpointJudge(config.eval.judge).preflight()


def test_serve_on_tiny_random_is_a_working_endpoint(tmp_path):
    """The plumbing against qwenft's own server: the model found from /v1/models, every game answered, each
    reply kept as it came (tiny-random's text parses rarely: whatever it says is recorded, never guessed)."""
    from tests.serve.conftest import LiveServer, served

    with LiveServer(served()) as live:
        config = compose_config("model=tiny-random", f"eval.judge.url={live.url}/v1", f"eval.judge.cache_dir={tmp_path}",
                                "eval.judge.max_tokens=6", "eval.judge.sanity_n=2", "eval.judge.concurrency=2")
        summary, judgments = run_judge(config, report_of(slots(3)))
    assert summary["judge"].startswith("model 'base' at ")  # the served model's name, from /v1/models
    assert summary["requests"]["asked"] == 2 * (3 + 2)
    for j in judgments:
        assert all(isinstance(g["reply"], str) and g["error"] is None for g in j["games"])
        assert j["verdict"] == (UNPARSED if any(g["parsed"] is None for g in j["games"]) else j["verdict"])
    base = summary["comparisons"]["base"]
    assert base["n"] + base["unparsed"] + base["errors"] == 3


def test_a_server_whose_cap_refuses_max_tokens_is_named_before_any_judging(tmp_path):
    from tests.serve.conftest import LiveServer, served, with_serve

    with LiveServer(with_serve(served(), max_tokens=16)) as live:
        config = compose_config("model=tiny-random", f"eval.judge.url={live.url}/v1", "eval.judge.max_tokens=64",
                                f"eval.judge.cache_dir={tmp_path}")
        with pytest.raises(JudgeUnavailable) as caught:
            run_judge(config, report_of(slots(2)))
    message = str(caught.value)
    assert "HTTP 400" in message and "eval.judge.max_tokens=64" in message and "\n" not in message


def test_train_judges_its_own_evaluation(tmp_path, capsys):
    from tests.conftest import qwenft_in_process, train_overrides

    out = tmp_path / "run"
    args = [a for a in train_overrides(tmp_path, out) if not a.startswith(("eval.after_train", "train.max_steps"))]
    with JudgeServer() as server:
        result = qwenft_in_process(capsys, "train", *args, "train.max_steps=1", "eval.max_new_tokens=4",
                                   f"eval.judge.url={server.url}", f"eval.judge.cache_dir={tmp_path / 'cache'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "judge win rate" in result.stdout  # the console's verdict line
    judged = json.loads((out / "metrics.json").read_text())["eval"]["judge"]
    assert judged["comparisons"]["base"]["n"] == 4 and (out / "judgments.jsonl").is_file()
    assert "## Judge" in (out / "report.md").read_text() and (out / "adapter" / "adapter_config.json").is_file()


def test_train_refuses_a_down_judge_before_training(tmp_path, capsys):
    from tests.conftest import qwenft_in_process, train_overrides

    out = tmp_path / "run"
    args = [a for a in train_overrides(tmp_path, out) if not a.startswith("eval.after_train")]
    result = qwenft_in_process(capsys, "train", *args, "eval.judge.url=http://127.0.0.1:9/v1",
                               "eval.judge.model=x", "eval.judge.retries=0")
    assert result.returncode == 2 and "judge endpoint http://127.0.0.1:9/v1: no HTTP response" in result.stderr
    assert not (out / "adapter").exists() and not (out / "config.yaml").exists()  # nothing trained, nothing written


def test_a_local_preset_judges_in_process(tmp_path):
    config = compose_config("model=tiny-random", "eval.judge.local=tiny-random", f"eval.judge.cache_dir={tmp_path}",
                            "eval.judge.max_tokens=4", "eval.judge.sanity_n=0")
    summary, judgments = run_judge(config, report_of(slots(2)))
    assert summary["judge"] == "tiny-random (local, in this process)" and summary["requests"]["asked"] == 4
    assert all(isinstance(g["reply"], str) for j in judgments for g in j["games"])


# --- through `qwenft eval` ---

@pytest.fixture(scope="module")
def eval_inputs(tmp_path_factory):
    from tests.conftest import train_overrides
    from tests.serve.conftest import make_adapter

    tmp = tmp_path_factory.mktemp("judge")
    adapter = make_adapter(tmp)
    return tmp, adapter


def _eval_args(tmp, adapter, out, *extra, cache: str = "cache"):
    from tests.conftest import train_overrides

    args = [a for a in train_overrides(tmp, out) if a.split("=")[0].split(".")[0] in ("model", "quant", "out_dir",
                                                                                        "data")]
    return ["eval", *args, f"adapter={adapter}", "eval.max_new_tokens=6", f"eval.judge.cache_dir={tmp / cache}",
            *extra]


def test_eval_with_a_judge_writes_its_section_judgments_and_no_key(eval_inputs, capsys, monkeypatch):
    from tests.conftest import qwenft_in_process

    tmp, adapter = eval_inputs
    out = tmp / "judged"
    monkeypatch.setenv("JUDGE_SECRET", "sk-very-secret-123")
    with JudgeServer(key="sk-very-secret-123") as server:
        result = qwenft_in_process(capsys, *_eval_args(tmp, adapter, out, f"eval.judge.url={server.url}",
                                                       "eval.judge.api_key_env=JUDGE_SECRET",
                                                       "eval.judge.compare=[base,reference]"))
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    judged = metrics["eval"]["judge"]
    assert judged["comparisons"]["base"]["n"] + judged["comparisons"]["base"]["unparsed"] == 4
    lines = (out / "judgments.jsonl").read_text().splitlines()
    assert len(lines) == 4 + 4 + judged["sanity"]["asked"]
    report = (out / "report.md").read_text()
    assert "## Judge (pairwise, both orders)" in report and "judge sanity:" in report
    assert "judge" in metrics["eval"]["ungated"]  # gated only by a gate of its own: the run's verdict is unchanged
    assert not any(g["name"] == "judge" for g in metrics["eval"]["gates"]["retention"]["items"])
    for path in out.rglob("*"):  # the key is nowhere on disk
        if path.is_file():
            assert b"sk-very-secret-123" not in path.read_bytes(), path


@pytest.mark.parametrize("typed, said", [
    ("eval.gates.judge={min: 0.5}", "eval.gates.judge"),  # a judge gate without a judge: refused, not dropped
    ("eval.judge.sources=[nope]", "eval.judge.sources[0]='nope'"),  # named as typed, not as the adapter's record
])
def test_eval_of_an_adapter_refuses_a_typed_judge_key_that_does_not_fit(eval_inputs, capsys, typed, said):
    from tests.conftest import qwenft_in_process

    tmp, adapter = eval_inputs
    extra = [typed] if "sources" not in typed else [typed, "eval.judge.url=http://127.0.0.1:9/v1"]
    result = qwenft_in_process(capsys, *_eval_args(tmp, adapter, tmp / "refused", *extra))
    assert result.returncode == 2 and said in result.stderr and "recorded" not in result.stderr
    assert not (tmp / "refused" / "metrics.json").exists()


def test_a_judge_that_goes_away_mid_run_loses_nothing_else(eval_inputs, capsys):
    from tests.conftest import qwenft_in_process

    tmp, adapter = eval_inputs
    out = tmp / "gone"
    with JudgeServer(deny_after=3) as server:  # the preflight and two games, then 401
        result = qwenft_in_process(capsys, *_eval_args(tmp, adapter, out, f"eval.judge.url={server.url}",
                                                       "eval.judge.concurrency=1", cache="cache-gone"))
    assert result.returncode == 2
    error = result.stderr.strip().splitlines()[-1]
    assert server.url in error and "HTTP 401" in error and "the evaluation without the judge is written" in error
    metrics = json.loads((out / "metrics.json").read_text())  # the evaluation itself is written
    assert "tuned" in metrics["eval"]["sources"]["toy"] and "HTTP 401" in metrics["eval"]["judge"]["failed"]
    assert "**Not completed**" in (out / "report.md").read_text() and not (out / "judgments.jsonl").exists()
    cached = list((tmp / "cache-gone").rglob("*.json"))
    assert len(cached) == 2  # the two games answered before the 401 are kept for the re-run
