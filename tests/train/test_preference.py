"""Preference training (qwenft/train/preference.py): the differentiable answer log-probs, padding-free == padded, the
reference without a second model, KTO's mismatched pairs, and `qwenft train` with a preference objective end to end
(TRL's metric names logged, exact resume after a kill, a second stage from an SFT adapter)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import compose_config, run_train, write_jsonl
from tests.train.conftest import kill_after_checkpoint

PAIRS = [("Name a fruit.", "Short answer: An apple.\nWhy: It grows on trees.", "An apple is a fruit, since it grows."),
         ("What is ice?", "Short answer: Frozen water.\nWhy: Water turns solid at 0 C.",
          "Ice is just water that froze."),
         ("Say hi.", "Short answer: Hi.\nWhy: A greeting.", "Hello there, friend, how are you today?"),
         ("Pick a colour.", "Short answer: Blue.\nWhy: The sky is blue.", "I would go with blue like the sky."),
         ("Count to two.", "Short answer: 1, 2.\nWhy: Two numbers.", "One and then two, that is all."),
         ("Name a pet.", "Short answer: A cat.\nWhy: Cats live indoors.", "Cats make fine pets for many homes.")]


def pair_rows(n: int):
    return [{"instruction": f"{q} ({i})", "input": "", "chosen": c, "rejected": r, "topic": f"t{i % 3}"}
            for i in range(n) for q, c, r in [PAIRS[i % len(PAIRS)]]]


def tiny_peft(seed: int = 0, lora_b: float = 0.0):
    """The tiny-random model with a fresh LoRA adapter (B filled with ``lora_b`` noise, so the adapter acts)."""
    from qwenft.model import attach_lora, load_model

    config = compose_config("model=tiny-random", "quant=none", "lora.lora_dropout=0")  # the same forward each time
    model, tokenizer = load_model(config, device="cpu")
    torch.manual_seed(seed)
    model = attach_lora(model, config.lora, gradient_checkpointing=False)
    if lora_b:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, lora_b)
    return model, tokenizer


def encoded_pairs(tokenizer, n: int = 3):
    from qwenft.preference.data import tokenize_example
    from qwenft.preference.formats import normalise_preference

    out = []
    for row in pair_rows(n):
        item = tokenize_example(normalise_preference(row, "pairs_alpaca", {}), tokenizer, max_seq_len=128)
        out.append({"prompt_ids": item.prompt_ids, "chosen_ids": item.chosen_ids, "rejected_ids": item.rejected_ids})
    return out


def test_token_logprobs_equal_the_full_log_softmax_and_its_gradients():
    from qwenft.train.preference import token_logprobs

    torch.manual_seed(0)
    hidden = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(37, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 37, (13,))
    upstream = torch.randn(13, dtype=torch.float64)
    got = token_logprobs(hidden, weight, targets, chunk=5)  # 13 rows in chunks of 5, 5, 3
    (got.double() * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    want = torch.log_softmax(hidden @ weight.t(), dim=-1).gather(1, targets[:, None]).squeeze(1)
    (want * upstream).sum().backward()
    # the forward runs in fp32 (as the training loss): its values agree to fp32 rounding; gradients likewise
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(grads[0], hidden.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(grads[1], weight.grad, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"expected \[rows, hidden\]"):
        token_logprobs(hidden, weight[:, :4], targets)


def test_padding_free_loss_and_gradients_equal_the_padded_ones():
    """The pairs' sequences in one row with restarting position_ids (transformers derives each sequence's causal
    mask from them) give the padded batch's log-probs, DPO loss and LoRA gradients."""
    from qwenft.preference.loss import preference_loss
    from qwenft.train.preference import PreferenceCollator, reference_adapter, sequence_logprobs

    model, tokenizer = tiny_peft(lora_b=0.02)
    model.train()
    features = encoded_pairs(tokenizer, 3)
    lengths = {len(f["prompt_ids"]) + len(f["chosen_ids"]) for f in features}
    assert len(lengths) > 1  # the padded batch does pad
    results = []
    for padding_free in (False, True):
        batch = PreferenceCollator(tokenizer.pad_token_id, padding_free)(features)
        assert ("position_ids" in batch) is padding_free and ("attention_mask" in batch) is not padding_free
        model.zero_grad(set_to_none=True)
        logps, lengths = sequence_logprobs(model, batch)
        with torch.no_grad(), reference_adapter(model):
            ref, _ = sequence_logprobs(model, batch)
        loss = preference_loss("dpo", logps[:3], logps[3:], ref[:3], ref[3:], beta=0.5).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((logps.detach(), lengths, ref, loss.detach(), grads))
    (lp_a, len_a, ref_a, loss_a, grads_a), (lp_b, len_b, ref_b, loss_b, grads_b) = results
    assert torch.equal(len_a, len_b) and len(lp_a) == 6
    # fp32 attention over the same tokens; only the summation order differs (one row vs padded rows)
    torch.testing.assert_close(lp_a, lp_b, rtol=0, atol=2e-4)
    torch.testing.assert_close(ref_a, ref_b, rtol=0, atol=2e-4)
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=1e-5)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 0
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-3, atol=1e-6)
    assert not torch.allclose(lp_a, ref_a)  # the adapter acts: policy and reference differ


def test_the_reference_is_the_base_or_the_frozen_init_adapter(tmp_path):
    from qwenft.model import attach_lora, load_model
    from qwenft.train.preference import PreferenceCollator, reference_adapter, sequence_logprobs

    model, tokenizer = tiny_peft(lora_b=0.05)
    batch = PreferenceCollator(tokenizer.pad_token_id, True)(encoded_pairs(tokenizer, 2))
    with torch.no_grad():
        with model.disable_adapter():
            base, _ = sequence_logprobs(model, batch)
        with reference_adapter(model):
            ref, _ = sequence_logprobs(model, batch)
        tuned, _ = sequence_logprobs(model, batch)
    torch.testing.assert_close(ref, base, rtol=0, atol=0)
    assert not torch.allclose(tuned, base)
    model.save_pretrained(str(tmp_path / "sft"))

    config = compose_config("model=tiny-random", "quant=none")
    fresh, _ = load_model(config, device="cpu")
    model = attach_lora(fresh, config.lora, gradient_checkpointing=False, init_adapter=str(tmp_path / "sft"),
                        reference=True)
    assert set(model.peft_config) == {"default", "reference"}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n for n in trainable)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a training step's change to the trained copy only
            if "lora_B.default" in name:
                param.add_(0.05)
        with reference_adapter(model):
            ref, _ = sequence_logprobs(model, batch)
        moved, _ = sequence_logprobs(model, batch)
    torch.testing.assert_close(ref, tuned, rtol=0, atol=1e-6)  # the SFT adapter as it was saved
    assert not torch.allclose(moved, tuned)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable  # the switch back re-froze it


def test_kto_batches_pair_each_prompt_with_the_previous_answer_for_the_kl_estimate():
    from qwenft.train.preference import PreferenceCollator

    features = [{"prompt_ids": [1, 2], "completion_ids": [7], "label": True},
                {"prompt_ids": [3], "completion_ids": [8, 9], "label": False},
                {"prompt_ids": [4, 5, 6], "completion_ids": [10], "label": True}]
    collator = PreferenceCollator(0, padding_free=False, unpaired=True)
    assert [ids for ids, _ in collator.sequences(features)] == [
        [1, 2, 7], [3, 8, 9], [4, 5, 6, 10], [1, 2, 10], [3, 7], [4, 5, 6, 8, 9]]
    batch = collator(features)
    assert batch["label"].tolist() == [True, False, True] and int(batch["n_seqs"]) == 6 and int(batch["pairs"]) == 3
    assert batch["labels"][0].tolist() == [-100, -100, 7, -100, -100]  # prompts and padding not supervised
    assert batch["seq_ids"][1].tolist() == [1, 1, 1, -1, -1]


def test_sft_rows_in_a_batch_add_their_nll_weighted_as_pairs(tmp_path):
    """A batch of 2 pairs and 1 SFT row (an SFT source mixed in by weight): loss = (2 * DPO + 1 * NLL) / 3, the NLL
    being transformers' own mean token loss of the SFT row, logged as sft_nll; the tokens counted are both kinds'."""
    from qwenft.data import DataBundle, encode_example
    from qwenft.train.preference import make_preference_trainer

    model, tokenizer = tiny_peft(lora_b=0.02)
    pairs = write_jsonl(tmp_path / "pairs.jsonl", pair_rows(4))
    config = compose_config("model=tiny-random", "quant=none", f"out_dir={tmp_path / 'run'}", "train.objective=dpo",
                            "pref.beta=0.5", "lora.lora_dropout=0",
                            f"data.sources=[{{name: pairs, path: '{pairs}', format: preference, weight: 1.0}}]")
    trainer = make_preference_trainer(config, model, tokenizer, DataBundle(train=[], eval=None, eval_rows={}, stats={}),
                                      tmp_path / "ckpt", "none")
    sft = encode_example(tokenizer, [{"role": "user", "content": "Name a river."},
                                     {"role": "assistant", "content": "The Nile, in Africa."}],
                         max_seq_len=128, train_on="assistant")
    sft_row = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": [], "input_ids": sft["input_ids"],
               "labels": sft["labels"]}
    pair_feats = [{**f, "input_ids": [], "labels": []} for f in encoded_pairs(tokenizer, 2)]
    model.train()
    collate = trainer.data_collator
    mixed = collate([pair_feats[0], sft_row, pair_feats[1]])
    trainer._stored["train"].clear()
    loss = trainer.compute_loss(model, mixed)
    assert trainer._stored["train"]["sft_nll"] and trainer._stored["train"]["rewards/margins"]
    with torch.no_grad():
        dpo = trainer.compute_loss(model, collate(pair_feats))
        ids = torch.tensor([sft["input_ids"]])
        nll = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.tensor([sft["labels"]])).loss
    # fp32 on a CPU: the chunked NLL vs transformers' logits loss differ by summation order only
    torch.testing.assert_close(loss.detach(), (2 * dpo + nll) / 3, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(trainer._stored["train"]["sft_nll"][-1]), nll.float(), rtol=0, atol=1e-5)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora" in n)
    pair_tokens = sum(2 * len(f["prompt_ids"]) + len(f["chosen_ids"]) + len(f["rejected_ids"]) for f in pair_feats)
    assert trainer.batch_tokens(mixed) == pair_tokens + len(sft["input_ids"])
    alone = trainer.compute_loss(model, collate([sft_row]))  # a batch drawn with SFT rows only: their NLL
    torch.testing.assert_close(alone.detach(), nll.float(), rtol=0, atol=1e-5)


def dpo_overrides(tmp_path, out_dir, *extra):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", pair_rows(24))
    return ["model=tiny-random", "quant=none", f"out_dir={out_dir}", "eval.after_train=false",
            f"data.sources=[{{name: pairs, path: '{pairs}', format: preference, weight: 1.0, eval_rows: 4}}]",
            "data.max_seq_len=160", "train.objective=dpo", "train.max_steps=6", "train.save_steps=3",
            "train.batch_size=2", "train.logging_steps=1", "train.eval_steps=3", "train.lr=5e-3",
            "train.warmup_ratio=0.2", "train.gradient_checkpointing=false", "pref.beta=0.5", *extra]


def adapter_weights(run):
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def test_dpo_train_logs_trl_metrics_and_resumes_exactly_after_a_kill(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    result = run_train(dpo_overrides(tmp_path, straight))
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((straight / "metrics.json").read_text())
    curve = metrics["train"]["loss_curve"]
    names = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected")
    assert len(curve) == 6 and all(name in point for point in curve for name in names)
    assert curve[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # log 2: policy == reference at the start
    assert curve[-1]["rewards/margins"] > 0  # it learned something of the pairs at lr 5e-3
    assert metrics["train"]["eval_curve"] and "eval_rewards/accuracies" in metrics["train"]["eval_curve"][0]
    assert "eval_perplexity" not in metrics["train"]["eval_curve"][0]  # DPO's eval loss is no token NLL
    assert metrics["data"]["kind"] == "preference" and metrics["data"]["train_examples"] == 20

    result = run_train(dpo_overrides(tmp_path, killed), patch=kill_after_checkpoint(3))
    assert result.returncode == -9, result.stderr[-3000:]
    result = run_train(dpo_overrides(tmp_path, killed, "train.resume=auto"))
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = adapter_weights(straight), adapter_weights(killed)
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:  # fp32 on CPU, the same batches, RNG and optimizer state: summation-order noise only
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6)


def test_a_second_stage_from_an_sft_adapter_trains_that_adapter_and_saves_it_alone(tmp_path):
    model, _ = tiny_peft(lora_b=0.05)
    model.peft_config["default"].r  # noqa: B018 - the adapter exists
    model.save_pretrained(str(tmp_path / "sft"))
    sft = load_file(str(tmp_path / "sft" / "adapter_model.safetensors"))
    run = tmp_path / "dpo"
    result = run_train(dpo_overrides(tmp_path, run, f"init_adapter={tmp_path / 'sft'}", "train.max_steps=2",
                                     "lora.r=4"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "its LoRA settings hold (r: 4 -> 16; lora_dropout: 0.05 -> 0.0)" in result.stderr + result.stdout
    saved = adapter_weights(run)
    assert saved.keys() == sft.keys()  # the trained adapter only: no reference copy saved beside it
    assert not (run / "adapter" / "reference").exists()
    assert any(not torch.equal(saved[n], sft[n]) for n in saved)  # trained on from the SFT weights
    assert json.loads((run / "adapter" / "adapter_config.json").read_text())["r"] == 16


def test_precomputed_reference_log_probs_train_the_same_adapter(tmp_path):
    """pref.precompute_ref=true computes the reference once before training: the steps must read those values (a
    branch that ignored them left TRL's loss at ln 2 = 0.6931 for good, trl #1962), so the adapter equals the one
    trained with a reference forward in every step. An SFT source is mixed in (weight 0.25): its rows have no
    reference, and their NLL is logged as sft_nll."""
    from tests.conftest import write_rows

    each, once = tmp_path / "each", tmp_path / "once"
    pairs, general = write_jsonl(tmp_path / "pairs.jsonl", pair_rows(24)), write_rows(tmp_path / "general.jsonl", 12)
    sources = (f"data.sources=[{{name: pairs, path: '{pairs}', format: preference, weight: 0.75, eval_rows: 4}}, "
               f"{{name: general, path: '{general}', format: alpaca, weight: 0.25}}]")
    for run, flag in ((each, "false"), (once, "true")):
        result = run_train(dpo_overrides(tmp_path, run, "train.max_steps=4", f"pref.precompute_ref={flag}", sources))
        assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((once / "metrics.json").read_text())
    assert metrics["data"]["sources"]["general"]["used"] == 7 and metrics["data"]["sft_rows"] == 7  # 20 : 6.67, rounded
    curve = metrics["train"]["loss_curve"]
    assert any("sft_nll" in point for point in curve)
    assert curve[-1]["loss"] < 0.69 and curve[-1]["rewards/margins"] > 0  # not stuck at ln 2
    a, b = adapter_weights(each), adapter_weights(once)
    for name in a:  # the same reference values (both computed in eval mode, fp32): summation-order noise only
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6)
