"""`qwenft plan`: parameter counts, NF4 and KV bytes, LoRA counts against peft, activation bytes against autograd."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from qwenft.config import ConfigError, QwenftError
from qwenft.plan import (Architecture, TrainSetup, kv_cache_bytes, lora_parameter_count, make_plan, nf4_bytes,
                         parameter_counts, resolve_architecture, training_memory)
from qwenft.plan.arch import BUILTIN_CONFIGS
from qwenft.plan.memory import activation_terms
from tests.conftest import ROOT, compose_config

QWEN7B = "Qwen/Qwen2.5-7B-Instruct"


def arch_of(name: str) -> Architecture:
    return Architecture.from_config_dict(BUILTIN_CONFIGS[name], name)


def meta_model(name: str):
    """The transformers model built from the built-in config numbers on the meta device (no memory, no weights)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        return Qwen2ForCausalLM(Qwen2Config(**BUILTIN_CONFIGS[name]))


def test_qwen7b_parameters_and_kv_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty HF cache: the built-in numbers are used
    arch = resolve_architecture(compose_config("model=qwen2.5-7b-instruct").model)
    assert "built-in" in arch.source
    total = parameter_counts(arch)["total"]
    assert total == 7_615_616_512
    assert abs(total - 7.615e9) / 7.615e9 < 0.005  # the acceptance bound: within 0.5% of 7.615 B
    assert kv_cache_bytes(arch, 1, 2) == 57_344  # 2 x 28 layers x 4 KV heads x 128 x 2 bytes (bf16)
    assert kv_cache_bytes(arch, 2048, 2) == 2048 * 57_344


@pytest.mark.parametrize("name", [QWEN7B, "Qwen/Qwen2.5-0.5B-Instruct", "embedded"])
def test_parameter_counts_match_transformers(name):
    """Every component count against the real module tree (tied lm_head counted once, as PyTorch does)."""
    model = meta_model(name)
    counts = parameter_counts(arch_of(name))
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["embeddings"] == model.model.embed_tokens.weight.numel()
    assert counts["norms"] == sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert counts["attention_bias"] == sum(p.numel() for n, p in model.named_parameters() if n.endswith("bias"))
    if name == "Qwen/Qwen2.5-0.5B-Instruct":
        assert counts["lm_head"] == 0 and model.lm_head.weight is model.model.embed_tokens.weight


def test_lora_count_equals_peft_on_meta_7b():
    """r=64 on all seven projections of the 7B: the planner's count is peft's count."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    config = compose_config("model=qwen2.5-7b-instruct", "lora.r=64")
    assert len(config.lora.target_modules) == 7
    peft_model = get_peft_model(meta_model(QWEN7B), PeftLoraConfig(
        r=64, lora_alpha=16, target_modules=list(config.lora.target_modules), task_type="CAUSAL_LM"))
    trainable, _ = peft_model.get_nb_trainable_parameters()
    assert lora_parameter_count(arch_of(QWEN7B), config.lora) == trainable == 161_480_704


@pytest.mark.parametrize("overrides", [["lora.r=8", "lora.target_modules=[q_proj,v_proj]"],
                                       ["lora.r=4", "lora.use_dora=true"], ["lora.r=2", "lora.bias=all"],
                                       ["lora.r=2", "lora.bias=lora_only", "lora.target_modules=[k_proj,o_proj]"]])
def test_lora_count_variants_equal_peft(overrides):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from qwenft.model.tiny import build_model, build_tokenizer

    config = compose_config("model=tiny-random", *overrides)
    lcfg, tcfg = config.lora, config.model.tiny
    peft_model = get_peft_model(build_model(tcfg, build_tokenizer(tcfg)), PeftLoraConfig(
        r=lcfg.r, lora_alpha=8, target_modules=list(lcfg.target_modules), bias=lcfg.bias, use_dora=lcfg.use_dora,
        task_type="CAUSAL_LM"))
    assert lora_parameter_count(resolve_architecture(config.model), lcfg) == \
        peft_model.get_nb_trainable_parameters()[0]


def test_nf4_bytes_match_bitsandbytes(tmp_path):
    """Packed 4-bit values + uint8 absmax + fp32 second-level absmax of a real Linear4bit, as the formula says."""
    from bitsandbytes.nn import Linear4bit

    from qwenft.model import load_model

    model, _ = load_model(compose_config("model=tiny-random", "quant=nf4", f"out_dir={tmp_path}"), device="cpu")
    layers = [m for m in model.modules() if isinstance(m, Linear4bit)]
    assert layers
    for layer in layers:
        qs = layer.weight.quant_state
        assert qs.blocksize == 64 and qs.nested and qs.state2.blocksize == 256
        stored = layer.weight.nbytes + qs.absmax.nbytes + qs.state2.absmax.nbytes
        assert stored == nf4_bytes(qs.shape[0] * qs.shape[1], double_quant=True)
    # 4 bits + 8/64 + 32/(64*256) bits per weight (QLoRA, section 3): 4.127 bits
    assert nf4_bytes(64 * 256 * 100) * 8 / (64 * 256 * 100) == pytest.approx(4 + 8 / 64 + 32 / (64 * 256))


def saved_bytes(config, batch: int, seq: int, amp: bool, tmp_path) -> int:
    """Bytes of the distinct non-parameter tensors autograd saves in one training forward of the tiny model, loss
    included, as qwenft's trainer runs it (``QwenftTrainer.compute_loss``: its autocast, its chunked loss)."""
    from qwenft.data import DataBundle
    from qwenft.model import attach_lora, load_model
    from qwenft.train.trainer import make_trainer

    torch.manual_seed(0)
    model, tokenizer = load_model(config, device="cpu")
    peft_model = attach_lora(model, config.lora, gradient_checkpointing=False)
    trainer = make_trainer(config, peft_model, tokenizer, DataBundle(train=[], eval=None, eval_rows={}, stats={}),
                           tmp_path / "checkpoints", "none")
    peft_model.train()
    params = {p.untyped_storage().data_ptr() for p in peft_model.parameters()}
    seen = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params:
            # keep the tensor: a storage freed during the forward could otherwise hand its address to another
            # saved tensor, which would then be counted as the same one (seen once in CI: 92 bytes short)
            seen[key] = (t.untyped_storage().nbytes(), t)
        return t

    ids = torch.randint(5, 300, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    if batch > 1:
        mask[1, -3:] = 0  # real padding: a mask reaches attention
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.compute_loss(peft_model, {"input_ids": ids, "attention_mask": mask, "labels": ids})
    return sum(nbytes for nbytes, _ in seen.values())


@pytest.mark.parametrize("quant,attn,dropout,amp,batch,dtype", [
    ("nf4", "sdpa", 0.05, True, 1, "float32"),   # the QLoRA default: fp32 residual, bf16 autocast
    ("nf4", "sdpa", 0.0, False, 1, "float32"),   # shared LoRA inputs, no autocast
    ("nf4", "sdpa", 0.0, True, 2, "float32"),    # padding: GQA off, float mask per layer
    ("none", "sdpa", 0.05, True, 1, "float32"),  # bf16 copies of fp32 base weights under autocast
    ("none", "eager", 0.05, True, 1, "bfloat16"),
    ("none", "sdpa", 0.0, False, 2, "bfloat16"),
])
def test_activation_formula_equals_autograd_saved_bytes(tmp_path, quant, attn, dropout, amp, batch, dtype):
    seq = 24
    config = compose_config("model=tiny-random", f"quant={quant}", f"model.attn_implementation={attn}",
                            f"lora.lora_dropout={dropout}", "lora.r=8", f"model.dtype={dtype}",
                            f"quant.compute_dtype={'bfloat16' if amp else 'float32'}",
                            f"train.precision={'bf16' if amp else 'fp32'}", "train.gradient_checkpointing=false",
                            f"out_dir={tmp_path}")
    measured = saved_bytes(config, batch, seq, amp, tmp_path)
    arch = resolve_architecture(config.model)
    setup = TrainSetup.from_config(config, device="cpu")
    assert setup.amp is amp
    terms = activation_terms(arch, setup, batch, seq)
    predicted = (terms["layers"] + arch.num_hidden_layers * terms["layer_constants"] + terms["final"]
                 + terms["loss_saved"])  # the loss keeps the [rows, hidden] gradient, no logits
    # 16 bytes: the scalar loss and the rounding of the int64 labels' storage; everything else is exact.
    assert abs(predicted - measured) <= 16, (predicted, measured)


def test_training_memory_shape_of_the_answer():
    arch = arch_of(QWEN7B)
    config = compose_config("model=qwen2.5-7b-instruct", "lora.r=64", "data.max_seq_len=2048", "train.batch_size=1")
    setup = TrainSetup.from_config(config, device="cuda")
    assert setup.nf4 and setup.amp and setup.optim == "paged_adamw_8bit"
    with_gc = training_memory(arch, setup, 1, 2048)
    import dataclasses

    without = training_memory(arch, dataclasses.replace(setup, gradient_checkpointing=False), 1, 2048)
    assert with_gc["peak"] < without["peak"]
    terms = activation_terms(arch, setup, 1, 2048)
    assert with_gc["loss"] == terms["loss_saved"] + terms["loss_transient"]
    assert with_gc["loss"] < 2048 * arch.vocab_size  # less than one byte per logit: no logits tensor
    # Training weights: NF4 projections + fp32 norms/biases (the k-bit preparation) + the embedding and the untied
    # lm_head kept in bf16 under autocast (qwenft.model.lora.prepare_kbit).
    counts = parameter_counts(arch)
    dense = counts["norms"] + counts["attention_bias"]
    bits = 4 + 8 / 64 + 32 / (64 * 256)  # NF4 with double-quantized absmax
    # rel 1e-6: only the per-tensor rounding up of blocks differs from the per-weight average
    projections = bits / 8 * (counts["attention"] + counts["mlp"])
    assert with_gc["weights"] - 4 * dense - 2 * (counts["embeddings"] + counts["lm_head"]) == \
        pytest.approx(projections, rel=1e-6)
    bigger = training_memory(arch, setup, 4, 2048)
    assert bigger["peak"] > with_gc["peak"]


def test_make_plan_never_loads_weights(monkeypatch, tmp_path):
    """The embedded preset with an empty cache: built-in numbers, and no conversion or from_pretrained call."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("plan must not load a model")

    monkeypatch.setenv("QWENFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr("qwenft.model.sources.embedded_model_dir", refuse)
    plan = make_plan(compose_config())
    assert "built-in" in plan["model"]["numbers_from"]
    assert plan["parameters"]["total"] == 630_167_424  # DESIGN: "untied lm_head (630 M params)"
    assert not (tmp_path / "cache").exists()


def test_local_config_and_errors(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(BUILTIN_CONFIGS["Qwen/Qwen2.5-0.5B-Instruct"]))
    plan = make_plan(compose_config("model.source=local", f"model.path={tmp_path}", "model.name=mine"))
    assert plan["model"]["numbers_from"] == str(tmp_path / "config.json")
    assert plan["parameters"]["lm_head"] == 0  # tied
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(QwenftError, match="intermediate_size"):
        make_plan(compose_config("model.source=local", f"model.path={tmp_path}"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(QwenftError, match="model.path='nobody/nothing'"):
        make_plan(compose_config("model.source=hub", "model.path=nobody/nothing"))
    with pytest.raises(ConfigError, match="plan.device"):
        compose_config("plan.device=tpu")


def test_budget_answers_are_consistent():
    small = make_plan(compose_config("model=qwen2.5-7b-instruct", "plan.gpu_gb=8"))
    assert small["budget"]["fits"] is False
    big = make_plan(compose_config("model=qwen2.5-7b-instruct", "plan.gpu_gb=80", "train.batch_size=1"))
    assert big["budget"]["fits"] is True
    rows = big["budget"]["largest_batch"]
    batches = [r["batch_size"] for r in rows]
    assert batches == sorted(batches, reverse=True)  # longer sequences never allow a larger batch
    arch, budget = arch_of(QWEN7B), big["budget"]["usable_bytes"]
    setup = TrainSetup.from_config(compose_config("model=qwen2.5-7b-instruct"), device="cuda")
    for row in rows:
        if row["batch_size"]:
            assert training_memory(arch, setup, row["batch_size"], row["seq_len"])["peak"] <= budget
            assert training_memory(arch, setup, row["batch_size"] + 1, row["seq_len"])["peak"] > budget


def test_evaluation_peak_holds_dense_weights_kv_and_one_chunk_of_logits():
    """Issue 26 item 7: on a CPU the NF4 base is dequantized to the compute dtype, every other weight and LoRA too; the
    perplexity batch costs its body's activations and one chunk of logits, no [batch, window, vocab] tensor."""
    from qwenft.plan.evaluation import CPU_BASELINE_BYTES, chunk_logits_bytes, forward_bytes

    overrides = ("quant=nf4", "quant.compute_dtype=bfloat16", "plan.device=cpu", "data.max_seq_len=768",
                 "eval.max_new_tokens=256", "eval.ppl_sources=[]")
    ev = make_plan(compose_config(*overrides, "eval.batch_size=8"))["evaluation"]
    arch = arch_of("embedded")
    V, H, I = arch.vocab_size, arch.hidden_size, arch.intermediate_size
    assert ev["dequantized"] and ev["dtype_bytes"] == 2 and ev["baseline"] == CPU_BASELINE_BYTES
    assert ev["weights"] == 2 * 630_167_424  # every parameter in bf16
    assert ev["lora_weights"] == 2 * lora_parameter_count(arch, compose_config(*overrides).lora)
    # 8 windows of 768 tokens: residual 2 H + MLP with LoRA on gate/up 4 I per token (bf16), the causal mask, the
    # gathered hidden states, one chunk of 110 rows x vocab (fp32 + its bf16 product)
    n = 8 * 768
    assert forward_bytes(arch, 8, 768, 2, lora_mlp=True) == n * (2 * H * 2 + 4 * I * 2) + 8 * 768 * 768
    assert chunk_logits_bytes(arch, n, 2) == 110 * V * 6
    assert ev["perplexity"] == forward_bytes(arch, 8, 768, 2, True) + n * H * 2 + 110 * V * 6
    assert ev["perplexity"] < n * V * 2 / 4  # the bf16 logits alone were 1.87 GB: now the whole batch is < 1/4
    assert ev["generation"] == (kv_cache_bytes(arch, 8 * (768 + 256), 2) + forward_bytes(arch, 8, 768, 2, True)
                                + 8 * 12 * V)
    assert ev["benchmarks"] == 0
    assert ev["peak"] == ev["baseline"] + ev["weights"] + ev["lora_weights"] + max(ev["generation"], ev["perplexity"])
    bench = make_plan(compose_config(*overrides, "eval.batch_size=8", "eval.benchmarks=[mmlu]"))["evaluation"]
    assert bench["benchmarks"] == (kv_cache_bytes(arch, 9 * 1024, 2) + forward_bytes(arch, 8, 1024, 2, True)
                                   + chunk_logits_bytes(arch, 8, 2))
    largest = max(ev["generation"], ev["perplexity"])
    assert bench["peak"] == ev["peak"] - largest + bench["benchmarks"]  # 1,024-token rows: the largest phase
    double = make_plan(compose_config(*overrides, "eval.batch_size=16"))["evaluation"]
    assert double["perplexity"] - 110 * V * 6 == 2 * (ev["perplexity"] - 110 * V * 6)  # linear in the batch


def test_evaluation_on_cuda_dequantizes_only_when_it_fits():
    big = make_plan(compose_config("model=qwen2.5-7b-instruct", "plan.gpu_gb=80"))["evaluation"]
    small = make_plan(compose_config("model=qwen2.5-7b-instruct", "plan.gpu_gb=16"))["evaluation"]
    arch = arch_of(QWEN7B)
    assert big["dequantized"] and big["weights"] == 2 * parameter_counts(arch)["total"] and big["baseline"] == 0
    assert not small["dequantized"] and small["weights"] < big["weights"] / 2  # NF4 kept: ~5.5 GB of 15 GB
    assert make_plan(compose_config("model=qwen2.5-7b-instruct", "plan.gpu_gb=80",
                                    "quant.dequantize_for_inference=false"))["evaluation"]["dequantized"] is False


def test_plan_cli_writes_json(tmp_path):
    """`plan > file` under WANDB_MODE=offline (issue 27): stdout (a pipe) is exactly the plan, full width (no cell
    cut to `…`, no line wrapped at 80 columns) and without transformers' "[INFO] Running in WANDB offline mode"."""
    import io

    from rich.console import Console

    from qwenft.logfilter import WIDE
    from qwenft.plan.command import render

    out = tmp_path / "plan.json"
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    proc = subprocess.run([sys.executable, "-m", "qwenft", "plan", "model=qwen2.5-7b-instruct", "lora.r=64",
                           f"plan.out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**env, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "57,344 B per token" in proc.stdout
    plan = json.loads(out.read_text())
    assert plan["lora"]["trainable"] == 161_480_704
    assert plan["kv_cache"]["bytes_per_token"] == 57_344
    assert "Evaluation peak on cuda" in proc.stdout and plan["evaluation"]["peak"] > plan["evaluation"]["weights"]
    expected = io.StringIO()
    render(plan, Console(file=expected, width=WIDE))
    assert proc.stdout == expected.getvalue() + f"plan written to {out}\n"
    assert "WANDB" not in proc.stdout and "…" not in proc.stdout
    assert max(len(line) for line in proc.stdout.splitlines()) > 80  # the evaluation line, unwrapped


def test_result_console_width_off_a_terminal(monkeypatch):
    """Not a terminal: COLUMNS when set, else wide; a narrow width folds table cells instead of cutting them."""
    import io

    from qwenft.logfilter import WIDE, result_console
    from qwenft.plan.command import render

    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.delenv("COLUMNS", raising=False)
    assert result_console().width == WIDE
    monkeypatch.setenv("COLUMNS", "60")
    console = result_console()
    assert console.width == 60
    render(make_plan(compose_config("model=qwen2.5-7b-instruct")), console)
    text = sys.stdout.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 60


def test_plan_out_that_is_a_directory_is_one_line(tmp_path, capsys):
    from tests.conftest import run_main

    code, err = run_main(["plan", f"plan.out={tmp_path}"], capsys)
    assert code == 2 and f"{tmp_path}: is a directory" in err, err[-2000:]
    assert "Traceback" not in err


def test_auto_dtypes_and_supervised_fraction():
    from qwenft.runtime import native_bf16

    cuda = TrainSetup.from_config(compose_config("quant=none", "model.dtype=auto"), device="cuda")
    assert cuda.model_bytes == 2 and cuda.amp  # a CUDA device is planned with native bf16
    cpu = TrainSetup.from_config(compose_config("quant.compute_dtype=auto"), device="cpu")
    native = native_bf16("cpu")
    assert cpu.compute_bytes == (2 if native else 4) and cpu.amp is native  # as qwenft.train decides
    arch = arch_of(QWEN7B)
    config = compose_config("model=qwen2.5-7b-instruct", "plan.supervised_fraction=0.25")
    setup = TrainSetup.from_config(config, device="cuda")
    # 2 rows x 999 predicted positions x 0.25 = 499.5 -> 500 supervised rows; their bf16 hidden-state gradient
    assert activation_terms(arch, setup, 2, 1000)["loss_saved"] == 500 * arch.hidden_size * 2
    with pytest.raises(ConfigError, match="plan.supervised_fraction"):
        compose_config("plan.supervised_fraction=0")


def test_planner_and_training_choose_the_same_optimizer_and_precision():
    """One home for the choice (qwenft.runtime): under FSDP the planner plans adamw_torch as training uses it (it
    planned paged 8-bit AdamW there before), and auto precision follows the compute dtype for both."""
    from qwenft.runtime import resolve_optim, resolve_precision

    fsdp = compose_config("model=qwen2.5-7b-instruct", "dist=fsdp")
    assert TrainSetup.from_config(fsdp, device="cuda").optim == "adamw_torch" == resolve_optim("auto", "fsdp", True)
    plain = compose_config("model=qwen2.5-7b-instruct")
    assert TrainSetup.from_config(plain, device="cuda").optim == "paged_adamw_8bit"
    assert resolve_precision("auto", "bfloat16", native=True) == "bf16"
    assert resolve_precision("auto", "bfloat16", native=False) == resolve_precision("auto", "float32", True) == "fp32"
    assert resolve_precision("fp16", "float32", native=False) == "fp16"


def test_result_console_width_when_rich_holds_a_stale_environ(monkeypatch):
    """rich's Console reads COLUMNS from the os.environ it saw when imported (a class attribute); after a library
    replaced os.environ, that copy is stale. The width off a terminal comes from the current os.environ."""
    import io

    from rich.console import Console

    from qwenft.logfilter import result_console

    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(Console, "_environ", {"COLUMNS": "80"})  # what rich saw, not what the process has
    monkeypatch.setenv("COLUMNS", "60")
    assert result_console().width == 60
