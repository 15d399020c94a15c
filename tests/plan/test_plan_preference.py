"""`qwenft plan` for a preference step (train.objective dpo, ipo, simpo, orpo, kto): 2 sequences per pair, the
reference forward's transient where a step runs one, the preference loss's chunk; the SFT plan unchanged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qwenft.plan import Architecture, TrainSetup, make_plan, resolve_architecture, training_memory
from qwenft.plan.arch import BUILTIN_CONFIGS
from qwenft.plan.evaluation import forward_bytes
from qwenft.plan.memory import activation_terms
from qwenft.plan.preference import chunk_bytes, layout, preference_terms, step_memory
from tests.conftest import compose_config

QWEN7B = "Qwen/Qwen2.5-7B-Instruct"
PREF = ("data.sources=[]",)  # a preference objective trains on preference sources only: none here


def arch_of(name: str) -> Architecture:
    return Architecture.from_config_dict(BUILTIN_CONFIGS[name], name)


def setup_of(*overrides: str, device: str = "cuda") -> TrainSetup:
    return TrainSetup.from_config(compose_config(*overrides), device=device)


def test_sft_plan_numbers_are_unchanged():
    """The SFT plan is what it was before preference steps were planned: step_memory is training_memory, and the
    benchmark cases' planned peaks are the bytes recorded in benchmarks/results/plan_accuracy*.json."""
    case = compose_config("quant=nf4", "quant.compute_dtype=float32", "train.precision=fp32", "lora.r=16",
                          "train.gradient_checkpointing=false")
    setup = TrainSetup.from_config(case, device="cpu")
    assert (setup.objective, setup.reference, setup.padding_free) == ("sft", False, False)
    arch = resolve_architecture(case.model)
    assert training_memory(arch, setup, 1, 128, steady=False)["peak"] == 1_855_323_071
    assert step_memory(arch, setup, 1, 128, steady=False) == training_memory(arch, setup, 1, 128, steady=False)
    tiny = compose_config("model=tiny-random", "model.tiny.hidden_size=512", "model.tiny.intermediate_size=2048",
                          "model.tiny.num_hidden_layers=4", "model.tiny.num_attention_heads=8",
                          "model.tiny.num_key_value_heads=2", "model.tiny.vocab_size=32000", "quant=nf4",
                          "quant.compute_dtype=bfloat16", "train.precision=fp32", "lora.r=16")
    tiny_setup = TrainSetup.from_config(tiny, device="cpu")
    for ckpt, peak in ((False, 368_599_166), (True, 214_509_694)):
        variant = dataclasses.replace(tiny_setup, gradient_checkpointing=ckpt)
        assert step_memory(resolve_architecture(tiny.model), variant, 2, 256, steady=False)["peak"] == peak
    plan = make_plan(compose_config("model=qwen2.5-7b-instruct", "lora.r=64"))
    arch7 = arch_of(QWEN7B)
    sft = setup_of("model=qwen2.5-7b-instruct", "lora.r=64")
    assert plan["training"]["with_checkpointing"] == training_memory(arch7, sft, 4, 1024)
    assert plan["training"]["objective"] == "sft" and "sequences_per_pair" not in plan["training"]


@pytest.mark.parametrize("pairs", [1, 2, 4])
def test_padded_dpo_step_saves_what_sft_saves_for_twice_the_rows(pairs):
    """Padded: B pairs are [2B, seq]; the body's terms are SFT's for 2B rows, the loss's are the preference path's."""
    arch = arch_of(QWEN7B)
    dpo = setup_of("model=qwen2.5-7b-instruct", "train.objective=dpo", "pref.padding_free=false", *PREF)
    sft = dataclasses.replace(dpo, objective="sft", reference=False)
    assert layout(dpo, pairs, 1024) == (2 * pairs, 1024, True)
    terms, base = preference_terms(arch, dpo, pairs, 1024), activation_terms(arch, sft, 2 * pairs, 1024)
    for key in ("layers", "per_token_layer", "final", "checkpoints", "backward_transient", "dequant_transient"):
        assert terms[key] == base[key], key
    assert terms["sequences"] == 2 * pairs
    for ckpt in (True, False):
        a, b = (dataclasses.replace(s, gradient_checkpointing=ckpt) for s in (dpo, sft))
        held = training_memory(arch, b, 2 * pairs, 1024)["held_at_loss"]
        assert step_memory(arch, a, pairs, 1024)["held_at_loss"] == held
    # twice the pairs, twice the body's activations
    double = preference_terms(arch, dpo, 2 * pairs, 1024)
    assert double["checkpoints"] == 2 * terms["checkpoints"]
    assert double["layers"] == pytest.approx(2 * terms["layers"], rel=1e-5)  # less a per-layer constant


def test_padding_free_step_is_one_row_with_a_packed_mask():
    """Padding-free: one row of 2B x seq tokens, with transformers' packed-sequence mask: SDPA saves its float copy
    ([tokens, tokens]) in every layer, so the attention term is quadratic in all the batch's tokens."""
    arch = arch_of(QWEN7B)
    # pref.padding_free=auto is padded on sdpa (this quadratic mask is why); =true forces one row
    assert not setup_of("model=qwen2.5-7b-instruct", "train.objective=dpo", *PREF).padding_free
    packed = setup_of("model=qwen2.5-7b-instruct", "train.objective=dpo", *PREF, "pref.padding_free=true")
    padded = dataclasses.replace(packed, padding_free=False)
    assert packed.padding_free and layout(packed, 4, 512) == (1, 4096, True)
    assert layout(dataclasses.replace(packed, attn="flash_attention_2"), 4, 512) == (1, 4096, False)
    T, S, L = 4096, 512, arch.num_hidden_layers
    diff = preference_terms(arch, packed, 4, S)["layers"] - preference_terms(arch, padded, 4, S)["layers"]
    assert diff == L * T * 2 * (T - S)  # bf16 mask: T x T per layer against 8 rows x S x S
    assert preference_terms(arch, packed, 4, S)["final"] - preference_terms(arch, padded, 4, S)["final"] == \
        2 * (T - S) * arch.head_dim * 4 + (T - 1) - 8 * (S - 1)  # RoPE tables of T positions; the answer mask


def test_reference_forward_is_counted_only_where_a_step_runs_one():
    arch = arch_of(QWEN7B)
    common = ("model=qwen2.5-7b-instruct", "pref.padding_free=false", "data.max_seq_len=2048", *PREF)
    dpo = setup_of(*common, "train.objective=dpo")
    assert dpo.reference and setup_of(*common, "train.objective=kto").reference
    for overrides in (["train.objective=simpo"], ["train.objective=orpo"],
                      ["train.objective=dpo", "pref.precompute_ref=true"]):
        setup = setup_of(*common, *overrides)
        assert not setup.reference, overrides
        assert preference_terms(arch, setup, 4, 2048)["reference"] == 0
    terms = preference_terms(arch, dpo, 4, 2048)
    # the largest single layer's forward of the 8 sequences (fp32 residual under NF4), SDPA's bf16 copy of the mask,
    # one dequantized NF4 weight: the 7B at 2048 tokens is far above the reference's loss part
    assert terms["reference"] == (forward_bytes(arch, 8, 2048, 4) + 2 * 8 * 2048 * 2048
                                  + terms["dequant_transient"])
    assert terms["loss_transient"] == max(terms["policy_loss"], terms["reference"], terms["loss_backward"])
    free = dataclasses.replace(dpo, reference=False)
    with_ref, without = step_memory(arch, dpo, 4, 2048), step_memory(arch, free, 4, 2048)
    assert with_ref["reference"] == terms["reference"] and without["reference"] == 0
    assert with_ref["loss_phase"] - without["loss_phase"] == \
        terms["reference"] - max(terms["policy_loss"], terms["loss_backward"])
    assert with_ref["peak"] >= without["peak"]
    # the reference's body scales with the sequences (2B), its mask with the rows' seq x seq
    assert preference_terms(arch, dpo, 8, 2048)["reference"] - terms["dequant_transient"] == \
        2 * (terms["reference"] - terms["dequant_transient"])


def test_preference_loss_uses_its_chunk_not_a_logits_tensor():
    arch = arch_of(QWEN7B)
    dpo = setup_of("model=qwen2.5-7b-instruct", "train.objective=dpo", *PREF)
    terms = preference_terms(arch, dpo, 4, 2048)
    rows = terms["rows"]
    assert rows == 8 * 2047  # plan.supervised_fraction=1: every predicted position is an answer token
    forward, backward = chunk_bytes(arch, rows, 2)
    assert (forward, backward) == (8 * 110 * arch.vocab_size, 10 * 110 * arch.vocab_size)
    assert terms["loss_backward"] == rows * arch.hidden_size * 2 + backward
    # saved for backward: the bf16 hidden rows (the 7B's lm_head is kept in bf16: no copy), targets and owners
    assert terms["loss_saved"] == rows * arch.hidden_size * 2 + 16 * rows
    # the policy's loss forward and backward: far less than one byte per logit
    assert max(terms["policy_loss"], terms["loss_backward"]) < rows * arch.vocab_size


def test_plan_output_says_objective_sequences_and_reference(tmp_path):
    import io

    from rich.console import Console

    from qwenft.plan.command import render

    def text(*overrides):
        plan = make_plan(compose_config(*overrides))
        out = io.StringIO()
        render(plan, Console(file=out, width=400))
        return plan, out.getvalue()

    plan, out = text("+recipe=dpo", "train.batch_size=2")
    t = plan["training"]
    assert (t["objective"], t["sequences_per_pair"], t["sequences"], t["reference_forward"]) == ("dpo", 2, 4, True)
    assert t["tokens"] == 4 * 192
    assert "objective dpo" in out and "2 sequences per pair" in out and "reference forward is counted" in out
    assert "reference forward (no-grad transient)" in out
    plan, out = text("+recipe=dpo", "train.objective=simpo")
    assert not plan["training"]["reference_forward"] and "not counted: simpo is reference-free" in out
    plan, out = text("+recipe=dpo", "pref.precompute_ref=true")
    assert "not counted: pref.precompute_ref" in out
    _, out = text()
    assert "sequences per pair" not in out and "reference forward" not in out


def test_padding_free_resolution_is_the_trainers():
    from qwenft.train.preference import padding_free_of

    for value in ("auto", "true", "false"):
        config = compose_config("train.objective=dpo", f"pref.padding_free={value}", *PREF)
        assert TrainSetup.from_config(config, device="cpu").padding_free is padding_free_of(config)


def _dpo_saved_bytes(config, pairs: int, seq: int, tmp_path):
    """Bytes of the distinct non-parameter tensors autograd saves in one DPO step's loss on the tiny model, as
    :class:`qwenft.train.preference.PreferenceTrainer` computes it (policy forward, reference forward, objective),
    and the number of answer tokens."""
    from qwenft.data import DataBundle
    from qwenft.model import attach_lora, load_model
    from qwenft.train.preference import PreferenceCollator, make_preference_trainer, padding_free_of

    torch.manual_seed(0)
    model, tokenizer = load_model(config, device="cpu")
    peft_model = attach_lora(model, config.lora, gradient_checkpointing=False)
    trainer = make_preference_trainer(config, peft_model, tokenizer,
                                      DataBundle(train=[], eval=None, eval_rows={}, stats={}),
                                      tmp_path / "checkpoints", "none")
    peft_model.train()
    ids = lambda n: torch.randint(5, 300, (n,)).tolist()  # noqa: E731
    rows = [{"prompt_ids": ids(6), "chosen_ids": ids(seq - 6), "rejected_ids": ids(seq - 6 - (3 if i else 0))}
            for i in range(pairs)]
    batch = PreferenceCollator(tokenizer.pad_token_id, padding_free_of(config))(rows)
    params = {p.untyped_storage().data_ptr() for p in peft_model.parameters()}
    seen = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params:
            seen[key] = (t.untyped_storage().nbytes(), t)  # kept alive: no address is reused (see test_plan.py)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.compute_loss(peft_model, batch)
    return sum(nbytes for nbytes, _ in seen.values()), sum(len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows)


@pytest.mark.parametrize("padding_free", ["false", "true"])
def test_dpo_policy_saves_what_the_plan_says(tmp_path, padding_free):
    """The policy's saved bytes of a DPO step on the tiny model (the reference forward saves nothing: no grad) equal
    the plan's body + loss_saved terms, padded and padding-free (its packed mask saved in every layer)."""
    seq = 24
    config = compose_config("model=tiny-random", "quant=nf4", "lora.lora_dropout=0.0", "lora.r=8",
                            "quant.compute_dtype=float32", "train.precision=fp32", "train.gradient_checkpointing=false",
                            "train.objective=dpo", f"pref.padding_free={padding_free}", *PREF, f"out_dir={tmp_path}")
    measured, answers = _dpo_saved_bytes(config, 2, seq, tmp_path)
    arch = resolve_architecture(config.model)
    setup = TrainSetup.from_config(config, device="cpu")
    # the plan's worst case: every sequence at full length; here the last rejected answer is 3 tokens short
    setup = dataclasses.replace(setup, supervised=answers / (4 * (seq - 1)))
    b, s, _ = layout(setup, 2, seq)
    if setup.padding_free:  # the packed row is 3 tokens shorter than the plan's 4 x seq
        s -= 3
        setup = dataclasses.replace(setup, supervised=answers / (4 * (seq - 1)))
    terms = preference_terms(arch, setup, 2, seq)
    if setup.padding_free:
        terms = {**terms, **{k: v for k, v in activation_terms(arch, setup, b, s, masked=True).items()
                             if k in ("layers", "layer_constants", "final")}}
    predicted = terms["layers"] + arch.num_hidden_layers * terms["layer_constants"] + terms["final"] + \
        terms["loss_saved"]
    # the objective's own [pairs]-sized tensors (log-sigmoid of the margins, ...) are not counted: < 1 KiB
    print(f"planned {predicted:,} measured {measured:,}")
    assert 0 <= measured - predicted <= 1024, (predicted, measured)
