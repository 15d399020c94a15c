"""The training loss: chunked vocabulary projection + cross-entropy, mixed precision, train.kernels."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qwenft.config import QwenftError
from qwenft.kernels import chunk_tokens, liger_chunk_tokens, resolve_kernels
from qwenft.train.loss import fused_loss, linear_cross_entropy
from tests.conftest import compose_config
from tests.conftest import QUESTIONS


class OpRecorder(TorchDispatchMode):
    """Records every aten op with its tensor inputs' dtypes and its output shapes (below autocast: the dtypes a
    kernel really receives)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else [out]
        self.ops.append((str(func), [a.dtype for a in args if isinstance(a, torch.Tensor)],
                         [(tuple(o.shape), o.dtype) for o in outs if isinstance(o, torch.Tensor)]))
        return out


def _plain(hidden, weight, targets):
    return torch.nn.functional.cross_entropy(hidden @ weight.t(), targets, reduction="sum")


@pytest.mark.parametrize("chunk", [1, 5, 37, 1000])
def test_linear_cross_entropy_equals_plain_value_and_gradients(chunk):
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = torch.randn(101, 16, requires_grad=True)
    targets = torch.randint(0, 101, (37,))
    ref = _plain(hidden, weight, targets) / 37
    ref.backward()
    ref_h, ref_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ours = linear_cross_entropy(hidden, weight, targets, chunk=chunk) / 37
    ours.backward()
    # fp32 throughout: the same sums in another order (per chunk); 1e-6 relative is a few ulps of a ~10.0 loss
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(hidden.grad, ref_h, rtol=0, atol=1e-6)
    torch.testing.assert_close(weight.grad, ref_w, rtol=0, atol=1e-6)


def test_linear_cross_entropy_under_bf16_autocast_projects_in_bf16():
    torch.manual_seed(0)
    hidden, weight = torch.randn(9, 16), torch.randn(50, 16)
    targets = torch.randint(0, 50, (9,))
    with torch.autocast("cpu", dtype=torch.bfloat16), OpRecorder() as rec:
        ours = linear_cross_entropy(hidden, weight, targets, chunk=4)
        plain = torch.nn.functional.cross_entropy(torch.nn.functional.linear(hidden, weight).float(), targets,
                                                  reduction="sum")
    mms = [op for op in rec.ops if op[0].startswith("aten.mm") and op[2][0][0][-1] == 50]
    assert mms and all(op[1] == [torch.bfloat16, torch.bfloat16] for op in mms)
    # both project in bf16 (8 significant bits) and reduce in fp32: they agree to bf16 rounding of the logits
    torch.testing.assert_close(ours, plain, rtol=2e-3, atol=0)
    assert ours != _plain(hidden, weight, targets)  # not the fp32 value


def test_linear_cross_entropy_empty_and_bad_shapes():
    hidden = torch.zeros(0, 8, requires_grad=True)
    loss = linear_cross_entropy(hidden, torch.randn(5, 8), torch.zeros(0, dtype=torch.long), chunk=3)
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad.shape == (0, 8)
    with pytest.raises(ValueError, match="expected"):
        linear_cross_entropy(torch.randn(3, 8), torch.randn(5, 7), torch.zeros(3, dtype=torch.long), chunk=3)
    with pytest.raises(ValueError, match="chunk=0"):
        linear_cross_entropy(torch.randn(3, 8), torch.randn(5, 8), torch.zeros(3, dtype=torch.long), chunk=0)
    assert chunk_tokens(151936) == 110  # 64 MiB of fp32 logits for Qwen2.5's vocabulary
    # Liger 0.8: next_power_of_2(ceil(2048 / ceil(152064 / 3584))) = next_power_of_2(48) = 64 for the 7B at 2048 tokens
    assert liger_chunk_tokens(2048, 152064, 3584) == 64 and liger_chunk_tokens(5, 512, 64) == 1
    assert liger_chunk_tokens(3, 100, 100) == 3 and liger_chunk_tokens(0, 100, 10) == 0


def _trainer(tmp_path, *overrides):
    from qwenft.data import DataCollator, encode_example
    from qwenft.model import attach_lora, load_model
    from qwenft.train.trainer import make_trainer
    from qwenft.data import DataBundle

    config = compose_config("model=tiny-random", f"out_dir={tmp_path}", "lora.lora_dropout=0.0",
                            "train.gradient_checkpointing=false", *overrides)
    model, tokenizer = load_model(config, device="cpu")
    torch.manual_seed(0)
    model = attach_lora(model, config.lora, gradient_checkpointing=False)
    for name, param in model.named_parameters():  # LoRA B starts at zero: make the adapter do something
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    rows = [encode_example(tokenizer, [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                           max_seq_len=128, train_on="assistant") for q, a in QUESTIONS[:3]]
    batch = DataCollator(tokenizer)([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
    bundle = DataBundle(train=[], eval=None, eval_rows={}, stats={})
    trainer = make_trainer(config, model, tokenizer, bundle, tmp_path / "ckpt", "none")
    return trainer, model, dict(batch), config


def _lora_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def test_compute_loss_gradients_equal_the_model_loss_and_hold_no_full_logits(tmp_path, monkeypatch):
    """fp32, 16-bit base: the chunked loss gives transformers' value and LoRA gradients, and with 4-token chunks no
    tensor of more than 4 x vocab values is created in forward or backward."""
    import qwenft.kernels

    trainer, model, batch, _ = _trainer(tmp_path, "quant=none", "train.precision=fp32")
    vocab = model.get_base_model().lm_head.weight.shape[0]
    reference = model(**batch).loss
    reference.backward()
    expected = _lora_grads(model)
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(qwenft.kernels, "CHUNK_BYTES", 4 * 4 * vocab)  # 4 tokens a chunk
    with OpRecorder() as rec:
        ours = trainer.compute_loss(model, dict(batch))
        ours.backward()
    got = _lora_grads(model)
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=0)  # fp32, same sums in another order
    assert expected.keys() == got.keys() and len(got) == 2 * 7 * 2  # A and B of 7 targets in 2 layers
    for name in expected:  # fp32; gradients of size ~1e-2..1e0 agree to ~1e-7: 1e-5 leaves room, not a pass-all
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-5, msg=name)
    supervised = int((batch["labels"][:, 1:] != -100).sum())
    assert supervised > 8  # several chunks ran
    biggest = max(s[0] for op in rec.ops if op[0] != "aten.t.default"  # lm_head.weight.t(): [hidden, vocab]
                  for s, _ in op[2] if len(s) == 2 and s[-1] == vocab)
    assert biggest == 4, f"a [{biggest}, {vocab}] logits tensor was created"
    assert not any(len(s) == 3 and s[-1] == vocab for op in rec.ops for s, _ in op[2])  # no [batch, seq, vocab]


@pytest.mark.parametrize("quant", ["nf4", "none"])
def test_bf16_precision_runs_lora_attention_and_vocabulary_in_bf16(tmp_path, quant):
    """train.precision=bf16 on a CPU: the first-step loss differs from fp32's, and the LoRA output, the vocabulary
    projection and SDPA's q/k/v are bf16 (the loss used to run outside autocast, all fp32)."""
    losses = {}
    for precision in ("fp32", "bf16"):
        trainer, model, batch, _ = _trainer(tmp_path / precision, f"quant={quant}", f"train.precision={precision}")
        seen = {}
        lora_b = model.get_base_model().model.layers[0].self_attn.q_proj.lora_B["default"]
        handle = lora_b.register_forward_hook(lambda m, i, o: seen.update(lora_out=o.dtype))  # returns None
        vocab = model.get_base_model().lm_head.weight.shape[0]
        with OpRecorder() as rec:
            losses[precision] = trainer.compute_loss(model, dict(batch)).item()
        handle.remove()
        compute = torch.bfloat16 if precision == "bf16" else torch.float32
        assert seen["lora_out"] == compute
        vocab_mms = [op for op in rec.ops if op[0].startswith("aten.mm") and op[2][0][0][-1] == vocab]
        assert vocab_mms and all(op[1] == [compute, compute] for op in vocab_mms), vocab_mms[:1]
        attention = [op for op in rec.ops if "scaled_dot_product" in op[0]]
        assert attention and all(op[1][:3] == [compute] * 3 for op in attention), attention[:1]
        assert not any(op[0].startswith(("aten.bmm", "aten._softmax")) for op in rec.ops)  # no math fallback
    assert losses["bf16"] != losses["fp32"]
    # bf16 GEMMs (8-bit mantissa) on a random tiny model: the loss moves by ~1e-4 relative, not more than 1e-2
    assert abs(losses["bf16"] - losses["fp32"]) < 1e-2 * losses["fp32"]


def test_kernels_resolution_and_refusals():
    assert resolve_kernels("auto", cuda=False, installed=True) == "none"
    assert resolve_kernels("auto", cuda=True, installed=False) == "none"
    assert resolve_kernels("auto", cuda=True, installed=True) == "liger"
    assert resolve_kernels("none", cuda=True, installed=True) == "none"
    assert resolve_kernels("liger", cuda=True, installed=True) == "liger"
    with pytest.raises(QwenftError, match="needs a CUDA GPU"):
        resolve_kernels("liger", cuda=False, installed=True)
    with pytest.raises(QwenftError, match="liger-kernel package"):
        resolve_kernels("liger", cuda=True, installed=False)


def test_liger_path_calls_liger_public_api(monkeypatch):
    """With train.kernels=liger, the layers are patched and the loss computed through liger_kernel.transformers'
    public names (a stand-in module records the calls: Liger itself needs CUDA and Triton)."""
    from qwenft.kernels import apply_kernels

    calls = {}

    class FakeLoss:
        def __init__(self, **kwargs):
            calls["loss_kwargs"] = kwargs

        def __call__(self, weight, hidden, targets):
            calls["loss_args"] = (weight.dtype, hidden.dtype, tuple(hidden.shape))
            return _plain(hidden.float(), weight.float(), targets)

    fake = types.ModuleType("liger_kernel.transformers")
    fake.apply_liger_kernel_to_qwen2 = lambda **kwargs: calls.setdefault("apply", kwargs)
    fake.LigerFusedLinearCrossEntropyLoss = FakeLoss
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    model = object()
    apply_kernels(model, "liger")
    assert calls["apply"] == {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                              "fused_linear_cross_entropy": False, "model": model}
    hidden, weight, targets = torch.randn(6, 8), torch.randn(20, 8), torch.randint(0, 20, (6,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused_loss(hidden, weight, targets, "liger")
    assert calls["loss_kwargs"] == {"reduction": "sum"}
    assert calls["loss_args"] == (torch.bfloat16, torch.bfloat16, (6, 8))  # cast once to the autocast dtype
    calls.clear()
    apply_kernels(model, "none")
    assert calls == {}


def test_liger_on_a_cpu_is_refused_before_loading(tmp_path, capsys):
    from tests.conftest import run_main

    code, err = run_main(["train", "model=tiny-random", "train.kernels=liger", f"out_dir={tmp_path / 'run'}"], capsys)
    assert code == 2
    assert "train.kernels=liger needs a CUDA GPU" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_untied_head_is_kept_in_the_autocast_dtype_and_a_tied_one_is_not(tmp_path):
    """Under bf16 precision make_trainer keeps an untied frozen lm_head in bf16 (autocast projects in bf16 anyway);
    fp32 precision and a tied lm_head (it is the input embedding) are left alone."""
    trainer, model, batch, _ = _trainer(tmp_path / "bf16", "quant=none", "train.precision=bf16")
    head = model.get_base_model().lm_head
    assert head.weight.dtype == torch.bfloat16
    assert model.get_base_model().model.embed_tokens.weight.dtype == torch.float32
    trainer, model, batch, _ = _trainer(tmp_path / "fp32", "quant=none", "train.precision=fp32")
    assert model.get_base_model().lm_head.weight.dtype == torch.float32
    trainer, model, batch, _ = _trainer(tmp_path / "tied", "quant=none", "train.precision=bf16",
                                        "model.tiny.tie_word_embeddings=true")
    base = model.get_base_model()
    assert base.lm_head.weight is base.model.embed_tokens.weight and base.lm_head.weight.dtype == torch.float32
    assert torch.isfinite(trainer.compute_loss(model, dict(batch)))


@pytest.mark.slow  # the real 0.5B: the chunked loss on real weights
def test_chunked_loss_equals_the_model_loss_on_the_embedded_model(tmp_path, embedded_dir, monkeypatch):
    """The real Qwen2.5 vocabulary (151,936 rows), fp32, 8-token chunks: QwenftTrainer.compute_loss against the exact
    (float64) value of the loss of the same hidden states, and against transformers' fp32 loss and LoRA gradients."""
    import qwenft.kernels
    from qwenft.data import DataBundle, DataCollator, encode_example
    from qwenft.model import attach_lora, load_model
    from qwenft.train.trainer import make_trainer

    config = compose_config("quant=none", "model.dtype=float32", "train.precision=fp32", "lora.lora_dropout=0.0",
                            "lora.r=4", f"out_dir={tmp_path}")
    model, tokenizer = load_model(config, device="cpu")
    torch.manual_seed(0)
    model = attach_lora(model, config.lora, gradient_checkpointing=False)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.01)
    rows = [encode_example(tokenizer, [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                           max_seq_len=128, train_on="assistant") for q, a in QUESTIONS[:2]]
    batch = dict(DataCollator(tokenizer)([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows]))
    assert int((batch["labels"][:, 1:] != -100).sum()) > 3 * 8  # several chunks
    trainer = make_trainer(config, model, tokenizer, DataBundle(train=[], eval=None, eval_rows={}, stats={}),
                           tmp_path / "ckpt", "none")
    monkeypatch.setattr(qwenft.kernels, "CHUNK_BYTES", 8 * 4 * 151936)  # 8 tokens a chunk
    transformers_loss = model(**batch).loss
    transformers_loss.backward()
    expected = _lora_grads(model)
    model.zero_grad(set_to_none=True)
    ours = trainer.compute_loss(model, dict(batch))
    ours.backward()
    got = _lora_grads(model)
    assert len(got) == len(expected) == 24 * 7 * 2
    base = model.get_base_model()
    with torch.no_grad():  # the exact value of what both compute: float64 projection and softmax of the same hidden
        hidden = base.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        targets = batch["labels"][:, 1:]
        keep = targets != -100
        exact = torch.nn.functional.cross_entropy(hidden[:, :-1][keep].double() @ base.lm_head.weight.double().t(),
                                                  targets[keep])
    # Loss: ours is 3e-7 from the exact value (measured); torch's fp32 cross-entropy over 151,936 logits rounds its
    # log-sum-exp to 2.7e-5 of the loss (float64 over the same fp32 logits agrees with ours).
    assert abs(ours.item() / exact.item() - 1) < 1e-6
    torch.testing.assert_close(ours, transformers_loss, rtol=1e-4, atol=0)
    # Gradients: the hidden-state gradients of the two losses differ by fp32 rounding (~5e-5 of their size; MKL's
    # GEMM for [25, 151936] x [151936, 896] accumulates differently from transformers' [120, ...]), which 24 layers
    # of backward grow to at most 1.1e-3 of a tensor's largest LoRA gradient (measured). 3e-3 allows that; a wrong
    # mask, shift or scale is off by the gradients' own size.
    for name in expected:
        worst = float((got[name] - expected[name]).abs().max())
        assert worst <= 3e-3 * float(expected[name].abs().max()), (name, worst)


@pytest.mark.parametrize("tied", [True, False])
def test_qlora_keeps_the_embedding_16bit_with_peft_preparations_loss_and_gradients(tmp_path, tied):
    """QLoRA under bf16 autocast (qwenft.model.lora.prepare_kbit): the embedding (and a tied lm_head) stays bf16
    where peft's prepare_model_for_kbit_training makes it fp32, the residual stream is fp32 in both (the embedding's
    output cast), and the loss and every LoRA gradient equal those of peft's preparation bit for bit: the fp32 table
    peft makes holds the same bf16 values, and autocast projects onto the vocabulary in bf16 either way. Under fp32
    precision the embedding is cast as peft casts it. end_training removes the cast."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, prepare_model_for_kbit_training

    from qwenft.data import DataBundle, DataCollator, encode_example
    from qwenft.model import attach_lora, end_training, load_model
    from qwenft.model.lora import EMBEDDING_CAST
    from qwenft.train.trainer import autocast_dtype, make_trainer

    config = compose_config("model=tiny-random", f"out_dir={tmp_path}", "lora.lora_dropout=0.0", "quant=nf4",
                            "quant.compute_dtype=bfloat16", "train.precision=bf16",
                            "train.gradient_checkpointing=false", f"model.tiny.tie_word_embeddings={str(tied).lower()}")
    assert autocast_dtype(config, "cpu") == torch.bfloat16
    runs = {}
    for arm in ("peft", "qwenft"):
        model, tokenizer = load_model(config, device="cpu")
        assert getattr(model, "is_loaded_in_4bit", False)
        torch.manual_seed(0)
        if arm == "peft":
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
            lcfg = config.lora
            model = get_peft_model(model, PeftLoraConfig(r=lcfg.r, lora_alpha=lcfg.lora_alpha, lora_dropout=0.0,
                                                         target_modules=list(lcfg.target_modules),
                                                         task_type="CAUSAL_LM"))
        else:
            model = attach_lora(model, config.lora, gradient_checkpointing=False, autocast_dtype=torch.bfloat16)
        for name, param in model.named_parameters():  # LoRA B starts at zero: make the adapter do something
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.05)
        rows = [encode_example(tokenizer, [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                               max_seq_len=128, train_on="assistant") for q, a in QUESTIONS[:3]]
        batch = dict(DataCollator(tokenizer)([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows]))
        trainer = make_trainer(config, model, tokenizer, DataBundle(train=[], eval=None, eval_rows={}, stats={}),
                               tmp_path / arm, "none")
        base = model.get_base_model()
        seen = {}
        hook = base.model.layers[0].register_forward_pre_hook(lambda m, a: seen.update(dtype=a[0].dtype))
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(model, dict(batch))
        loss.backward()
        hook.remove()
        runs[arm] = (loss.detach(), _lora_grads(model), base, seen["dtype"])
    (peft_loss, peft_grads, peft_base, peft_stream), (loss, grads, base, stream) = runs["peft"], runs["qwenft"]
    assert peft_base.model.embed_tokens.weight.dtype == torch.float32
    assert base.model.embed_tokens.weight.dtype == torch.bfloat16
    assert base.lm_head.weight.dtype == torch.bfloat16 and peft_base.lm_head.weight.dtype == (
        torch.float32 if tied else torch.bfloat16)  # peft's untied head goes back to bf16 in make_trainer
    assert base.model.norm.weight.dtype == torch.float32  # norms fp32, as peft casts them
    assert stream == peft_stream == torch.float32
    assert torch.equal(loss, peft_loss)
    assert grads.keys() == peft_grads.keys() and len(grads) > 0
    assert all(torch.equal(grads[name], peft_grads[name]) for name in grads)
    assert end_training(base) and EMBEDDING_CAST not in base.__dict__ and not end_training(base)
    ids = torch.tensor([[1, 2, 3]])
    assert base.model.embed_tokens(ids).dtype == torch.bfloat16  # the cast is gone: eval runs as `qwenft eval`

    model, _ = load_model(config, device="cpu")
    model = attach_lora(model, config.lora, gradient_checkpointing=False, autocast_dtype=None)  # fp32 precision
    assert model.get_base_model().model.embed_tokens.weight.dtype == torch.float32
    assert EMBEDDING_CAST not in model.get_base_model().__dict__
