"""The slow export tests on the real 0.5B model, sharing one merge (each merge of the 0.5B is 1-2 minutes on 2 CPU
cores): the float32 merge and its checks (test_export covers the rest on tiny-random), its f16 GGUF run by llama.cpp
and a q8_0 written again (test_gguf_check), and a Q4_K_M with its cost rows (test_quantize). One file, so that a
parallel run (``pytest -n 2``, files kept whole) makes the merge once."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.test_export import read_record
from tests.test_gguf_check import HF_EOS, _llama_again


@pytest.fixture(scope="module")
def embedded_merge(tmp_path_factory, embedded_dir) -> Path:
    """One merge of the 0.5B with a seeded random r=8 adapter, shared by the tests below: float32 (the strict check),
    and where llama-cpp-python is installed also an f16 GGUF run by llama.cpp and a Q4_K_M made from it with its cost
    rows (eval.* small: the adapter has no run config.yaml). Returns the merge's directory; its adapter is
    ``<dir>/../run/adapter``."""
    import importlib.util

    from qwenft.export import merge
    from tests.test_export import make_adapter, merge_config

    root = tmp_path_factory.mktemp("embedded_merge")
    adapter = root / "run" / "adapter"
    make_adapter(adapter, "quant=none", "lora.r=8", "lora.lora_alpha=16", std=0.01, model_args=())
    gguf = ("merge.gguf=f16", "merge.verify_gguf=true", "merge.quantize=[gguf-q4_k_m]",
            "eval.max_new_tokens=8", "eval.max_eval_prompts=3") if importlib.util.find_spec("llama_cpp") else ()
    merge(merge_config(adapter, root / "merged", "merge.dtype=float32", *gguf), device="cpu")
    return root / "merged"


@pytest.mark.slow
def test_embedded_merge(embedded_merge, embedded_dir):
    """The 0.5B model with a 16-bit-base adapter, merged in float32 (the module's shared merge). The NF4 path is
    covered on tiny-random in test_export; on 2 CPU cores its NF4 load and round trip would double this test's time.
    float32: this suite's CPUs lack native bfloat16 GEMMs (bfloat16 is tens of times slower there), and the float32
    check is the strict one (1e-5 of max|z|); bfloat16 merges are covered on tiny-random."""
    from safetensors import safe_open

    out, adapter = embedded_merge, embedded_merge.parent / "run" / "adapter"
    record = read_record(out)
    check = record["verification"]["merge"]
    print(f"0.5B float32 merge: max|delta logit| {check['max_abs_logit_delta']:.3g} "
          f"(tolerance {check['tolerance']:.3g})")
    assert check["passed"] and check["greedy"] == ["equal"] * 3  # greedy text equal on all 3 prompts
    saved = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in saved and saved["dtype"] == "float32"
    assert saved["tie_word_embeddings"] is False  # the embedded model has an untied lm_head
    assert set(json.loads((out / "generation_config.json").read_text())["eos_token_id"]) >= {151645, 151643}
    # The adapter is not a no-op, and it is what was merged: merged q_proj - base q_proj = (alpha/r) B @ A,
    # up to float32 rounding of the sum (2^-24 of |W| per entry).
    from safetensors.torch import load_file

    lora = load_file(adapter / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    delta = 2.0 * lora[f"{prefix}.lora_B.weight"].float() @ lora[f"{prefix}.lora_A.weight"].float()
    with safe_open(str(out / "model.safetensors"), "pt") as merged, \
            safe_open(str(embedded_dir / "model.safetensors"), "pt") as base:
        name = "model.layers.0.self_attn.q_proj.weight"
        diff = merged.get_tensor(name).float() - base.get_tensor(name).float()
    assert float((diff - delta).norm()) < 1e-3 * float(delta.norm())


@pytest.mark.slow
def test_embedded_merge_checked_by_llama_cpp(tmp_path, embedded_merge):
    """The 0.5B model with a random r=8 adapter, merged in float32 with an f16 GGUF run by llama.cpp (the module's
    shared merge); then a q8_0 GGUF of the same merge against the same HF tokens."""
    pytest.importorskip("llama_cpp")
    from qwenft.export.gguf_file import write_gguf
    from qwenft.model import load_tokenizer

    out = embedded_merge
    record = json.loads((out / "qwenft_merge.json").read_text())
    check = record["verification"]["llama_cpp"]
    print(f"0.5B llama.cpp f16: {check['identical']}/"
          f"{check['compared']} identical ({check['seconds']} s)")
    assert check["passed"] and check["identical"] == check["compared"] > 0
    assert check["chat"] == {"eos": 151645, "eot": 151645, "hf_eos": HF_EOS, "problems": []}

    tokenizer = load_tokenizer(str(out))
    start = time.perf_counter()
    write_gguf(out, tmp_path / "merged-q8_0.gguf", "q8_0", tokenizer, "merged")
    verdict = _llama_again(tmp_path / "merged-q8_0.gguf", record, tokenizer, "q8_0")
    print(f"0.5B llama.cpp q8_0: {verdict.summary()} (with writing the file: {time.perf_counter() - start:.0f} s)")
    assert verdict.passed, verdict.problems


@pytest.mark.slow
def test_embedded_model_k_quant(embedded_merge):
    """The 0.5B model with a random r=8 adapter (the module's shared float32 merge): Q4_K_M (llama.cpp's check at
    its threshold), measured; the Modelfile carries the generation_config's sampling values and the template's system
    prompt. (GPTQ and AWQ run end to end on the 128-wide tiny-random in test_quantize; on the 0.5B, GPTQ alone added
    about 3 minutes to CI, over its time budget.)"""
    pytest.importorskip("llama_cpp")
    out = embedded_merge
    record = json.loads((out / "qwenft_merge.json").read_text())
    q4 = record["quantized"]["gguf-q4_k_m"]
    assert {"Q4_K", "Q6_K"} <= set(q4["tensor_types"])  # 896 wide: llama.cpp falls back where 256 does not divide
    modelfile = (out / q4["modelfile"]).read_text()
    assert 'SYSTEM """You are Qwen, created by Alibaba Cloud. You are a helpful assistant."""' in modelfile
    assert 'PARAMETER stop "<|im_end|>"' in modelfile and "PARAMETER repeat_penalty" in modelfile
    costs = record["costs"]["artifacts"]
    for label in ("gguf-f16", "gguf-q4_k_m"):
        print(label, {k: costs[label][k] for k in ("bytes", "agreement", "decode_tokens_per_s")},
              {g: round(v["ratio"], 4) for g, v in costs[label]["perplexity"].items()})
        assert all(v["ratio"] < 1.5 for v in costs[label]["perplexity"].values())
    # the float32 merge: against the f16 GGUF (491 of 1,260 MB on the quickstart's bfloat16 merge)
    assert costs["gguf-q4_k_m"]["bytes"] < 0.45 * costs["gguf-f16"]["bytes"]
