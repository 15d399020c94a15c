"""Long context with YaRN end to end (issue 47): a tiny Qwen2 whose original window is 64 positions is trained past
that window with ``model.rope_scaling`` yarn, factor 4 (``data.max_seq_len=256``, packing, gradient checkpointing,
the chunked loss), its perplexity is scored on a text longer than the window, it is merged with an f16 GGUF, and
llama.cpp's logits at positions past the window match transformers' only when the GGUF carries the rope keys.

The tiny base is tiny-random with ``max_position_embeddings=64`` and its q/k projections multiplied by
:data:`SHARPEN`: a random init's queries and keys are so small that attention is nearly uniform and the positions
hardly change the output (measured on the plain tiny-random: llama.cpp without the rope keys only 3.3e-3 off
transformers, with them 2.9e-4: within the f16 tolerance either way); sharper attention makes the rotation decide it.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import compose_config, run_train
from tests.export.conftest import merge_config

WINDOW, FACTOR = 64, 4.0
ROPE = f"model.rope_scaling={{rope_type: yarn, factor: {FACTOR}, original_max_position_embeddings: {WINDOW}}}"
SHARPEN = 8.0  # q and k x 8: attention scores x 64
COMPARED = 250  # tokens fed to both runtimes: positions 0..249, of which 64..249 lie past the original window


def _long_text(rng: random.Random) -> str:
    """About 250 tiny-tokenizer tokens of the tokenizer's own corpus sentences in a random order."""
    from qwenft.model.tiny import _CORPUS

    return " ".join(rng.choice(_CORPUS[:6]) for _ in range(11))


def _sharp_base(root: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qwenft.config import TinyModelConfig
    from qwenft.model.tiny import tiny_model_dir

    source = tiny_model_dir(TinyModelConfig(max_position_embeddings=WINDOW))
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(SHARPEN)
            layer.self_attn.k_proj.weight.mul_(SHARPEN)
    model.save_pretrained(root / "base")
    AutoTokenizer.from_pretrained(source).save_pretrained(root / "base")
    return root / "base"


@pytest.fixture(scope="module")
def yarn_run(tmp_path_factory) -> Path:
    """``python -m qwenft train`` on the sharp 64-window base with YaRN x4: 12 texts of ~250 tokens (2 held out),
    packed into rows of 256, gradient checkpointing on, 8 steps; after training qwenft's evaluation scores the
    perplexity of one more ~220-token text in 256-token windows. Returns the run directory."""
    root = tmp_path_factory.mktemp("yarn")
    base = _sharp_base(root)
    rng = random.Random(0)
    rows = root / "long.jsonl"
    rows.write_text("".join(json.dumps({"text": _long_text(rng)}) + "\n" for _ in range(12)), encoding="utf-8")
    (root / "long.txt").write_text(_long_text(rng), encoding="utf-8")
    result = run_train(["model=tiny-random", "model.source=local", f"model.path={base}", "quant=none", ROPE,
                        f"out_dir={root / 'run'}", "logger=none",
                        f"data.sources=[{{name: long, path: '{rows}', format: text, weight: 1.0, eval_rows: 2}}]",
                        "data.max_seq_len=256", "data.packing=true", "train.gradient_checkpointing=true",
                        "train.kernels=none", "train.max_steps=8", "train.save_steps=8", "train.batch_size=2",
                        "train.lr=5e-3", f"eval.ppl_sources=[{root / 'long.txt'}]", "eval.ppl_window=256",
                        "eval.ppl_stride=128", "eval.max_eval_prompts=2", "eval.max_new_tokens=4"])
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "run"


@pytest.fixture(scope="module")
def yarn_merge(yarn_run) -> Path:
    """The run's adapter merged in float32 with an f16 GGUF (the llama.cpp comparison below is this module's own
    check, so the merge's greedy one is off). Returns the merged directory."""
    from qwenft.export.merge import merge

    out = yarn_run.parent / "merged"
    merge(merge_config(yarn_run / "adapter", out, "merge.dtype=float32", "merge.gguf=f16",
                       "merge.verify_gguf=false"), device="cpu")
    return out


def test_tiny_model_trains_past_its_window_with_yarn_and_perplexity_is_scored_there(yarn_run):
    meta = json.loads((yarn_run / "adapter" / "qwenft.json").read_text())
    rope = {k: v for k, v in meta["model"]["rope_scaling"].items() if v is not None}
    assert rope == {"rope_type": "yarn", "factor": FACTOR, "original_max_position_embeddings": WINDOW}
    metrics = json.loads((yarn_run / "metrics.json").read_text())
    assert metrics["train"]["global_step"] == 8 and np.isfinite(metrics["train"]["final_loss"])
    # trained on packed rows of 256 whose examples run past the window (positions restart at 0 in each example)
    assert metrics["data"]["packing"] and metrics["data"]["max_seq_len"] == 256
    assert metrics["data"]["tokens"]["p50"] > 3 * WINDOW
    ppl = metrics["eval"]["perplexity"]["text:long.txt"]
    print(f"perplexity of a {ppl['base']['tokens']}-token text (window {WINDOW}, YaRN x{FACTOR:g}): base "
          f"{ppl['base']['perplexity']:.1f}, tuned {ppl['tuned']['perplexity']:.1f}")
    # every position but the first is scored, most of them past the original window of 64
    assert ppl["base"]["tokens"] == ppl["tuned"]["tokens"] > 3 * WINDOW
    assert np.isfinite(ppl["tuned"]["perplexity"]) and ppl["tuned"]["perplexity"] < ppl["base"]["perplexity"]


def _transformers_logits(model_dir: Path, ids) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


LLAMA_LOGITS = r'''
import json, sys
import numpy as np
import llama_cpp
ids = json.loads(sys.argv[2])
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, n_threads=2, n_gpu_layers=0, logits_all=True, verbose=False)
llm.eval(ids)
np.save(sys.argv[3], np.asarray(llm.scores[:len(ids)], dtype=np.float32))
llm.close()
'''


def _llama_logits(gguf_path: Path, ids, work: Path) -> np.ndarray:
    """llama.cpp's logits ``[len(ids), vocab]`` for ``ids`` in one batch (a child process, as qwenft runs it)."""
    out = work / f"{gguf_path.stem}.npy"
    subprocess.run([sys.executable, "-c", LLAMA_LOGITS, str(gguf_path), json.dumps(ids), str(out)], check=True,
                   capture_output=True, timeout=300)
    return np.load(out)


def test_yarn_gguf_in_llama_cpp_matches_transformers_past_the_window(yarn_merge, tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp")
    from gguf import GGUFReader

    from qwenft.export import gguf_file
    from qwenft.export.verify import GGUF_RTOL
    from qwenft.model import load_tokenizer

    gguf_path = yarn_merge / "merged-f16.gguf"
    fields = {k: f.contents() for k, f in GGUFReader(str(gguf_path)).fields.items() if k.startswith("qwen2.")}
    assert fields["qwen2.rope.scaling.type"] == "yarn" and fields["qwen2.rope.scaling.factor"] == FACTOR
    assert fields["qwen2.rope.scaling.original_context_length"] == WINDOW
    assert fields["qwen2.context_length"] == WINDOW * FACTOR  # llama.cpp's n_ctx_train: the scaled context

    tokenizer = load_tokenizer(str(yarn_merge))
    text = " ".join(_long_text(random.Random(7)) for _ in range(2))
    ids = tokenizer(text, add_special_tokens=False).input_ids[:COMPARED]
    assert len(ids) == COMPARED
    reference = _transformers_logits(yarn_merge, ids)
    # The merge's own GGUF check (qwenft.export.verify.GGUF_RTOL): float32 logits against f16 weights, 2^-8 of
    # max(1, max|z|) for the 11 significant bits an f16 weight keeps, plus float32's 1e-5.
    tolerance = GGUF_RTOL[("f16", "float32")] * max(1.0, float(np.abs(reference).max()))
    past = slice(WINDOW, COMPARED)

    with_keys = np.abs(_llama_logits(gguf_path, ids, tmp_path) - reference)
    monkeypatch.setattr(gguf_file, "rope_scaling_keys", lambda config, arch="qwen2": {})
    bare = tmp_path / "no-rope-keys.gguf"
    gguf_file.write_gguf(yarn_merge, bare, "f16", tokenizer, "merged")
    without_keys = np.abs(_llama_logits(bare, ids, tmp_path) - reference)
    print(f"llama.cpp vs transformers, max |delta logit| at positions {WINDOW}..{COMPARED - 1}: with the rope keys "
          f"{with_keys[past].max():.3g}, without {without_keys[past].max():.3g} (tolerance {tolerance:.3g}; "
          f"within the window: {with_keys[:WINDOW].max():.3g} and {without_keys[:WINDOW].max():.3g})")
    assert with_keys[past].max() <= tolerance
    assert with_keys.max() <= tolerance
    assert without_keys[past].max() > 10 * tolerance  # the keys are what makes llama.cpp agree


def test_yarn_merge_writes_the_scaling_for_every_reader(yarn_merge):
    from transformers import AutoConfig

    config = json.loads((yarn_merge / "config.json").read_text())
    expected = {"rope_type": "yarn", "factor": FACTOR, "original_max_position_embeddings": WINDOW,
                "rope_theta": 1e6}
    assert config["rope_parameters"] == config["rope_scaling"] == expected
    assert config["max_position_embeddings"] == WINDOW * FACTOR
    assert AutoConfig.from_pretrained(yarn_merge).rope_parameters == expected  # transformers 5 reads both keys
    from qwenft.doctor.command import diagnose

    assert diagnose(yarn_merge).codes() == []  # rope-theta-lost among them: the RoPE base survives both keys

    serve = json.loads((yarn_merge / "qwenft_merge.json").read_text())["serve"]
    assert serve["merged"] == f"vllm serve {yarn_merge} --max-model-len 256"
    assert serve["gguf"] == f"llama-server -m {yarn_merge / 'merged-f16.gguf'}"  # the GGUF carries the keys
    overrides = serve["adapter"].split("--hf-overrides ")[1].split(" --max-model-len ")
    assert json.loads(overrides[0].strip("'")) == {"rope_scaling": expected} and overrides[1] == "256"
    card = (yarn_merge / "README.md").read_text()
    assert "YaRN, factor 4, over the base's original 64-token window: a context of 256 tokens" in card
    assert "static YaRN can hurt short texts" in card


def test_rope_scaling_keys_for_each_type():
    from qwenft.config import QwenftError
    from qwenft.export.gguf_file import rope_scaling_keys

    base = {"max_position_embeddings": 131072}
    assert rope_scaling_keys(base) == {}
    assert rope_scaling_keys({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}) == {}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}
    assert rope_scaling_keys({**base, "rope_parameters": yarn}) == {
        "qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
        "qwen2.rope.scaling.original_context_length": 32768}
    assert rope_scaling_keys({**base, "rope_scaling": {"type": "linear", "factor": 2.0}}) == {
        "qwen2.rope.scaling.type": "linear", "qwen2.rope.scaling.factor": 2.0}
    # YaRN's knobs at the values llama.cpp assumes are written as nothing more
    assert len(rope_scaling_keys({**base, "rope_parameters": {**yarn, "beta_fast": 32, "truncate": True}})) == 3
    with pytest.raises(QwenftError, match="rope_type=dynamic has no llama.cpp equivalent"):
        rope_scaling_keys({**base, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(QwenftError, match=r"model\.rope_scaling\.beta_fast=16 is not written"):
        rope_scaling_keys({**base, "rope_parameters": {**yarn, "beta_fast": 16}})


def test_long_context_facts_and_serve_commands(tmp_path):
    from qwenft.export.card import long_context, model_card, serve_commands

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}
    facts = long_context({"max_position_embeddings": 131072, "rope_parameters": yarn})
    assert (facts["original"], facts["context"]) == (32768, 131072)
    linear = long_context({"max_position_embeddings": 65536, "rope_parameters": {"rope_type": "linear",
                                                                                  "factor": 2.0}})
    assert (linear["original"], linear["context"]) == (32768, 65536)
    dynamic = long_context({"max_position_embeddings": 32768, "rope_parameters": {"rope_type": "dynamic",
                                                                                   "factor": 2.0}})
    assert (dynamic["original"], dynamic["context"]) == (32768, 65536)
    assert long_context({"max_position_embeddings": 32768, "rope_parameters": {"rope_type": "default"}}) is None

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 16, "target_modules": [
        "q_proj", "v_proj"]}))
    plain = serve_commands(tmp_path / "out", None, adapter, "Qwen/Qwen2.5-7B-Instruct", "run")
    assert "--max-model-len" not in plain["merged"] + plain["adapter"] and "--hf-overrides" not in plain["adapter"]
    scaled = serve_commands(tmp_path / "out", None, adapter, "Qwen/Qwen2.5-7B-Instruct", "run", facts)
    assert scaled["merged"].endswith("--max-model-len 131072")
    assert ("--hf-overrides '{\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":4.0,"
            "\"original_max_position_embeddings\":32768,\"rope_theta\":1000000.0}}' --max-model-len 131072"
            ) in scaled["adapter"]
    base = {"name": "qwen2.5-7b-instruct", "source": "hub", "path": "Qwen/Qwen2.5-7B-Instruct",
            "trained_on": "NF4", "merged_into": "NF4-dequantized weights"}
    check = {"max_abs_logit_delta": 0.1, "tolerance": 1.0, "greedy": ["equal"]}
    settings = {"dtype": "bfloat16", "max_shard_size": "5GB"}
    card = model_card("out", base, None, settings, {"merge": check}, None, None, rope=facts)
    assert "YaRN, factor 4, over the base's original 32,768-token window: a context of 131,072 tokens" in card
    assert "## Long context" not in model_card("out", base, None, settings, {"merge": check}, None, None)


def test_long_sequences_are_accepted_with_packing_and_checkpointing():
    """data.max_seq_len 32,768 (the native window) and 131,072 (YaRN x4) compose with packing, gradient
    checkpointing and the chunked loss, with no context warning; packing keeps every token of such examples."""
    from qwenft.data.collate import pack
    from qwenft.kernels import chunk_tokens
    from qwenft.model.rope import context_warning

    yarn = "model.rope_scaling={rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}"
    for length, extra in ((32768, ()), (131072, (yarn,))):
        config = compose_config("model=tiny-random", f"data.max_seq_len={length}", "data.packing=true",
                                "train.gradient_checkpointing=true", "train.kernels=none", *extra)
        assert config.data.max_seq_len == length
        assert context_warning(length, 32768, config.model.rope_scaling) is None
    rope = compose_config("model=tiny-random", yarn).model.rope_scaling
    assert "exceeds the scaled context of 131072" in context_warning(131073, 32768, rope)
    lengths = [131072, 70000, 61072, 30000]
    rows = pack(lengths, 131072)
    assert sorted(i for row in rows for i in row) == [0, 1, 2, 3]
    assert all(sum(lengths[i] for i in row) <= 131072 for row in rows) and len(rows) == 3
    assert chunk_tokens(152064) * 152064 * 4 <= 64 << 20  # a 131k row's loss holds one chunk's logits at a time


def test_merge_refuses_a_gguf_of_dynamic_scaling_before_loading(tmp_path, monkeypatch):
    from qwenft.config import QwenftError
    from qwenft.export import merge as merge_module
    from qwenft.export.merge import merge
    from tests.export.conftest import make_adapter

    adapter = tmp_path / "run" / "adapter"
    make_adapter(adapter, "quant=none", "model.rope_scaling.rope_type=dynamic", "model.rope_scaling.factor=2.0")
    monkeypatch.setattr(merge_module, "load_base", lambda *a, **k: pytest.fail("loaded the base"))
    with pytest.raises(QwenftError, match=r"model\.rope_scaling\.rope_type=dynamic has no llama\.cpp equivalent"):
        merge(merge_config(adapter, tmp_path / "merged", "merge.gguf=f16"), device="cpu")
    assert not (tmp_path / "merged").exists()


def test_linear_scaling_gguf_in_llama_cpp_matches_transformers_past_the_window(tmp_path):
    """``rope_type=linear`` (no training: the sharp base with the scaling applied, as merge saves it): llama.cpp with
    the GGUF's type and factor keys agrees with transformers past the window (measured 6.5e-4; a trial run of the same
    model without the keys: 0.39)."""
    pytest.importorskip("llama_cpp")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from qwenft.config import RopeScalingConfig
    from qwenft.export.gguf_file import write_gguf
    from qwenft.export.verify import GGUF_RTOL
    from qwenft.model import load_tokenizer
    from qwenft.model.rope import apply_rope_scaling

    base = _sharp_base(tmp_path)
    config = AutoConfig.from_pretrained(base)
    apply_rope_scaling(config, RopeScalingConfig(rope_type="linear", factor=FACTOR))
    scaled = tmp_path / "linear"
    AutoModelForCausalLM.from_pretrained(base, config=config, dtype=torch.float32).save_pretrained(scaled)
    tokenizer = load_tokenizer(str(base))
    tokenizer.save_pretrained(scaled)
    write_gguf(scaled, scaled / "linear-f16.gguf", "f16", tokenizer, "linear")
    ids = tokenizer(" ".join(_long_text(random.Random(3)) for _ in range(2)), add_special_tokens=False).input_ids
    ids = ids[:COMPARED]
    reference = _transformers_logits(scaled, ids)
    delta = np.abs(_llama_logits(scaled / "linear-f16.gguf", ids, tmp_path) - reference)
    tolerance = GGUF_RTOL[("f16", "float32")] * max(1.0, float(np.abs(reference).max()))
    print(f"linear x{FACTOR:g}: llama.cpp vs transformers past the window {delta[WINDOW:].max():.3g} "
          f"(tolerance {tolerance:.3g})")
    assert len(ids) == COMPARED and delta[WINDOW:].max() <= tolerance
