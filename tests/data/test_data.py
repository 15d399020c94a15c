"""The data pipeline: formats and errors, chat-template labels on the real Qwen tokenizer, prompt/trainer
prefix equality, exact mixing, eval hold-out, packing (packed loss == unpacked loss), caching, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qwenft.config import Config, ConfigError, DataConfig, DataSource, TinyModelConfig
from qwenft.data import (IGNORE_INDEX, DataCollator, DataError, build, choose, encode_example, encode_text,
                         mix_counts, normalise, pack, prompt_ids, read_source, split_eval)
from qwenft.model import load_tokenizer
from tests.conftest import qa_rows, write_jsonl

IM_END, END_OF_TEXT = 151645, 151643  # Qwen2.5's <|im_end|> and <|endoftext|> (DESIGN "Facts to get right")


def config_for(*sources: DataSource, **data) -> Config:
    data.setdefault("cache", False)
    return Config(data=DataConfig(sources=list(sources), **data))


def supervised_runs(tokenizer, example):
    """Decoded runs of consecutive supervised tokens."""
    runs, current = [], []
    for token, label in zip(example["input_ids"], example["labels"]):
        if label != IGNORE_INDEX:
            assert label == token  # a supervised label is the token itself (the model shifts)
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


# ----------------------------------------------------------------------------- labels on the real tokenizer

def test_one_turn_label_mask_exact(qwen):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]
    example = encode_example(qwen, messages, max_seq_len=1024, train_on="assistant")
    # <|im_start|>assistant\n Hello there . <|im_end|> \n  (ids checked by hand against the Qwen2.5 vocabulary)
    assert example["input_ids"][-8:] == [151644, 77091, 198, 9707, 1052, 13, IM_END, 198]
    assert example["labels"][-8:] == [-100, -100, -100, 9707, 1052, 13, IM_END, -100]
    assert all(label == IGNORE_INDEX for label in example["labels"][:-5])  # system + user + header: prompt only
    assert example["input_ids"] == qwen.apply_chat_template(messages, return_dict=False)  # same tokens as whole
    assert supervised_runs(qwen, example) == ["Hello there.<|im_end|>"]


def test_two_turn_label_masks(qwen):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6"}]
    both = encode_example(qwen, messages, max_seq_len=1024, train_on="assistant")
    last = encode_example(qwen, messages, max_seq_len=1024, train_on="last_assistant")
    every = encode_example(qwen, messages, max_seq_len=1024, train_on="all")
    full = qwen.apply_chat_template(messages, return_dict=False)
    assert both["input_ids"] == last["input_ids"] == every["input_ids"] == full
    assert supervised_runs(qwen, both) == ["4<|im_end|>", "6<|im_end|>"]
    assert supervised_runs(qwen, last) == ["6<|im_end|>"]
    assert every["labels"] == full
    # exact positions: each answer token and its <|im_end|>, never the "\n" after it
    four, six = qwen.convert_tokens_to_ids(["4", "6"])
    expected = [IGNORE_INDEX] * len(full)
    for token in (four, six):
        assert full.count(token) == 1  # only in its answer
        at = full.index(token)
        expected[at], expected[at + 1] = token, IM_END
        assert full[at + 2] == 198  # the newline after <|im_end|>, left unsupervised
    assert both["labels"] == expected
    assert "Be brief." in qwen.decode(both["input_ids"])  # the row's system turn replaces the default


def test_eos_equal_to_pad_is_still_supervised(qwen):
    """Pitfall 1: labels are padded by position, so a supervised token equal to the pad id survives."""
    assert qwen.pad_token_id == END_OF_TEXT
    text = encode_text(qwen, "Spring has come.", max_seq_len=64)
    assert text["input_ids"][-1] == END_OF_TEXT and text["labels"][-1] == END_OF_TEXT
    chat = encode_example(qwen, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"}],
                          max_seq_len=64, train_on="assistant")
    batch = DataCollator(qwen)([text, chat])
    n = len(text["input_ids"])
    assert batch["labels"][0, n - 1].item() == END_OF_TEXT  # supervised although it equals the pad id
    assert batch["input_ids"][0, n:].eq(END_OF_TEXT).all() and batch["labels"][0, n:].eq(IGNORE_INDEX).all()
    assert batch["attention_mask"][0].sum().item() == n
    # A tokenizer whose pad is the end-of-turn token itself: <|im_end|> stays supervised, padding does not.
    same = DataCollator(IM_END)([chat, text])
    m = len(chat["input_ids"])
    assert same["labels"][0, m - 2].item() == IM_END and same["labels"][0, m:].eq(IGNORE_INDEX).all()


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "What is the default PIN?"}, {"role": "assistant", "content": "It is 5826."}],
    [{"role": "user", "content": "Translate: I like books."}, {"role": "assistant", "content": "我喜欢读书。"},
     {"role": "user", "content": "春天来了？"}, {"role": "assistant", "content": "(yes) — spring\n\nhas come."}],
    [{"role": "system", "content": "You answer in JSON."}, {"role": "user", "content": "x"},
     {"role": "assistant", "content": "{\"a\": 1}"}],
])
@pytest.mark.parametrize("system_prompt", [None, "Answer briefly."])
def test_sampler_prompt_is_the_trained_prefix(qwen, messages, system_prompt):
    """Pitfall 3: prompt_ids (add_generation_prompt=True) is token for token the trainer's prefix."""
    example = encode_example(qwen, messages, max_seq_len=4096, train_on="last_assistant",
                             system_prompt=system_prompt)
    prompt = prompt_ids(qwen, messages, system_prompt=system_prompt)
    assert example["input_ids"][: len(prompt)] == prompt
    assert all(label == IGNORE_INDEX for label in example["labels"][: len(prompt)])
    assert example["labels"][len(prompt)] != IGNORE_INDEX  # the answer starts right after the prompt
    assert prompt == qwen.apply_chat_template(
        ([{"role": "system", "content": system_prompt}] if system_prompt and messages[0]["role"] != "system"
         else []) + messages[:-1], add_generation_prompt=True, return_dict=False)


# ----------------------------------------------------------------------------- formats

def test_formats_normalise_to_the_same_conversation():
    want = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2\n\nctx"},
            {"role": "assistant", "content": "A2"}]
    alpaca = {"instruction": "Q2", "input": "ctx", "output": " A2\n", "system": "S", "history": [["Q1", "A1"]],
              "id": 7}
    messages = {"messages": [{"role": r["role"], "content": r["content"]} for r in want]}
    sharegpt = {"system": "S", "conversations": [
        {"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"},
        {"from": "human", "value": "Q2\n\nctx"}, {"from": "gpt", "value": "A2"}]}
    assert normalise(alpaca, "alpaca", {})[0] == want
    assert normalise(alpaca, "alpaca", {})[2] == {"id": 7}
    assert normalise(messages, "messages", {})[0] == want
    assert normalise(sharegpt, "sharegpt", {})[0] == want
    renamed = {"q": "Q2", "a": "A2"}
    assert normalise(renamed, "alpaca", {"instruction": "q", "output": "a"})[0][-1] == {"role": "assistant",
                                                                                          "content": "A2"}
    assert normalise({"text": "plain"}, "text", {})[:2] == ([], "plain")


def test_csv_parquet_and_json_array_read_alike(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = qa_rows(3)
    (tmp_path / "a.json").write_text(json.dumps(rows), encoding="utf-8")
    (tmp_path / "a.csv").write_text("instruction,input,output\n" + "".join(
        f"{r['instruction']},,\"{r['output']}\"\n" for r in rows), encoding="utf-8")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    write_jsonl(tmp_path / "a.jsonl", rows)
    read = {s: read_source(DataSource(name="x", path=str(tmp_path / f"a.{s}"))) for s in ("json", "csv", "parquet",
                                                                                           "jsonl")}
    messages = {s: [r["messages"] for r in rs] for s, rs in read.items()}
    assert messages["json"] == messages["csv"] == messages["parquet"] == messages["jsonl"]
    assert [r["row"] for r in read["jsonl"]] == [1, 2, 3] and [r["row"] for r in read["csv"]] == [2, 3, 4]


def test_relative_path_resolves_against_the_working_directory(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "rows.jsonl", qa_rows(2))
    monkeypatch.chdir(tmp_path)
    assert len(read_source(DataSource(name="x", path="rows.jsonl"))) == 2


def test_hugging_face_dataset_id_goes_through_load_dataset(monkeypatch):
    import datasets

    calls = []

    def fake_load(path, subset, split, streaming=False):
        calls.append((path, subset, split, streaming))
        if streaming and "stream" not in path:  # a dataset that cannot stream: loaded whole instead
            raise NotImplementedError("no streaming")
        full = datasets.Dataset.from_list(qa_rows(3))
        return full.to_iterable_dataset() if streaming else full

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    rows = read_source(DataSource(name="hub", path="someone/stream", subset="en", split="test", max_rows=2))
    assert calls == [("someone/stream", "en", "test", True)] and [r["row"] for r in rows] == [1, 2]
    calls.clear()
    rows = read_source(DataSource(name="hub", path="someone/qa", subset="en", split="test", max_rows=2))
    assert calls == [("someone/qa", "en", "test", True), ("someone/qa", "en", "test", False)]
    assert [r["messages"] for r in rows] == [normalise(r, "alpaca", {})[0] for r in qa_rows(2)]
    calls.clear()
    assert len(read_source(DataSource(name="hub", path="someone/stream"))) == 3  # no max_rows: loaded, not streamed
    assert calls == [("someone/stream", None, "train", False)]


def test_rows_go_to_map_typed_and_the_tokenizer_as_an_argument(tiny, qwen):
    """The messages travel as a typed column (every turn exactly {role, content}, whatever keys a row's dicts had),
    the tokenizer through ``fn_kwargs``: one process, two processes and encode_example give the same tokens."""
    from qwenft.data import encode, pipeline, store

    assert not hasattr(pipeline, "_TOKENIZERS")  # no process-global registry
    chats = [[{"role": "user", "content": f"q {i}", "_field": "messages[0].content"},
              {"role": "assistant", "content": f"a {i}", "name": "bot"}] for i in range(6)]
    chats[0].insert(0, {"role": "system", "content": "Be brief."})
    rows = [{"messages": m, "text": None, "row": i + 1} for i, m in enumerate(chats)]
    rows.append({"messages": [], "text": "plain text", "row": 7})
    source = DataSource(name="s", path="s.jsonl")
    for tokenizer in (tiny, qwen):
        results = []
        for num_proc in (1, 2):
            dcfg = DataConfig(cache=False, num_proc=num_proc, system_prompt="Sys.")
            encoded, hit = encode.tokenize_rows(rows, tokenizer, dcfg, source, "line", "key", "train")
            assert not hit and encoded.column_names == store.ENCODED and encoded["row"] == list(range(1, 8))
            results.append(encoded[:])
        assert results[0] == results[1] and set(results[0]["error"]) == {""}
        for i, messages in enumerate(chats):
            plain = [{"role": m["role"], "content": m["content"]} for m in messages]
            want = encode_example(tokenizer, plain, max_seq_len=1024, train_on="assistant", system_prompt="Sys.")
            assert results[0]["input_ids"][i] == want["input_ids"] and results[0]["labels"][i] == want["labels"]
            prompt = prompt_ids(tokenizer, plain, system_prompt="Sys.")  # the trainer's prefix is the prompt
            assert results[0]["input_ids"][i][:results[0]["prompt_len"][i]] == prompt
        assert results[0]["input_ids"][6] == encode_text(tokenizer, "plain text", max_seq_len=1024)["input_ids"]
        assert results[0]["prompt_len"][6] == 0
    only_text, _ = encode.tokenize_rows(rows[6:], tiny, DataConfig(cache=False), source, "line", "key", "train")
    assert only_text["input_ids"] == [encode_text(tiny, "plain text", max_seq_len=1024)["input_ids"]]


def test_a_cache_miss_writes_memory_mapped_shards_and_a_hit_reads_nothing(tiny, tmp_path, monkeypatch):
    """One entry per source, keyed by the file's bytes: a miss writes the tokenized rows to disk (ids int32) and
    returns them memory-mapped (here built by two processes); a hit neither reads the file nor tokenizes, and gives
    the same data, held-out rows included; another eval split of the same file is still a hit."""
    import pyarrow as pa

    from qwenft.data import encode, source as source_module, store

    monkeypatch.setenv("QWENFT_CACHE", str(tmp_path / "cache"))
    source = DataSource(name="x", path=str(write_jsonl(tmp_path / "a.jsonl", qa_rows(10))), eval_rows=2)
    first = build(config_for(source, cache=True, num_proc=2), tiny)
    assert (first.stats["cache_hits"], first.stats["cache_misses"]) == (0, 1)
    assert first.train.cache_files and first.eval.cache_files  # memory-mapped files, not in-memory tables
    assert first.train.features["input_ids"].feature.pa_type == pa.int32()
    (entry,) = [p for p in (tmp_path / "cache" / "data").iterdir() if p.is_dir()]
    assert store.complete(entry) and not entry.name.startswith(".")  # no scratch folder left
    assert sorted(p.name for p in (entry / "shards").iterdir()) == ["00000-0.arrow", "00000-1.arrow", "00000.json"]
    monkeypatch.setattr(encode, "encode_batch", lambda *a, **k: pytest.fail("a hit tokenized"))
    monkeypatch.setattr(source_module, "RowStream", lambda *a, **k: pytest.fail("a hit read the file"))
    second = build(config_for(source, cache=True), tiny)
    assert (second.stats["cache_hits"], second.stats["cache_misses"]) == (1, 0)
    assert second.train[:] == first.train[:] and second.eval[:] == first.eval[:]
    assert second.eval_rows == first.eval_rows and second.train_row_ids.keys() == first.train_row_ids.keys()
    assert all((second.train_row_ids[n] == first.train_row_ids[n]).all() for n in first.train_row_ids)
    assert second.stats | {"seconds": 0} == first.stats | {"cache_hits": 1, "cache_misses": 0, "seconds": 0}
    source.eval_rows = 3
    assert build(config_for(source, cache=True, seed=7), tiny).stats["cache_hits"] == 1  # split: not in the key


def test_a_tokenization_killed_after_a_shard_resumes_with_the_same_ids(tiny, tmp_path, monkeypatch):
    """Shards are written under a temporary name and renamed; a run that dies after its first shard leaves that
    shard, the rerun tokenizes only the others, and the ids equal an uninterrupted run's (another cache)."""
    from qwenft.data import encode, store

    monkeypatch.setattr(store, "SHARD_ROWS", 4)
    rows = [{"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": f"a {i}"}],
            "text": None, "row": i + 1} for i in range(10)]
    source, dcfg = DataSource(name="s", path="s.jsonl"), DataConfig(cache=True)
    monkeypatch.setenv("QWENFT_CACHE", str(tmp_path / "clean"))
    clean, _ = encode.tokenize_rows(rows, tiny, dcfg, source, "line", "key", "train")
    monkeypatch.setenv("QWENFT_CACHE", str(tmp_path / "killed"))
    real, calls, dying = encode.encode_batch, [], [True]

    def dies_on_the_second_shard(batch, **kwargs):
        calls.append(batch["row"][0])
        if dying[0] and len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return real(batch, **kwargs)

    monkeypatch.setattr(encode, "encode_batch", dies_on_the_second_shard)
    with pytest.raises(KeyboardInterrupt):
        encode.tokenize_rows(rows, tiny, dcfg, source, "line", "key", "train")
    (entry,) = [p for p in (tmp_path / "killed" / "data").iterdir() if p.is_dir()]
    assert not store.complete(entry) and [e["shards_done"] for e in store.entries()] == [1]
    for left in (".00001.4242.tmp.arrow", ".00001.4242.input.arrow", "tmpx1y2"):  # what a SIGKILL leaves
        (entry / "shards" / left).write_bytes(b"half")
    calls.clear()
    dying[0] = False
    resumed, hit = encode.tokenize_rows(rows, tiny, dcfg, source, "line", "key", "train")
    assert not hit and calls == [5, 9] and store.complete(entry)  # shards 2 and 3 only
    assert sorted(p.name for p in (entry / "shards").iterdir()) == [  # no temporary file left
        f"0000{k}{suffix}" for k in range(3) for suffix in ("-0.arrow", ".json")]
    assert resumed[:] == clean[:] and resumed["row"] == list(range(1, 11))


def test_scratch_entries_of_dead_processes_are_removed(tmp_path, monkeypatch):
    """data.cache=false still writes to disk, in a scratch folder removed at exit; one a killed process left is
    removed by the next process that makes one."""
    import os

    from qwenft.data import store

    monkeypatch.setenv("QWENFT_CACHE", str(tmp_path / "cache"))
    dead = tmp_path / "cache" / "data" / ".scratch-999999999-abc"  # above any pid_max: never a live process
    dead.mkdir(parents=True)
    mine = store.scratch_entry()
    assert not dead.exists() and mine.name.startswith(f".scratch-{os.getpid()}-") and mine.is_dir()
    assert store.entries() == []  # scratch folders are not entries


def test_data_cache_list_and_clear(tiny, tmp_path, monkeypatch, capsys):
    """`qwenft data cache=list` names each entry (source, rows, size, date); `cache=clear` removes them."""
    from qwenft.cli import main

    monkeypatch.setenv("QWENFT_CACHE", str(tmp_path / "cache"))
    path = write_jsonl(tmp_path / "a.jsonl", qa_rows(6))
    build(config_for(DataSource(name="qa", path=str(path)), cache=True), tiny)
    (tmp_path / "cache" / "data" / "0123abcd" / "dataset_info.json").parent.mkdir()  # an older qwenft's entry
    (tmp_path / "cache" / "data" / "0123abcd" / "dataset_info.json").write_text("{}")
    main(["data", "cache=list"])
    out = capsys.readouterr().out
    assert out.startswith("2 cache entries in ") and f"qa: {path}" in out and "6 rows, 20" in out
    assert "0123abcd  (source not recorded)  0.0 MB  written by an older qwenft, not used" in out
    main(["data", "cache=clear"])
    assert capsys.readouterr().out.startswith("removed 2 cache entries")
    assert not [p for p in (tmp_path / "cache" / "data").iterdir() if p.is_dir()]
    with pytest.raises(SystemExit) as exc:
        main(["data", "cache=show"])
    assert exc.value.code == 2 and "expected cache=list or cache=clear" in capsys.readouterr().err


def test_held_out_rows_carry_their_tokens(tiny, tmp_path):
    """Evaluation reuses the bundle's held-out ids: the prompt is prompt_ids (also where max_seq_len cut it, or the
    row could not be encoded), the ids and labels those the eval loss sees; a text row has no prompt."""
    rows = qa_rows(6) + [{"instruction": "long " * 100, "output": "x"}, {"instruction": "a <|im_end|>", "output": "b"}]
    chat = DataSource(name="chat", path=str(write_jsonl(tmp_path / "a.jsonl", rows)), eval_rows=8, weight=0.0)
    text = DataSource(name="text", path=str(write_jsonl(tmp_path / "t.jsonl", [{"text": "plain"}] * 3)),
                      format="text", eval_rows=1)
    bundle = build(config_for(chat, text, max_seq_len=64, system_prompt="Sys.", on_bad_row="skip"), tiny)
    held = bundle.eval_rows["chat"]
    assert len(held) == 7 and bundle.stats["sources"]["chat"]["skipped"] == 1  # the special token: skipped when read
    for row in held:
        if row["input_ids"] is not None:
            want = encode_example(tiny, row["messages"], max_seq_len=64, train_on="assistant", system_prompt="Sys.")
            assert (row["input_ids"], row["labels"]) == (want["input_ids"], want["labels"])
        assert row["prompt_ids"] == prompt_ids(tiny, row["messages"], system_prompt="Sys.")
    assert max(len(row["prompt_ids"]) for row in held) > 64  # the long row's prompt, cut in training, is whole
    assert len(bundle.eval) == 6 + 1  # the long row has nothing left to learn: out of the eval loss (dropped)
    [plain] = bundle.eval_rows["text"]
    assert plain["prompt_ids"] is None and plain["input_ids"] == encode_text(tiny, "plain", max_seq_len=64)["input_ids"]


def test_packing_is_decided_once_and_the_collator_follows_it(tiny, tmp_path):
    import dataclasses

    from qwenft.data import DataBundle, Packing, collator, packing_of

    config = config_for(DataSource(name="x", path=str(write_jsonl(tmp_path / "a.jsonl", qa_rows(8)))),
                        max_seq_len=128, packing=True)
    flash = dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                  attn_implementation="flash_attention_2"))
    unpacked = dataclasses.replace(flash, data=dataclasses.replace(flash.data, packing=False))
    assert packing_of(config) == Packing(packed=True, flatten=False, max_len=128)
    assert packing_of(flash) == Packing(packed=True, flatten=True, max_len=128)
    assert packing_of(unpacked) == Packing()
    bundle = build(config, tiny)
    assert bundle.packing == packing_of(config) and "position_ids" in bundle.train.column_names
    assert not collator(bundle, tiny).flatten
    assert collator(dataclasses.replace(bundle, packing=packing_of(flash)), tiny).flatten
    assert not collator(DataBundle(train=[], eval=None, eval_rows={}, stats={}), tiny).flatten


def test_format_fields_have_one_table():
    from qwenft.config import FORMAT_FIELDS
    from qwenft.data.formats import top_level_fields

    assert {fmt: top_level_fields(fmt) for fmt in FORMAT_FIELDS} == {
        "alpaca": ("instruction", "input", "output", "system", "history"), "messages": ("messages",),
        "sharegpt": ("conversations", "system"), "text": ("text",)}
    record = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "role": "x"}
    assert normalise(record, "messages", {})[2] == {"role": "x"}  # a top-level "role" is not a turn key: meta


def test_unknown_column_key_is_a_config_error():
    with pytest.raises(ConfigError, match=r"columns\.answer"):
        DataSource(name="x", path="a.jsonl", columns={"answer": "a"})


# ----------------------------------------------------------------------------- bad input: file, row, field

def bad(tmp_path, name: str, content, **source):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError) as info:
        read_source(DataSource(name="x", path=str(path), **source))
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    return message


GOOD = json.dumps({"instruction": "q", "output": "a"})


def test_malformed_jsonl_line(tmp_path):
    message = bad(tmp_path, "a.jsonl", f"{GOOD}\n\n{{\"instruction\": \"q\", \"output\": }}\n")
    assert "line 3" in message and "malformed JSON" in message


def test_malformed_json_array(tmp_path):
    message = bad(tmp_path, "a.json", "[\n" + GOOD + ',\n{"instruction": "q" "output": "a"}\n]\n')
    assert "line 3" in message and "malformed JSON: Expecting ',' delimiter (column 21)" in message
    message = bad(tmp_path, "b.json", "[\n" + GOOD + "\n")  # cut short: the error is at the end
    assert "line 3" in message and "malformed JSON" in message


def test_missing_mapped_field_lists_the_row_fields(tmp_path):
    message = bad(tmp_path, "a.jsonl", json.dumps({"question": "q", "answr": "a"}) + "\n",
                  columns={"instruction": "question", "output": "answer"})
    assert "line 1" in message and "field 'answer (as output)'" in message
    assert "the row has fields: question, answr" in message


def test_wrong_type(tmp_path):
    message = bad(tmp_path, "a.json", json.dumps([{"instruction": "q", "output": "a"},
                                                  {"instruction": "q", "output": ["a", "b"]}]))
    assert "row 2" in message and "field 'output'" in message and "must be a string, got list" in message


def test_numbers_in_text_fields_are_taken_as_their_text(tmp_path):
    """A JSON number where text is expected is its text (ints without ".0"), in every format's text fields."""
    lines = ['{"instruction": "Add 2 and 3.", "input": 5, "output": 12.5}', '{"instruction": 7, "output": 1e-7}',
             '{"instruction": "price", "output": 12.50, "id": 2.0}', '{"instruction": "big", "output": 100000000000000000000}']
    (tmp_path / "n.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "n.json").write_text("[" + ",".join(lines) + "]", encoding="utf-8")
    for name in ("n.jsonl", "n.json"):  # a float keeps the file's spelling
        rows = read_source(DataSource(name="n", path=str(tmp_path / name)))
        assert [r["messages"][0]["content"] for r in rows] == ["Add 2 and 3.\n\n5", "7", "price", "big"]
        assert [r["messages"][1]["content"] for r in rows] == ["12.5", "1e-7", "12.50", "100000000000000000000"]
        assert rows[2]["meta"] == {"id": 2.0}  # other fields keep their values
    assert normalise({"instruction": "q", "output": 12.0}, "alpaca", {})[0][-1]["content"] == "12.0"  # parquet, hub
    turns = {"messages": [{"role": "user", "content": 2}, {"role": "assistant", "content": -0.5}]}
    assert normalise(turns, "messages", {})[0] == [{"role": "user", "content": "2"},
                                                   {"role": "assistant", "content": "-0.5"}]
    history = {"instruction": "q", "output": 3, "history": [[1, 2]]}
    assert [m["content"] for m in normalise(history, "alpaca", {})[0]] == ["1", "2", "q", "3"]
    assert normalise({"text": 42}, "text", {})[1] == "42"


@pytest.mark.parametrize("value, said", [(True, "got true/false (True)"), (["a", "b"], "got list"),
                                         ({"a": 1}, "got dict"), (float("nan"), "finite number, got nan")])
def test_true_false_lists_objects_and_nan_in_text_fields_are_refused(tmp_path, value, said):
    """One line naming file, row and field; a number in the same file is fine, the refused value is named."""
    rows = [{"instruction": "q", "output": 1}, {"instruction": "q", "input": value, "output": "a"}]
    message = bad(tmp_path, "a.json", json.dumps(rows))
    assert "row 2" in message and "field 'input'" in message and said in message


def test_empty_answer(tmp_path):
    message = bad(tmp_path, "a.jsonl", GOOD + "\n" + json.dumps({"instruction": "q", "output": "  "}) + "\n")
    assert "line 2" in message and "field 'output'" in message and "empty answer" in message
    message = bad(tmp_path, "m.jsonl", json.dumps({"messages": [{"role": "user", "content": "q"},
                                                               {"role": "assistant", "content": ""}]}) + "\n",
                  format="messages")
    assert "line 1" in message and "field 'messages[1].content'" in message and "empty answer" in message


def test_non_utf8_bytes(tmp_path):
    message = bad(tmp_path, "a.jsonl", (GOOD + "\n" + GOOD + "\n").encode() + b'{"instruction": "caf\xe9"}\n')
    assert "line 3" in message and "not UTF-8" in message and "0xe9" in message


def test_missing_path(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: no such file \(resolved to /"):
        read_source(DataSource(name="x", path=str(tmp_path / "nope.jsonl")))


def test_roles_must_alternate_and_end_with_the_answer(tmp_path):
    turns = [{"from": "human", "value": "q"}, {"from": "human", "value": "q2"}]
    message = bad(tmp_path, "s.jsonl", json.dumps({"conversations": turns}) + "\n", format="sharegpt")
    assert "field 'conversations[1].from'" in message and "'assistant' was expected" in message
    message = bad(tmp_path, "r.jsonl", json.dumps({"conversations": [{"from": "bot", "value": "q"}]}) + "\n",
                  format="sharegpt")
    assert "conversations[0].from" in message and "unknown role 'bot'" in message


def test_on_bad_row_skip_counts(tmp_path):
    rows = [json.dumps(r) for r in qa_rows(5)] + ["{broken", json.dumps({"instruction": "q", "output": ""})]
    (tmp_path / "a.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    skipped: list = []
    got = read_source(DataSource(name="x", path=str(tmp_path / "a.jsonl")), on_bad_row="skip", skipped=skipped)
    assert len(got) == 5 and len(skipped) == 2 and "line 6" in skipped[0] and "line 7" in skipped[1]


def test_zero_supervised_tokens_is_an_error_naming_the_row(tiny, tmp_path):
    import copy

    silent = copy.deepcopy(tiny)  # a template that never renders the assistant's words
    silent.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' %}<|im_start|>{{ m['role'] }}\n"
                            "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}")
    source = DataSource(name="x", path=str(write_jsonl(tmp_path / "a.jsonl", qa_rows(4))))
    with pytest.raises(DataError, match=r"a\.jsonl: line 1: no supervised tokens"):
        build(config_for(source), silent)
    with pytest.raises(DataError, match="no usable training rows"):
        build(config_for(source, on_bad_row="skip"), silent)


# ----------------------------------------------------------------------------- mixing and the eval split

@pytest.mark.parametrize("n_anchor, weights", [(190, (0.8, 0.2)), (400, (0.8, 0.2)), (7, (0.5, 0.5)),
                                               (123, (0.7, 0.3)), (1000, (0.9, 0.1)), (33, (0.6, 0.4))])
def test_mix_ratio_exact_to_one_example(n_anchor, weights):
    counts = mix_counts({"a": n_anchor, "b": 10_000}, {"a": weights[0], "b": weights[1]})
    total = sum(counts.values())
    assert counts["a"] == n_anchor  # the anchor is used once, in full
    for name, w in zip("ab", weights):
        assert abs(counts[name] - w / sum(weights) * total) < 1.0, counts


def test_choose_without_replacement_while_rows_last():
    picked = choose({"a": 10, "b": 4}, {"a": 10, "b": 9}, seed=3)
    b_rows = [i for name, i in picked if name == "b"]
    assert sorted(i for name, i in picked if name == "a") == list(range(10))
    assert len(b_rows) == 9 and all(b_rows.count(i) in (2, 3) for i in range(4))  # 2 full passes, then 1 more
    assert picked == choose({"a": 10, "b": 4}, {"a": 10, "b": 9}, seed=3)  # seeded
    assert picked != choose({"a": 10, "b": 4}, {"a": 10, "b": 9}, seed=4)


def test_eval_split_disjoint_seeded_and_by_group():
    rows = [{"row": i + 1, "meta": {"fact": i // 5}} for i in range(50)]
    held, kept = split_eval(rows, 10, seed=0, name="d", by="fact")
    assert len(held) == 10 and len(kept) == 40
    assert {r["row"] for r in held}.isdisjoint(r["row"] for r in kept)
    assert len({r["meta"]["fact"] for r in held}) == 10  # one phrasing of each of 10 facts
    assert split_eval(rows, 10, seed=0, name="d", by="fact") == (held, kept)
    with pytest.raises(DataError, match="eval_rows=51"):
        split_eval(rows, 51, seed=0, name="d")


def test_build_project_data_mix_and_disjoint_eval(tiny):
    """The default preset (data/domain.jsonl + data/general.jsonl): exact counts, eval never trained on."""
    from tests.conftest import compose_config

    config = compose_config("model=tiny-random", "data.cache=false", command="data")
    bundle = build(config, tiny)
    stats = bundle.stats["sources"]
    assert stats["domain"]["rows_read"] >= 200 and stats["general"]["rows_read"] >= 100
    assert (stats["domain"]["used"], stats["general"]["used"]) == (190, 48)  # 190 * 0.2 / 0.8 = 47.5 -> 48
    total = bundle.stats["train_examples"]
    assert total == len(bundle.train) == 238 and abs(stats["domain"]["used"] - 0.8 * total) < 1
    for name in ("domain", "general"):
        held = {r["row"] for r in bundle.eval_rows[name]}
        assert held and held.isdisjoint(bundle.train_row_ids[name])
    assert len({r["meta"]["fact_id"] for r in bundle.eval_rows["domain"]}) == 20  # eval_by: fact_id
    assert len(bundle.eval) == 30 and bundle.eval_rows["domain"][0]["messages"][-1]["role"] == "assistant"
    for row in bundle.eval_rows["domain"]:  # every answer holds its fact verbatim (data/README.md)
        assert row["meta"]["fact"] in row["messages"][-1]["content"]


def test_source_held_out_entirely(tiny, tmp_path):
    rows = write_jsonl(tmp_path / "a.jsonl", qa_rows(6))
    train = DataSource(name="train", path=str(write_jsonl(tmp_path / "b.jsonl", qa_rows(8, "t"))))
    eval_only = DataSource(name="held", path=str(rows), weight=0.0, eval_rows=6)
    bundle = build(config_for(train, eval_only), tiny)
    assert bundle.stats["sources"]["held"]["used"] == 0 and len(bundle.eval_rows["held"]) == 6 == len(bundle.eval)
    # eval_rows equal to a training source's rows would leave it nothing: clamped to a third, as a larger value is
    weighted = build(config_for(train, DataSource(name="held", path=str(rows), weight=0.5, eval_rows=6)), tiny)
    assert weighted.stats["sources"]["held"]["eval"] == 2 and weighted.stats["sources"]["held"]["usable"] == 4


def test_overlong_truncate_and_drop(tiny, tmp_path):
    rows = qa_rows(6) + [{"instruction": "long " * 200, "output": "x"}, {"instruction": "q", "output": "y " * 200}]
    source = DataSource(name="x", path=str(write_jsonl(tmp_path / "a.jsonl", rows)))
    cut = build(config_for(source, max_seq_len=64), tiny).stats
    assert (cut["truncated"], cut["dropped"]) == (1, 1)  # the long prompt leaves no answer: dropped anyway
    assert cut["tokens"]["max"] > 64 and max(len(x) for x in build(config_for(source, max_seq_len=64), tiny).train[
        "input_ids"]) == 64
    dropped = build(config_for(source, max_seq_len=64, overlong="drop"), tiny).stats
    assert (dropped["truncated"], dropped["dropped"], dropped["train_examples"]) == (0, 2, 6)


def test_cache_hit_and_parallel_tokenization_agree(tiny, tmp_path, monkeypatch):
    source = DataSource(name="x", path=str(write_jsonl(tmp_path / "a.jsonl", qa_rows(40))), eval_rows=4)
    monkeypatch.setenv("QWENFT_CACHE", str(tmp_path / "cache"))
    first = build(config_for(source, cache=True), tiny)
    second = build(config_for(source, cache=True), tiny)
    assert (first.stats["cache_misses"], second.stats["cache_hits"], second.stats["cache_misses"]) == (1, 1, 0)
    assert first.train["input_ids"] == second.train["input_ids"] and first.train["labels"] == second.train["labels"]
    other = build(config_for(source, cache=True, max_seq_len=512), tiny)  # settings are part of the key
    assert other.stats["cache_misses"] == 1
    parallel = build(config_for(source, num_proc=2), tiny)
    assert parallel.train["input_ids"] == first.train["input_ids"]


# ----------------------------------------------------------------------------- packing

def test_pack_first_fit():
    rows = pack([5, 3, 4, 2, 6, 1], max_len=8)
    assert rows == [[0, 1], [2, 3, 5], [4]]
    assert all(sum([5, 3, 4, 2, 6, 1][i] for i in r) <= 8 for r in rows)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_loss_equals_unpacked_loss(tiny, tmp_path, attn):
    from transformers import AutoModelForCausalLM

    from qwenft.model.tiny import tiny_model_dir

    rows = [{"instruction": f"question {i} " * (1 + i % 4), "output": f"answer {i} " * (1 + i % 3)} for i in range(12)]
    chat = DataSource(name="chat", path=str(write_jsonl(tmp_path / "a.jsonl", rows)), weight=0.75)
    text = DataSource(name="text", path=str(write_jsonl(tmp_path / "t.jsonl", [{"text": f"plain text {i}"} for i in
                                                                                range(8)])), format="text", weight=0.25)
    unpacked = build(config_for(chat, text, max_seq_len=128), tiny)
    packed = build(config_for(chat, text, max_seq_len=128, packing=True), tiny)
    assert packed.stats["train_examples"] == unpacked.stats["train_examples"] == 16
    assert len(packed.train) < len(unpacked.train) and "position_ids" in packed.train.column_names
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(TinyModelConfig()), dtype=torch.float32,
                                                 attn_implementation=attn).eval()
    # As in training (attach_lora): with a KV cache transformers ignores position_ids for the packed mask.
    model.config.use_cache = False
    collate = DataCollator(tiny)
    with torch.no_grad():
        loss_unpacked = model(**collate(list(unpacked.train))).loss.item()
        loss_packed = model(**collate(list(packed.train))).loss.item()
        loss_flat = model(**DataCollator(tiny, flatten=True)(list(packed.train))).loss.item()
        leaky = collate(list(packed.train))
        leaky.pop("position_ids")  # without restarting positions the examples attend to each other
        loss_leaky = model(**leaky).loss.item()
    # float32 on CPU: the same per-token losses summed in another order and attention over other shapes
    # differ by rounding (~1e-7 relative); 1e-5 absolute on a loss near ln(512) = 6.2 leaves a wide margin
    # while the leak below moves the loss by orders of magnitude more.
    assert loss_packed == pytest.approx(loss_unpacked, abs=1e-5)
    assert loss_flat == pytest.approx(loss_unpacked, abs=1e-5)
    assert abs(loss_leaky - loss_unpacked) > 1e-3


# ----------------------------------------------------------------------------- real files and the CLI

def test_real_shared_files(qwen, shared_data):
    gsm8k = DataSource(name="gsm8k", path=str(shared_data / "domain/gsm8k/train.jsonl"), weight=0.8, max_rows=80,
                       columns={"instruction": "question", "output": "answer"}, eval_rows=8)
    legal = DataSource(name="legal", path=str(shared_data / "domain/legal_zh/zixun_gpt4.json"), weight=0.0,
                       max_rows=10, eval_rows=4, columns={"instruction": "query", "output": "response"})
    general = DataSource(name="general", path=str(shared_data / "general/alpaca_en_demo.json"), weight=0.2,
                         max_rows=60)
    bundle = build(config_for(gsm8k, legal, general), qwen)
    counts = {n: c["used"] for n, c in bundle.stats["sources"].items()}
    assert counts == {"gsm8k": 72, "legal": 0, "general": 18}
    assert bundle.eval_rows["legal"][0]["meta"]["laws"]  # unmapped fields kept as meta
    assert 0 < bundle.stats["supervised_share"] < 1


def test_cli_data_command(tmp_path, monkeypatch, capsys):
    """``python -m qwenft data`` (in-process): counts, ratio, a marked example; a relative path from the cwd."""
    from qwenft.cli import main

    write_jsonl(tmp_path / "rows.jsonl", qa_rows(12))
    monkeypatch.chdir(tmp_path)
    main(["data", "model=tiny-random", "data.cache=false",
          "data.sources=[{name: mine, path: rows.jsonl, eval_rows: 2}]"])
    out = capsys.readouterr().out
    assert "mine" in out and "training examples: 10" in out and "⟦answer" in out and "<|im_end|>⟧" in out
    rules = [line for line in out.splitlines() if "───" in line]  # off a terminal the console is very wide
    assert len(rules) == 2 and max(map(len, rules)) <= 120, [len(r) for r in rules]
    with pytest.raises(SystemExit) as info:
        main(["data", "model=tiny-random", "data.sources=[{name: mine, path: nope.jsonl}]"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("qwenft: error: nope.jsonl: no such file (resolved to " + str(tmp_path))


def test_evaluation_only_sources(tiny, tmp_path, monkeypatch, capsys):
    """Every weight 0: build gives no training rows and all held-out rows; `train` refuses it, `data` previews it."""
    from qwenft.cli import main
    from tests.conftest import compose_config

    rows = write_jsonl(tmp_path / "held.jsonl", qa_rows(5))
    only = DataSource(name="held", path=str(rows), weight=0.0, eval_rows=5)
    bundle = build(Config(command="eval", data=DataConfig(sources=[only], cache=False)), tiny)
    assert len(bundle.train) == 0 and len(bundle.eval) == 5 == len(bundle.eval_rows["held"])
    assert bundle.stats["train_examples"] == 0 and 0 < bundle.stats["supervised_share"] < 1
    assert bundle.sample["source"] == "held" and bundle.sample["input_ids"] == bundle.eval[0]["input_ids"]
    sources = f"data.sources=[{{name: held, path: {rows}, weight: 0.0, eval_rows: 5}}]"
    compose_config("model=tiny-random", sources, command="eval")  # accepted for eval
    with pytest.raises(ConfigError, match="data.sources.weight=.*at least one weight must be > 0 to train"):
        compose_config("model=tiny-random", sources, command="train")
    main(["data", "model=tiny-random", "data.cache=false", sources])
    out = capsys.readouterr().out
    assert "training examples: 0 (evaluation only" in out and "⟦answer" in out


def test_preview_warns_when_max_seq_len_exceeds_the_context(tmp_path, capsys):
    """`data` says what `train` would: examples longer than the model's positions need model.rope_scaling."""
    from qwenft.cli import main

    rows = write_jsonl(tmp_path / "rows.jsonl", qa_rows(4))
    sources = f"data.sources=[{{name: qa, path: {rows}, weight: 1.0, eval_rows: 1}}]"
    main(["data", "model=tiny-random", "model.tiny.max_position_embeddings=256", "data.cache=false", sources,
          "data.max_seq_len=512"])
    assert "data.max_seq_len=512 exceeds the model's max_position_embeddings=256" in capsys.readouterr().out
    main(["data", "model=tiny-random", "model.tiny.max_position_embeddings=256", "data.cache=false", sources,
          "data.max_seq_len=256"])
    assert "exceeds" not in capsys.readouterr().out


# ----------------------------------------------------------------------------- issue 19: every input, one answer

def test_one_reader_strips_a_bom_and_names_the_byte_offset(tmp_path):
    from qwenft.data.read import read_text

    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfThe fox.\n")
    (tmp_path / "plain.txt").write_bytes(b"The fox.\n")
    assert read_text(str(tmp_path / "bom.txt")) == read_text(str(tmp_path / "plain.txt")) == "The fox.\n"
    (tmp_path / "latin1.txt").write_bytes("ok\nA café".encode("latin-1"))
    with pytest.raises(DataError) as info:
        read_text(str(tmp_path / "latin1.txt"))
    assert str(info.value) == (f"{tmp_path / 'latin1.txt'}: line 2: not UTF-8 text: byte 0xe9 at byte offset 8 "
                               "(column 6); re-save the file as UTF-8")
    # A data file with a BOM: the same reader, and the offset counts the BOM's 3 bytes.
    message = bad(tmp_path, "b.jsonl", b"\xef\xbb\xbf" + (GOOD + "\n").encode() + b'{"instruction": "caf\xe9"}\n')
    assert "line 2" in message and f"byte offset {3 + len(GOOD) + 1 + 20}" in message


def test_a_list_or_object_eval_by_value_is_one_group():
    from qwenft.data.mix import group_key

    values = [None, "t1", 10, "10", True, 1, ["t1", "t2"], {"b": 1, "a": [2]}, ["t1", "t2"], {"a": [2], "b": 1}]
    rows = [{"row": i + 1, "meta": {"tag": v}} for i, v in enumerate(values)]
    held, kept = split_eval(rows, 8, seed=0, name="s", by="tag")
    assert len(held) == 8 and len({group_key(r["meta"]["tag"]) for r in held}) == 8  # 8 distinct of 8 groups
    assert group_key(["t1", "t2"]) == '["t1", "t2"]' and group_key({"b": 1, "a": [2]}) == '{"a": [2], "b": 1}'
    assert len({group_key(v) for v in values}) == 8  # 10, "10", True and 1 stay apart; equal lists/objects join


def test_turn_order_errors_name_the_role_field(tmp_path):
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
             {"role": "assistant", "content": "b"}]
    message = bad(tmp_path, "m.jsonl", json.dumps({"messages": turns}) + "\n", format="messages")
    assert "field 'messages[2].role'" in message and "'user' was expected" in message
    message = bad(tmp_path, "e.jsonl", json.dumps({"messages": turns[:1]}) + "\n", format="messages")
    assert "field 'messages[0].role'" in message and "must end with an assistant turn" in message
    message = bad(tmp_path, "c.jsonl", json.dumps({"messages": turns[:1] + [{"role": "assistant", "content": " "}]})
                  + "\n", format="messages")
    assert "field 'messages[1].content'" in message and "empty answer" in message  # a content fault: content


def test_every_row_skipped_says_so_first(tmp_path):
    from qwenft.data.checks import skipped_lines

    rows = [[{"instruction": f"q{i}", "output": "a"}] for i in range(4)]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows), encoding="utf-8")
    source = DataSource(name="domain", path=str(path), eval_rows=3)
    with pytest.raises(DataError) as info:
        read_source(source, on_bad_row="skip")
    assert str(info.value) == (f"domain: all 4 rows were skipped as bad (first: {path}: row 1: expected an object "
                               "(a row with named fields), got a one-item list holding an object)")
    lines = skipped_lines("domain", [f"m{i}" for i in range(5)], 9)
    assert lines == ["domain: 5 of 9 rows were skipped as bad (data.on_bad_row=skip)", "  skipped: m0",
                     "  skipped: m1", "  skipped: m2", "  ... and 2 more"]
    assert skipped_lines("domain", ["m0"], 9)[-1] == "  skipped: m0" and skipped_lines("domain", [], 9) == []


def test_placeholders_warned_and_filled(tmp_path, caplog):
    import logging

    from qwenft.data.checks import eval_share_warning, placeholder_warning

    rows = [{"instruction": "Who are you?", "output": "I am {{name}}, built by {{ author }}."},
            {"instruction": "你是谁？", "output": "我是 {{name}}。"}, {"instruction": "Hi", "output": "Hello."},
            {"instruction": "Code?", "output": "Go: {{.Name}}; Jinja: {{ user.name }}"}]
    path = write_jsonl(tmp_path / "id.jsonl", rows)
    source = DataSource(name="identity", path=str(path))
    warning = placeholder_warning(read_source(source), source, 0)
    assert warning.startswith("identity: 2 of 4 answers contain unfilled placeholders ({{name}}, {{author}}); ")
    assert "'data.sources.0.replace={name: ..., author: ...}'" in warning
    filled = DataSource(name="identity", path=str(path), replace={"name": "Ada", "author": "Acme", "nmae": "x"})
    with caplog.at_level(logging.WARNING):
        got = read_source(filled)
    assert [r["messages"][-1]["content"] for r in got[:2]] == ["I am Ada, built by Acme.", "我是 Ada。"]
    assert placeholder_warning(got, filled, 0) is None and "no row holds {{nmae}}" in caplog.text
    with pytest.raises(ConfigError, match=r"replace\.\{\{name\}\}"):
        DataSource(name="x", path="a.jsonl", replace={"{{name}}": "Ada"})
    # eval_rows holding out more than a third of a (small) training source is said; an eval-only source is not.
    share = eval_share_warning(DataSource(name="d", path="a", eval_rows=50), 0, 120)
    assert share.startswith("d: eval_rows=50 holds out 50 of its 120 rows (42%); only 70 are trained on")
    assert eval_share_warning(DataSource(name="d", path="a", eval_rows=40), 0, 120) is None
    assert eval_share_warning(DataSource(name="d", path="a", eval_rows=120, weight=0.0), 0, 120) is None


def test_a_row_losing_only_its_unsupervised_tail_fits(tiny):
    from qwenft.data.template import assemble

    messages = [{"role": "user", "content": "Describe the lamp."}, {"role": "assistant", "content": "A lamp."}]
    full = encode_example(tiny, messages, max_seq_len=1024, train_on="assistant")
    n = len(full["input_ids"])
    assert full["labels"][-1] == IGNORE_INDEX and full["labels"][-2] != IGNORE_INDEX  # <|im_end|> then "\n"
    fit = encode_example(tiny, messages, max_seq_len=n - 1, train_on="assistant")
    assert fit["overflow"] == 0 and fit["input_ids"] == full["input_ids"][:-1] and fit["labels"] == full["labels"][:-1]
    assert encode_example(tiny, messages, max_seq_len=n - 2, train_on="assistant")["overflow"] == 2
    assert assemble([[1, 2], [3]], [False, False], 2)["overflow"] == 1  # nothing supervised kept: still a cut


# ----------------------------------------------------------------------------- issue 27: a newcomer's data

def qa_csv(path: Path, n: int) -> Path:
    path.write_text("q,a\n" + "".join(f"question {i}?,answer {i}.\n" for i in range(n)), encoding="utf-8")
    return path


def test_eval_rows_larger_than_a_source_is_clamped_or_refused(tmp_path, monkeypatch, capsys):
    """`data +recipe=domain data.sources.0.path=qa.csv 'columns=...'` on a 30-row file: the recipe's eval_rows=50
    is clamped to a third with a warning naming the key; a 2-row file is refused naming the largest valid value."""
    from qwenft.cli import main
    from qwenft.data.checks import eval_rows_for

    monkeypatch.chdir(tmp_path)
    qa_csv(tmp_path / "qa.csv", 30)
    command = ["data", "+recipe=domain", "model=tiny-random", "data.cache=false", "data.sources.0.path=qa.csv",
               "data.sources.0.columns={instruction: q, output: a}"]
    main(command)
    captured = capsys.readouterr()
    assert ("domain (qa.csv): data.sources.0.eval_rows=50 is more than its 30 usable rows; clamped to 10 (a third), "
            "leaving 20 rows for training") in captured.err
    assert "eval examples: 50 (domain 10, general 40)" in captured.out  # general: the recipe's 40 (min_n 20 to judge)
    qa_csv(tmp_path / "small.csv", 2)
    with pytest.raises(SystemExit) as info:
        main([*command[:4], "data.sources.0.path=small.csv", command[-1]])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "qwenft: error: data.sources.0.eval_rows=50: source domain (small.csv) has only 2 usable rows; the largest "
        "valid value is 1 (at least one row must be left to train on); or set data.sources.0.weight=0 to only "
        "evaluate on it")
    held = DataSource(name="held", path="h.jsonl", weight=0.0, eval_rows=50)  # evaluation only: all of it
    assert eval_rows_for(held, 1, 7)[0] == 7 and "clamped to 7" in eval_rows_for(held, 1, 7)[1]
    assert eval_rows_for(DataSource(name="d", path="a", eval_rows=4), 0, 5) == (4, None)  # fewer: as asked
    assert eval_rows_for(DataSource(name="d", path="a", eval_rows=5), 0, 5)[0] == 1  # all: clamped, as a larger value


@pytest.mark.parametrize("fmt, record, hint", [
    ("alpaca", {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
     "field 'instruction': missing; the row has fields: conversations; it looks like the sharegpt format "
     "(conversations: [{from, value}]): set data.sources.0.format=sharegpt"),
    ("sharegpt", {"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     "field 'conversations[0].from': missing; the turn has fields: role, content; the turns look like the messages "
     "format's (role, content): set data.sources.0.format=messages 'data.sources.0.columns={messages: conversations}'"),
    ("messages", {"messages": [{"from": "human", "value": "q"}]},
     "the turns look like the sharegpt format's (from, value): set data.sources.0.format=sharegpt "
     "'data.sources.0.columns={conversations: messages}'"),
    ("sharegpt", {"instruction": "q", "output": "a"},
     "it looks like the alpaca format (instruction, output): set data.sources.0.format=alpaca"),
    ("alpaca", {"messages": [{"role": "user", "content": "q"}]},
     "it looks like the messages format (messages: [{role, content}]): set data.sources.0.format=messages"),
    ("alpaca", {"q": "q", "a": "a"},
     "map the file's fields to the alpaca format's (instruction, output) with "
     "'data.sources.0.columns={instruction: FIELD, output: FIELD}'"),
])
def test_a_row_of_another_format_says_which(tiny, tmp_path, fmt, record, hint):
    """The issue's files: sharegpt read as alpaca, role/content turns under format=sharegpt, and the other shapes."""
    write_jsonl(tmp_path / "rows.jsonl", [record])
    with pytest.raises(DataError) as info:
        build(config_for(DataSource(name="mine", path=str(tmp_path / "rows.jsonl"), format=fmt)), tiny)
    assert str(info.value).endswith(hint) and "line 1" in str(info.value)
    with pytest.raises(DataError) as info:  # read without its place in data.sources: N
        read_source(DataSource(name="x", path=str(tmp_path / "rows.jsonl"), format=fmt))
    assert str(info.value).endswith(hint.replace("data.sources.0.", "data.sources.N."))


def test_a_file_type_as_format_says_where_the_type_comes_from():
    with pytest.raises(ConfigError, match=r"format='csv' is not accepted; the file type comes from the path's "
                                          r"extension .*alpaca \(instruction, output\); messages \(messages: "):
        DataSource(name="d", path="qa.csv", format="csv")


def test_a_typo_in_a_local_path_shows_the_resolved_path(tmp_path, monkeypatch):
    """`data.sources.0.path=qa.cvs`: not a file, so tried as a Hub id; the error shows both and the near name."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    qa_csv(tmp_path / "qa.csv", 3)
    with pytest.raises(DataError) as info:
        read_source(DataSource(name="d", path="qa.cvs", columns={"instruction": "q", "output": "a"}))
    message = str(info.value)
    assert message.startswith(f"qa.cvs: no such local file (resolved to {tmp_path / 'qa.cvs'}), and not loadable "
                              "as a Hugging Face dataset id")
    assert message.endswith("; did you mean qa.csv?")


def test_a_plain_text_prompts_file_and_a_missing_model_dir_say_what_was_expected(tmp_path, monkeypatch):
    """`generate prompts_file=prompts.txt` holding plain lines: the file and line, and what a line must hold; a model
    directory that is not there: its absolute path (model.source=local), or beside the Hub attempt (source=hub)."""
    from qwenft.config import ModelConfig, QwenftError
    from qwenft.generation.command import read_prompts
    from qwenft.model.sources import resolve_model_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.txt").write_text("\nWrite a haiku about spring\n", encoding="utf-8")
    with pytest.raises(QwenftError) as info:
        read_prompts("prompts.txt")
    assert str(info.value) == ('prompts.txt:2: not valid JSON (Expecting value, column 1); a prompts file holds one '
                               'JSON object per line: {"prompt": "your question"} or {"messages": [{"role": "user", '
                               '"content": "..."}]}')
    with pytest.raises(QwenftError, match=r"prompts_file='prompt\.txt': no such file \(resolved to "
                                          + str(tmp_path) + r"/prompt\.txt\); did you mean prompts\.txt\?"):
        read_prompts("prompt.txt")
    with pytest.raises(QwenftError, match=r"model.path='my-model': does not exist \(resolved to " + str(tmp_path)):
        resolve_model_dir(ModelConfig(source="local", path="my-model"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(QwenftError, match=r"model \./my-model: cannot load it .*; no local directory "
                                          + str(tmp_path) + r"/my-model either \(a local model: model.source=local"):
        load_tokenizer("./my-model")


def test_preview_says_how_long_the_data_took_on_a_miss_and_a_hit(tmp_path, monkeypatch, capsys):
    """`data` prints the seconds a run spends on data before training (tokenizer load + build), the cache's
    hit/miss beside it: the number issue 28's second-run target is read from (benchmarks/data_scale.py)."""
    import re

    from qwenft.cli import main

    monkeypatch.setenv("QWENFT_CACHE", str(tmp_path / "cache"))
    rows = write_jsonl(tmp_path / "rows.jsonl", qa_rows(6))
    argv = ["data", "model=tiny-random", f"data.sources=[{{name: qa, path: {rows}, eval_rows: 1}}]"]
    pattern = (r"tokenized cache: (\d) hit\(s\), (\d) miss\(es\); data ready in ([\d.]+) s "
               r"\(tokenizer ([\d.]+) s, build ([\d.]+) s\)")
    seen = []
    for _ in range(2):
        main(argv)
        out = capsys.readouterr().out
        found = re.search(pattern, out)
        assert found, f"no data-ready line in:\n{out}"
        hits, misses, total, tokenizer_s, build_s = found.groups()
        # each printed to 0.1 s, so the sum of the rounded parts is within 0.1 s of the rounded total
        assert abs(float(total) - float(tokenizer_s) - float(build_s)) <= 0.1 + 1e-9
        seen.append((int(hits), int(misses)))
    assert seen == [(0, 1), (1, 0)]


def test_a_shard_is_tokenized_while_the_next_is_read_and_its_error_comes_first(tiny, tmp_path, monkeypatch):
    """The build reads shard k+1 while a worker thread tokenizes shard k (one shard in flight): shard 0's
    tokenization sees shard 1's input being written before it returns. An error of the shard in flight is raised
    before a later read error (file order), and nothing half-written is left."""
    import threading

    from qwenft.data import encode, store

    monkeypatch.setattr(store, "SHARD_ROWS", 4)
    monkeypatch.setenv("QWENFT_CACHE", str(tmp_path / "cache"))
    rows = [{"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": f"a {i}"}],
            "text": None, "row": i + 1} for i in range(10)]
    source, dcfg = DataSource(name="s", path="s.jsonl"), DataConfig(cache=True)
    second_read = threading.Event()
    real_write, real_encode = store.ShardInput.write, encode.encode_batch

    def write(self, part):
        if ".00001." in self.path.name:
            second_read.set()
        return real_write(self, part)

    overlapped = []

    def encode_waiting(batch, **kwargs):
        if batch["row"][0] == 1:  # shard 0: returns only once shard 1 is being read (or after 10 s: no overlap)
            overlapped.append(second_read.wait(timeout=10))
        return real_encode(batch, **kwargs)

    monkeypatch.setattr(store.ShardInput, "write", write)
    monkeypatch.setattr(encode, "encode_batch", encode_waiting)
    encode.tokenize_rows(rows, tiny, dcfg, source, "line", "key", "train")
    assert overlapped == [True]

    def fails_on_shard_0(batch, **kwargs):
        if batch["row"][0] == 1:
            second_read.wait(timeout=10)
            raise RuntimeError("shard 0 failed")
        return real_encode(batch, **kwargs)

    def read_fails_in_shard_1():
        yield rows[:4]
        yield rows[4:6]
        raise DataError("bad row", file="s.jsonl", row=7)

    monkeypatch.setattr(encode, "encode_batch", fails_on_shard_0)
    second_read.clear()
    shards = tmp_path / "shards"
    shards.mkdir()
    with pytest.raises(RuntimeError, match="shard 0 failed"):
        store._build(tmp_path, shards, read_fails_in_shard_1(),
                     lambda part, cache_file, shard: part.map(encode.encode_batch, batched=True,
                                                              cache_file_name=cache_file, fn_kwargs={}),
                     {}, dict)
    assert list(shards.iterdir()) == []  # neither shard's input nor output left
