"""Issue 45, item 1 (first stage): preference rows read from the formats people have into typed pairs (or KTO's
unpaired examples), bad rows named by file, row and field, and pairs tokenized so that both answers share the prompt
token for token. Tokenizer only (the tiny-random model's), no model forward."""

from __future__ import annotations

import json

import pytest

from qwenft.config import ConfigError, TinyModelConfig
from qwenft.data import DataError, IGNORE_INDEX, encode_example, prompt_ids
from qwenft.preference.data import (EncodedPair, EncodedUnpaired, PreferenceSource, encode_preference,
                                    load_preference, read_preference)
from qwenft.preference.formats import PreferencePair, UnpairedExample, detect_format, normalise_preference
from tests.conftest import write_jsonl

SYSTEM = {"role": "system", "content": "Be brief."}


@pytest.fixture(scope="module")
def tiny():
    """The tiny-random model's tokenizer (Qwen2's chat template and special tokens on a small vocabulary)."""
    from qwenft.model import load_tokenizer
    from qwenft.model.tiny import tiny_model_dir

    return load_tokenizer(str(tiny_model_dir(TinyModelConfig())))


def read(tmp_path, rows, fmt="auto", name="p.jsonl", **kwargs):
    path = write_jsonl(tmp_path / name, rows)
    return read_preference(PreferenceSource(path=str(path), format=fmt, columns=kwargs.pop("columns", {})),
                           **kwargs)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


# --- formats ---

HH_CHOSEN = "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: Name a colour.\n\nAssistant: Teal."
FORMATS = [
    ("pairs_alpaca", {"instruction": "Name a colour.", "input": "One word.", "system": "Be brief.",
                      "chosen": " Teal. ", "rejected": "I cannot."},
     [SYSTEM, user("Name a colour.\n\nOne word.")], "Teal.", "I cannot."),
    ("pairs_sharegpt", {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                          {"from": "gpt", "value": "Hello!"},
                                          {"from": "human", "value": "Name a colour."}],
                        "chosen": {"from": "gpt", "value": "Teal."}, "rejected": {"from": "gpt", "value": "No."}},
     [SYSTEM, user("Hi"), assistant("Hello!"), user("Name a colour.")], "Teal.", "No."),
    ("pairs_trl", {"prompt": "Name a colour.", "chosen": "Teal.", "rejected": "No."},
     [user("Name a colour.")], "Teal.", "No."),
    ("pairs_trl", {"prompt": [SYSTEM, user("Name a colour.")], "chosen": [assistant("Teal.")],
                   "rejected": [assistant("No.")]},
     [SYSTEM, user("Name a colour.")], "Teal.", "No."),
    # UltraFeedback-binarized: a prompt string beside whole conversations (TRL's implicit prompt), extra fields kept
    ("pairs_trl", {"prompt": "Name a colour.", "prompt_id": "x1", "score_chosen": 8.0,
                   "chosen": [user("Name a colour."), assistant("Teal.")],
                   "rejected": [user("Name a colour."), assistant("No.")]},
     [user("Name a colour.")], "Teal.", "No."),
    ("pairs_trl", {"chosen": [user("Hi"), assistant("Hello!"), user("Name a colour."), assistant("Teal.")],
                   "rejected": [user("Hi"), assistant("Hello!"), user("Name a colour."), assistant("No.")]},
     [user("Hi"), assistant("Hello!"), user("Name a colour.")], "Teal.", "No."),
    ("hh_rlhf", {"chosen": HH_CHOSEN, "rejected": HH_CHOSEN.replace("Teal.", "Tea, I mean no.")},
     [user("Hi there"), assistant("Hello!"), user("Name a colour.")], "Teal.", "Tea, I mean no."),
]


@pytest.mark.parametrize("fmt,row,prompt,chosen,rejected", FORMATS)
def test_each_pair_format_reads_into_a_typed_pair(tmp_path, fmt, row, prompt, chosen, rejected):
    for given in (fmt, "auto"):
        got = read(tmp_path, [row], fmt=given)
        assert got.format == fmt and got.n_skipped == 0
        pair = got.examples[0]
        assert isinstance(pair, PreferencePair)
        assert (pair.prompt, pair.chosen, pair.rejected) == (prompt, chosen, rejected)
        assert (pair.file, pair.row, pair.unit) == (str(tmp_path / "p.jsonl"), 1, "line")
    if fmt == "pairs_trl" and "prompt_id" in row:
        assert pair.meta == {"prompt_id": "x1", "score_chosen": 8.0}


def test_hh_transcripts_split_at_the_last_shared_assistant_turn(tmp_path):
    """Answers that begin alike (the common prefix runs past "Assistant:") still split at that turn; a speaker's
    consecutive turns (4 rows of the real harmless-base test split) become one turn."""
    base = "Human: Hi\n\nAssistant: Hello.\n\nAssistant: Ask me.\n\nHuman: Colour?\n\nAssistant:"
    pair = read(tmp_path, [{"chosen": base + " I like teal.", "rejected": base + " I like nothing."}],
                fmt="hh_rlhf").examples[0]
    assert pair.prompt == [user("Hi"), assistant("Hello.\n\nAsk me."), user("Colour?")]
    assert (pair.chosen, pair.rejected) == ("I like teal.", "I like nothing.")


def test_kto_rows_read_into_unpaired_examples(tmp_path):
    rows = [{"messages": [user("Hi"), assistant("Hello!"), user("Colour?"), assistant("Teal.")], "label": True},
            {"messages": [user("Colour?"), assistant("No.")], "label": False}]
    got = read(tmp_path, rows)
    assert got.format == "kto"
    first, second = got.examples
    assert isinstance(first, UnpairedExample)
    assert (first.prompt, first.answer, first.label) == ([user("Hi"), assistant("Hello!"), user("Colour?")], "Teal.",
                                                         True)
    assert (second.prompt, second.answer, second.label) == ([user("Colour?")], "No.", False)
    # TRL's unpaired shape, from a CSV file: the label as text, the prompt a string
    path = tmp_path / "u.csv"
    path.write_text("prompt,completion,label\nColour?,Teal.,true\nColour?,No.,0\n")
    got = read_preference(PreferenceSource(path=str(path)))
    assert got.format == "kto_trl" and [(e.answer, e.label) for e in got.examples] == [("Teal.", True), ("No.", False)]
    assert [e.row for e in got.examples] == [2, 3]


def test_columns_map_the_files_field_names(tmp_path):
    row = {"question": "Colour?", "better": "Teal.", "worse": "No.", "id": 7}
    columns = {"instruction": "question", "chosen": "better", "rejected": "worse"}
    got = read(tmp_path, [row], columns=columns)
    assert got.format == "pairs_alpaca" and got.examples[0].meta == {"id": 7}
    assert (got.examples[0].chosen, got.examples[0].rejected) == ("Teal.", "No.")
    with pytest.raises(DataError, match=r"line 1: field 'worse \(as rejected\)': chosen and rejected are the same"):
        read(tmp_path, [{**row, "worse": "Teal."}], fmt="pairs_alpaca", columns=columns)
    # sharegpt turns written as {role, content}: mapped through from / value
    row = {"messages": [user("Colour?")], "chosen": assistant("Teal."), "rejected": assistant("No.")}
    got = read(tmp_path, [row], fmt="pairs_sharegpt",
               columns={"conversations": "messages", "from": "role", "value": "content"})
    assert got.examples[0].prompt == [user("Colour?")]
    with pytest.raises(ConfigError, match="columns.output is not accepted"):
        PreferenceSource(path="p.jsonl", format="pairs_alpaca", columns={"output": "x"})
    with pytest.raises(ConfigError, match="format='dpo' is not accepted"):
        PreferenceSource(path="p.jsonl", format="dpo")


def test_message_lists_as_json_text_are_read_and_an_answer_that_is_json_code_stays_text(tmp_path):
    """A CSV cell holds a list as JSON text: read as turns when every item has role and content, else text."""
    path = tmp_path / "p.csv"
    turns = [json.dumps([user("Colour?"), assistant(a)]).replace('"', '""') for a in ("Teal.", "No.")]
    path.write_text(f'chosen,rejected\n"{turns[0]}","{turns[1]}"\n')
    got = read_preference(PreferenceSource(path=str(path)))
    assert got.format == "pairs_trl" and got.examples[0].prompt == [user("Colour?")]
    row = {"prompt": "Give JSON.", "chosen": '[{"role": 1}]', "rejected": '[{"a": 1}]'}
    assert detect_format(row, {}) == "pairs_trl"
    assert normalise_preference(row, "pairs_trl", {}).chosen == '[{"role": 1}]'


# --- bad rows: one error naming file, row and field ---

GOOD = {"instruction": "Colour?", "chosen": "Teal.", "rejected": "No."}
TURNS = {"chosen": [user("Colour?"), assistant("Teal.")], "rejected": [user("Shape?"), assistant("Round.")]}
BAD = [
    ("pairs_alpaca", {**GOOD, "rejected": " Teal."}, "rejected", "chosen and rejected are the same answer"),
    ("pairs_alpaca", {**GOOD, "chosen": "  "}, "chosen", "empty answer"),
    ("pairs_alpaca", {"instruction": "Colour?", "chosen": "Teal."}, "rejected", "missing; the row has fields"),
    ("pairs_alpaca", {**GOOD, "instruction": "", "input": ""}, "instruction", "empty prompt"),
    ("pairs_alpaca", {**GOOD, "chosen": "Teal.<|im_end|>"}, "chosen", "contains the special token <|im_end|>"),
    ("pairs_sharegpt", {"conversations": [{"from": "human", "value": "Colour?"}],
                        "chosen": {"from": "gpt", "value": ""}, "rejected": {"from": "gpt", "value": "No."}},
     "chosen.value", "empty answer"),
    ("pairs_sharegpt", {"conversations": [{"from": "human", "value": "Colour?"}],
                        "chosen": {"from": "human", "value": "Teal."}, "rejected": {"from": "gpt", "value": "No."}},
     "chosen.from", "must be the assistant's answer"),
    ("pairs_sharegpt", {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}],
                        "chosen": {"from": "gpt", "value": "a"}, "rejected": {"from": "gpt", "value": "b"}},
     "conversations[1].from", "must end with the user's"),
    ("pairs_sharegpt", {"conversations": [{"role": "user", "content": "Hi"}],
                        "chosen": {"from": "gpt", "value": "a"}, "rejected": {"from": "gpt", "value": "b"}},
     "conversations[0].from", "map its keys with columns={from: role, value: content}"),
    ("pairs_trl", TURNS, "rejected[0].content", "the prompt differs between the answers at turn 1"),
    ("pairs_trl", {"chosen": TURNS["chosen"], "rejected": [assistant("Round.")]}, "rejected",
     "1 turns before one answer, 0 before the other"),
    ("pairs_trl", {**TURNS, "rejected": [user("Colour?"), assistant("No.")], "prompt": "Shape?"}, "prompt",
     "differs from the turns before the answer in chosen"),
    ("pairs_trl", {"prompt": "Colour?", "chosen": "Teal.", "rejected": [assistant("No.")]}, "rejected",
     "must both be text or both be message lists"),
    ("pairs_trl", {"chosen": HH_CHOSEN, "rejected": HH_CHOSEN + "!"}, "prompt", "set format=hh_rlhf"),
    ("hh_rlhf", {"chosen": "\n\nHuman: Hi\n\nAssistant: A\n\nHuman: Colour?\n\nAssistant: Teal.",
                 "rejected": "\n\nHuman: Hi\n\nAssistant: B\n\nHuman: Colour?\n\nAssistant: Teal."},
     "chosen", "the prompt differs between chosen and rejected"),
    ("hh_rlhf", {"chosen": HH_CHOSEN, "rejected": HH_CHOSEN.replace("Teal.", " ")}, "rejected", "empty answer"),
    ("hh_rlhf", {"chosen": "Teal.", "rejected": "No."}, "chosen", "no 'Assistant:' in the part both"),
    ("kto", {"messages": [user("Colour?"), assistant("Teal.")], "label": "maybe"}, "label", "must be true or false"),
    ("kto", {"messages": [user("Colour?"), assistant("Teal."), user("And?")], "label": True}, "messages[2].role",
     "must be the assistant's answer"),
    ("kto", {"messages": [], "label": True}, "messages", "an empty list"),
]


@pytest.mark.parametrize("fmt,row,field,said", BAD, ids=[f"{b[0]}-{b[3][:24]}" for b in BAD])
def test_a_bad_row_is_one_error_naming_file_row_and_field(tmp_path, fmt, row, field, said):
    good = {"pairs_alpaca": GOOD, "pairs_sharegpt": FORMATS[1][1], "pairs_trl": FORMATS[2][1],
            "hh_rlhf": FORMATS[-1][1], "kto": {"messages": [user("Colour?"), assistant("Teal.")], "label": False}}[fmt]
    path = tmp_path / "p.jsonl"
    with pytest.raises(DataError) as info:
        read(tmp_path, [good, row, good], fmt=fmt)
    assert str(info.value).startswith(f"{path}: line 2: field '{field}': ")
    assert said in str(info.value)
    skipped = read(tmp_path, [good, row, good], fmt=fmt, on_bad_row="skip")
    assert [e.row for e in skipped.examples] == [1, 3] and skipped.n_skipped == 1
    assert skipped.skipped == [str(info.value)]


def test_malformed_lines_unknown_shapes_and_empty_files(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(GOOD) + "\n{not json\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(DataError, match=rf"^{path}: line 2: "):
        read_preference(PreferenceSource(path=str(path)))
    got = read_preference(PreferenceSource(path=str(path)), on_bad_row="skip")
    assert [e.row for e in got.examples] == [1, 3] and got.n_skipped == 1
    with pytest.raises(DataError, match=r"line 1: cannot tell the preference format from the row's fields \(q, a\)"):
        read(tmp_path, [{"q": 1, "a": 2}])
    with pytest.raises(DataError, match=r"all 2 rows were skipped as bad \(first: .*line 1: field 'rejected'"):
        read(tmp_path, [{**GOOD, "rejected": "Teal."}] * 2, fmt="pairs_alpaca", on_bad_row="skip")
    path.write_text("\n")
    with pytest.raises(DataError, match=rf"^{path}: no rows"):
        read_preference(PreferenceSource(path=str(path)))
    rows = [{**GOOD, "chosen": f"Teal {i}."} for i in range(5)]
    assert [e.row for e in read_preference(PreferenceSource(path=str(write_jsonl(path, rows)),
                                                            max_rows=2)).examples] == [1, 2]


# --- tokens ---

def test_both_answers_share_the_prompt_token_for_token_and_only_answers_are_labelled(tiny, tmp_path):
    """The prompt is SFT's (the sampler's prompt_ids); each answer is its content and <|im_end|>, as SFT labels it."""
    pair = read(tmp_path, [FORMATS[1][1]]).examples[0]
    encoded, counts = encode_preference([pair], tiny, max_seq_len=256)
    item = encoded[0]
    assert isinstance(item, EncodedPair) and (counts.pairs, counts.truncated, counts.dropped) == (1, 0, 0)
    assert item.prompt_ids == prompt_ids(tiny, pair.prompt)
    im_end = tiny.convert_tokens_to_ids("<|im_end|>")
    for side, answer in (("chosen", pair.chosen), ("rejected", pair.rejected)):
        ids = getattr(item, f"{side}_ids")
        assert ids[-1] == im_end and tiny.decode(ids[:-1]) == answer
        sft = encode_example(tiny, pair.prompt + [assistant(answer)], max_seq_len=256, train_on="last_assistant")
        n = len(item.prompt_ids) + len(ids)
        assert sft["input_ids"][:n] == item.prompt_ids + ids  # SFT's tokens, then only the template's "\n"
        assert [t for t in sft["labels"] if t != IGNORE_INDEX] == ids
        seq = item.sequences()
        assert seq[f"{side}_input_ids"] == item.prompt_ids + ids
        assert seq[f"{side}_labels"] == [IGNORE_INDEX] * len(item.prompt_ids) + ids
    assert item.chosen_ids != item.rejected_ids
    # a system prompt reaches a prompt without one, as in SFT
    bare = read(tmp_path, [FORMATS[2][1]]).examples[0]
    with_system, _ = encode_preference([bare], tiny, max_seq_len=256, system_prompt="Be brief.")
    assert with_system[0].prompt_ids == prompt_ids(tiny, bare.prompt, system_prompt="Be brief.")


def test_an_overlong_answer_is_truncated_to_the_budget_never_emptied(tiny, tmp_path):
    pair = read(tmp_path, [{"prompt": "Colour?", "chosen": "Teal, the colour of a duck's head. " * 4,
                            "rejected": "No."}]).examples[0]
    full, _ = encode_preference([pair], tiny, max_seq_len=512)
    prompt_len = len(full[0].prompt_ids)
    budget = len(full[0].rejected_ids) + 2  # rejected fits, chosen does not
    encoded, counts = encode_preference([pair], tiny, max_seq_len=prompt_len + budget)
    item = encoded[0]
    assert (counts.pairs, counts.truncated, counts.dropped) == (1, 1, 0) and item.truncated
    assert item.chosen_ids == full[0].chosen_ids[:budget] and item.rejected_ids == full[0].rejected_ids
    assert item.prompt_ids == full[0].prompt_ids
    encoded, counts = encode_preference([pair], tiny, max_seq_len=prompt_len + 1)  # the smallest budget: one token
    assert [len(encoded[0].chosen_ids), len(encoded[0].rejected_ids)] == [1, 1] and counts.truncated == 1
    encoded, counts = encode_preference([pair], tiny, max_seq_len=prompt_len + budget, overlong="drop")
    assert encoded == [] and (counts.pairs, counts.truncated, counts.dropped) == (0, 0, 1)


def test_a_prompt_with_no_room_or_answers_equal_within_the_budget_is_a_bad_row(tiny, tmp_path):
    rows = [{"prompt": "Colour?", "chosen": "Teal.", "rejected": "No."},
            {"prompt": "Colour? " * 40, "chosen": "Teal.", "rejected": "No."},
            {"prompt": "Colour?", "chosen": "Teal is a colour, yes.", "rejected": "Teal is a colour, no."}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    pairs = read_preference(PreferenceSource(path=str(path))).examples
    short = len(encode_preference(pairs[:1], tiny, max_seq_len=512)[0][0].prompt_ids)
    limit = short + 3  # room for 3 answer tokens: rows 1's answers differ there, row 3's do not
    with pytest.raises(DataError, match=rf"^{path}: line 2: field 'prompt': the prompt alone is \d+ tokens and "
                                        rf"max_seq_len is {limit}: no room"):
        encode_preference(pairs, tiny, max_seq_len=limit)
    encoded, counts = encode_preference(pairs, tiny, max_seq_len=limit, on_bad_row="skip")
    assert [e.row for e in encoded] == [1] and (counts.pairs, counts.dropped) == (1, 2)
    assert "line 3: field 'rejected': chosen and rejected are the same in their first 3 tokens" in counts.reasons[1]
    encoded, counts, got = load_preference(PreferenceSource(path=str(path)), tiny, max_seq_len=512)
    assert (counts.pairs, counts.truncated, counts.dropped, got.n_skipped) == (3, 0, 0, 0)


def test_kto_examples_tokenize_prompt_then_completion(tiny, tmp_path):
    rows = [{"messages": [user("Colour?"), assistant("Teal.")], "label": True},
            {"messages": [user("Colour?"), assistant("No.")], "label": False}]
    encoded, counts, _ = load_preference(PreferenceSource(path=str(write_jsonl(tmp_path / "k.jsonl", rows))), tiny,
                                         max_seq_len=128)
    assert counts.pairs == 2 and all(isinstance(e, EncodedUnpaired) for e in encoded)
    assert [e.label for e in encoded] == [True, False]
    assert encoded[0].prompt_ids == encoded[1].prompt_ids == prompt_ids(tiny, [user("Colour?")])
    seq = encoded[0].sequences()
    assert seq["labels"] == [IGNORE_INDEX] * len(encoded[0].prompt_ids) + encoded[0].completion_ids


# --- the real files in ../shared/data/preference (read there, never copied) ---

REAL = [("dpo_en_demo.json", "pairs_sharegpt"), ("dpo_zh_demo.json", "pairs_sharegpt"), ("kto_en_demo.json", "kto"),
        ("hh_harmless_base_test.jsonl", "hh_rlhf")]


@pytest.mark.parametrize("name,fmt", REAL)
def test_the_shared_preference_files_read_and_tokenize(tiny, shared_data, name, fmt):
    """The first 50 rows of each: the format detected, counts that add up, two different answers per pair, the
    prompt shared token for token (the sampler's prompt_ids), labels on the answers only."""
    path = shared_data / "preference" / name
    if not path.is_file():
        pytest.skip(f"{path} is not present")
    source = PreferenceSource(path=str(path), max_rows=50)
    encoded, counts, got = load_preference(source, tiny, max_seq_len=2048, on_bad_row="skip")
    assert got.format == fmt and len(got.examples) == 50 and got.n_skipped == 0
    assert counts.pairs + counts.dropped == 50 and counts.pairs >= 25 and counts.truncated <= counts.pairs
    by_row = {e.row: e for e in got.examples}
    im_end = tiny.convert_tokens_to_ids("<|im_end|>")
    for item in encoded:
        example = by_row[item.row]
        assert item.prompt_ids == prompt_ids(tiny, example.prompt)
        answers = [item.chosen_ids, item.rejected_ids] if fmt != "kto" else [item.completion_ids]
        if fmt != "kto":
            assert example.chosen != example.rejected and item.chosen_ids != item.rejected_ids
        for ids in answers:
            assert 0 < len(ids) and len(item.prompt_ids) + len(ids) <= 2048
            assert ids[-1] == im_end or item.truncated
        for key, labels in item.sequences().items():
            if key.endswith("labels"):
                assert set(labels[:len(item.prompt_ids)]) == {IGNORE_INDEX}
                assert IGNORE_INDEX not in labels[len(item.prompt_ids):]


def test_the_shared_files_whole_counts(shared_data):
    """Read whole (no tokenizing): 300 sharegpt pairs each, KTO's 150 / 150 labels, and HH-RLHF harmless-base
    test's 2,312 transcripts less 4 whose chosen answer is empty (lines 87, 517, 926, 1104)."""
    folder = shared_data / "preference"
    if not (folder / "hh_harmless_base_test.jsonl").is_file():
        pytest.skip(f"{folder} is not complete")
    for name in ("dpo_en_demo.json", "dpo_zh_demo.json"):
        assert len(read_preference(PreferenceSource(path=str(folder / name))).examples) == 300
    kto = read_preference(PreferenceSource(path=str(folder / "kto_en_demo.json"))).examples
    assert sum(e.label for e in kto) == 150 and len(kto) == 300
    with pytest.raises(DataError, match=r"hh_harmless_base_test\.jsonl: line 87: field 'chosen': empty answer"):
        read_preference(PreferenceSource(path=str(folder / "hh_harmless_base_test.jsonl")))
    hh = read_preference(PreferenceSource(path=str(folder / "hh_harmless_base_test.jsonl")), on_bad_row="skip")
    assert len(hh.examples) == 2308 and hh.n_skipped == 4
    assert [s.split(": ")[1] for s in hh.skipped] == ["line 87", "line 517", "line 926", "line 1104"]
    assert all(e.chosen != e.rejected and e.prompt[-1]["role"] == "user" for e in hh.examples)
