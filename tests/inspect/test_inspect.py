"""`qwenft inspect`: per-layer statistics, attention, next-token distribution, adapter comparison, the CLI."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from qwenft.config import ConfigError, QwenftError
from qwenft.inspect.command import inspect_command
from qwenft.inspect.trace import resolve_layers, token_table, trace_forward
from tests.conftest import ROOT, compose_config

PROMPT = "春天来了，花开了。"


def tiny_config(tmp_path, *overrides):
    return compose_config("model=tiny-random", "quant=none", "model.attn_implementation=eager",
                          "model.tiny.num_hidden_layers=3", f"out_dir={tmp_path}", *overrides, command="inspect")


@pytest.fixture
def tiny(tmp_path):
    from qwenft.model import load_model

    config = tiny_config(tmp_path)
    model, tokenizer = load_model(config, device="cpu")
    model.eval()
    ids = torch.tensor([tokenizer(PROMPT, add_special_tokens=False)["input_ids"]])
    return config, model, tokenizer, ids


def stats(x: torch.Tensor) -> dict:
    """The reference statistics, written independently of qwenft.inspect.trace.tensor_stats."""
    x = x.double()
    return {"rms": x.square().mean().sqrt().item(), "mean": x.mean().item(), "std": x.var(unbiased=False).sqrt().item(),
            "max_abs": x.abs().max().item(), "token_norm": torch.linalg.vector_norm(x, dim=-1).mean().item()}


def close(got: dict, want: dict) -> None:
    for key, value in want.items():
        # rel 1e-9: both sides reduce the same float32 tensor in float64; only summation order may differ
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_layer_statistics_equal_output_hidden_states(tiny):
    config, model, tokenizer, ids = tiny
    layers = list(range(model.config.num_hidden_layers))
    trace, hidden = trace_forward(model, ids, layers)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    hs = [h[0] for h in out.hidden_states]  # [embeddings, layer 0 out, ..., final norm(last layer out)]
    close(trace["embeddings"], stats(hs[0]))
    for record in trace["layers"][:-1]:
        close(record["mlp"], stats(hs[record["layer"] + 1]))
        assert torch.equal(hidden[record["layer"]], hs[record["layer"] + 1].float())
    close(trace["final_norm"], stats(hs[-1]))
    decoder = model.model
    with torch.no_grad():  # after attention = input + self_attn(input_layernorm(input)), from the layer's input
        position_ids = torch.arange(ids.shape[1])[None]
        rope = decoder.rotary_emb(out.hidden_states[0], position_ids)
        mask = torch.full((ids.shape[1], ids.shape[1]), float("-inf")).triu(1)[None, None]
        for record in trace["layers"]:
            layer = decoder.layers[record["layer"]]
            h_in = out.hidden_states[record["layer"]]
            attn, _ = layer.self_attn(layer.input_layernorm(h_in), position_embeddings=rope, attention_mask=mask)
            h_mid = h_in + attn
            close(record["attention"], stats(h_mid[0]))
            h_out = h_mid + layer.mlp(layer.post_attention_layernorm(h_mid))  # the last layer's raw output too
            # 1e-6: the layer recomputed outside the model may round differently in float32
            assert record["mlp"]["rms"] == pytest.approx(stats(h_out[0])["rms"], rel=1e-6)
            assert record["growth"] == pytest.approx(stats(h_out[0])["token_norm"] / stats(h_in[0])["token_norm"],
                                                     rel=1e-6)
            assert record["time_ms"] > 0


def test_attention_entropy_and_positions(tiny):
    config, model, tokenizer, ids = tiny
    trace, _ = trace_forward(model, ids, [0, 2], top_positions=2)
    with torch.no_grad():
        attentions = model(input_ids=ids, output_attentions=True).attentions
    for record in trace["layers"]:
        probs = attentions[record["layer"]][0, :, -1, :].double()  # [heads, seq] of the last token
        entropy = -(probs * probs.log()).sum(-1)
        assert record["attention_entropy"] == pytest.approx(entropy.tolist(), rel=1e-6)  # float32 probabilities
        assert [p["position"] for p in record["top_positions"]] == probs.mean(0).topk(2).indices.tolist()
        assert record["head_top_position"] == probs.argmax(-1).tolist()


def test_next_token_topk_matches_softmax_and_kv_bytes(tiny):
    config, model, tokenizer, ids = tiny
    trace, _ = trace_forward(model, ids, [0], top_k=7)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1].float()
    probs = torch.softmax(logits, dim=-1)
    top = trace["next_token"]["top"]
    assert len(top) == 7 and sum(t["prob"] for t in top) <= 1.0
    assert [t["id"] for t in top] == probs.topk(7).indices.tolist()
    assert [t["prob"] for t in top] == pytest.approx(probs.topk(7).values.tolist(), rel=1e-6)  # float32 softmax
    entropy = -(probs * probs.log()).sum().item()
    assert trace["next_token"]["entropy_nats"] == pytest.approx(entropy, rel=1e-5)
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    # 2 (K, V) x layers x KV heads x head_dim x 4 bytes (float32) per token
    assert trace["kv_cache_bytes"] == 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4 * ids.shape[1]


def test_token_table_bytes_rebuild_the_text(tiny):
    config, model, tokenizer, ids = tiny
    rows = token_table(tokenizer, ids[0].tolist())
    assert b"".join(bytes.fromhex(r["bytes"]) for r in rows).decode("utf-8") == PROMPT
    assert any(r["text"] == "\ufffd" or "\ufffd" in r["text"] for r in rows)  # a piece holding part of a character
    special = token_table(tokenizer, [tokenizer.convert_tokens_to_ids("<|im_end|>")])[0]
    assert special["special"] and special["bytes"] is None


def test_resolve_layers():
    assert resolve_layers(None, 3) == [0, 1, 2]
    assert resolve_layers([-1, 0, 2], 3) == [0, 2]
    with pytest.raises(ConfigError, match=r"inspect\.layers.*layer 3 is out of range"):
        resolve_layers([0, 3], 3)


def make_adapter(config, path, scale: float):
    from qwenft.model import attach_lora, load_model

    model, _ = load_model(config, device="cpu")
    peft_model = attach_lora(model, config.lora, gradient_checkpointing=False)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, scale)  # B starts at zero; a non-zero B makes the adapter change the output
    peft_model.save_pretrained(str(path))


def test_adapter_comparison(tmp_path):
    config = tiny_config(tmp_path, f"inspect.out={tmp_path / 'trace.json'}", "inspect.top_moved=2")
    plain = inspect_command(dataclasses.replace(config, prompt=PROMPT))
    for scale, moved in ((0.0, False), (0.5, True)):
        adapter = tmp_path / f"adapter{scale}"
        make_adapter(config, adapter, scale)
        result = inspect_command(dataclasses.replace(config, prompt=PROMPT, adapter=str(adapter)))
        # the base pass (adapter disabled) is the plain model
        assert result["base"]["next_token"]["top"] == plain["base"]["next_token"]["top"]
        assert [r["mlp"] for r in result["base"]["layers"]] == [r["mlp"] for r in plain["base"]["layers"]]
        comparison = result["comparison"]
        assert len(comparison["moved_most"]) == 2
        if moved:
            assert comparison["kl_tuned_base"] > 1e-6 and comparison["kl_base_tuned"] > 1e-6
            assert max(r["relative_change"] for r in comparison["layers"]) > 1e-3
        else:
            # 1e-6: KL of identical float32 distributions is zero up to rounding
            assert abs(comparison["kl_tuned_base"]) < 1e-6
            assert all(r["relative_change"] == 0.0 for r in comparison["layers"])
    written = json.loads((tmp_path / "trace.json").read_text(encoding="utf-8"))
    assert written["adapter"] == str(tmp_path / "adapter0.5") and written["tuned"]["layers"]
    assert not list(tmp_path.glob(".trace.json.*"))  # the atomic write left no temp file


def test_chat_prompt_carries_the_system_prompt(tmp_path):
    """The traced prompt is the one generate and eval build: data.system_prompt (or the adapter's) as the system
    turn, the template's default without one."""
    config = tiny_config(tmp_path)
    texts = {}
    for system in (None, "Answer as Zed."):
        data = dataclasses.replace(config.data, system_prompt=system)
        result = inspect_command(dataclasses.replace(config, prompt=PROMPT, chat=True, data=data))
        texts[system] = "".join(row["text"] for row in result["tokens"])
    assert "Answer as Zed." in texts["Answer as Zed."] and "Answer as Zed." not in texts[None]


def test_user_errors_stop_before_loading(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr("qwenft.model.lora.load_model", refuse)
    config = tiny_config(tmp_path)
    with pytest.raises(QwenftError, match="prompt"):
        inspect_command(config)
    with pytest.raises(ConfigError, match=r"inspect\.layers=\[0, 7\].*3 layers"):
        inspect_command(dataclasses.replace(config, prompt="x", inspect=dataclasses.replace(config.inspect,
                                                                                            layers=[0, 7])))
    with pytest.raises(QwenftError, match=f"{tmp_path / 'none'} does not exist"):
        inspect_command(dataclasses.replace(config, prompt="x", adapter=str(tmp_path / "none")))
    proc = subprocess.run([sys.executable, "-m", "qwenft", "inspect", "model=tiny-random"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "prompt" in proc.stderr and "Traceback" not in proc.stderr


def test_redirected_tables_keep_every_value(tmp_path):
    """`inspect ... > out` (issue 27): stdout is a pipe, so the tables are printed full width: no cell cut to
    `2.16e…` or a header to `atten…`, every layer's statistics as the JSON trace has them."""
    import os

    out = tmp_path / "trace.json"
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    proc = subprocess.run([sys.executable, "-m", "qwenft", "inspect", "model=tiny-random", "quant=none",
                           "model.attn_implementation=eager", f"prompt={PROMPT}", f"inspect.out={out}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**env, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "…" not in proc.stdout and "WANDB" not in proc.stdout
    trace = json.loads(out.read_text(encoding="utf-8"))
    rows = [line for line in proc.stdout.splitlines() if line.startswith("│")]
    for layer in trace["base"]["layers"]:
        cells = [f"{layer['attention']['rms']:.3g}", f"{layer['mlp']['max_abs']:.3g}", f"x{layer['growth']:.2f}",
                 " ".join(f"{p['position']}({p['weight']:.2f})" for p in layer["top_positions"])]
        assert any(all(cell in row for cell in cells) for row in rows), (cells, proc.stdout)
    assert "attends" in proc.stdout and "H(attn)" in proc.stdout


@pytest.mark.slow  # the real 0.5B and tokenizer: the per-layer trace of a Chinese prompt
def test_inspect_embedded_chinese_prompt(tmp_path, embedded_dir):
    """The real 0.5B model (16-bit, to stay fast on a CPU) on a Chinese prompt: tables printed, JSON written."""
    out = tmp_path / "trace.json"
    proc = subprocess.run([sys.executable, "-m", "qwenft", "inspect", 'prompt="春天"', "quant=none",
                           "model.dtype=bfloat16", "inspect.layers=[0,12,-1]", f"inspect.out={out}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**__import__("os").environ, "COLUMNS": "160"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    for text in ("Tokens of the prompt", "Layers", "Next token", "KV cache for the prompt", "e6 98 a5 e5 a4 a9"):
        assert text in proc.stdout, text
    trace = json.loads(out.read_text(encoding="utf-8"))
    assert [r["layer"] for r in trace["base"]["layers"]] == [0, 12, 23]
    assert any(r["text"] == "春天" for r in trace["tokens"])
    top = trace["base"]["next_token"]["top"]
    assert 0 < sum(t["prob"] for t in top) <= 1.0
    # bf16: 2 (K and V) x 24 layers x 2 KV heads x 64 dims x 2 bytes = 12,288 bytes per token
    assert trace["kv_cache"]["measured_bytes"] == trace["kv_cache"]["formula_bytes"] == 12_288 * len(trace["tokens"])
