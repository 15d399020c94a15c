"""Serving hand-off: which adapters vLLM serves unmerged (qwenft.model.vllm_lora) checked against docs/serve.md's table
and against adapters qwenft itself writes; the --max-lora-rank rule; the serve commands of merge (printed, model card);
the one warning of eval."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import pytest

from qwenft.config import ALL_TARGETS
from qwenft.model.vllm_lora import (VLLM_CHECKED_KEYS, VLLM_MAX_LORA_RANKS, VLLM_QWEN2_TARGETS, read_adapter_config,
                                  vllm_max_lora_rank, vllm_support)
from tests.conftest import ROOT, compose_config

SERVE_PAGE = ROOT / "docs" / "serve.md"

# One value per table row that the row does not allow (a DoRA adapter, LoRA on lm_head, ...).
NOT_SERVABLE = {"peft_type": "LOHA", "r": 1024, "target_modules": ["q_proj", "lm_head"], "use_dora": True,
                "modules_to_save": ["lm_head"], "bias": "all", "lora_bias": True, "rank_pattern": {"q_proj": 8},
                "alpha_pattern": {"q_proj": 8}, "trainable_token_indices": [151665]}


def serve_section() -> str:
    text = SERVE_PAGE.read_text(encoding="utf-8")
    start = text.index("\n## vLLM, llama.cpp and Ollama\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def docs_table() -> dict:
    """``{key: (allowed JSON values, the cell's text)}`` from docs/serve.md's "what vLLM serves" table."""
    rows = {}
    for line in serve_section().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue
        key = cells[0].strip("`")
        rows[key] = ([json.loads(token) for token in re.findall(r"`([^`]+)`", cells[1])], cells[1])
    return rows


def servable_by_docs(key: str, value, allowed: list, cell: str) -> bool:
    if key == "r":
        assert cell.startswith("at most"), cell
        return value <= allowed[0]
    if key == "target_modules":
        return set(value) <= set(allowed)
    return value in allowed


def make_qwenft_adapter(adapter_dir: Path, *overrides: str) -> dict:
    """An adapter saved through qwenft's own LoRA attach on tiny-random; its adapter_config.json."""
    from qwenft.model import attach_lora, load_model, save_adapter_meta

    config = compose_config("model=tiny-random", "quant=none", *overrides)
    model, _ = load_model(config, device="cpu")
    peft_model = attach_lora(model, config.lora, gradient_checkpointing=False)
    peft_model.save_pretrained(adapter_dir)
    save_adapter_meta(adapter_dir, config)
    return read_adapter_config(adapter_dir)


@pytest.fixture(scope="module")
def qwenft_adapter(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("serving") / "run" / "adapter"
    make_qwenft_adapter(path)
    return path


def test_docs_table_is_the_rule():
    """The table lists exactly the keys the rule reads, the same targets and the same largest rank; every row's
    allowed values pass the rule and a value outside them is refused with the key named."""
    table = docs_table()
    assert set(table) == set(VLLM_CHECKED_KEYS)
    assert table["target_modules"][0] == list(VLLM_QWEN2_TARGETS)
    assert table["r"][0] == [VLLM_MAX_LORA_RANKS[-1]]
    for key, (allowed, cell) in table.items():
        for value in allowed:
            assert vllm_support({key: value}) == [], (key, value)
        bad = NOT_SERVABLE[key]
        assert not servable_by_docs(key, bad, allowed, cell), key
        reasons = vllm_support({key: bad})
        assert len(reasons) == 1 and key in reasons[0], (key, reasons)


def test_docs_state_vllms_ranks():
    ranks = re.search(r"vLLM accepts only ([\d, or]+)", " ".join(serve_section().split())).group(1)
    assert tuple(int(n) for n in re.findall(r"\d+", ranks)) == VLLM_MAX_LORA_RANKS


def test_qwenft_adapter_config_is_servable_as_the_docs_say(qwenft_adapter):
    """The adapter_config.json qwenft writes (default LoRA: all 7 projections) has every key of the table, each with
    a value the table allows; and every target qwenft can train is one vLLM serves."""
    config = read_adapter_config(qwenft_adapter)
    for key, (allowed, cell) in docs_table().items():
        assert key in config, f"peft no longer writes {key!r}"
        assert servable_by_docs(key, config[key], allowed, cell), (key, config[key])
    assert set(config["target_modules"]) == set(ALL_TARGETS)
    assert set(ALL_TARGETS) <= set(docs_table()["target_modules"][0])
    assert vllm_support(config) == []


@pytest.mark.parametrize("override, key", [("lora.use_dora=true", "use_dora"), ("lora.bias=all", "bias")])
def test_qwenft_adapters_vllm_cannot_serve(tmp_path, override, key):
    config = make_qwenft_adapter(tmp_path / "adapter", override)
    table = docs_table()
    assert not servable_by_docs(key, config[key], *table[key])
    reasons = vllm_support(config)
    assert len(reasons) == 1 and key in reasons[0]


def test_max_lora_rank_is_the_smallest_allowed_at_least_r():
    cases = {1: 1, 2: 8, 8: 8, 9: 16, 16: 16, 24: 32, 64: 64, 200: 256, 257: 320, 321: 512, 512: 512, 513: None}
    assert {r: vllm_max_lora_rank(r) for r in cases} == cases


def test_serve_commands_and_model_card(tmp_path, qwenft_adapter):
    from qwenft.export.card import model_card, serve_commands

    out = tmp_path / "my merged"
    serve = serve_commands(out, {"file": "my merged-f16.gguf"}, qwenft_adapter, "Qwen/Qwen2.5-7B-Instruct",
                           "run 1")
    assert serve["merged"] == f"vllm serve '{out}'"
    assert serve["gguf"] == f"llama-server -m '{out}/my merged-f16.gguf'"
    assert serve["adapter"] == (f"vllm serve Qwen/Qwen2.5-7B-Instruct --enable-lora --lora-modules "
                                f"run-1={qwenft_adapter} --max-lora-rank 16")
    assert serve["adapter_problem"] is None
    assert serve_commands(out, None, qwenft_adapter, "b", "n")["gguf"] is None

    base = {"name": "tiny-random", "source": "tiny-random", "path": "/cache/tiny", "trained_on": "16-bit",
            "merged_into": "original 16-bit weights"}
    verification = {"merge": {"max_abs_logit_delta": 1e-6, "tolerance": 1e-5, "greedy": ["identical"]}, "gguf": None}
    settings = {"dtype": "float32", "max_shard_size": "5GB", "base": "dequantized", "gguf": "f16"}
    card = model_card(out.name, base, None, settings, verification, None, None, out, serve)
    section = card[card.index("## Serve"):card.index("## Base and merge")]
    assert serve["merged"] in section and serve["gguf"] in section and serve["adapter"] in section


def test_merge_names_an_adapter_vllm_cannot_serve(tmp_path):
    from qwenft.export.card import serve_commands

    adapter = tmp_path / "adapter"
    make_qwenft_adapter(adapter, "lora.use_dora=true")
    serve = serve_commands(tmp_path / "out", None, adapter, "Qwen/Qwen2.5-7B-Instruct", "run")
    assert serve["adapter"] is None
    problem = serve["adapter_problem"]
    assert "use_dora" in problem and f"vllm serve {tmp_path / 'out'}" in problem


def test_merge_prints_the_serve_commands(tmp_path, qwenft_adapter, capsys):
    """A real merge (tiny-random, float32): its last lines are the serve commands, the model card has them, and a
    re-run that does nothing prints them again."""
    from qwenft.export.merge import merge

    out = tmp_path / "merged"
    config = compose_config(f"adapter={qwenft_adapter}", f"out={out}", "merge.dtype=float32", command="merge")
    merge(config, device="cpu")
    printed = capsys.readouterr().out.splitlines()
    record = json.loads((out / "qwenft_merge.json").read_text())
    assert printed[-2:] == [f"serve it with vLLM: vllm serve {out}",
                            f"or serve the adapter unmerged with vLLM: {record['serve']['adapter']}"]
    run_name = json.loads((qwenft_adapter / "qwenft.json").read_text())["run_name"]
    assert f"--lora-modules {run_name}={qwenft_adapter} --max-lora-rank 16" in record["serve"]["adapter"]
    card = (out / "README.md").read_text()
    assert "## Serve" in card and f"vllm serve {out}\n" in card
    merge(config, device="cpu")
    assert capsys.readouterr().out.splitlines()[-2:] == printed[-2:]


def test_eval_warns_once_for_an_adapter_vllm_cannot_serve(tmp_path, caplog):
    from qwenft.model.lora import prepare_inference

    adapter = tmp_path / "adapter"
    make_qwenft_adapter(adapter, "lora.use_dora=true")
    with caplog.at_level(logging.WARNING, logger="qwenft"):
        prepare_inference(compose_config("model=tiny-random", f"adapter={adapter}", command="eval"))
    lines = [r.getMessage() for r in caplog.records if "vLLM" in r.getMessage()]
    assert len(lines) == 1 and "use_dora" in lines[0] and "qwenft merge" in lines[0]
    caplog.clear()
    config = dataclasses.replace(compose_config("model=tiny-random", f"adapter={adapter}"), command="generate")
    with caplog.at_level(logging.WARNING, logger="qwenft"):  # generate is not eval: no warning there
        prepare_inference(config)
    assert not [r for r in caplog.records if "vLLM" in r.getMessage()]
