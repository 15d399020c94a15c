"""merge.quantize: the config and its one-line refusals, the Modelfile, the calibration rows, the cost table; GGUF
K-quants end to end on tiny-random (llama.cpp), GPTQ/AWQ on a 128-wide tiny-random (llm-compressor, slow), and both
on the embedded 0.5B model (slow). Tests that run llama.cpp or llm-compressor skip when it is not installed."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from qwenft.config import ConfigError, QwenftError
from tests.conftest import compose_config
from tests.conftest import run_qwenft
from tests.export.conftest import make_adapter, merge_config

GENERATION = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
              "eos_token_id": [151645, 151643]}
SMALL_EVAL = ("eval.max_new_tokens=8", "eval.max_eval_prompts=3")  # the adapters here have no run config.yaml


def test_methods_are_checked_with_one_line_errors():
    config = compose_config("merge.gguf=f16", "merge.quantize=[gguf-q4_k_m,gguf-q8_0]", command="merge")
    assert config.merge.quantize == ["gguf-q4_k_m", "gguf-q8_0"] and config.merge.calibration_rows == 128
    cases = [(["merge.quantize=[gguf-q3_k]"],
              "choose one of: gguf-q8_0, gguf-q6_k, gguf-q5_k_m, gguf-q4_k_m, gptq, awq"),
             (["merge.gguf=f16", "merge.quantize=[gguf-q6_k,gguf-q6_k]"], "names a method twice"),
             (["merge.quantize=[gguf-q4_k_m]"], "no GGUF is written (merge.gguf=none): also pass merge.gguf=f16"),
             (["merge.gguf=q8_0", "merge.quantize=[gguf-q5_k_m]"], "requantizing a q8_0 GGUF loses quality"),
             (["merge.calibration_rows=0"], "merge.calibration_rows=0 is not accepted")]
    for overrides, message in cases:
        with pytest.raises(ConfigError) as error:
            compose_config(*overrides, command="merge")
        assert message in str(error.value) and "\n" not in str(error.value), overrides


def test_missing_or_untested_packages_stop_before_anything_loads(monkeypatch):
    import qwenft.config.export as export_config

    versions = {"llama-cpp-python": "0.3.35", "llmcompressor": None, "compressed-tensors": "0.19.0", "loguru": "0.7.3"}
    monkeypatch.setattr(export_config, "installed_version", versions.get)
    with pytest.raises(ConfigError) as error:
        compose_config("merge.gguf=f16", "merge.quantize=[gguf-q4_k_m]", command="merge")
    assert ("llama-cpp-python==0.3.36 (installed: 0.3.35, untested): pip install 'qwenft[gguf-check]'"
            in str(error.value))
    with pytest.raises(ConfigError) as error:
        compose_config("merge.quantize=[gptq,awq]", command="merge")
    message = str(error.value)
    assert message.startswith("merge.quantize=['gptq', 'awq'] is not accepted; needs llmcompressor==0.14.0.1 "
                              "(not installed)") and "pip install --no-deps llmcompressor==0.14.0.1" in message
    versions.update({"llama-cpp-python": "0.3.36", "llmcompressor": "0.14.0.1"})
    assert compose_config("merge.gguf=f16", "merge.quantize=[gptq,gguf-q6_k]", command="merge").merge.quantize


def test_an_unknown_method_exits_2_with_one_line(tmp_path):
    result = run_qwenft("merge", f"adapter={tmp_path}", f"out={tmp_path / 'out'}", "merge.quantize=[gguf-iq2]")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "merge.quantize='gguf-iq2' is not accepted" in lines[0], result.stderr
    assert not (tmp_path / "out").exists()


def test_a_bare_method_is_a_one_item_list(tmp_path):
    """merge.quantize=gguf-q4_k_m (no brackets) is the list [gguf-q4_k_m], as lora.target_modules=q_proj is: the
    method's own check answers, not OmegaConf's "not a ListConfig" (found by a new-user pass)."""
    from qwenft.cli.overrides import free_form

    assert free_form(["merge.quantize=gguf-q4_k_m", "merge.quantize=gguf-q8_0,gptq", "merge.quantize=[awq]",
                      "merge.quantize=[]"]) == ["merge.quantize=[gguf-q4_k_m]", "merge.quantize=[gguf-q8_0,gptq]",
                                                "merge.quantize=[awq]", "merge.quantize=[]"]
    result = run_qwenft("merge", f"adapter={tmp_path}", f"out={tmp_path / 'out'}", "merge.quantize=gguf-q4_k_m")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "merge.quantize='gguf-q4_k_m' is not accepted; llama.cpp quantizes the merge's f16 GGUF and no GGUF is " \
           "written (merge.gguf=none): also pass merge.gguf=f16" in lines[0], lines[0]
    # Where no override is rewritten (a recipe file, a composed config) one value for a list says the bracket form.
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("# @package _global_\nmerge:\n  quantize: gguf-q4_k_m\n")
    for overrides, where in ((["merge.quantize=gguf-q4_k_m"], ""), ([f"+recipe={recipe}"], f" (in recipe file {recipe})")):
        with pytest.raises(ConfigError) as error:
            compose_config(*overrides, command="merge")
        assert str(error.value) == ("merge.quantize=gguf-q4_k_m: a list is expected, in brackets: "
                                    f"merge.quantize=[gguf-q4_k_m]{where}")


def test_a_finished_merge_with_other_settings_names_them(tmp_path):
    """A non-empty out= holding a finished merge made with other settings: the refusal names each recorded setting
    that differs (there vs here) and the overrides that reuse the merge (was "exists and is not empty")."""
    from qwenft.export.merge import MARKER, _request, merge
    from qwenft.model.adapter import resolve_base

    adapter = tmp_path / "run" / "adapter"
    make_adapter(adapter, "quant=none")
    out = tmp_path / "out"
    finished = merge_config(adapter, out, "merge.gguf=f16", "merge.dtype=float32")
    model, quant, _ = resolve_base(finished.model, finished.quant, adapter)
    out.mkdir()
    (out / MARKER).write_text(json.dumps({"request": _request(adapter, model, quant, finished)}))
    with pytest.raises(QwenftError) as refused:  # as adding merge.quantize=[gptq] is typed: merge.gguf left out
        merge(merge_config(adapter, out, "merge.dtype=bfloat16", "merge.calibration_rows=8"), device="cpu")
    assert str(refused.value) == (
        f"out={out}: holds a finished merge made with other settings (merge.dtype: float32 there, bfloat16 here; "
        "merge.gguf: f16 there, none here); to reuse it (merge.quantize then adds only its artifacts) pass "
        "merge.dtype=float32 merge.gguf=f16, or choose another out= or pass merge.overwrite=true to replace it")
    with pytest.raises(QwenftError, match="holds a merge whose files are not as recorded"):  # same settings
        merge(finished, device="cpu")
    (out / MARKER).unlink()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(QwenftError, match="exists and is not empty; choose another out="):
        merge(finished, device="cpu")


def test_group_size_must_divide_every_width():
    from qwenft.export.w4a16 import width_problem

    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
    assert "hidden_size 64, num_attention_heads x head_dim 64 is not a multiple of 128" in width_problem(tiny, "gptq")
    qwen05 = {"hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14}  # 7, 38 and 7 groups
    qwen7 = {"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28}
    assert width_problem(qwen05, "awq") is None and width_problem(qwen7, "gptq") is None


def test_calibration_rows_are_distinct_seeded_and_capped():
    from qwenft.export.w4a16 import calibration_rows

    train = {"input_ids": [[1, 2], [3], [1, 2], [4, 5, 6], [7], [3]]}  # epochs repeat rows
    rows, distinct = calibration_rows(train, 3, seed=0)
    assert distinct == 4 and len(rows) == 3 and len({tuple(r) for r in rows}) == 3
    assert rows == calibration_rows(train, 3, seed=0)[0] and rows != calibration_rows(train, 3, seed=5)[0]
    assert sorted(calibration_rows(train, 128, seed=0)[0]) == [[1, 2], [3], [4, 5, 6], [7]]


def test_modelfile_holds_the_template_stops_system_and_sampling():
    from qwenft.export.gguf_quant import CHATML_TEMPLATE, modelfile

    text = modelfile("m-q4_k_m.gguf", GENERATION, "You are a thermostat expert.")
    lines = text.splitlines()
    assert lines[1] == "FROM ./m-q4_k_m.gguf" and "ollama create NAME -f m-q4_k_m.Modelfile" in lines[0]
    assert f'TEMPLATE """{CHATML_TEMPLATE}"""' in text and 'SYSTEM """You are a thermostat expert."""' in text
    assert lines[-6:] == ['PARAMETER stop "<|im_end|>"', 'PARAMETER stop "<|endoftext|>"', "PARAMETER temperature 0.7",
                          "PARAMETER top_p 0.8", "PARAMETER top_k 20", "PARAMETER repeat_penalty 1.05"]
    # the ChatML turns of Qwen2.5's template, and an open assistant turn after the last user turn
    for piece in ("<|im_start|>system\n{{ .System }}<|im_end|>\n", "<|im_start|>user\n{{ .Content }}<|im_end|>\n",
                  "{{- if and (ne .Role \"assistant\") $last }}<|im_start|>assistant\n"):
        assert piece in CHATML_TEMPLATE
    bare = modelfile("m.gguf", {"eos_token_id": 1}, None)
    assert "SYSTEM" not in bare and "temperature" not in bare
    with pytest.raises(ValueError, match="triple quotes"):
        modelfile("m.gguf", GENERATION, 'say """hi"""')


def test_default_system_prompt_is_the_templates_own():
    from qwenft.config import TinyModelConfig
    from qwenft.export.gguf_quant import default_system_prompt
    from qwenft.model import load_tokenizer
    from qwenft.model.tiny import tiny_model_dir

    tokenizer = load_tokenizer(str(tiny_model_dir(TinyModelConfig())))
    system = default_system_prompt(tokenizer)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    assert system and rendered.startswith(f"<|im_start|>system\n{system}<|im_end|>\n")


def _entry(ratio: float, right: int, agreement: int, backend: str = "llama.cpp") -> dict:
    return {"backend": backend, "bytes": 491_000_000, "decode_tokens_per_s": 40.0,
            "perplexity": {"answers:domain": {"perplexity": 5.0 * ratio, "tokens": 100, "ratio": ratio}},
            "sources": {"domain": {"metric": "contains_fact", "mean": right / 12, "right": right, "rows": 12,
                                   "kept": min(right, 9), "of": 9}},
            "agreement": {"identical": agreement, "compared": 200, "share": agreement / 200}}


def test_cost_table_and_the_card_section():
    from qwenft.export.card import QUANTIZED_HEADING, cost_table, replace_section

    reference = _entry(1.0, 9, 200, "transformers")
    del reference["sources"]["domain"]["kept"], reference["sources"]["domain"]["of"]
    artifacts = {"gguf-q4_k_m": _entry(1.043, 10, 181), "16-bit": reference, "awq": {"error": "RuntimeError: x"}}
    table = cost_table(artifacts, "16-bit").splitlines()
    assert table[0] == ("| artifact | weights | ppl ratio answers:domain | domain: contains_fact | greedy agreement | "
                        "decode tok/s |")
    assert table[2].startswith("| 16-bit | 491.0 MB | 1.000 (ppl 5.000) | 0.750; 9/12 right | 100.0% (200/200) |")
    assert table[3] == ("| gguf-q4_k_m | 491.0 MB | 1.043 | 0.833; 10/12 right, 9/9 kept | 90.5% (181/200) | "
                        "40.0 (llama.cpp) |")
    assert table[4].startswith("| awq | not measured: RuntimeError: x |")
    card = "# m\n\n## Serve\n\nx\n"
    once = replace_section(card, f"{QUANTIZED_HEADING}\n\nold\n")
    twice = replace_section(once, f"{QUANTIZED_HEADING}\n\nnew\n")
    assert twice == "# m\n\n## Serve\n\nx\n\n" + f"{QUANTIZED_HEADING}\n\nnew\n"
    middle = replace_section(f"# m\n\n{QUANTIZED_HEADING}\n\nold\n\n## Later\n\ny\n", f"{QUANTIZED_HEADING}\n\nnew\n")
    assert middle == f"# m\n\n{QUANTIZED_HEADING}\n\nnew\n\n## Later\n\ny\n"


def test_rows_measured_in_another_run_say_when():
    """A run that adds an artifact re-measures the 16-bit merge and keeps the earlier rows: the table then says when
    each row was measured (tokens/s of two runs are not comparable); rows of one run need no such column."""
    from qwenft.export.card import cost_table
    from qwenft.export.costs import public, stamp

    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", stamp())
    reference = _entry(1.0, 9, 200, "transformers")
    earlier = {"16-bit": {**reference, "measured": "2026-12-01 10:00:00 UTC"},
               "gguf-q8_0": {**_entry(1.001, 9, 199), "measured": "2026-12-01 10:00:00 UTC"}}
    assert "measured" not in cost_table(earlier, "16-bit").splitlines()[0]
    now = {**earlier, "16-bit": {**reference, "measured": "2026-12-02 22:00:00 UTC"},
           "gguf-q4_k_m": public({**_entry(1.04, 9, 190), "sources": {}}, "2026-12-02 22:00:00 UTC"),
           "awq": {"error": "RuntimeError: x", "measured": "2026-12-02 22:00:00 UTC"}, "gptq": _entry(1.1, 8, 180)}
    table = cost_table(now, "16-bit").splitlines()
    assert table[0].endswith("| decode tok/s | measured |") and table[1] == "|" + "---|" * 7
    assert table[2].startswith("| 16-bit |") and table[2].endswith("| 2026-12-02 22:00:00 UTC |")
    assert table[3].startswith("| gguf-q8_0 |") and table[3].endswith("| 2026-12-01 10:00:00 UTC |")
    assert table[4].endswith("| 2026-12-02 22:00:00 UTC |")
    assert table[5] == "| awq | not measured: RuntimeError: x |  |  |  |  | 2026-12-02 22:00:00 UTC |"
    assert table[6].startswith("| gptq |") and table[6].endswith("| an earlier run |")  # recorded without a time
    assert {len(row.split(" | ")) for row in table[2:]} == {len(table[0].split(" | "))}


def test_quantize_settings_are_not_part_of_the_merges_identity(tmp_path):
    from qwenft.export.merge import _request
    from qwenft.model.adapter import resolve_base

    adapter = tmp_path / "run" / "adapter"
    make_adapter(adapter, "quant=none")
    plain = merge_config(adapter, tmp_path / "out", "merge.gguf=f16")
    quantized = merge_config(adapter, tmp_path / "out", "merge.gguf=f16", "merge.quantize=[gguf-q4_k_m]",
                             "merge.calibration_rows=8")
    model, quant, _ = resolve_base(plain.model, plain.quant, adapter, typed=[])
    assert _request(adapter, model, quant, plain) == _request(adapter, model, quant, quantized)


def test_gptq_on_tiny_random_is_refused_before_merging(tmp_path):
    pytest.importorskip("llmcompressor")
    adapter = tmp_path / "run" / "adapter"
    make_adapter(adapter, "quant=none")
    out = tmp_path / "out"
    result = run_qwenft("merge", f"adapter={adapter}", f"out={out}", "merge.quantize=[gptq]", timeout=300)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("qwenft: error: merge.quantize=gptq: W4A16 groups 128 input columns per scale, and this "
                           "model's hidden_size 64"), result.stderr
    assert not out.exists()


@pytest.mark.slow  # llama.cpp's quantizer and its evaluation end to end
def test_tiny_random_gguf_k_quants_end_to_end(tmp_path, monkeypatch):
    """Merge + f16 GGUF + Q8_0 and Q4_K_M by llama.cpp: published files, Modelfiles, llama.cpp's check, the cost
    table in qwenft_merge.json, the card and the output; a re-run loads nothing; the merge itself stays done."""
    pytest.importorskip("llama_cpp")
    import qwenft.export.quantize as quantize_module
    from qwenft.export.merge import merge
    from qwenft.export.quantize import check_request

    adapter = tmp_path / "run" / "adapter"
    make_adapter(adapter, "quant=none")
    out = tmp_path / "merged"
    config = merge_config(adapter, out, "merge.dtype=float32", "merge.gguf=f16",
                          "merge.quantize=[gguf-q8_0,gguf-q4_k_m]", *SMALL_EVAL)
    start = time.perf_counter()
    merge(config, device="cpu")
    print(f"tiny-random merge + 2 K-quants + cost table: {time.perf_counter() - start:.0f} s")
    record = json.loads((out / "qwenft_merge.json").read_text())
    for method, kind in (("gguf-q8_0", "Q8_0"), ("gguf-q4_k_m", "Q5_0")):  # width 64: no 256-value super-blocks
        entry = record["quantized"][method]
        assert (out / entry["path"]).is_file() and (out / entry["modelfile"]).is_file()
        assert kind in entry["tensor_types"] and entry["llama_cpp"]["chat"] == "as in HF"
        assert entry["llama_cpp"]["identical"] >= entry["llama_cpp"]["required"] * entry["llama_cpp"]["compared"]
        assert f"FROM ./{entry['path']}" in (out / entry["modelfile"]).read_text()
    assert (out / "merged-f16.Modelfile").is_file() and record["gguf"]["modelfile"] == "merged-f16.Modelfile"
    costs = record["costs"]["artifacts"]
    assert list(costs) == ["16-bit", "gguf-f16", "gguf-q8_0", "gguf-q4_k_m"]
    assert costs["16-bit"]["agreement"]["share"] == 1.0 and costs["16-bit"]["backend"] == "transformers"
    assert abs(costs["gguf-f16"]["perplexity"]["answers:domain"]["ratio"] - 1) < 1e-3
    assert costs["gguf-q4_k_m"]["bytes"] < costs["gguf-q8_0"]["bytes"] < costs["gguf-f16"]["bytes"]
    assert all(c["decode_tokens_per_s"] > 0 for c in costs.values())
    assert "## Quantized artifacts and what they cost" in (out / "README.md").read_text()
    assert not list(out.glob(".*"))  # no temporary name left

    # A re-run: the merge and every artifact are done, nothing is loaded or measured; a killed run's leftovers go.
    (out / ".merged-q6_k.gguf.tmp-abc").write_text("partial")
    monkeypatch.setattr(quantize_module, "run_inputs", lambda *a: pytest.fail("a finished quantize loaded data"))
    merge(config, device="cpu")
    assert not (out / ".merged-q6_k.gguf.tmp-abc").exists()
    assert json.loads((out / "qwenft_merge.json").read_text())["costs"] == record["costs"]
    monkeypatch.undo()

    # A merge directory without an f16 GGUF cannot feed a GGUF method.
    with pytest.raises(QwenftError, match="holds no f16 GGUF to quantize"):
        check_request(config, json.loads((out / "config.json").read_text()), None)


@pytest.mark.slow  # two merges, each artifact measured by llama.cpp in its child processes
def test_adding_an_artifact_keeps_the_earlier_rows_and_says_when(tmp_path, monkeypatch, capsys):
    """A run that adds an artifact to a quantized merge measures the 16-bit merge and the new artifact, keeps the other
    rows as they were, and the table says when each row was measured (was: one table of two runs' tokens/s, unmarked);
    each progress bar names the artifact it measures (was "generate (base, domain)"). llama.cpp's quantizer is
    replaced by a copy of the f16 GGUF: what is tested is the bookkeeping; the K-quants run end to end above."""
    pytest.importorskip("llama_cpp")
    import shutil

    import tqdm.auto

    import qwenft.export.costs as costs_module
    import qwenft.export.gguf_quant as gguf_quant
    from qwenft.export.merge import merge

    bars = []

    class Recorded(tqdm.auto.tqdm):
        def __init__(self, *args, **kwargs):
            bars.append(kwargs.get("desc"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf_quant, "quantize_gguf", lambda source, target, method: shutil.copyfile(source, target))
    monkeypatch.setattr(tqdm.auto, "tqdm", Recorded)
    adapter = tmp_path / "run" / "adapter"
    make_adapter(adapter, "quant=none")
    out = tmp_path / "merged"
    first, later = "2030-01-01 00:00:00 UTC", "2030-01-02 00:00:00 UTC"
    monkeypatch.setattr(costs_module, "stamp", lambda: first)
    merge(merge_config(adapter, out, "merge.dtype=float32", "merge.gguf=f16", "merge.quantize=[gguf-q8_0]",
                       *SMALL_EVAL), device="cpu")
    before = json.loads((out / "qwenft_merge.json").read_text())["costs"]["artifacts"]
    assert {label: entry["measured"] for label, entry in before.items()} == dict.fromkeys(before, first)
    assert "| measured |" not in capsys.readouterr().out  # one run: no column
    assert "measure 16-bit (domain)" in bars and "measure gguf-q8_0 (llama.cpp)" in bars, bars
    assert "measure gguf-f16 (llama.cpp)" in bars and not [b for b in bars if b and b.startswith("generate")], bars

    monkeypatch.setattr(costs_module, "stamp", lambda: later)
    bars.clear()
    merge(merge_config(adapter, out, "merge.dtype=float32", "merge.gguf=f16", "merge.quantize=[gguf-q8_0,gguf-q6_k]",
                       *SMALL_EVAL), device="cpu")
    printed = capsys.readouterr().out
    after = json.loads((out / "qwenft_merge.json").read_text())["costs"]["artifacts"]
    assert list(after) == ["16-bit", "gguf-f16", "gguf-q8_0", "gguf-q6_k"]
    assert after["16-bit"]["measured"] == after["gguf-q6_k"]["measured"] == later
    assert after["gguf-f16"] == before["gguf-f16"] and after["gguf-q8_0"] == before["gguf-q8_0"]  # kept as measured
    rows = {line.split(" | ")[0].lstrip("| "): line for line in printed.splitlines() if line.startswith("| ")}
    assert rows["artifact"].endswith("| decode tok/s | measured |"), printed
    assert rows["16-bit"].endswith(f"| {later} |") and rows["gguf-q8_0"].endswith(f"| {first} |"), printed
    assert "measure gguf-q6_k (llama.cpp)" in bars and "measure gguf-q8_0 (llama.cpp)" not in bars, bars


@pytest.mark.slow  # llm-compressor's GPTQ and AWQ end to end
def test_tiny_random_gptq_and_awq(tmp_path):
    """GPTQ and AWQ by llm-compressor on a tiny-random of width 128 (one group per row): compressed-tensors
    directories that transformers loads, measured in the cost table; AWQ's 8 rows go in one right-padded batch."""
    pytest.importorskip("llmcompressor")
    from qwenft.export.merge import merge

    adapter = tmp_path / "run" / "adapter"
    make_adapter(adapter, "quant=none", model_args=("model=tiny-random", "model.tiny.hidden_size=128",
                                                    "model.tiny.intermediate_size=256"))
    out = tmp_path / "merged"
    start = time.perf_counter()
    merge(merge_config(adapter, out, "merge.quantize=[gptq,awq]", "merge.calibration_rows=8", *SMALL_EVAL),
          device="cpu")
    print(f"tiny-random (128) merge + GPTQ + AWQ + cost table: {time.perf_counter() - start:.0f} s")
    record = json.loads((out / "qwenft_merge.json").read_text())
    for method in ("gptq", "awq"):
        entry = record["quantized"][method]
        config = json.loads((out / entry["path"] / "config.json").read_text())["quantization_config"]
        weights = config["config_groups"]["group_0"]["weights"]
        assert (config["quant_method"], config["format"], config["ignore"]) == ("compressed-tensors", "pack-quantized",
                                                                                 ["lm_head"])
        assert (weights["num_bits"], weights["group_size"], weights["symmetric"]) == (4, 128, True)
        assert entry["calibration"]["rows"] == 8 and entry["settings"]["calibration_rows"] == 8
        assert entry["settings"].get("batch_size") == (16 if method == "awq" else None)  # AWQ batched, padding masked
        cost = record["costs"]["artifacts"][method]
        assert cost["backend"] == "transformers" and 0 < cost["bytes"] < record["costs"]["artifacts"]["16-bit"]["bytes"]
    assert f"vllm serve {out / 'w4a16-awq'}" in (out / "README.md").read_text()


@pytest.mark.slow  # the real 0.5B merge (shared): Q4_K_M by llama.cpp
@pytest.mark.xdist_group("embedded_merge")  # one worker builds the shared merge once
def test_embedded_model_k_quant(embedded_merge):
    """The 0.5B model with a random r=8 adapter (the float32 merge the conftest fixture shares): Q4_K_M (llama.cpp's
    check at its threshold), measured; the Modelfile carries the generation_config's sampling values and the
    template's system prompt. (GPTQ and AWQ run end to end on the 128-wide tiny-random above; on the 0.5B, GPTQ
    alone added about 3 minutes to CI, over its time budget.)"""
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_calibration_child_dies_with_a_merge_killed_by_sigkill(tmp_path):
    """A merge killed with SIGKILL while GPTQ / AWQ calibrates takes its child with it: the child's prelude
    (DIE_WITH_PARENT) asks the kernel for SIGKILL when its parent dies. Without it the orphan kept calibrating into a
    temporary directory that the next run removes from under it."""
    import signal
    import subprocess

    from qwenft.export.w4a16 import DIE_WITH_PARENT

    child_pid = tmp_path / "child.pid"
    child = DIE_WITH_PARENT + f"\nimport pathlib, time\npathlib.Path({str(child_pid)!r}).write_text(str(os.getpid()))\ntime.sleep(60)\n"
    parent = ("import os, subprocess, sys\n"
              f"subprocess.run([sys.executable, '-c', {child!r}, str(os.getpid())])\n")
    proc = subprocess.Popen([sys.executable, "-c", parent])
    deadline = time.monotonic() + 30
    while not (child_pid.is_file() and child_pid.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(child_pid.read_text())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    def alive() -> bool:  # an orphan is reaped by init, or by nobody in a container: a zombie counts as dead
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            return False

    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive():
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the child outlived its killed parent")


@pytest.mark.parametrize("amx", [True, False])
def test_llama_children_load_without_extra_buffers_on_an_amx_cpu(amx):
    """llama.cpp's AMX matmul segfaults on quantized weights (ggml-org/llama.cpp#20824; q8_0 and K-quants of
    tiny-random crashed the child on an AMX_INT8 Xeon): there, PLAIN_BUFFERS makes every Llama(...) the child builds
    load with use_extra_bufts=False; elsewhere the defaults are untouched. Run on a stand-in llama_cpp module."""
    import types

    from qwenft.export.llama_check import LLAMA_SCRIPT, PLAIN_BUFFERS
    from qwenft.export.llama_eval import SCRIPT

    class Params:
        use_extra_bufts = True

    inner = types.SimpleNamespace(llama_model_default_params=Params)
    info = b"CPU : AVX2 = 1 | AVX512 = 1 | " + (b"AMX_INT8 = 1 | " if amx else b"") + b"REPACK = 1 |"
    fake = types.SimpleNamespace(llama_cpp=inner, llama_print_system_info=lambda: info)
    scope = {"llama_cpp": fake}
    exec(PLAIN_BUFFERS, scope)
    assert scope["report_extra_bufts"] is (not amx)
    assert inner.llama_model_default_params().use_extra_bufts is (not amx)
    for script in (LLAMA_SCRIPT, SCRIPT):  # both children apply it before their Llama(...)
        assert script.index(PLAIN_BUFFERS) < script.index("llama_cpp.Llama(")
