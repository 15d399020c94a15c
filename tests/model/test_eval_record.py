"""The eval settings a run records in its adapter's qwenft.json, and the rule by which `qwenft eval adapter=...`
starts from them (issue 44 item 6): the record, the typed keys on top, a typed recipe or eval group, an older
record, a bad record. Config only: no model is loaded."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from qwenft.config import ConfigError, QwenftError
from qwenft.model import save_adapter_meta
from qwenft.model.adapter import inference_config
from qwenft.model.eval_record import settings_origin
from tests.conftest import compose_config, write_rows

# The run's non-default eval settings: a gate of its own, metrics in another order, a sampling preset with a seed
# typed for the run (generate_presets.creative.seed), max_new_tokens, batches of 3, a perplexity file.
RUN_EVAL = ["++eval.gates.toy={metric: char_f1, max_drop: 0.5}", "eval.metrics=[char_f1, rouge_l]",
            "eval.generate=creative", "generate_presets.creative.seed=11", "eval.max_new_tokens=16",
            "eval.batch_size=3", "eval.correct_threshold=0.3", "eval.after_train=false"]


def toy_source(rows) -> str:
    return f"data.sources=[{{name: toy, path: '{rows}', format: alpaca, weight: 1.0, eval_rows: 4}}]"


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """An adapter directory holding only the qwenft.json of a tiny-random run with RUN_EVAL (a relative
    perplexity file, made absolute in the record), and that run's config."""
    monkeypatch.chdir(tmp_path)
    rows = write_rows(tmp_path / "rows.jsonl")
    trained = compose_config("model=tiny-random", "quant=none", toy_source(rows), *RUN_EVAL,
                             "eval.ppl_sources=[rows.jsonl]")
    adapter = tmp_path / "run" / "adapter"
    save_adapter_meta(adapter, trained)
    return adapter, trained


def later_eval(adapter, *typed: str):
    """``eval adapter=ADAPTER TYPED...`` composed and resolved as the command resolves it (typed = what the user
    typed)."""
    typed = [f"adapter={adapter}", *typed]
    return inference_config(compose_config(*typed, command="eval"), typed=typed)


def test_the_record_holds_the_whole_eval_section_and_the_resolved_preset(recorded, tmp_path):
    adapter, trained = recorded
    meta = json.loads((adapter / "qwenft.json").read_text())
    assert meta["eval"] == {**dataclasses.asdict(trained.eval), "ppl_sources": [str(tmp_path / "rows.jsonl")]}
    assert meta["eval_preset"] == dataclasses.asdict(trained.generate_presets["creative"])
    assert meta["eval_preset"]["seed"] == 11 and meta["eval_preset"]["do_sample"] is True


def test_a_later_eval_starts_from_the_recorded_settings(recorded, tmp_path):
    adapter, trained = recorded
    default = compose_config(f"adapter={adapter}", command="eval").eval
    resolved = later_eval(adapter)
    assert default.gates != trained.eval.gates and default.generate != "creative"  # the test means something
    expected = dataclasses.replace(trained.eval, ppl_sources=[str(tmp_path / "rows.jsonl")], after_train=True)
    assert resolved.eval == expected  # after_train alone is this command's
    assert resolved.generate_presets["creative"] == trained.generate_presets["creative"]
    assert [s.name for s in resolved.data.sources] == ["toy"]  # the run's data, which its gate names
    origin = settings_origin(resolved, json.loads((adapter / "qwenft.json").read_text()), adapter / "qwenft.json",
                             set())
    assert origin["from"] == "adapter" and origin["typed"] == [] and origin["not_recorded"] == []


def test_typed_keys_win_over_the_recorded_ones(recorded):
    adapter, trained = recorded
    # (a typed gate must name a source of this command's composed data, checked before the adapter is read:
    # retention is a gate of every config)
    resolved = later_eval(adapter, "eval.max_new_tokens=4", "++eval.gates.retention.max_drop=0.9",
                          "generate_presets.creative.top_k=3")
    assert resolved.eval.max_new_tokens == 4
    # only the typed entry of a mapping changes: the other gates stay as recorded (toy's own among them)
    assert resolved.eval.gates == {**trained.eval.gates, "retention": {"max_drop": 0.9}}
    assert resolved.eval.gates["toy"] == {"metric": "char_f1", "max_drop": 0.5}
    preset = resolved.generate_presets["creative"]
    assert (preset.top_k, preset.seed) == (3, 11)  # typed on top of the recorded preset
    assert resolved.eval.metrics == ["char_f1", "rouge_l"]
    meta = json.loads((adapter / "qwenft.json").read_text())
    origin = settings_origin(resolved, meta, adapter / "qwenft.json",
                             {"adapter", "eval.max_new_tokens", "eval.gates.retention.max_drop",
                              "generate_presets.creative.top_k"})
    assert origin["typed"] == ["eval.gates.retention.max_drop", "eval.max_new_tokens",
                               "generate_presets.creative.top_k"]
    # another preset typed: that preset as this config has it, the recorded one's values unused
    greedy = later_eval(adapter, "eval.generate=precise")
    assert greedy.eval.generate == "precise" and greedy.eval.gates == trained.eval.gates
    assert greedy.generate_presets["creative"].seed is None


@pytest.mark.parametrize("group", ["eval=default", "+recipe=quickstart"])
def test_a_typed_recipe_or_eval_group_uses_that_config_with_a_warning(recorded, group, caplog):
    adapter, trained = recorded
    extra = ["model=tiny-random", "quant=none", toy_source(trained.data.sources[0].path)]  # the recipe's data fits
    typed = [f"adapter={adapter}", group, *extra]
    composed = compose_config(*typed, command="eval")
    with caplog.at_level(logging.WARNING, logger="qwenft"):
        resolved = inference_config(composed, typed=typed)
    assert resolved.eval == composed.eval
    warning = [r.getMessage() for r in caplog.records if "NOT THE RUN'S EVAL SETTINGS" in r.getMessage()]
    assert len(warning) == 1 and group.split("=")[0].lstrip("+") in warning[0] and "eval.gates" in warning[0]
    meta = json.loads((adapter / "qwenft.json").read_text())
    origin = settings_origin(resolved, meta, adapter / "qwenft.json", {"adapter", group.split("=")[0].lstrip("+")})
    assert origin["from"] == "command" and "eval.gates" in origin["differs"] and "typed" in origin["why"]


def test_an_older_record_and_no_record(recorded, tmp_path):
    adapter, trained = recorded
    meta = json.loads((adapter / "qwenft.json").read_text())
    # a run recorded before eval.correct_threshold existed: that key is this command's, and named
    older = {**meta, "eval": {k: v for k, v in meta["eval"].items() if k != "correct_threshold"}}
    (adapter / "qwenft.json").write_text(json.dumps(older))
    resolved = later_eval(adapter)
    assert resolved.eval.correct_threshold == 0.5 and resolved.eval.gates == trained.eval.gates
    origin = settings_origin(resolved, older, adapter / "qwenft.json", set())
    assert origin["not_recorded"] == ["eval.correct_threshold"]
    # no eval settings at all (an older run, another tool): this command's, and said so
    (adapter / "qwenft.json").write_text(json.dumps({k: v for k, v in meta.items()
                                                     if k not in ("eval", "eval_preset")}))
    composed = compose_config(f"adapter={adapter}", command="eval")
    resolved = inference_config(composed, typed=[f"adapter={adapter}"])
    assert resolved.eval == composed.eval
    origin = settings_origin(resolved, {}, adapter / "qwenft.json", set())
    assert origin["from"] == "command" and "records no eval settings" in origin["why"]
    # a library call (typed None) keeps the caller's settings, as it keeps the caller's data
    (adapter / "qwenft.json").write_text(json.dumps(meta))
    assert inference_config(composed).eval == composed.eval


def test_a_bad_record_is_named(recorded):
    adapter, _ = recorded
    meta = json.loads((adapter / "qwenft.json").read_text())
    (adapter / "qwenft.json").write_text(json.dumps({**meta, "eval": {**meta["eval"], "max_new_tokens": 0}}))
    with pytest.raises(QwenftError, match=r"qwenft.json: 'eval' is not a valid eval section .*max_new_tokens"):
        later_eval(adapter)
    # recorded gates that do not fit the data typed for this evaluation: named, with the way out
    (adapter / "qwenft.json").write_text(json.dumps(meta))
    rows = adapter.parent.parent / "rows.jsonl"
    other = f"data.sources=[{{name: other, path: '{rows}', format: alpaca, weight: 1.0, eval_rows: 4}}]"
    with pytest.raises(QwenftError, match="do not fit this evaluation .*eval=default"):
        later_eval(adapter, other)


def test_a_typed_gate_on_the_runs_own_source_is_checked_against_the_runs_data(recorded):
    """`eval adapter=RUN eval.gates.toy...` names the run's source, which only the record holds (the composed
    config has the default data): accepted, and checked once the run's data is read; a gate naming nothing that
    evaluation has is refused with its key, before any model loads."""
    adapter, _ = recorded
    resolved = later_eval(adapter, "++eval.gates.toy={min_delta: 0.1}", "eval.targets=[toy]")
    assert resolved.eval.gates["toy"] == {"min_delta": 0.1} and resolved.eval.targets == ["toy"]
    with pytest.raises(ConfigError, match=r"^eval.gates.tyo: no held-out source or benchmark named 'tyo'"):
        later_eval(adapter, "++eval.gates.tyo={min_delta: 0.1}")
    with pytest.raises(ConfigError, match=r"^eval.targets\[0\]='nosuch'"):
        later_eval(adapter, "eval.targets=[nosuch]")
