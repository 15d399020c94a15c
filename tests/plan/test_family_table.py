"""`qwenft plan` for every Qwen2.5 preset: which GPUs fit (one GPU, sharded), long context, and docs/plan.md's tables."""

from __future__ import annotations

import pytest

from qwenft.model.family import MEMBERS, by_preset
from qwenft.plan import make_plan
from qwenft.plan.arch import Architecture
from qwenft.plan.gpus import GIB, SHARDED_DISTS, SHARDED_PROCESSES, fitting_gpus, long_context, step_peak, variant
from tests.conftest import ROOT, compose_config
from tests.plan import family_table

REWRITE = "python -m tests.plan.family_table --write"


def arch_of(preset: str) -> Architecture:
    member = by_preset(preset)
    return Architecture.from_config_dict(dict(member.config), member.repo_id)


def test_docs_tables_are_rendered_from_the_family_and_the_planner():
    text = (ROOT / "docs" / "plan.md").read_text(encoding="utf-8")
    for name, lines in family_table.render().items():
        assert family_table.current(text, name) == lines, f"docs/plan.md's {name} table is stale: run `{REWRITE}`"


def test_every_preset_plans_offline(monkeypatch, tmp_path):
    """`qwenft plan model=X` with no network and an empty HF cache: the family's numbers, one-GPU QLoRA and LoRA
    figures for every preset, and the per-GPU figures under FSDP and ZeRO-3 on 2, 4 and 8 GPUs for the 32B / 72B."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    presets = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))
    assert {m.preset for m in MEMBERS.values()} <= set(presets)
    for member in MEMBERS.values():
        plan = make_plan(compose_config(f"model={member.preset}", command="plan"))
        assert "built-in" in plan["model"]["numbers_from"] and plan["model"]["name"] == member.preset
        assert plan["model"]["architecture"]["hidden_size"] == member.config["hidden_size"]
        one = {row["quant"]: row for row in plan["gpus"]["one_gpu"]}
        assert set(one) == {"nf4", "none"} and one["nf4"]["peak"] < one["none"]["peak"], member.preset
        large = plan["parameters"]["total"] >= 20e9
        assert large == (member.size in ("32B", "72B")), member.preset
        sharded = plan["gpus"]["sharded"]
        assert len(sharded) == (len(SHARDED_DISTS) * len(SHARDED_PROCESSES) * 2 if large else 0), member.preset
        for row in sharded:  # more GPUs: less per GPU (weights, gradients and states are divided)
            if row["processes"] > 2:
                fewer = next(r for r in sharded if r["dist"] == row["dist"] and r["quant"] == row["quant"]
                             and r["processes"] == row["processes"] // 2)
                assert row["peak"] < fewer["peak"], (member.preset, row)


def test_72b_on_eight_gpus_fits_where_one_does_not():
    config = compose_config("model=qwen2.5-72b-instruct", "data.max_seq_len=2048", "train.batch_size=1",
                            command="plan")
    plan = make_plan(config)
    lora_one = next(r for r in plan["gpus"]["one_gpu"] if r["quant"] == "none")
    assert lora_one["fits"] == []  # 145 GB of 16-bit weights alone
    eight = [r for r in plan["gpus"]["sharded"] if r["processes"] == 8 and r["quant"] == "none"]
    assert {r["dist"] for r in eight} == set(SHARDED_DISTS) and all(80 in r["fits"] for r in eight)


def test_fits_rule_is_n_gib_minus_the_reserve():
    assert 80 in fitting_gpus(79 * GIB, 1.0) and 80 not in fitting_gpus(79 * GIB + 1, 1.0)
    assert fitting_gpus(10 * GIB, 1.0) == [16, 24, 40, 48, 80, 141]
    assert fitting_gpus(200 * GIB, 1.0) == []


def test_long_context_rows_7b():
    """8k / 32k natively, 128k with YaRN x4; the layer inputs kept are fp32 under NF4 (about twice bf16's); the KV
    cache of one sequence is 57,344 B a token for the 7B."""
    config = compose_config("model=qwen2.5-7b-instruct", command="plan")
    rows = long_context(config, arch_of("qwen2.5-7b-instruct"))
    assert [(r["seq_len"], r["quant"]) for r in rows] == [(s, q) for s in (8192, 32768, 131072) for q in ("nf4", "none")]
    assert [r["rope_scaling"] is not None for r in rows] == [False] * 4 + [True] * 2
    for nf4, none in zip(rows[::2], rows[1::2]):
        assert 1.9 < nf4["checkpoints"] / none["checkpoints"] <= 2  # (+ the final norm's input, fp32 in both)
        assert nf4["kv_cache"] == none["kv_cache"] == 57_344 * nf4["seq_len"]
    assert rows[-1]["peak"] > 80 * GIB  # 128k does not fit one 80 GB GPU (docs/plan.md says so)


def test_math_has_no_yarn_rows():
    """Qwen2.5-Math's 4,096-token context: no 8k+ row (YaRN x4 is documented for the 32,768-token models)."""
    config = compose_config("model=qwen2.5-math-7b-instruct", command="plan")
    assert long_context(config, arch_of("qwen2.5-math-7b-instruct")) == []


def test_packed_rows_under_sdpa_count_their_mask():
    """A packed row reaches SDPA with a block-diagonal [tokens, tokens] mask even one row to a batch; flash-attention
    reads the boundaries from position_ids and has none."""
    config = compose_config("model=qwen2.5-7b-instruct", "data.max_seq_len=8192", "train.batch_size=1",
                            command="plan")
    arch = arch_of("qwen2.5-7b-instruct")

    def peak(packed: bool, attn: str) -> int:
        return step_peak(variant(config, packed=packed, attn=attn), arch)["peak"]

    assert peak(False, "sdpa") == peak(False, "flash_attention_2")
    assert peak(True, "flash_attention_2") == peak(False, "flash_attention_2")
    assert peak(True, "sdpa") > peak(False, "sdpa") + 8192 * 8192  # at least the saved mask of one layer


@pytest.mark.parametrize("recipe_overrides", [["+recipe=long_context", "data.sources.0.path=data/domain.jsonl"]])
def test_long_context_recipe_fits_80gb(recipe_overrides):
    config = compose_config(*recipe_overrides, "plan.gpu_gb=80", command="plan")
    assert config.data.packing and config.train.gradient_checkpointing and config.train.batch_size == 1
    plan = make_plan(config)
    assert plan["budget"]["fits"] and plan["training"]["seq_len"] == 32768


def test_131072_tokens_need_yarn():
    """data.max_seq_len=131072 is accepted; without model.rope_scaling the plan warns and names the YaRN setting, with
    it the context is 131,072 and nothing is said; the long-context rows are planned from data.max_seq_len 8,192."""
    plain = make_plan(compose_config("model=qwen2.5-7b-instruct", "data.max_seq_len=131072", "train.batch_size=1",
                                     command="plan"))
    assert any("model.rope_scaling" in w and "yarn" in w for w in plain["warnings"])
    yarn = make_plan(compose_config("model=qwen2.5-7b-instruct", "data.max_seq_len=131072", "train.batch_size=1",
                                    "model.rope_scaling={rope_type: yarn, factor: 4.0, "
                                    "original_max_position_embeddings: 32768}", command="plan"))
    assert yarn["warnings"] == [] and yarn["model"]["architecture"]["max_position_embeddings"] == 131072
    assert [r["seq_len"] for r in yarn["long_context"]][-1] == 131072
    short = make_plan(compose_config("model=qwen2.5-7b-instruct", "data.max_seq_len=2048", command="plan"))
    assert short["long_context"] == []
