"""The cases of ../shared/cases/turn2 (issue 19): each case's input, run as its README says, gives the right value.

Skipped where that folder is absent (a user's checkout). The model is tiny-random; the cases run in-process
except one command-line run (a refused `eval` must leave nothing behind).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qwenft.config import TinyModelConfig
from qwenft.data import DataError, build
from tests.conftest import ROOT, compose_config

CASES = ROOT.parent / "shared" / "cases" / "turn2"


@pytest.fixture
def case(monkeypatch):
    """Run from a case's folder (its commands use paths relative to it); skip when the cases are absent."""
    def enter(name: str) -> Path:
        folder = CASES / name
        if not folder.is_dir():
            pytest.skip(f"{folder} is not present")
        monkeypatch.chdir(folder)
        return folder
    return enter


@pytest.fixture(scope="module")
def tiny():
    from qwenft.model import load_tokenizer
    from qwenft.model.tiny import tiny_model_dir

    return load_tokenizer(str(tiny_model_dir(TinyModelConfig())))


def data_config(*overrides: str, command: str = "data"):
    from qwenft.cli.overrides import free_form

    return compose_config(*free_form(["model=tiny-random", "data.cache=false", *overrides]), command=command)


def test_eval_by_list_value_is_one_group(case, tiny):
    from qwenft.data import read_source
    from qwenft.data.mix import group_key

    case("eval-by-list")
    config = data_config("data.sources=[{name: s, path: rows.jsonl, format: alpaca, eval_rows: 5, eval_by: tag}]")
    rows = read_source(config.data.sources[0])
    assert rows[11]["row"] == 12 and rows[11]["meta"]["tag"] == ["t1", "t2"]  # the case's input
    bundle = build(config, tiny)  # no TypeError: the list is one group value
    held = bundle.eval_rows["s"]
    assert len(held) == 5 and bundle.stats["train_examples"] == 7
    assert len({group_key(row["meta"]["tag"]) for row in held}) == 5  # one row of each of 5 groups


def test_ppl_sources_read_like_data_files(case):
    from qwenft.evaluate.run import check_ppl_sources, perplexities
    from qwenft.model import load_model

    case("ppl-source-encoding")
    config = data_config("quant=none", "eval.ppl_sources=[ppl_bom.txt, ppl_nobom.txt]", command="eval")
    check_ppl_sources(config)
    model, tokenizer = load_model(config, device="cpu")
    scores = perplexities(model, tokenizer, config, None)
    bom, plain = scores["text:ppl_bom.txt"], scores["text:ppl_nobom.txt"]
    assert bom["tokens"] == plain["tokens"] and bom["perplexity"] == pytest.approx(plain["perplexity"], rel=1e-9)
    with pytest.raises(DataError, match=r"^ppl_latin1\.txt: line 1: not UTF-8 text: byte 0x[0-9a-f]{2} at byte "
                                        r"offset \d+"):
        check_ppl_sources(data_config("quant=none", "eval.ppl_sources=[ppl_latin1.txt]", command="eval"))


def test_refused_eval_leaves_nothing_behind(case, tmp_path):
    """The README's command on the Latin-1 file: exit 2 and one line before any model load; no outputs/ left."""
    folder = case("ppl-source-encoding")
    work = tmp_path / "work"
    shutil.copytree(folder, work)
    os.chmod(work, 0o755)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, "-m", "qwenft", "eval", "model=tiny-random", "quant=none",
                           "eval.ppl_sources=[ppl_latin1.txt]", "eval.max_eval_prompts=1", "eval.max_new_tokens=2"],
                          cwd=work, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("qwenft: error: ppl_latin1.txt: line 1: not UTF-8 text: byte 0x")
    assert "byte offset" in lines[0] and "Traceback" not in proc.stderr
    assert sorted(p.name for p in work.iterdir()) == sorted(p.name for p in folder.iterdir())  # no outputs/


def test_eval_with_a_recipe_runs_the_adapters_base(case, tmp_path):
    """Only what the user typed overrides the base an adapter records; +recipe=domain's 7B default does not."""
    from qwenft.model.adapter import inference_config
    from qwenft.model import save_adapter_meta

    case("eval-recipe-base")
    adapter = tmp_path / "RUN" / "adapter"
    save_adapter_meta(adapter, compose_config("model=tiny-random", "quant=none", "lora.r=4"))
    typed = ["+recipe=domain", f"adapter={adapter}", "data.sources.0.path=rows.jsonl", "data.sources.0.eval_rows=2",
             "data.sources.1.eval_rows=1"]
    config = compose_config(*typed, command="eval")
    assert config.model.name == "qwen2.5-7b-instruct" and config.quant.method == "nf4"  # the recipe's defaults
    resolved = inference_config(config, typed=typed)
    assert resolved.model.source == "tiny-random" and resolved.quant.method == "none"
    # What the user types wins: other weights, or another quantization of the recorded base.
    assert inference_config(config, typed=[*typed, "model=qwen2.5-0.5b-instruct"]).model.name == "qwen2.5-7b-instruct"
    sixteen = compose_config(*typed, "quant=nf4", command="eval")
    assert inference_config(sixteen, typed=[*typed, "quant=nf4"]).quant.method == "nf4"
    assert inference_config(sixteen, typed=[*typed, "quant.method=nf4"]).model.source == "tiny-random"
    # The system prompt trained with wins over a recipe's, not over a typed one.
    import dataclasses

    trained = compose_config("model=tiny-random", "quant=none", "data.system_prompt=Trained.")
    save_adapter_meta(adapter, trained)
    from_recipe = dataclasses.replace(config, data=dataclasses.replace(config.data, system_prompt="Recipe."))
    assert inference_config(from_recipe, typed=typed).data.system_prompt == "Trained."
    assert inference_config(from_recipe, typed=[*typed, "data.system_prompt=Recipe."]).data.system_prompt == "Recipe."


def test_placeholders_are_counted_and_fillable(case, tiny, caplog):
    case("placeholders")
    overrides = ["+recipe=domain", "data.sources.0.path=rows.json", "data.sources.0.eval_rows=1"]
    with caplog.at_level(logging.WARNING):
        bundle = build(data_config(*overrides), tiny)
    assert "domain: 4 of 4 answers contain unfilled placeholders ({{name}}, {{author}})" in caplog.text
    assert "data.sources.0.replace=" in caplog.text and bundle.stats["train_examples"] > 0
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        bundle = build(data_config(*overrides, "data.sources.0.replace={name: Ada, author: Acme Labs}"), tiny)
    assert "placeholders" not in caplog.text
    answers = [row["messages"][-1]["content"] for rows in bundle.eval_rows.values() for row in rows]
    assert not any("{{" in text for text in answers)
    text = tiny.decode(bundle.train[0]["input_ids"]) + "".join(answers)
    assert "{{" not in text


def test_every_row_skipped_is_said_first(case, tiny, caplog):
    case("all-rows-skipped")
    config = data_config("+recipe=domain", "data.sources.0.path=rows.json", "data.on_bad_row=skip")
    with pytest.raises(DataError) as info:
        build(config, tiny)
    assert str(info.value) == ("domain: all 4 rows were skipped as bad (first: rows.json: row 1: expected an object "
                               "(a row with named fields), got a one-item list holding an object)")


def test_turn_order_error_names_the_role_field(case, tiny):
    case("role-field")
    config = data_config("+recipe=domain", "data.sources.0.path=turns.jsonl", "data.sources.0.format=sharegpt",
                         "data.sources.0.eval_rows=0")
    with pytest.raises(DataError) as info:
        build(config, tiny)
    assert str(info.value).startswith("turns.jsonl: line 1: field 'conversations[2].from': turn 3 has role "
                                      "'assistant' where 'user' was expected")


def test_a_row_cut_only_in_its_unsupervised_tail_fits(case, tiny):
    from qwenft.data import encode_example, read_source
    from qwenft.config import DataSource

    case("truncation-boundary")
    row = read_source(DataSource(name="s", path="row.jsonl"))[0]
    full = encode_example(tiny, row["messages"], max_seq_len=4096, train_on="assistant")
    assert len(full["input_ids"]) == 106  # as the case says: <|im_end|> + "\n" last
    config = data_config("data.sources=[{name: s, path: row.jsonl, format: alpaca}]", "data.max_seq_len=105",
                         "data.overlong=drop")
    stats = build(config, tiny).stats
    assert (stats["truncated"], stats["dropped"], stats["train_examples"]) == (0, 0, 1)
