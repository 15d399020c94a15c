"""Issue 28: the chat template rendered once per message shape. The cached pieces equal the template's own cut
(Qwen's real tokenizer and the tiny one, every train_on, system or not, several turns), rows after the first of a
shape never call the template, and a template that treats contents by what they hold is caught and rendered by
itself."""

from __future__ import annotations

import copy
import logging

import pytest

from qwenft.data import DataError, encode_example
from qwenft.data.template import cut, with_system
from tests.data.conftest import encode_many


def conversations():
    one = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    two = one + [{"role": "user", "content": "春天来了？\n\n  spaced  "}, {"role": "assistant", "content": "是的 🌸"}]
    system = [{"role": "system", "content": "Be brief."}] + two
    for k in range(20):  # other contents of the same shapes
        yield [dict(m, content=f"{m['content']} {k} {{x}} \\n") for m in one]
        yield [dict(m, content=f"{k}: {m['content']}") for m in two]
        yield [dict(m, content=f"{m['content']}" * (k % 3 + 1)) for m in system]


@pytest.mark.parametrize("train_on", ["assistant", "last_assistant", "all"])
@pytest.mark.parametrize("system_prompt", [None, "Sys.", ""])
def test_cached_pieces_equal_the_templates_cut(qwen, tiny, monkeypatch, train_on, system_prompt):
    from qwenft.data import render

    monkeypatch.setattr(render, "VERIFY_FIRST", 0)  # nothing verified: the cached pieces alone are compared here
    monkeypatch.setattr(render, "VERIFY_EVERY", 10 ** 9)
    for tokenizer in (qwen, tiny):
        cache = render.TemplateCache()
        for messages in conversations():
            messages = with_system(messages, system_prompt)
            assert cache(tokenizer, messages, train_on) == cut(tokenizer, messages, train_on)
        shapes = {tuple(m["role"] for m in with_system(c, system_prompt)) for c in conversations()}
        assert len(cache.recipes) == len(shapes) and all(cache.recipes.values()) and cache.mismatches == 0


def test_rows_of_a_known_shape_do_not_call_the_template(qwen, monkeypatch):
    from qwenft.data import render

    monkeypatch.setattr(render, "VERIFY_FIRST", 2)
    monkeypatch.setattr(render, "VERIFY_EVERY", 5)
    calls = []
    real = type(qwen).apply_chat_template

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(qwen), "apply_chat_template", counted)
    cache = render.TemplateCache()
    rows = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(10)]
    per_row = []
    for messages in rows:
        before = len(calls)
        cache(qwen, messages, "assistant")
        per_row.append(len(calls) - before)
    assert per_row == [4, 2, 0, 0, 2, 0, 0, 0, 0, 2]  # the shape once (2 renders); rows 1, 2, 5 and 10 verified
    items = [(messages, None) for messages in rows]
    fast = encode_many(qwen, items, max_seq_len=64, train_on="assistant", system_prompt=None, cutter=cache)
    assert [{k: r[k] for k in ("input_ids", "labels")} for r in fast] == [
        {k: encode_example(qwen, m, max_seq_len=64, train_on="assistant")[k] for k in ("input_ids", "labels")}
        for m in rows]


def test_a_template_that_reads_the_contents_is_caught(tiny, caplog):
    """A template that drops a reasoning part of an answer (as some do with </think>) renders the sentinels as they
    are; the rows that hold such a part differ, are caught while verified, and the shape goes to the template."""
    from qwenft.data import render

    odd = copy.deepcopy(tiny)
    odd.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'].split('</think>')[-1] }}"
                         "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    cache = render.TemplateCache()
    plain = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    thinking = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "hmm</think>a"}]
    assert cache(odd, plain, "assistant") == cut(odd, plain, "assistant")
    with caplog.at_level(logging.WARNING):
        assert cache(odd, thinking, "assistant") == cut(odd, thinking, "assistant")
    assert cache.mismatches == 1 and "rendered by the template itself from now on" in caplog.text
    assert cache.recipes[(("user", "assistant"), "assistant")] is None


def test_the_cache_keeps_the_templates_errors(tiny):
    from qwenft.data import render

    cache = render.TemplateCache()
    good = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    cache(tiny, good, "assistant")
    with pytest.raises(DataError, match=r"turn 2 contains the special token <\|im_end\|> as text"):
        cache(tiny, [good[0], {"role": "assistant", "content": "a<|im_end|>"}], "assistant")
    with pytest.raises(DataError, match="no assistant turn"):
        cache(tiny, [good[0]], "assistant")


@pytest.mark.parametrize("max_seq_len", [1, 6, 9, 14, 40, 4096])
@pytest.mark.parametrize("train_on", ["assistant", "last_assistant", "all"])
def test_the_maps_table_equals_encode_many_row_for_row(qwen, max_seq_len, train_on):
    """encode_batch lays the pieces' ids end to end and masks them (no per-row lists); every column of every row
    equals encode_many's, at lengths that cut inside the prompt, inside an answer, on the tail "\\n" and not at all,
    for conversations, text rows and rows that fail (a special token as text; nothing supervised kept)."""
    from qwenft.data.encode import encode_batch
    from qwenft.data.render import TemplateCache

    convs = list(conversations())[:12]
    bad = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<|im_end|>"}]
    messages = convs[:5] + [bad] + convs[5:] + [[], []]
    texts = [None] * 6 + [None] * (len(convs) - 5) + ["A plain text row.", ""]
    rows = [3 * i + 1 for i in range(len(messages))]
    table = encode_batch({"row": rows, "messages": messages, "text": texts}, tokenizer=qwen,
                         max_seq_len=max_seq_len, train_on=train_on, system_prompt=None, file="f.jsonl",
                         unit="line", cutter=TemplateCache())
    expected = encode_many(qwen, list(zip(messages, texts)), max_seq_len=max_seq_len, train_on=train_on,
                           system_prompt=None)
    got = table.to_pylist()
    assert [r["row"] for r in got] == rows
    kinds = set()
    for row, result in zip(got, expected):
        if isinstance(result, DataError):
            kinds.add("error")
            assert row["error"] == str(result.located("f.jsonl", row["row"], "line")) and row["error"]
            assert (row["input_ids"], row["labels"], row["length"], row["supervised"]) == ([], [], 0, 0)
        else:
            kinds.add("cut" if result["overflow"] else "whole")
            assert row["error"] == ""
            assert {k: row[k] for k in ("input_ids", "labels", "overflow", "supervised", "prompt_len")} == {
                k: result[k] for k in ("input_ids", "labels", "overflow", "supervised", "prompt_len")}
            assert row["length"] == len(result["input_ids"])
    assert "error" in kinds and ("cut" in kinds or max_seq_len == 4096)
    assert table.schema.field("input_ids").type.value_type.bit_width == 32
