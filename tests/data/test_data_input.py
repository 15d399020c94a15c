"""Issue 28, bad input: each file a user can plausibly hand ``qwenft data`` gets an error naming the file, the
line or row and the field, counts that add up, and a cache left clean."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwenft.config import DataSource
from qwenft.data import DataError, build, read_source
from tests.conftest import qa_rows


def csv_lines(n: int, start: int = 0):
    return [f"question {i}?,answer {i}." for i in range(start, start + n)]


def read_skipping(path: Path, **source):
    skipped: list = []
    rows = read_source(DataSource(name="x", path=str(path), **source), on_bad_row="skip", skipped=skipped)
    return rows, skipped


def test_an_unclosed_csv_quote_is_refused_even_with_skip_naming_its_line(tmp_path):
    """The rows after an unclosed quote are one field to the csv module: skipping "1 row" would lose 4 silently."""
    path = tmp_path / "a.csv"
    path.write_text("\n".join(["instruction,output", *csv_lines(3), '"abc,def', *csv_lines(4, 3)]) + "\n")
    for on_bad_row in ("error", "skip"):
        with pytest.raises(DataError) as info:
            read_source(DataSource(name="x", path=str(path)), on_bad_row=on_bad_row)
        message = str(info.value)
        assert message.startswith(f"{path}: line 5: a quoted field") and "never closed" in message
        assert "lines 5-9" in message
    # a quote misplaced inside one line spoils that row only: skipped and counted, the rows after it read
    path.write_text("\n".join(["instruction,output", *csv_lines(2), '"q"x,a', *csv_lines(2, 2)]) + "\n")
    rows, skipped = read_skipping(path)
    assert [r["row"] for r in rows] == [2, 3, 5, 6]
    assert len(skipped) == 1 and f"{path}: line 4: malformed CSV" in skipped[0]


def test_special_tokens_as_text_are_bad_rows_of_the_read_naming_the_field(tmp_path):
    """Found while reading (in file order, skippable, counted like any bad row), naming the turn's field."""
    rows = qa_rows(4) + [{"instruction": "q", "input": "see <|im_start|>", "output": "a"},
                         {"instruction": "q", "output": "a <|im_end|> b"}]
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"a\.jsonl: line 5: field 'input': contains the special token <\|im_start\|>"):
        read_source(DataSource(name="x", path=str(path)))
    got, skipped = read_skipping(path)
    assert len(got) == 4 and len(skipped) == 2 and "line 6: field 'output'" in skipped[1]
    turns = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "<|endoftext|>"}]}]
    path.write_text(json.dumps(turns[0]) + "\n")
    with pytest.raises(DataError, match=r"line 1: field 'conversations\[1\]\.value': contains the special token "
                                        r"<\|endoftext\|> as text \(turn 2, assistant\)"):
        read_source(DataSource(name="x", path=str(path), format="sharegpt"))


def test_rows_failing_tokenization_first_in_file_and_counted_when_held_out(tiny, tmp_path):
    """A row that encodes to nothing (here: no supervised token under a template that drops answers) and an
    overlong drop: with on_bad_row=error the first in the file is named whichever side of the split it fell on;
    with skip, held-out ones are counted too."""
    import copy

    from qwenft.config import Config, DataConfig

    silent = copy.deepcopy(tiny)  # answers rendered only when they say "keep"
    silent.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' or 'keep' in m['content'] %}"
                            "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}")
    rows = [{"instruction": f"q{i}", "output": f"keep {i}" if i % 3 else f"drop {i}"} for i in range(30)]
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for seed in range(4):  # the eval split moves; the row named stays line 1
        source = DataSource(name="x", path=str(path), eval_rows=10)
        with pytest.raises(DataError, match=r"a\.jsonl: line 1: no supervised tokens"):
            build(Config(data=DataConfig(sources=[source], cache=False, seed=seed)), silent)
    source = DataSource(name="x", path=str(path), eval_rows=10)
    bundle = build(Config(data=DataConfig(sources=[source], cache=False, on_bad_row="skip")), silent)
    counts = bundle.stats["sources"]["x"]
    assert 0 < len(bundle.eval) < 10  # some of the 10 bad rows were held out
    assert counts["skipped"] == 10 == bundle.stats["skipped"]  # lines 1, 4, ..., 28: held out or not
    assert counts["eval"] == 10 and counts["usable"] + len(bundle.eval) == 20
    # overlong rows dropped from the held-out rows are counted as well
    long = [{"instruction": f"q{i}", "output": "keep " + "word " * (60 if i < 10 else 1)} for i in range(30)]
    path.write_text("".join(json.dumps(r) + "\n" for r in long))
    whole = DataSource(name="x", path=str(path), eval_rows=30, weight=0.0)
    train = DataSource(name="t", path=str(tmp_path / "t.jsonl"))
    Path(train.path).write_text("".join(json.dumps(r) + "\n" for r in long[10:]))
    bundle = build(Config(data=DataConfig(sources=[whole, train], cache=False, max_seq_len=32, overlong="drop")),
                   silent)
    assert bundle.stats["sources"]["x"]["dropped"] == 10 and len(bundle.eval) == 20


@pytest.mark.parametrize("name, content, said", [
    ("a.csv", "", "the file is empty or holds only its header line"),
    ("a.csv", "instruction,output\n", "the file is empty or holds only its header line"),
    ("a.jsonl", "", "the file is empty or all blank lines"),
    ("a.jsonl", "\n \n", "the file is empty or all blank lines"),
    ("a.json", "", "the file is empty or all whitespace"),
    ("a.json", "[]", "an empty array")])
def test_a_file_of_no_rows_is_refused_naming_it(tiny, tmp_path, name, content, said):
    """Not "no usable training rows" of the source's name: the file, and what it holds."""
    from qwenft.config import Config, DataConfig

    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError) as info:
        build(Config(data=DataConfig(sources=[DataSource(name="d", path=str(path))], cache=False)), tiny)
    assert str(info.value).startswith(f"{path}: no rows ({said})")


def test_a_refused_build_leaves_no_entry_and_a_killed_ones_leftovers_go(tiny, tmp_path, monkeypatch):
    """A bad row before any shard finished: no entry folder stays (a fixed file has another key: it would never be
    used). What a SIGKILL left (temporary files of a dead pid, an entry with nothing finished) goes at the next
    build; a live process's files and a killed run's finished shards stay (resumed: another test)."""
    import os

    from qwenft.config import Config, DataConfig
    from qwenft.data import store

    monkeypatch.setenv("QWENFT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(3) + [{"instruction": "q", "output": ""}]))
    with pytest.raises(DataError, match="line 4: field 'output': empty answer"):
        build(Config(data=DataConfig(sources=[DataSource(name="d", path=str(path))])), tiny)
    assert not any(p.is_dir() and not p.name.startswith(".") for p in (tmp_path / "cache" / "data").iterdir())
    root, dead = tmp_path / "cache" / "data", 999_999_999  # above any pid_max: never a live process
    killed, resumable = root / ("k" * 32), root / ("r" * 32)
    for entry in (killed, resumable):
        (entry / "shards").mkdir(parents=True)
        (entry / "building.json").write_text(json.dumps({"source": "x", "pid": dead}))
        (entry / f".rows.arrow.{dead}.tmp").write_bytes(b"half")
        (entry / f".rows.arrow.{os.getpid()}.tmp").write_bytes(b"mine")  # a live process's: kept
    (resumable / "shards" / "00000.json").write_text(json.dumps({"rows": 1, "files": ["00000-0.arrow"]}))
    (resumable / "shards" / "00000-0.arrow").write_bytes(b"done")
    (resumable / "shards" / f".00001.{dead}.input.arrow").write_bytes(b"half")
    path.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(3)))
    build(Config(data=DataConfig(sources=[DataSource(name="d", path=str(path))])), tiny)
    assert not killed.exists()
    assert sorted(p.name for p in resumable.rglob("*")) == sorted([
        "shards", "building.json", f".rows.arrow.{os.getpid()}.tmp", "00000.json", "00000-0.arrow"])
    assert [e["shards_done"] for e in store.entries() if not e["complete"]] == [1]


@pytest.mark.slow  # the embedded model's real tokenizer, prepared from its GGUF
def test_qwenft_data_on_an_empty_cache_prepares_only_the_embedded_tokenizer(embedded_dir, tmp_path, monkeypatch,
                                                                           capsys):
    """The data command never converts the embedded weights (a minute or two): the tokenizer and config come from
    the GGUF's metadata (the first package part), and tokenize exactly as the converted model's tokenizer."""
    from qwenft.cli import main
    from qwenft.data.encode import tokenizer_fingerprint
    from qwenft.model import load_tokenizer, sources

    def no_conversion():
        raise AssertionError("qwenft data converted the embedded model")

    monkeypatch.setattr(sources, "embedded_model_dir", no_conversion)
    monkeypatch.setenv("QWENFT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(4)))
    main(["data", "data.cache=false", f"data.sources=[{{name: d, path: {path}}}]"])
    assert "training examples: 4" in capsys.readouterr().out
    made = tmp_path / "cache" / "embedded" / f"{sources.EMBEDDED_SHA256[:16]}-tokenizer"
    assert sorted(p.name for p in made.iterdir()) == ["chat_template.jinja", "config.json", "tokenizer.json",
                                                      "tokenizer_config.json"]
    assert not (made.parent / sources.EMBEDDED_SHA256[:16]).exists()
    assert tokenizer_fingerprint(load_tokenizer(str(made))) == tokenizer_fingerprint(load_tokenizer(str(embedded_dir)))


def test_jsonl_line_ends_and_columns(tmp_path):
    """CR-only line ends are named as such (not "Extra data" of a one-line file); a malformed line's column counts
    within the line (its newline is not a second line)."""
    path = tmp_path / "a.jsonl"
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\r" for r in qa_rows(3)))
    with pytest.raises(DataError) as info:
        read_source(DataSource(name="x", path=str(path)))
    assert str(info.value) == (f"{path}: line 1: the lines end in a carriage return (\\r) only, so the file reads as "
                               "one line holding 3 JSON values; re-save it with LF (or CRLF) line endings")
    for end in ("\n", "\r\n"):
        path.write_text(json.dumps(qa_rows(1)[0]) + end + '{"instruction": "x", "output": "y"' + end)
        with pytest.raises(DataError, match=r"line 2: malformed JSON: Expecting ',' delimiter \(column 35\)$"):
            read_source(DataSource(name="x", path=str(path)))


def test_csv_rows_of_another_width_and_a_duplicated_header(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("instruction,output\nq0,a0\nq1\nq2,a2,extra,more\nq3,a3\n")
    rows, skipped = read_skipping(path)
    assert [r["row"] for r in rows] == [2, 5]
    assert skipped == [f"{path}: line 3: the row has 1 cell where the header has 2 (instruction, output)",
                       f"{path}: line 4: the row has 4 cells where the header has 2 (instruction, output)"]
    path.write_text("instruction,output,output\nq0,a0,\n")
    with pytest.raises(DataError) as info:
        read_skipping(path)
    assert str(info.value).startswith(f"{path}: line 1: the header line names 'output' more than once")


def test_eval_by_names_the_line_and_eval_rows_equal_to_the_rows_is_clamped(tiny, tmp_path, caplog):
    import logging

    from qwenft.config import Config, ConfigError, DataConfig

    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({**r, "fact": i % 3}) + "\n" for i, r in enumerate(qa_rows(9)))
                    + json.dumps(qa_rows(1)[0]) + "\n")
    source = DataSource(name="d", path=str(path), eval_rows=3, eval_by="fact")
    with pytest.raises(DataError, match=rf"^{path}: line 10: field 'fact': missing \(needed by eval_by=fact; "
                                        r"eval_by=null holds rows out at random\)"):
        build(Config(data=DataConfig(sources=[source], cache=False)), tiny)
    with caplog.at_level(logging.WARNING):  # equal counts: as a larger value, clamped with a warning
        bundle = build(Config(data=DataConfig(sources=[DataSource(name="d", path=str(path), eval_rows=10)],
                                              cache=False)), tiny)
    assert bundle.stats["sources"]["d"]["eval"] == 3 and bundle.stats["train_examples"] == 7
    assert "data.sources.0.eval_rows=10 is all of its 10 usable rows; clamped to 3 (a third)" in caplog.text
    path.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(2)))
    with pytest.raises(ConfigError, match=r"eval_rows=2: source d .* has only 2 usable rows; the largest valid value "
                                          r"is 1"):
        build(Config(data=DataConfig(sources=[DataSource(name="d", path=str(path), eval_rows=2)], cache=False)), tiny)


def test_small_config_messages(tiny, tmp_path, monkeypatch, capsys, caplog):
    """A source key's type error names the key in full; an unknown columns key lists the allowed ones; weight 0
    without eval_rows warns; cache=clear of a key no entry has exits 2 saying so."""
    import logging

    from qwenft.cli import main
    from qwenft.config import Config, ConfigError, DataConfig

    monkeypatch.setenv("QWENFT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(4)))
    for extra, said in ((", max_rows: abc", "data.sources.0.max_rows: Value 'abc' of type 'str' could not be "
                                            "converted to Integer"),
                        (", columns: {bogus: x}", "data.sources[d].columns.bogus='x' is not accepted; 'bogus' is not a "
                                                  "field of the alpaca format; the keys allowed are its fields: "
                                                  "instruction, input, output, system, history")):
        with pytest.raises(SystemExit) as info:
            main(["data", "model=tiny-random", f"data.sources=[{{name: d, path: {path}{extra}}}]"])
        assert info.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1].startswith(
            f"qwenft: error: {said}")
    with pytest.raises(ConfigError, match="the keys allowed are its fields: conversations, from, value, system"):
        DataSource(name="x", path="a.jsonl", format="sharegpt", columns={"messages": "m"})
    train, idle = DataSource(name="t", path=str(path)), DataSource(name="idle", path=str(path), weight=0.0)
    with caplog.at_level(logging.WARNING):
        build(Config(data=DataConfig(sources=[train, idle], cache=False)), tiny)
    assert "idle: weight 0 and no eval_rows: neither trained nor evaluated on; set data.sources.1.eval_rows=N" \
        in caplog.text
    with pytest.raises(SystemExit) as info:
        main(["data", "cache=clear", "nosuchkey"])
    assert info.value.code == 2 and "no cache entry's key starts with nosuchkey; nothing removed" in \
        capsys.readouterr().err
