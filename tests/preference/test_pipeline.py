"""A run's preference data (qwenft/preference/pipeline.py): held-out pairs, weights, the cache, bad rows, KTO's
unpaired examples, SFT sources held out beside the pairs, the config's refusals, and the `data` preview of a pair."""

from __future__ import annotations

import json

import pytest

from tests.conftest import QUESTIONS, compose_config, qwenft_in_process, write_jsonl, write_rows
from tests.train.test_preference import pair_rows


@pytest.fixture
def tokenizer():
    from qwenft.model import load_tokenizer
    from qwenft.model.tiny import tiny_model_dir
    from qwenft.config import TinyModelConfig

    return load_tokenizer(str(tiny_model_dir(TinyModelConfig())))


def hydra_value(value) -> str:
    """``value`` (a list / dict / str / number) in Hydra's override grammar (keys bare, strings quoted)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {hydra_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(hydra_value(v) for v in value) + "]"
    return f"'{value}'" if isinstance(value, str) else json.dumps(value)


def config_for(tmp_path, sources, *extra, objective="dpo"):
    return compose_config("model=tiny-random", "quant=none", f"out_dir={tmp_path / 'run'}",
                          f"train.objective={objective}", "data.max_seq_len=160",
                          f"data.sources={hydra_value(sources)}", *extra)


def test_pairs_are_held_out_mixed_and_cached(tmp_path, tokenizer, monkeypatch):
    from qwenft.preference.pipeline import build_preference

    monkeypatch.setenv("QWENFT_CACHE", str(tmp_path / "cache"))
    a = write_jsonl(tmp_path / "a.jsonl", pair_rows(12))
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": r["instruction"], "chosen": r["chosen"],
                                             "rejected": r["rejected"]} for r in pair_rows(9)])
    sources = [{"name": "a", "path": str(a), "format": "preference", "weight": 2.0, "eval_rows": 3, "eval_by": "topic"},
               {"name": "b", "path": str(b), "format": "pairs_trl", "weight": 1.0, "eval_rows": 0}]
    config = config_for(tmp_path, sources)
    bundle = build_preference(config, tokenizer)
    stats = bundle.stats
    assert stats["sources"]["a"]["format"] == "pairs_alpaca"  # detected
    assert (stats["sources"]["a"]["usable"], stats["sources"]["a"]["used"]) == (9, 9)
    assert (stats["sources"]["b"]["usable"], stats["sources"]["b"]["used"]) == (9, 5)  # 2 : 1 by weight, 9 : 4.5
    assert len(bundle.train) == stats["train_examples"] == 14 and sorted(set(bundle.train["source"])) == ["a", "b"]
    held = bundle.eval_rows["a"]
    assert len(held) == 3 and len(bundle.eval) == 3
    assert sorted(r["meta"]["topic"] for r in held) == ["t0", "t1", "t2"]  # spread over eval_by
    row = held[0]
    assert row["messages"][-1] == {"role": "assistant", "content": row["messages"][-1]["content"]}
    assert row["messages"][-1]["content"].startswith("Short answer:") and not row["rejected"].startswith("Short")
    n = len(row["prompt_ids"])
    assert row["input_ids"][:n] == row["rejected_input_ids"][:n] == row["prompt_ids"]  # one prompt, token for token
    assert row["labels"][:n] == [-100] * n and row["labels"][n:] == row["input_ids"][n:]
    assert stats["cache_misses"] == 2 and stats["cache_hits"] == 0
    again = build_preference(config, tokenizer)
    assert (again.stats["cache_hits"], again.stats["cache_misses"]) == (2, 0)
    assert again.train["chosen_ids"] == bundle.train["chosen_ids"]  # the same pairs, in the same order


def test_a_bad_pair_is_named_by_file_row_and_field_or_skipped_and_counted(tmp_path, tokenizer):
    from qwenft.data.formats import DataError
    from qwenft.preference.pipeline import build_preference

    rows = pair_rows(8)
    rows[4]["rejected"] = rows[4]["chosen"]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    sources = [{"name": "p", "path": str(path), "format": "pairs_alpaca", "weight": 1.0, "eval_rows": 2}]
    with pytest.raises(DataError, match=r"p\.jsonl.*line 5.*rejected.*same answer"):
        build_preference(config_for(tmp_path, sources), tokenizer)
    bundle = build_preference(config_for(tmp_path, sources, "data.on_bad_row=skip"), tokenizer)
    counts = bundle.stats["sources"]["p"]
    assert counts["rows_read"] == 8 and counts["skipped"] == 1 and counts["usable"] + counts["eval"] == 7
    # a pair that cannot be tokenized (its prompt alone fills max_seq_len) among the held-out ones is skipped there
    # too: never an eval row without token ids (found on HH-RLHF's test split with max_seq_len=320: the evaluation
    # failed after the training)
    rows = pair_rows(6)
    for k in (1, 4):
        rows[k]["instruction"] = "tell me more " * 200
    path = write_jsonl(tmp_path / "q.jsonl", rows)
    sources = [{"name": "q", "path": str(path), "format": "pairs_alpaca", "weight": 1.0, "eval_rows": 5}]
    bundle = build_preference(config_for(tmp_path, sources, "data.on_bad_row=skip"), tokenizer)
    held = bundle.eval_rows["q"]
    assert 3 <= len(held) <= 4 and all(r["prompt_ids"] and r["input_ids"] for r in held)  # 5 held, 1 or 2 bad
    assert len(held) == len(bundle.eval) and all(r["messages"][-1]["content"] for r in held)


def test_kto_trains_on_labelled_answers_and_on_pairs_unpaired(tmp_path, tokenizer):
    from qwenft.preference.pipeline import build_preference

    pairs = write_jsonl(tmp_path / "p.jsonl", pair_rows(6))
    kto = write_jsonl(tmp_path / "k.jsonl", [{"messages": [{"role": "user", "content": f"q{i}"},
                                                           {"role": "assistant", "content": f"a{i}"}],
                                              "label": i % 2 == 0} for i in range(5)])
    sources = [{"name": "p", "path": str(pairs), "format": "pairs_alpaca", "weight": 1.0},
               {"name": "k", "path": str(kto), "format": "kto", "weight": 1.0}]
    bundle = build_preference(config_for(tmp_path, sources, "train.batch_size=2", objective="kto"), tokenizer)
    assert set(bundle.train.column_names) == {"prompt_ids", "completion_ids", "label", "source"}
    by_source = {}
    for source, label in zip(bundle.train["source"], bundle.train["label"]):
        by_source.setdefault(source, []).append(label)
    # 6 pairs are 12 examples (each pair's chosen desirable, its rejected not); 1 : 1 with the 5 labelled answers,
    # which repeat to 12 (the larger source sets the epoch, qwenft.data.mix)
    assert len(by_source["p"]) == 12 and sum(by_source["p"]) == 6 and len(by_source["k"]) == 12
    assert bundle.stats["sources"]["k"]["repeats"] == 7


def test_an_sft_source_of_weight_0_is_held_out_beside_the_pairs(tmp_path, tokenizer):
    from qwenft.preference.pipeline import build_preference

    pairs = write_jsonl(tmp_path / "p.jsonl", pair_rows(8))
    general = write_rows(tmp_path / "g.jsonl", 10)
    sources = [{"name": "p", "path": str(pairs), "format": "pairs_alpaca", "weight": 1.0, "eval_rows": 2},
               {"name": "general", "path": str(general), "format": "alpaca", "weight": 0.0, "eval_rows": 4}]
    bundle = build_preference(config_for(tmp_path, sources), tokenizer)
    assert len(bundle.eval_rows["general"]) == 4 and "rejected" not in bundle.eval_rows["general"][0]
    assert bundle.stats["sources"]["general"]["eval"] == 4 and len(bundle.train) == 6


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_an_sft_source_of_weight_above_0_is_mixed_with_the_pairs_by_weight(tmp_path, tokenizer, objective):
    from qwenft.preference.pipeline import build_preference
    from qwenft.train.preference import PreferenceCollator, is_sft_row

    pairs = write_jsonl(tmp_path / "p.jsonl", pair_rows(10))
    general = write_rows(tmp_path / "g.jsonl", 12)
    sources = [{"name": "p", "path": str(pairs), "format": "pairs_alpaca", "weight": 0.8, "eval_rows": 2},
               {"name": "general", "path": str(general), "format": "alpaca", "weight": 0.2, "eval_rows": 2}]
    extra = ("train.batch_size=2", "pref.rpo_alpha=0") if objective == "kto" else ()
    bundle = build_preference(config_for(tmp_path, sources, *extra, objective=objective), tokenizer)
    stats = bundle.stats
    unit = 2 if objective == "kto" else 1  # KTO: a pair is two examples
    # 8 pairs (16 KTO examples) train at 0.8, the general rows at 0.2 of the mix, exactly: 2 (4)
    assert stats["sources"]["p"]["used"] == 8 * unit and stats["sources"]["general"]["used"] == 2 * unit
    assert stats["sources"]["general"]["share_target"] == 0.2
    assert stats["sources"]["general"]["usable"] == 10 and len(bundle.eval_rows["general"]) == 2
    train = bundle.train
    assert len(train) == stats["train_examples"] == 10 * unit
    general_rows = [row for row in train if row["source"] == "general"]
    assert bundle.sample["source"] == "p" and len(bundle.eval) == 2 * unit  # the eval loss: held-out pairs only
    if objective == "kto":  # desirable examples: the answer after its conversation, batched with the others
        assert stats["sft_rows"] == 0 and "input_ids" not in train.column_names
        texts = {q: a for q, a in QUESTIONS}
        for row in general_rows:
            assert row["label"] is True and row["completion_ids"][-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
            answer = tokenizer.decode(row["completion_ids"][:-1])
            question = tokenizer.decode(row["prompt_ids"]).split("<|im_start|>user\n")[1].split(" (")[0]
            assert answer == texts[question]
        return
    assert stats["sft_rows"] == 2
    sft = [row for row in train if is_sft_row(row)]
    assert sft == general_rows and all(not row["prompt_ids"] for row in sft)
    assert all(-100 in row["labels"] and len(row["labels"]) == len(row["input_ids"]) for row in sft)
    pref = [row for row in train if not is_sft_row(row)]
    assert all(row["source"] == "p" and row["prompt_ids"] and not row["input_ids"] for row in pref)
    batch = PreferenceCollator(tokenizer.pad_token_id, False)([pref[0], sft[0], pref[1]])
    assert int(batch["pairs"]) == 2 and int(batch["sft_rows"]) == 1 and int(batch["n_seqs"]) == 4
    assert batch["sft_input_ids"].tolist() == [sft[0]["input_ids"]] and batch["sft_labels"].tolist() == [sft[0]["labels"]]
    only_sft = PreferenceCollator(tokenizer.pad_token_id, False)([sft[0]])
    assert int(only_sft["pairs"]) == 0 and "input_ids" not in only_sft


def test_a_mixed_sft_sources_messages_name_its_own_position(tmp_path, tokenizer):
    """The SFT sources of a preference run are built apart from the pairs; their messages still say
    data.sources.N for their place in the user's list (a new user was told data.sources.0: the pairs)."""
    from qwenft.data.formats import DataError
    from qwenft.preference.pipeline import build_preference

    pairs = write_jsonl(tmp_path / "p.jsonl", pair_rows(6))
    broken = write_jsonl(tmp_path / "g.jsonl", [{"instruction": "Name a river.", "answer": "The Nile."}] * 4)
    sources = [{"name": "p", "path": str(pairs), "format": "pairs_alpaca", "weight": 0.8},
               {"name": "general", "path": str(broken), "format": "alpaca", "weight": 0.2}]
    with pytest.raises(DataError, match=r"data\.sources\.1\.columns") as raised:
        build_preference(config_for(tmp_path, sources), tokenizer)
    assert "data.sources.0" not in str(raised.value)


@pytest.mark.parametrize("objective, fmt, weight, message", [
    ("sft", "pairs_alpaca", 1.0, "is a preference format: train on it with train.objective=dpo"),
    ("dpo", "alpaca", 1.0, "train.objective=dpo needs a preference source of weight > 0"),
    ("dpo", "kto", 1.0, "holds unpaired labelled answers: train.objective=dpo needs pairs"),
])
def test_a_source_that_does_not_fit_the_objective_is_refused(tmp_path, objective, fmt, weight, message):
    from qwenft.config import ConfigError

    sources = [{"name": "s", "path": str(tmp_path / "s.jsonl"), "format": fmt, "weight": weight}]
    with pytest.raises(ConfigError, match=message):
        config_for(tmp_path, sources, objective=objective)


def test_pref_settings_and_columns_are_checked(tmp_path):
    from qwenft.config import ConfigError

    sources = [{"name": "s", "path": "x.jsonl", "format": "pairs_alpaca", "columns": {"output": "o"}}]
    with pytest.raises(ConfigError, match=r"'output' is not a field of the pairs_alpaca format.*instruction, input, "
                                          r"chosen, rejected, system"):
        config_for(tmp_path, sources)
    ok = [{"name": "s", "path": "x.jsonl", "format": "pairs_alpaca"}]
    for override, message in (("pref.beta=0", "pref.beta"), ("pref.label_smoothing=0.5", "pref.label_smoothing"),
                              ("pref.padding_free=maybe", "pref.padding_free"), ("train.objective=ppo",
                                                                                "train.objective")):
        with pytest.raises(ConfigError, match=message):
            config_for(tmp_path, ok, override)


def test_the_data_preview_shows_a_pair_with_its_masks(tmp_path, capsys):
    pairs = write_jsonl(tmp_path / "p.jsonl", pair_rows(6))
    sources = hydra_value([{"name": "p", "path": str(pairs), "format": "preference", "weight": 1.0, "eval_rows": 2}])
    result = qwenft_in_process(capsys, "data", "model=tiny-random", "quant=none", "train.objective=dpo",
                               f"data.sources={sources}", "data.max_seq_len=160")
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "objective: dpo; training pairs: 4; held out: p 2" in out
    assert "first training pair: chosen" in out and "first training pair: rejected" in out
    assert "⟦Short answer:" in out  # the chosen answer supervised, the prompt not
    assert out.count("<|im_start|>user") == 2


def test_what_a_new_user_met_is_refused_in_one_line(tmp_path, tokenizer, capsys):
    """Found by a new user's try (issue 45): each refused before any weight loads, naming the key to change."""
    from qwenft.config import ConfigError
    from qwenft.preference.pipeline import build_preference

    pairs = [{"name": "p", "path": str(write_jsonl(tmp_path / "p.jsonl", pair_rows(6))), "format": "preference",
              "weight": 1.0}]
    with pytest.raises(ConfigError, match=r"pref.rpo_alpha=1.0 is not accepted; must be 0 with train.objective=orpo: "
                                          r"ORPO carries its own NLL term"):
        config_for(tmp_path, pairs, "pref.rpo_alpha=1.0", objective="orpo")
    with pytest.raises(ConfigError, match="must be 0 with train.objective=kto"):
        config_for(tmp_path, pairs, "pref.rpo_alpha=0.5", "train.batch_size=2", objective="kto")
    kto = write_jsonl(tmp_path / "k.jsonl", [{"messages": [{"role": "user", "content": f"q{i}"},
                                                           {"role": "assistant", "content": f"a{i}"}],
                                              "label": i % 2 == 0} for i in range(8)])
    detected = [{"name": "k", "path": str(kto), "format": "preference", "weight": 1.0, "eval_rows": 4}]
    with pytest.raises(ConfigError, match=r"k\.jsonl holds unpaired labelled answers \(detected kto\); "
                                          r"train.objective=dpo needs pairs"):
        build_preference(config_for(tmp_path, detected), tokenizer)
    bundle = build_preference(config_for(tmp_path, detected, "train.batch_size=2", objective="kto"), tokenizer)
    held = bundle.eval_rows["k"]  # only the desirable answers are references for generated ones
    assert held and all(row["label"] for row in held) and bundle.stats["sources"]["k"]["eval"] == 4
    code = qwenft_in_process(capsys, "data", "model=tiny-random", "quant=none", "train.objective=sft",
                             f"data.sources={hydra_value(pairs)}")
    assert code.returncode == 2 and "is a preference format: train on it with train.objective=dpo" in code.stderr
    code = qwenft_in_process(capsys, "train", "model=tiny-random", "quant=none", "train.objective=dpo",
                             f"data.sources={hydra_value(pairs)}", f"out_dir={tmp_path / 'run'}",
                             f"init_adapter={tmp_path / 'missing'}")
    assert code.returncode == 2 and f"init_adapter={tmp_path / 'missing'}: " in code.stderr
    assert not (tmp_path / "run").exists()
