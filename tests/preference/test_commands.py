"""A DPO adapter through the commands that take an adapter, unchanged (issue acceptance: merge, GGUF, 4-bit, serve and
eval, a test each on tiny-random): one `qwenft train train.objective=dpo` run in a new process (the real entry point)
shared by the file's tests (one xdist group, so it is trained once), then each command as the existing tests run it on
an SFT adapter, with their helpers (tests/export, tests/serve, tests/evaluate) and their skip rules.

The run's tiny-random is 128 wide, the width tests/export/test_quantize.py gives GPTQ / AWQ (W4A16 groups 128 input
columns per scale; the default 64 is refused). Merge and eval read that base from the adapter's qwenft.json; serve
(whose helper types model=tiny-random) and the logits oracle (which loads the base itself) are given the width."""

from __future__ import annotations

import json

import pytest

from tests.conftest import compose_config, qwenft_in_process, run_train, write_jsonl
from tests.export.conftest import merge_config
from tests.train.test_preference import pair_rows

WIDE = ("model.tiny.hidden_size=128", "model.tiny.intermediate_size=256")  # as test_tiny_random_gptq_and_awq
SMALL_EVAL = ("eval.max_new_tokens=8", "eval.max_eval_prompts=3")  # the cost table's measurements kept short


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
    """``(tmp, run)``: 4 DPO steps on 20 of 24 pairs (4 held out), the adapter in ``run/adapter``."""
    tmp = tmp_path_factory.mktemp("dpo")
    run = tmp / "run"
    pairs = write_jsonl(tmp / "pairs.jsonl", pair_rows(24))
    result = run_train(["model=tiny-random", "quant=none", f"out_dir={run}", "eval.after_train=false",
                        "train.objective=dpo",
                        f"data.sources=[{{name: pairs, path: '{pairs}', format: preference, weight: 1.0, "
                        "eval_rows: 4}]", "data.max_seq_len=160", "train.max_steps=4", "train.batch_size=2",
                        "train.lr=5e-3", "pref.beta=0.5", "train.gradient_checkpointing=false", *WIDE])
    assert result.returncode == 0, result.stderr[-3000:]
    meta = json.loads((run / "adapter" / "qwenft.json").read_text())
    assert meta["train"]["objective"] == "dpo" and meta["model"]["tiny"]["hidden_size"] == 128
    return tmp, run


MERGE = ("merge.dtype=float32", "merge.gguf=f16")  # float32: the strict check (and fast on CPUs without bf16 GEMMs)


@pytest.fixture(scope="module")
def merged(dpo_run):
    """The DPO adapter merged by `merge merge.dtype=float32 merge.gguf=f16` (llama.cpp's check of the GGUF too where
    llama-cpp-python is installed: merge.verify_gguf=null), shared by the merge tests (each merge verifies by a
    reload in a new interpreter, ~10 s on 2 cores); the 4-bit test adds its artifact to this merge."""
    from qwenft.export.merge import merge

    tmp, run = dpo_run
    out = tmp / "merged"
    merge(merge_config(run / "adapter", out, *MERGE), device="cpu")
    return out


def test_merge_16bit_of_a_dpo_adapter_passes_its_logits_check(dpo_run, merged):
    """`merge` (float32): the merge's own check passes, and the merged directory reloaded by transformers gives the
    adapter-on-base logits (computed with qwenft.model only) to rounding."""
    from tests.export.test_export import max_delta, no_leftovers, oracle, read_record, reload_logits

    _, run = dpo_run
    assert no_leftovers(merged)
    record = read_record(merged)
    assert record["verification"]["passed"] and record["verification"]["merge"]["max_abs_logit_delta"] <= 1e-5
    saved = json.loads((merged / "config.json").read_text())
    assert saved["hidden_size"] == 128 and "quantization_config" not in saved  # the base qwenft.json records

    expected, base_logits, inputs = oracle(compose_config("model=tiny-random", "quant=none", *WIDE), run / "adapter")
    got, model = reload_logits(merged, inputs)
    assert max_delta(expected, base_logits) > 1e-2  # 4 DPO steps moved the adapter off its no-op init (~1 here)
    assert max_delta(got, expected) <= 1e-5  # fp32: merged W + s*B@A vs the two-path forward, rounding only
    assert not any("lora" in name for name, _ in model.named_parameters())


def test_merge_gguf_of_a_dpo_adapter(merged):
    """`merge merge.gguf=f16`: the f16 GGUF passes the merge's check, loads back through transformers with the merged
    directory's logits (as test_merge_bfloat16_with_gguf_f16_round_trip), and where llama-cpp-python is installed
    passes llama.cpp's token-for-token check, chat template and end tokens included (as test_gguf_check's
    tiny-random merge)."""
    import importlib.util

    from qwenft.export.llama_check import NEW_TOKENS
    from tests.export.test_export import max_delta, oracle, read_record, reload_logits

    record = read_record(merged)
    path = merged / record["gguf"]["file"]
    assert path.is_file() and record["gguf"]["type"] == "f16" and record["verification"]["gguf"]["passed"]
    _, _, inputs = oracle(compose_config("model=tiny-random", "quant=none", *WIDE), merged.parent / "run" / "adapter")
    directory, _ = reload_logits(merged, inputs)
    from_gguf, _ = reload_logits(merged, inputs, gguf_file=path.name)
    assert max_delta(from_gguf, directory) <= 5e-3  # float32 weights stored as f16: the GGUF check's own scale
    if importlib.util.find_spec("llama_cpp") is None:  # as embedded_merge: llama.cpp's check where it is installed
        assert "llama_cpp" not in record["verification"]
        return
    check = record["verification"]["llama_cpp"]
    assert check["passed"] and check["identical"] == check["compared"] == 3 * NEW_TOKENS
    assert check["chat"]["problems"] == []
    assert "GGUF run by llama.cpp" in (merged / "README.md").read_text()


@pytest.mark.slow  # llm-compressor's GPTQ end to end (as test_tiny_random_gptq_and_awq)
def test_merge_gptq_of_a_dpo_adapter(dpo_run, merged):
    """`merge merge.quantize=[gptq]` on the finished merge (the quantize settings are not part of the merge's
    identity, so only the artifact is made): calibrated on the DPO run's training pairs, measured in the cost table on
    its held-out pairs; a compressed-tensors W4A16 directory. GPTQ alone: AWQ takes the same calibration rows and
    adds ~15 s on 2 cores."""
    pytest.importorskip("llmcompressor")
    from qwenft.export.merge import merge

    _, run = dpo_run
    # calibrated on prompt + chosen answer: the run's preference rows have no input_ids column
    merge(merge_config(run / "adapter", merged, *MERGE, "merge.quantize=[gptq]", "merge.calibration_rows=8",
                       *SMALL_EVAL), device="cpu")
    record = json.loads((merged / "qwenft_merge.json").read_text())
    entry = record["quantized"]["gptq"]
    config = json.loads((merged / entry["path"] / "config.json").read_text())["quantization_config"]
    weights = config["config_groups"]["group_0"]["weights"]
    assert (config["quant_method"], weights["num_bits"], weights["group_size"]) == ("compressed-tensors", 4, 128)
    assert entry["calibration"]["rows"] == entry["settings"]["calibration_rows"] == 8
    costs = record["costs"]["artifacts"]
    assert costs["gptq"]["backend"] == "transformers" and 0 < costs["gptq"]["bytes"] < costs["16-bit"]["bytes"]
    assert costs["16-bit"]["agreement"]["share"] == 1.0
    assert f"vllm serve {merged / entry['path']}" in (merged / "README.md").read_text()


def test_serve_answers_a_chat_completion_with_a_dpo_adapter(dpo_run):
    """`serve adapter=RUN/adapter` (tests/serve's served model under a live uvicorn): the run is listed, and a greedy
    chat completion of the tuned model is the one `qwenft generate` gives with the same adapter."""
    pytest.importorskip("fastapi")  # test_serve.py's module skips
    pytest.importorskip("openai")
    from qwenft.generation.command import generate_command
    from tests.serve.conftest import LiveServer, serve_config, served

    tmp, run = dpo_run
    adapter, prompt = run / "adapter", "Name a fruit."
    tiny_served = served(adapter, *WIDE)
    with LiveServer(tiny_served) as live:
        client = live.client()
        assert [m.id for m in client.models.list().data] == ["base", tiny_served.tuned]
        assert tiny_served.tuned.endswith("/run")
        replies = {model: client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                         temperature=0, max_tokens=8, logprobs=True)
                   for model in ("base", tiny_served.tuned)}
    tuned = replies[tiny_served.tuned].choices[0]
    assert tuned.finish_reason in ("stop", "length") and replies[tiny_served.tuned].usage.completion_tokens >= 1
    base_logprobs = [t.logprob for t in replies["base"].choices[0].logprobs.content]
    assert [t.logprob for t in tuned.logprobs.content] != base_logprobs  # the adapter is on for the run only

    prompts, out = tmp / "prompts.jsonl", tmp / "generated.jsonl"  # tests/serve/test_serve.py's generate_file
    write_jsonl(prompts, [{"prompt": prompt}])
    config = serve_config(adapter, *WIDE, f"prompts_file={prompts}", f"out={out}", "generate.max_new_tokens=8",
                          "generate.do_sample=false", "generate.batch_size=1")
    config.command = "generate"
    generate_command(config)
    expected = json.loads(out.read_text(encoding="utf-8").splitlines()[0])
    assert tuned.message.content == expected["output"]
    assert replies[tiny_served.tuned].usage.completion_tokens == expected["completion_tokens"]


def test_eval_of_a_dpo_adapter_scores_its_held_out_pairs(dpo_run, capsys):
    """`eval adapter=RUN/adapter` with no data typed: the run's recorded preference source, its 4 held-out pairs
    scored on each side (pref_accuracy, the implicit reward against the base), each generation row with its rejected
    answer, and report.md's preference section."""
    tmp, run = dpo_run
    out = tmp / "eval"
    result = qwenft_in_process(capsys, "eval", f"adapter={run / 'adapter'}", f"out_dir={out}",
                               "eval.metrics=[pref_accuracy,char_f1]", "eval.max_new_tokens=8")
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert f"eval data from the adapter's qwenft.json (what it was trained on): pairs ({tmp / 'pairs.jsonl'}" in log, \
        log[-3000:]
    assert "NOT THE ADAPTER'S DATA" not in log

    metrics = json.loads((out / "metrics.json").read_text())
    pairs = metrics["eval"]["preference"]["pairs"]
    assert pairs["n"] == 4 and 0.0 <= pairs["reward_accuracy"] <= 1.0 and set(pairs["margin"]) == {"base", "tuned"}
    for side in ("base", "tuned"):
        assert 0.0 <= metrics["eval"]["sources"]["pairs"][side]["pref_accuracy"] <= 1.0
        assert "char_f1" in metrics["eval"]["sources"]["pairs"][side]

    by_prompt = {row["instruction"]: row for row in pair_rows(24)}
    rows = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for row in rows:
        pair = by_prompt[row["prompt"]]
        assert (row["reference"], row["rejected"]) == (pair["chosen"], pair["rejected"]), row
        for side in ("base", "tuned"):
            assert row[side]["pref_accuracy"] in (0.0, 1.0) and "logp_rejected" in row[side]

    report = (out / "report.md").read_text()
    assert "## Preference pairs (held out)" in report and "### pairs (4 pairs)" in report
    section = report.split("## Preference pairs (held out)")[1]
    assert "| pref_accuracy | " in section and "Implicit reward accuracy (tuned vs base): " in section
    assert "| pref_accuracy |" in report.split("## Generation metrics")[1].split("## Preference pairs")[0]
