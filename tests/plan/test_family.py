"""The Qwen2.5 family table (qwenft/model/family.py): its numbers against DESIGN.md's and transformers' module tree,
the bookkeeping of what was not verified, and the planner reading it (one home for each fact)."""

from __future__ import annotations

import pytest
import torch

from qwenft.model.family import MEMBERS, SHAPE_KEYS, by_preset, identify, member
from qwenft.model.family_table import SHAPES
from qwenft.plan.arch import BUILTIN_CONFIGS, Architecture, parameter_counts
from tests.conftest import ROOT

# DESIGN.md, "Qwen2.5 family": hidden / intermediate / layers / heads / KV heads / tied / vocab rows
DESIGN = {"0.5B": (896, 4864, 24, 14, 2, True, 151936), "1.5B": (1536, 8960, 28, 12, 2, True, 151936),
          "3B": (2048, 11008, 36, 16, 2, True, 151936), "7B": (3584, 18944, 28, 28, 4, False, 152064),
          "14B": (5120, 13824, 48, 40, 8, False, 152064), "32B": (5120, 27648, 64, 40, 8, False, 152064),
          "72B": (8192, 29568, 80, 64, 8, False, 152064)}
# parameters (billions) as the model cards print them, for the sizes whose card was read
CARD_BILLIONS = {"0.5B": 0.49, "1.5B": 1.54, "7B": 7.61, "14B": 14.7}


def test_the_family_is_complete():
    expected = {f"Qwen/Qwen2.5-{s}{v}" for s in DESIGN for v in ("", "-Instruct")}
    expected |= {f"Qwen/Qwen2.5-Coder-{s}{v}" for s in ("1.5B", "7B", "14B", "32B") for v in ("", "-Instruct")}
    expected |= {f"Qwen/Qwen2.5-Math-{s}{v}" for s in ("1.5B", "7B", "72B") for v in ("", "-Instruct")}
    assert set(MEMBERS) == expected
    for m in MEMBERS.values():
        assert m.instruct == m.repo_id.endswith("-Instruct") and m.preset == m.repo_id.split("/")[1].lower()
        assert f"-{m.size}" in m.repo_id and m.line in m.repo_id
        preset = (ROOT / "conf" / "model" / f"{m.preset}.yaml").read_text(encoding="utf-8")
        assert f"path: {m.repo_id}\n" in preset and "source: hub\n" in preset and preset.startswith("# ")


@pytest.mark.parametrize("repo_id", sorted(MEMBERS))
def test_shapes_are_designs(repo_id):
    m = MEMBERS[repo_id]
    c = m.config
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["num_attention_heads"],
            c["num_key_value_heads"], c["tie_word_embeddings"], c["vocab_size"]) == DESIGN[m.size]
    assert c["hidden_size"] // c["num_attention_heads"] == (64 if m.size == "0.5B" else 128) and c["model_type"] == "qwen2"


def test_context_facts():
    """Instruct models read 32,768 positions, the Qwen2.5 base models but the 0.5B and 3B were published with 131,072;
    Qwen2.5-Math: 4,096 positions and RoPE base 10,000 (the others 1e6); rms_norm_eps 1e-5 in the base models of 14B
    and up (where read)."""
    for m in MEMBERS.values():
        c = m.config
        if m.line == "Qwen2.5-Math":
            assert (c["max_position_embeddings"], c["rope_theta"]) == (4096, 10000.0), m.repo_id
            continue
        assert c["rope_theta"] == 1e6
        if m.instruct or "max_position_embeddings" in m.unverified:
            assert c["max_position_embeddings"] == 32768, m.repo_id
    sizes = ("0.5b", "1.5b", "3b", "7b", "14b", "32b", "72b")
    assert [by_preset(f"qwen2.5-{s}").config["max_position_embeddings"] for s in sizes] == \
        [32768, 131072, 32768, 131072, 131072, 131072, 131072]
    eps = {m.preset for m in MEMBERS.values() if m.config["rms_norm_eps"] == 1e-5}
    assert eps == {"qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b", "qwen2.5-coder-14b", "qwen2.5-coder-32b",
                   "qwen2.5-math-72b"}
    assert (by_preset("qwen2.5-0.5b-instruct").config["sliding_window"],
            by_preset("qwen2.5-0.5b-instruct").config["max_window_layers"]) == (32768, 21)


def test_unverified_keys_are_named_never_guessed():
    for m in MEMBERS.values():
        assert set(m.unverified) <= set(m.config) | {"sliding_window", "max_window_layers"} | {
            f"generation.{k}" for k in m.generation}, m.repo_id
        if "sliding_window" in m.unverified:  # left out, not guessed
            assert "sliding_window" not in m.config and "max_window_layers" not in m.config
        else:
            assert m.config["use_sliding_window"] is False and m.config["sliding_window"] >= 32768
        assert m.sources[0] == f"https://huggingface.co/{m.repo_id}/blob/main/config.json" and len(m.sources) >= 3


def test_generation_defaults_end_turns():
    for m in MEMBERS.values():
        g = m.generation
        assert g["bos_token_id"] == 151643
        if m.instruct:
            assert g["eos_token_id"] == [151645, 151643] and g["pad_token_id"] == 151643 and g["do_sample"]
        else:
            assert g["eos_token_id"] == 151643 and not g["do_sample"]


def test_identify_by_shape():
    found = {m.repo_id for m in identify(dict(BUILTIN_CONFIGS["Qwen/Qwen2.5-7B-Instruct"]))}
    assert found == {"Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-Coder-7B-Instruct",
                     "Qwen/Qwen2.5-Coder-7B", "Qwen/Qwen2.5-Math-7B-Instruct", "Qwen/Qwen2.5-Math-7B"}
    untied = dict(BUILTIN_CONFIGS["Qwen/Qwen2.5-0.5B-Instruct"], tie_word_embeddings=False)
    assert identify(untied) == [] and member("qwen/qwen2.5-72b-INSTRUCT").size == "72B"


def test_the_planner_reads_the_family():
    for repo_id, m in MEMBERS.items():
        assert BUILTIN_CONFIGS[repo_id] == m.config and BUILTIN_CONFIGS[repo_id] is not m.config
    assert BUILTIN_CONFIGS["embedded"]["tie_word_embeddings"] is False


@pytest.mark.parametrize("size", sorted(SHAPES))
def test_parameter_counts_match_transformers_and_the_cards(size):
    """Each shape built by transformers on the meta device (no memory): the planner's count is its count; and within
    1% of the model card's where it was read."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = next(m.config for m in MEMBERS.values() if m.size == size and m.line == "Qwen2.5")
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**{k: config[k] for k in SHAPE_KEYS}))
    total = parameter_counts(Architecture.from_config_dict(dict(config), size))["total"]
    assert total == sum(p.numel() for p in model.parameters())
    if size in CARD_BILLIONS:
        assert abs(total / 1e9 - CARD_BILLIONS[size]) / CARD_BILLIONS[size] < 0.01
