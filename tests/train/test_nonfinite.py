"""Non-finite logits are refused by the sampler (``generate``, ``eval`` and ``serve`` all run it) with an error naming
the step and the dtype, instead of the argmax of NaN (token 0: the "!!!!" answers of QwenLM/Qwen3#761)."""

from __future__ import annotations

import pytest
import torch

from qwenft.generation import Sampler
from qwenft.generation.sampling import NonFiniteLogits, check_finite
from qwenft.model import load_model
from tests.conftest import compose_config


@pytest.fixture(scope="module")
def tiny():
    config = compose_config("model=tiny-random", "quant=none", command="generate")
    model, tokenizer = load_model(config, device="cpu")
    return model.eval(), tokenizer


def poison(model, at_call: int, value: float):
    """Make the output layer's ``at_call``-th forward (0: the prefill) return ``value`` in row 0; returns the hook."""
    calls = {"n": 0}

    def hook(module, args, output):
        calls["n"] += 1
        if calls["n"] - 1 == at_call:
            output = output.clone()
            output[0, -1, 3] = value
        return output

    return model.get_output_embeddings().register_forward_hook(hook)


@pytest.mark.parametrize("at_call,value,kind,where", [(0, float("nan"), "NaN", "prefill (step 0)"),
                                                      (2, float("inf"), "inf", "decode step 2")])
def test_sampler_refuses_non_finite_logits_naming_step_and_dtype(tiny, at_call, value, kind, where):
    model, tokenizer = tiny
    handle = poison(model, at_call, value)
    try:
        with pytest.raises(NonFiniteLogits) as caught:
            Sampler(model, tokenizer).generate(["Hello there"], max_new_tokens=6, do_sample=False, min_new_tokens=6)
    finally:
        handle.remove()
    message = str(caught.value)
    assert f"{kind} logits at {where}" in message and "float32" in message and "row(s) [0]" in message
    # the same model, unpoisoned, samples as before: the check has no false alarm
    out = Sampler(model, tokenizer).generate(["Hello there"], max_new_tokens=6, do_sample=False)
    assert out.sequences[0].token_ids


def test_the_evaluations_batches_refuse_them_too(tiny):
    """eval's path (generate_many over batches): the error comes out of the batch, not a row of token 0."""
    from qwenft.generation.batches import generate_many

    model, tokenizer = tiny
    prompts = [tokenizer("a b c")["input_ids"], tokenizer("d e")["input_ids"]]
    handle = poison(model, 1, float("nan"))
    try:
        with pytest.raises(NonFiniteLogits, match="decode step 1"):
            generate_many(Sampler(model, tokenizer), prompts, 2, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    finally:
        handle.remove()


def test_fp16_overflow_says_what_to_do_and_finished_rows_are_ignored():
    logits = torch.zeros(2, 5)
    logits[1, 2] = float("inf")
    with pytest.raises(NonFiniteLogits, match=r"computed in float16; .*bfloat16"):
        check_finite(logits, torch.tensor([True, True]), 4, torch.float16)
    check_finite(logits, torch.tensor([True, False]), 4, torch.float16)  # row 1 has finished: not sampled


def test_generate_command_prints_one_line(tmp_path, monkeypatch, capsys):
    """``qwenft generate`` on a model whose logits overflow: one error line (exit 2), no traceback (in this process,
    the model loader patched to poison the logits)."""
    import qwenft.model.lora as inference
    from qwenft.model import load
    from tests.conftest import qwenft_in_process

    original = load.load_model

    def poisoned(*args, **kwargs):
        model, tokenizer = original(*args, **kwargs)
        model.get_output_embeddings().register_forward_hook(lambda module, inputs, out: out * float("nan"))
        return model, tokenizer

    monkeypatch.setattr(load, "load_model", poisoned)
    monkeypatch.setattr(inference, "load_model", poisoned)
    monkeypatch.chdir(tmp_path)
    proc = qwenft_in_process(capsys, "generate", "model=tiny-random", "quant=none", "prompt=hi",
                             "generate.max_new_tokens=3")
    lines = [line for line in proc.stderr.splitlines() if line.startswith("qwenft: error:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "NaN logits at prefill (step 0)" in lines[0] and "float32" in lines[0] and "Traceback" not in proc.stderr
