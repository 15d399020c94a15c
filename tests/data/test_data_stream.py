"""Issue 28: the data path streams. Files are read a block at a time (a JSON array element by element, with its
errors located as when read whole), rows go to disk shard by shard as they are read (a read that fails halfway
leaves the shards before it, and the rerun tokenizes only the others, with the same ids), and the skipped-row
counts stay exact when only the first messages are kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwenft.config import Config, DataConfig, DataSource, TinyModelConfig
from qwenft.data import DataError, build, read_source
from qwenft.model import load_tokenizer
from tests.conftest import qa_rows, write_jsonl


@pytest.fixture(scope="module")
def tiny():
    from qwenft.model.tiny import tiny_model_dir

    return load_tokenizer(str(tiny_model_dir(TinyModelConfig())))


@pytest.fixture
def small_blocks(monkeypatch):
    """Windows of 7 bytes: every element, string and multi-byte character of a small file crosses a block edge."""
    from qwenft.data import records

    monkeypatch.setattr(records, "BLOCK", 7)


def rows_of(path: Path, **source):
    return read_source(DataSource(name="x", path=str(path), **source))


ROWS = [{"instruction": f"问题 {i} \"quoted\" \\ é", "input": i, "output": f"answer {i}. 春天 🌸"} for i in range(9)]


@pytest.mark.parametrize("indent", [None, 2])
def test_a_json_array_read_in_small_blocks_equals_the_whole_read(tmp_path, small_blocks, indent):
    """Minified (one line) and indented arrays, UTF-8 characters of 2-4 bytes split between blocks, numbers as
    text: the rows equal those of the JSON Lines file."""
    path = tmp_path / "a.json"
    path.write_text(json.dumps(ROWS, ensure_ascii=False, indent=indent), encoding="utf-8")
    got = rows_of(path)
    want = rows_of(write_jsonl(tmp_path / "a.jsonl", ROWS))
    assert [r["messages"] for r in got] == [r["messages"] for r in want] and len(got) == 9
    assert [r["row"] for r in got] == list(range(1, 10))
    assert got[3]["messages"][0]["content"] == "问题 3 \"quoted\" \\ é\n\n3"
    (tmp_path / "e.json").write_text(" [ ] \n", encoding="utf-8")
    with pytest.raises(DataError, match=r"e\.json: no rows \(an empty array\)"):
        rows_of(tmp_path / "e.json")
    (tmp_path / "b.json").write_bytes(b"\xef\xbb\xbf" + path.read_bytes())  # a byte-order mark first
    assert [r["messages"] for r in rows_of(tmp_path / "b.json")] == [r["messages"] for r in got]


def test_json_errors_in_a_later_block_name_their_line_and_column(tmp_path, small_blocks):
    lines = ["["] + [json.dumps(r, ensure_ascii=False) + "," for r in ROWS[:4]] + ['{"instruction": "q" "output": 1}]']
    path = tmp_path / "a.json"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(DataError) as info:
        rows_of(path)
    assert str(info.value) == f"{path}: line 6: malformed JSON: Expecting ',' delimiter (column 21)"
    one_line = json.dumps(ROWS[:2], ensure_ascii=False)  # minified: the column counts from the line's start
    (tmp_path / "m.json").write_text(one_line + ' {"x": 1}', encoding="utf-8")
    with pytest.raises(DataError) as info:
        rows_of(tmp_path / "m.json")
    assert str(info.value).endswith(f"line 1: malformed JSON: Extra data (column {len(one_line) + 2})")
    (tmp_path / "c.json").write_text(one_line[:-1], encoding="utf-8")  # cut short
    with pytest.raises(DataError, match="line 1: malformed JSON: Expecting ',' delimiter"):
        rows_of(tmp_path / "c.json")
    data = json.dumps(ROWS[:3], indent=1).encode()
    at = data.index(b"answer 2")
    (tmp_path / "u.json").write_bytes(data[:at] + b"\xe9" + data[at + 1:])
    with pytest.raises(DataError) as info:
        rows_of(tmp_path / "u.json")
    line = data[:at].count(b"\n") + 1
    column = at - data.rfind(b"\n", 0, at)
    assert str(info.value) == (f"{tmp_path / 'u.json'}: line {line}: not UTF-8 text: byte 0xe9 at byte offset {at} "
                               f"(column {column}); re-save the file as UTF-8")


def test_json_top_level_shapes(tmp_path, small_blocks):
    (tmp_path / "o.json").write_text(json.dumps({"instruction": "q", "output": "a", "id": 1}), encoding="utf-8")
    with pytest.raises(DataError, match="expected a JSON array of objects .or JSON Lines.; got an object with keys: "
                                        "instruction, output, id"):
        rows_of(tmp_path / "o.json")
    (tmp_path / "s.json").write_text('"text"', encoding="utf-8")
    with pytest.raises(DataError, match="expected a JSON array of objects, got str"):
        rows_of(tmp_path / "s.json")
    lines = "\n".join(json.dumps(r) for r in qa_rows(3)) + "\n"  # JSON Lines under a .json name
    (tmp_path / "l.json").write_text(lines, encoding="utf-8")
    assert [r["row"] for r in rows_of(tmp_path / "l.json")] == [1, 2, 3]
    (tmp_path / "n.json").write_text("[1, 222, 3]", encoding="utf-8")  # "222" ends the first block: not cut
    with pytest.raises(DataError, match=r"all 3 rows were skipped as bad \(first: .*row 1: expected an object"):
        read_source(DataSource(name="x", path=str(tmp_path / "n.json")), on_bad_row="skip")


def test_csv_and_parquet_stream_alike(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from qwenft.data import records

    rows = qa_rows(25)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet", row_group_size=7)
    (tmp_path / "a.csv").write_text("instruction,input,output\n" + "".join(
        f"\"{r['instruction']}\nline two\",,{r['output']}\n" for r in rows), encoding="utf-8")
    records.BATCH_ROWS, batch = 4, records.BATCH_ROWS
    try:
        parquet = rows_of(tmp_path / "a.parquet")
    finally:
        records.BATCH_ROWS = batch
    csv_rows = rows_of(tmp_path / "a.csv")
    assert [r["row"] for r in parquet] == list(range(1, 26)) and [r["row"] for r in csv_rows][:3] == [2, 4, 6]
    assert [r["messages"][1] for r in parquet] == [r["messages"][1] for r in csv_rows]


def config_for(*sources: DataSource, **data) -> Config:
    return Config(data=DataConfig(sources=list(sources), **data))


def test_a_read_that_fails_halfway_keeps_its_shards_and_the_rerun_gives_the_same_ids(tiny, tmp_path, monkeypatch):
    """Rows are tokenized as they are read: a bad row at the end of the file (on_bad_row=error) is found after
    the shards before it are on disk; the rerun with on_bad_row=skip reads the file again, tokenizes only the last
    shard, and equals a run that never failed."""
    from qwenft.data import encode, source as source_module, store

    monkeypatch.setattr(store, "SHARD_ROWS", 4)
    monkeypatch.setattr(source_module, "WRITE_ROWS", 3)  # batches of rows read, that do not divide a shard
    lines = [json.dumps(r) for r in qa_rows(10)] + ['{"instruction": "q", "output": ""}']
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    source = DataSource(name="x", path=str(path), eval_rows=2)
    monkeypatch.setenv("QWENFT_CACHE", str(tmp_path / "clean"))
    clean = build(config_for(source, on_bad_row="skip"), tiny)
    monkeypatch.setenv("QWENFT_CACHE", str(tmp_path / "failed"))
    with pytest.raises(DataError, match="line 11: field 'output': empty answer"):
        build(config_for(source), tiny)
    assert [e["shards_done"] for e in store.entries()] == [2]  # rows 1-8 tokenized before the bad row was read
    (entry,) = [p for p in (tmp_path / "failed" / "data").iterdir() if p.is_dir()]
    assert not [p.name for p in entry.rglob("*") if ".tmp" in p.name or ".input" in p.name]
    firsts, real = [], encode.encode_batch

    def counted(batch, **kwargs):
        firsts.append(batch["row"][0])
        return real(batch, **kwargs)

    monkeypatch.setattr(encode, "encode_batch", counted)
    resumed = build(config_for(source, on_bad_row="skip"), tiny)
    assert firsts == [9] and resumed.stats["cache_misses"] == 1  # the last shard only
    assert resumed.train[:] == clean.train[:] and resumed.eval_rows == clean.eval_rows
    assert resumed.stats | {"cache_misses": 1, "seconds": 0} == clean.stats | {"cache_misses": 1, "seconds": 0}
    assert resumed.stats["sources"]["x"]["skipped"] == 1 and resumed.stats["sources"]["x"]["rows_read"] == 11
    with pytest.raises(DataError, match="line 11: field 'output': empty answer"):  # a hit still says it
        build(config_for(source), tiny)


def test_skipped_rows_are_counted_beyond_the_messages_kept(tiny, tmp_path, monkeypatch, caplog):
    import logging

    from qwenft.data import source as source_module

    monkeypatch.setattr(source_module, "KEEP_SKIPPED", 2)
    monkeypatch.setenv("QWENFT_CACHE", str(tmp_path / "cache"))
    lines = []
    for i, row in enumerate(qa_rows(12)):
        lines.append(json.dumps(row) if i % 2 else "{broken")
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    source = DataSource(name="x", path=str(path), eval_rows=1)
    for _ in range(2):  # a miss, then a hit
        with caplog.at_level(logging.WARNING):
            bundle = build(config_for(source, on_bad_row="skip"), tiny)
        counts = bundle.stats["sources"]["x"]
        assert (counts["skipped"], counts["rows_read"], counts["usable"]) == (6, 12, 5)
        assert "x: 6 of 12 rows were skipped as bad" in caplog.text and "... and 3 more" in caplog.text
        assert "line 1: malformed JSON" in caplog.text and "line 3: malformed JSON" in caplog.text
        caplog.clear()


# ----------------------------------------------------------------------------- mixing and packing on index arrays

def choose_as_pairs(available, counts, seed):
    """The pair-list choose of earlier qwenft, kept here as the reference for the order."""
    import random

    picked = []
    for name, count in counts.items():
        rng = random.Random(f"{seed}:{name}:mix")
        taken = []
        while len(taken) < count:
            perm = list(range(available[name]))
            rng.shuffle(perm)
            taken.extend(perm[: count - len(taken)])
        picked.extend((name, i) for i in taken)
    random.Random(f"{seed}:order").shuffle(picked)
    return picked


@pytest.mark.parametrize("available, counts", [({"a": 10, "b": 4}, {"a": 10, "b": 9}),
                                               ({"a": 1000, "b": 7, "c": 300}, {"a": 1000, "b": 250, "c": 0}),
                                               ({"a": 5}, {"a": 5})])
@pytest.mark.parametrize("seed", [0, 3])
def test_choose_gives_the_pair_lists_order_as_arrays(available, counts, seed):
    import numpy as np

    from qwenft.data import choose

    picked = choose(available, counts, seed)
    assert picked.source.dtype == picked.index.dtype == np.int64 and len(picked) == sum(counts.values())
    assert list(picked) == choose_as_pairs(available, counts, seed) == picked
    assert picked[0] == choose_as_pairs(available, counts, seed)[0]


def test_packed_rows_are_gathered_from_the_memory_map(tiny, tmp_path):
    """The packed training set holds offset arrays; each row is its members' ids in order, positions restarting,
    each member's first label masked, and equal to packing the unpacked examples by hand."""
    import numpy as np

    from qwenft.data import pack
    from qwenft.data.collate import PackedDataset

    rows = [{"instruction": f"question {i} " * (1 + i % 5), "output": f"answer {i} " * (1 + i % 3)} for i in range(30)]
    source = DataSource(name="x", path=str(write_jsonl(tmp_path / "a.jsonl", rows)))
    unpacked = build(config_for(source, cache=False, max_seq_len=96), tiny)
    packed = build(config_for(source, cache=False, max_seq_len=96, packing=True), tiny)
    assert isinstance(packed.train, PackedDataset) and isinstance(packed.train.members, np.ndarray)
    examples = unpacked.train[:]
    groups = pack([len(ids) for ids in examples["input_ids"]], 96)
    assert len(packed.train) == len(groups) == packed.stats["train_rows"] and len(groups) < 30
    for r, members in enumerate(groups):
        row = packed.train[r]
        assert row["input_ids"] == [t for i in members for t in examples["input_ids"][i]]
        assert row["labels"] == [t for i in members for t in [-100] + examples["labels"][i][1:]]
        assert row["position_ids"] == [p for i in members for p in range(len(examples["input_ids"][i]))]
    assert packed.train[-1] == packed.train[len(groups) - 1] and len(list(packed.train)) == len(groups)
    with pytest.raises(IndexError):
        packed.train[len(groups)]
    assert all(isinstance(ids, np.ndarray) and ids.dtype == np.int64 for ids in packed.train_row_ids.values())


def test_the_trainer_batches_packed_rows(tmp_path):
    """The Trainer takes the packed set as it is (a map-style dataset, no datasets.Dataset): its dataloader gives
    packed batches with restarting positions, the same ones for the same seed, and a finite loss."""
    import torch

    from qwenft.model import attach_lora, load_model
    from qwenft.train.trainer import make_trainer
    from tests.conftest import compose_config

    rows = write_jsonl(tmp_path / "a.jsonl", [{"instruction": f"question {i} " * (1 + i % 4),
                                               "output": f"answer {i}."} for i in range(24)])
    config = compose_config("model=tiny-random", "quant=none", f"out_dir={tmp_path / 'run'}", "data.cache=false",
                            f"data.sources=[{{name: qa, path: '{rows}', weight: 1.0, eval_rows: 4}}]",
                            "data.packing=true", "data.max_seq_len=96", "train.batch_size=2",
                            "train.gradient_checkpointing=false")
    model, tokenizer = load_model(config, device="cpu")
    model = attach_lora(model, config.lora, gradient_checkpointing=False)
    bundle = build(config, tokenizer)
    batches = []
    for _ in range(2):
        trainer = make_trainer(config, model, tokenizer, bundle, tmp_path / "ckpt", "none")
        batches.append(next(iter(trainer.get_train_dataloader())))
    first = batches[0]
    assert set(first) == {"input_ids", "labels", "position_ids"} and first["input_ids"].shape[0] == 2
    assert all(torch.equal(first[k], batches[1][k]) for k in first)
    assert (first["position_ids"] == 0).sum() > 2  # more than one example in a row
    with torch.no_grad():
        assert torch.isfinite(trainer.compute_loss(model, dict(first)))


def test_the_data_command_imports_no_trainer(tmp_path):
    """`qwenft data` loads a tokenizer only: under WANDB_MODE=offline it neither imports transformers' W&B
    integration (the Trainer, peft, bitsandbytes: seconds of imports) nor prints its notice."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    rows = write_jsonl(tmp_path / "rows.jsonl", qa_rows(6))
    script = ("import sys\nfrom qwenft.cli import main\nmain(sys.argv[1:])\n"
              "print('IMPORTED', sorted(m for m in ('peft', 'transformers.integrations.integration_utils', "
              "'qwenft.train.run') if m in sys.modules))\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "QWENFT_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", script, "data", "model=tiny-random", "data.cache=false",
                           f"data.sources=[{{name: qa, path: '{rows}', eval_rows: 1}}]"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "training examples: 5" in proc.stdout and "IMPORTED []" in proc.stdout
    assert "Running in WANDB offline mode" not in proc.stdout + proc.stderr


DEEP = '{"instruction": "q", "output": "a", "m": ' + "[" * 100_000 + "]" * 100_000 + "}"
LONG_INT = '{"instruction": "q", "output": ' + "9" * 5000 + "}"
HALF_PAIR = '{"instruction": "q", "output": "bad \\ud800 half"}'
WHOLE_PAIR = '{"instruction": "q", "output": "smile \\ud83d\\ude00"}'


@pytest.mark.parametrize("line,says", [(DEEP, "nested too deeply"), (LONG_INT, "integer too long"),
                                       (HALF_PAIR, "half of a UTF-16 surrogate pair")])
def test_json_the_reader_gives_up_on_is_a_bad_row_not_a_crash(tmp_path, line, says):
    """JSON that ``json`` refuses beside JSONDecodeError (RecursionError, the int digits limit) and a lone surrogate
    escape, which decodes but cannot be written as UTF-8 (Arrow's UnicodeEncodeError): a DataError naming the line,
    which on_bad_row=skip skips and counts (they crashed the command with a traceback)."""
    good = [json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) for i in range(4)]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(good[:2] + [line] + good[2:]) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"bad\.jsonl.*line 3.*{says}"):
        rows_of(path)
    skipped = []
    rows = read_source(DataSource(name="x", path=str(path)), on_bad_row="skip", skipped=skipped)
    assert len(skipped) == 1 and says in skipped[0]
    assert [r["row"] for r in rows] == [1, 2, 4, 5]
    as_array = tmp_path / "bad.json"
    as_array.write_text("[" + ",\n".join(good[:2] + [line] + good[2:]) + "]", encoding="utf-8")
    if says.startswith("half"):  # one element: skippable as a row
        kept = read_source(DataSource(name="x", path=str(as_array)), on_bad_row="skip")
        assert [r["row"] for r in kept] == [1, 2, 4, 5]
    with pytest.raises(DataError, match=rf"bad\.json\b.*{says}"):
        rows_of(as_array)


def test_a_whole_surrogate_pair_is_the_character(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text(WHOLE_PAIR + "\n", encoding="utf-8")
    assert rows_of(path)[0]["messages"][-1]["content"] == "smile \U0001F600"
