"""The inference engine of eval / generate (issue 18): the decode path chosen for the device and memory, LoRA
folded into 16-bit weights, batches planned to few compiled shapes, results in input order. Every GPU-only
decision is checked here on the CPU by passing the device type and memory numbers explicitly; the compile
count is checked with a counting torch.compile backend (dynamo traces on the CPU exactly as on CUDA)."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import random
import sys

import pytest
import torch

from qwenft.config import QwenftError
from qwenft.export.verify import RTOL
from qwenft.generation import Sampler
from qwenft.generation.batches import ALIGN, plan_batches, generate_many
from qwenft.generation.engine import (MARGIN_BYTES, MAX_AUTO_ROWS, auto_batch_sizes, choose_path,
                                      dense_projection_bytes, prepare_for_decoding, reserve_bytes, row_bytes,
                                      window_bytes)
from qwenft.model import attach_lora, load_model
from qwenft.model.fold import fold_blocker, unwrap
from qwenft.model.load import has_4bit_layers
from qwenft.plan import Architecture
from tests.conftest import compose_config

GiB = 2**30
QWEN7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
          "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
          "tie_word_embeddings": False, "model_type": "qwen2"}


def config(*overrides, command="eval"):
    return compose_config("model=tiny-random", *overrides, command=command)


# --- choose_path: the decisions a CUDA run takes, from the numbers it would see -------------------------------

def test_7b_dequantizes_folds_and_compiles_on_an_h200_but_not_on_a_16_gb_card():
    arch = Architecture.from_config_dict(QWEN7B, "test")
    dense = dense_projection_bytes(arch)
    # 28 layers x (q 3584x3584 + k,v 3584x512 + o 3584x3584 + 3 x 3584x18944) x 2 bytes
    assert dense == 2 * 28 * (2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944) == 13_050_576_896
    reserve = reserve_bytes(arch, cache_len=32 + 128, prompt_len=32, window=1024)
    cfg = config("quant=nf4")
    h200 = choose_path(cfg, "cuda", nf4=True, adapter=True, fold_blocker=None, dense_bytes=dense,
                       free_bytes=130 * GiB, reserve_bytes=reserve, native_bf16=True)
    assert (h200.dequantize, h200.fold, h200.compile, h200.dtype) == (True, True, True, "bfloat16")
    small = choose_path(cfg, "cuda", nf4=True, adapter=True, fold_blocker=None, dense_bytes=dense,
                        free_bytes=11 * GiB, reserve_bytes=reserve, native_bf16=True)  # 16 GB card, NF4 loaded
    # kept in NF4, but its other weights and LoRA in the compute dtype, as a later `qwenft eval` loads them
    assert (small.dequantize, small.fold, small.compile, small.dtype) == (False, False, False, "bfloat16")
    assert "do not fit" in small.reason
    # The boundary is the planner's sum: dense + reserve.
    edge = choose_path(cfg, "cuda", nf4=True, adapter=False, fold_blocker=None, dense_bytes=dense,
                       free_bytes=dense + reserve, reserve_bytes=reserve)
    assert edge.dequantize and not edge.fold
    below = choose_path(cfg, "cuda", nf4=True, adapter=False, fold_blocker=None, dense_bytes=dense,
                        free_bytes=dense + reserve - 1, reserve_bytes=reserve)
    assert not below.dequantize


def test_cpu_dequantizes_but_neither_folds_nor_compiles_by_default():
    path = choose_path(config("quant=nf4"), "cpu", nf4=True, adapter=True, fold_blocker=None, dense_bytes=10,
                       free_bytes=None, reserve_bytes=0, native_bf16=True)
    # the compute dtype on a CPU too (it used to keep the fp32 weights QLoRA's preparation leaves after training)
    assert (path.dequantize, path.fold, path.compile, path.dtype) == (True, False, False, "bfloat16")
    plain = choose_path(config("quant=nf4"), "cpu", nf4=True, adapter=True, fold_blocker=None, dense_bytes=10,
                        free_bytes=None, reserve_bytes=0, native_bf16=False)
    assert plain.dtype == "float32"  # compute_dtype auto where bf16 is not native
    forced = choose_path(config("quant=nf4", "generate.fold_lora=true"), "cpu", nf4=True, adapter=True,
                         fold_blocker=None, dense_bytes=10, free_bytes=None, reserve_bytes=0)
    assert forced.fold


def test_explicit_settings_win_and_impossible_ones_are_refused():
    common = dict(adapter=True, fold_blocker=None, dense_bytes=10, reserve_bytes=0)
    kept = choose_path(config("quant=nf4", "quant.dequantize_for_inference=false"), "cuda", nf4=True,
                       free_bytes=100 * GiB, **common)
    assert not kept.dequantize and not kept.fold and not kept.compile
    with pytest.raises(QwenftError, match="generate.fold_lora=true needs a 16-bit base"):
        choose_path(config("quant=nf4", "quant.dequantize_for_inference=false", "generate.fold_lora=true"), "cuda",
                    nf4=True, free_bytes=100 * GiB, **common)
    with pytest.raises(QwenftError, match="generate.compile=true .* needs the model on a CUDA device"):
        choose_path(config("generate.compile=true"), "cpu", nf4=True, free_bytes=None, **common)
    with pytest.raises(QwenftError, match="generate.fold_lora=true: .*modules_to_save"):
        choose_path(config("quant=none", "generate.fold_lora=true"), "cuda", nf4=False, free_bytes=None,
                    **{**common, "fold_blocker": "x is a modules_to_save copy, not a LoRA delta"})
    off = choose_path(config("quant=none", "generate.compile=false", "generate.fold_lora=false"), "cuda", nf4=False,
                      free_bytes=None, native_bf16=True, **common)
    assert not off.compile and not off.fold and off.dtype is not None


def test_auto_batch_sizes_from_kv_and_logits_bytes():
    arch = Architecture.from_config_dict(QWEN7B, "test")
    # 7B, 1,152 cached tokens per row: 57,344 B/token KV -> 66 MB, plus the prefill's MLP transients and logits.
    each = row_bytes(arch, cache_len=1152, prompt_len=1024)
    assert each == 57_344 * 1152 + 6 * 1024 * 18944 + 12 * 152064
    rows, windows = auto_batch_sizes(arch, 120 * GiB, 1152, 1024, 1024)
    assert rows == MAX_AUTO_ROWS and windows == 16
    rows, windows = auto_batch_sizes(arch, MARGIN_BYTES + 5 * each, 1152, 1024, 1024)
    assert rows == 4  # five fit; rounded down to a power of two
    assert each == 184_276_992
    # A 1,024-token window holds no [window, vocab] logits any more (chunked projection): its body's activations,
    # 1024 x (2 x 3584 x 2 residual + 3 x 18944 x 2 MLP) + 1024^2 mask + 1024 x 3584 x 2 gathered = 139 MB.
    assert window_bytes(arch, 1024) == 1024 * (2 * 3584 * 2 + 3 * 18944 * 2) + 1024**2 + 1024 * 3584 * 2
    assert window_bytes(arch, 1024) == 139_460_608
    assert windows == 4  # 921 MB of room holds six: rounded down to a power of two
    assert auto_batch_sizes(arch, MARGIN_BYTES + 3 * 139_460_608, 1152, 1024, 1024)[1] == 2
    assert auto_batch_sizes(arch, MARGIN_BYTES + 139_460_607, 1152, 1024, 1024)[1] == 1  # never fewer than 1
    assert auto_batch_sizes(arch, 0, 1152, 1024, 1024) == (1, 1)
    assert auto_batch_sizes(arch, None, 1152, 1024, 1024) == (8, 8)  # a CPU: the former default


# --- plan_batches: few shapes, every prompt once, minimal padding ---------------------------------------------

def brute_force_padding(needs, k):
    best = None
    n = len(needs)
    for cuts in itertools.chain.from_iterable(itertools.combinations(range(1, n), c) for c in range(k)):
        bounds = (0, *cuts, n)
        cost = sum(needs[b - 1] * (b - a) - sum(needs[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_plan_batches_uses_at_most_three_lengths_and_the_least_padding(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(5, 700) for _ in range(rng.randint(1, 90))]
    batch, new = rng.choice([1, 3, 8, 16]), rng.choice([8, 128])
    plan = plan_batches(lengths, batch, new)
    assert sorted(i for b in plan for i in b.indices) == list(range(len(lengths)))
    assert len({b.cache_len for b in plan}) <= 3
    needs = []
    for b in plan:
        need = max(lengths[i] for i in b.indices) + new
        assert b.cache_len >= need and b.cache_len % ALIGN == 0 and len(b.indices) <= batch
        needs.append(-(-need // ALIGN) * ALIGN)
    assert needs == sorted(needs)  # sorted by prompt length
    if len(needs) <= 12:
        assert sum(b.cache_len for b in plan) - sum(needs) == brute_force_padding(needs, 3)


def test_plan_batches_rejects_nothing_to_do():
    with pytest.raises(ValueError):
        plan_batches([], 8, 16)


# --- the sampler on the static path: padded rows and buckets change no token; results in input order ---------

@pytest.fixture(scope="module")
def sharp():
    """tiny-random in fp32 with its output layer scaled x20 (argmax gaps well above float noise)."""
    cfg = compose_config("model=tiny-random", "quant=none", command="generate")
    torch.manual_seed(0)
    model, tokenizer = load_model(cfg, device="cpu")
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model.eval(), tokenizer


def prompts_of(tokenizer, n, seed=0):
    rng = random.Random(seed)
    words = ["spring", "river", "stone", "light", "garden", "winter", "paper", "cloud"]
    return [tokenizer(" ".join(rng.choice(words) for _ in range(rng.randint(1, 25))))["input_ids"] for _ in range(n)]


def test_generate_many_keeps_input_order_and_equals_one_by_one(sharp):
    model, tokenizer = sharp
    prompts = prompts_of(tokenizer, 11)
    one = [Sampler(model, tokenizer).generate([p], max_new_tokens=10, do_sample=False).sequences[0].token_ids
           for p in prompts]
    for static in (False, True):
        sampler = Sampler(model, tokenizer, dataclasses.replace(config().generate, static_cache=static))
        results, totals = generate_many(sampler, prompts, 4, max_new_tokens=10, do_sample=False)
        assert [r.token_ids for r in results] == one
        assert [r.prompt_tokens for r in results] == [len(p) for p in prompts]
        assert totals.generated_tokens == sum(len(t) for t in one)


def count_compiles():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(tuple(tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)))
        return gm.forward

    return backend, graphs


def test_an_evaluation_compiles_at_most_three_times_and_the_folded_side_reuses_them(sharp):
    """Many batches of varied prompt lengths, base then tuned (adapter folded into the same weights): the
    decode step is traced at most 3 times in all, and the tokens equal the uncompiled dynamic-cache path."""
    torch._dynamo.reset()
    model, tokenizer = sharp
    cfg = config("quant=none")
    peft_model = attach_lora(copy.deepcopy(model), cfg.lora, gradient_checkpointing=False)
    randomize_lora(peft_model, 0.3)
    peft_model.eval()
    prompts = prompts_of(tokenizer, 19, seed=3)
    expected = {}
    for side in ("base", "tuned"):
        ctx = peft_model.disable_adapter() if side == "base" else torch.no_grad()
        with ctx:
            expected[side] = [r.token_ids for r in
                              generate_many(Sampler(peft_model, tokenizer), prompts, 4, max_new_tokens=6,
                                            do_sample=False)[0]]
    assert expected["base"] != expected["tuned"]  # the adapter matters
    plain, fold = unwrap(peft_model)
    backend, graphs = count_compiles()
    sampler = Sampler(plain, tokenizer, config().generate, compile_backend=backend)
    assert sampler.static and sampler.compiled
    got = {"base": [r.token_ids for r in generate_many(sampler, prompts, 4, max_new_tokens=6, do_sample=False)[0]]}
    traced_base = len(graphs)
    fold.fold_()
    got["tuned"] = [r.token_ids for r in generate_many(sampler, prompts, 4, max_new_tokens=6, do_sample=False)[0]]
    assert 1 <= traced_base <= 3 and len(graphs) == traced_base, graphs
    assert got == expected


# --- folding: the tuned side's weights are peft's merge arithmetic --------------------------------------------

def randomize_lora(peft_model, scale):
    torch.manual_seed(7)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, scale)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_folded_logits_match_adapter_on_base_within_merge_tolerance(sharp, dtype):
    model, tokenizer = sharp
    base = copy.deepcopy(model).to(getattr(torch, dtype))
    peft_model = attach_lora(base, config("quant=none").lora, gradient_checkpointing=False, keep_dtype=True)
    randomize_lora(peft_model, 0.05)
    peft_model.eval()
    ids = torch.tensor([prompts_of(tokenizer, 1, seed=5)[0]])
    with torch.no_grad():
        adapter_on = peft_model(input_ids=ids).logits.float()
        with peft_model.disable_adapter():
            adapter_off = peft_model(input_ids=ids).logits.float()
        plain, fold = unwrap(peft_model)
        base_side = plain(input_ids=ids).logits.float()
        assert fold.fold_() == 2 * 7  # two layers x seven projections
        folded = plain(input_ids=ids).logits.float()
    assert torch.equal(base_side, adapter_off)  # unwrapping alone changes nothing
    scale = max(1.0, adapter_on.abs().max().item())
    assert (folded - adapter_on).abs().max().item() <= RTOL[dtype] * scale  # merge's own tolerance (export.verify)
    assert (adapter_on - adapter_off).abs().max().item() > RTOL[dtype] * scale  # the adapter is not a no-op
    with pytest.raises(RuntimeError, match="already folded"):
        fold.fold_()


def test_fold_blocker_names_what_cannot_be_folded(sharp):
    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    model, _ = sharp
    assert fold_blocker(model) == "the model has no adapter"
    saved = get_peft_model(copy.deepcopy(model), PeftLoraConfig(r=2, target_modules=["q_proj"],
                                                                 modules_to_save=["lm_head"]))
    assert "modules_to_save" in fold_blocker(saved)
    with pytest.raises(ValueError, match="cannot fold"):
        unwrap(saved)
    dora = get_peft_model(copy.deepcopy(model), PeftLoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    assert "LoRA variant" in fold_blocker(dora)


# --- prepare_for_decoding on a real NF4 + adapter load (the CPU path, folding forced) --------------------------

def test_prepare_for_decoding_dequantizes_unwraps_and_folds_in_order(tmp_path):
    cfg = config("quant=nf4", "generate.fold_lora=true", "quant.compute_dtype=float32")
    torch.manual_seed(0)
    model, tokenizer = load_model(cfg, device="cpu")
    peft_model = attach_lora(model, cfg.lora, gradient_checkpointing=False)
    randomize_lora(peft_model, 0.3)
    ids = prompts_of(tokenizer, 1, seed=9)[0]
    engine = prepare_for_decoding(peft_model, cfg, cache_len=len(ids) + 8, prompt_len=len(ids))
    assert engine.path.dequantize and engine.path.fold and not engine.path.compile
    assert not has_4bit_layers(engine.model) and has_4bit_layers(load_model(cfg, device="cpu")[0])
    assert not hasattr(engine.model, "peft_config")  # the plain model: the base side runs without peft
    with engine.side("base") as base:
        base_logits = base(input_ids=torch.tensor([ids])).logits
    with engine.side("tuned") as tuned:
        tuned_logits = tuned(input_ids=torch.tensor([ids])).logits
    assert not torch.allclose(base_logits, tuned_logits)
    with pytest.raises(RuntimeError, match="base side must be evaluated before"):
        with engine.side("base"):
            pass


def test_after_training_and_a_later_eval_run_the_same_dtypes(tmp_path):
    """Issue 26 item 7: QLoRA's preparation leaves the embeddings, norms, lm_head and LoRA in fp32; the evaluation
    after `train` used to run on those on a CPU, while `qwenft eval` loads them in the compute dtype. Both now read
    every weight (the dequantized projections too) in the compute dtype."""
    from qwenft.model.lora import load_adapter

    cfg = config("quant=nf4", "quant.compute_dtype=bfloat16")
    torch.manual_seed(0)
    trained = attach_lora(load_model(cfg, device="cpu")[0], cfg.lora, gradient_checkpointing=False)
    assert torch.float32 in {p.dtype for p in trained.parameters()}  # what training leaves
    trained.save_pretrained(str(tmp_path))
    fresh = load_adapter(load_model(cfg, device="cpu")[0], str(tmp_path))
    dtypes = {}
    for name, model in (("after train", trained), ("later eval", fresh)):
        engine = prepare_for_decoding(model, cfg, cache_len=16, prompt_len=8)
        assert engine.path.dequantize and not has_4bit_layers(engine.model)
        dtypes[name] = {n: p.dtype for n, p in engine.model.named_parameters()}
    assert dtypes["after train"] == dtypes["later eval"]
    assert set(dtypes["after train"].values()) == {torch.bfloat16}
    assert any("lora_A" in n for n in dtypes["after train"]) and any("mlp.down_proj" in n for n in dtypes["later eval"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_on_a_cpu_no_weight_stays_a_view_into_the_loaded_file():
    """transformers leaves weights it did not convert as views into the memory-mapped safetensors file, which keeps
    the file mapped and every page loading read resident (0.3-0.6 GiB beyond the weights on the 0.5B model):
    prepare_for_decoding copies them into the process's own memory, values unchanged."""

    def in_file_mapping(model):
        spans = [[int(x, 16) for x in line.split()[0].split("-")] for line in open("/proc/self/maps")
                 if line.rstrip().endswith(".safetensors")]
        return [n for n, p in model.named_parameters() if any(a <= p.data_ptr() < b for a, b in spans)]

    cfg = config("quant=none")
    model, _ = load_model(cfg, device="cpu")
    before = in_file_mapping(model)
    assert "lm_head.weight" in before and "model.embed_tokens.weight" in before  # what the loader does
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = prepare_for_decoding(model, cfg, cache_len=16, prompt_len=8)
    assert in_file_mapping(engine.model) == []
    assert all(torch.equal(p, values[n]) for n, p in engine.model.named_parameters())


def test_the_prefill_projects_the_last_position_without_expanding_the_vocabulary_weight(sharp):
    """A frozen lm_head given transformers' strided last-position view ran as a bmm against the weight expanded to
    [batch, hidden, vocab] (2.1 GB and ~11 s per prefill on the 0.5B model): prepare_for_decoding makes the input
    contiguous, so the projection is one GEMM of [batch, hidden] and the logits are unchanged."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append((str(func), [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
            return func(*args, **(kwargs or {}))

    model, tokenizer = sharp
    vocab = model.lm_head.weight.shape[0]
    ids = torch.tensor([p[:5] for p in prompts_of(tokenizer, 3, seed=4)])  # [3, 5]
    plain = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad(), Ops() as before:
        expected = plain(input_ids=ids, logits_to_keep=1).logits
    assert any("bmm" in op and [3, model.config.hidden_size, vocab] == list(shapes[1]) for op, shapes in before.seen)
    engine = prepare_for_decoding(plain, config("quant=none"), cache_len=16, prompt_len=5)
    with torch.no_grad(), Ops() as after:
        got = engine.model(input_ids=ids, logits_to_keep=1).logits
    assert not any("bmm" in op and any(vocab in shape for shape in shapes) for op, shapes in after.seen)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)  # fp32, the same products in another kernel


def test_evaluate_warns_when_the_adapter_trained_the_base_biases(sharp, caplog):
    """lora.bias=all changes the base model's biases in place; peft cannot switch them off, so the 'base' side is
    not the base model: said in a warning (found by a fresh user: base perplexity 522.60 vs 523.37)."""
    import logging

    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    from qwenft.evaluate.run import evaluate

    model, tokenizer = sharp
    cfg = config("quant=none")
    for bias, warned in (("all", True), ("none", False)):
        peft_model = get_peft_model(copy.deepcopy(model), PeftLoraConfig(r=2, target_modules=["q_proj"], bias=bias))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="qwenft"):
            report = evaluate(peft_model, tokenizer, cfg, None, ["base", "tuned"])
        assert any("'base' side includes them" in r.getMessage() for r in caplog.records) == warned
        assert report["engine"]["weights_dtype"] == "torch.float32"
