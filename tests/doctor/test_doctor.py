"""``qwenft doctor``: each planted fault is found as exactly its code (so removing a check fails its test), the clean
artifacts and qwenft's own outputs give exit 0, unreadable paths exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwenft.config import QwenftError
from qwenft.doctor.command import diagnose
from qwenft.doctor.findings import CODES
from tests.conftest import qwenft_in_process
from tests.doctor.conftest import copy, edit_json, family_dir, peft_adapter, rewrite_gguf


def codes(path) -> list:
    return diagnose(path).codes()


# --- clean artifacts ----------------------------------------------------------------------------------------------

def test_clean_transformers_dir_plain_peft_adapter_and_family_dir(tiny_dir, tied_tiny_dir, plain_adapter, tmp_path):
    for path in (tiny_dir, tied_tiny_dir, plain_adapter, family_dir(tmp_path / "f")):
        report = diagnose(path)
        assert report.findings == [], (path, report.text())
    assert any("not one of the Qwen2.5 family's shapes" in line for line in diagnose(tiny_dir).info)
    assert any("Qwen/Qwen2.5-0.5B-Instruct" in line for line in diagnose(tmp_path / "f").info)


def test_qwenft_own_tiny_outputs_are_clean(qwenft_outputs, capsys):
    for name in ("adapter", "merged", "gguf"):
        result = qwenft_in_process(capsys, "doctor", str(qwenft_outputs[name]))
        assert result.returncode == 0, result.stdout + result.stderr
        assert "doctor: clean" in result.stdout
    run_dir = qwenft_outputs["adapter"].parent  # a run directory stands for its adapter
    assert diagnose(run_dir).kind == "adapter"


def test_merge_output_stops_on_im_end(qwenft_outputs):
    """qwenft's merge never writes a stop list without <|im_end|> under a ChatML template (it would be its own bug)."""
    merged = qwenft_outputs["merged"]
    eos = json.loads((merged / "generation_config.json").read_text())["eos_token_id"]
    im_end = json.loads((merged / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in im_end["added_tokens"]}
    assert ids["<|im_end|>"] in eos and "eos-missing-im-end" not in codes(merged)


# --- one planted fault each ---------------------------------------------------------------------------------------

def test_eos_missing_im_end(tiny_dir, tmp_path):
    path = copy(tiny_dir, tmp_path / "m")
    edit_json(path / "generation_config.json", eos_token_id=[json.loads((path / "config.json").read_text())
                                                             ["pad_token_id"]])
    assert codes(path) == ["eos-missing-im-end"]


def test_generation_config_missing(tiny_dir, tmp_path):
    path = copy(tiny_dir, tmp_path / "m")
    (path / "generation_config.json").unlink()
    assert codes(path) == ["generation-config-missing"]


def test_pad_is_im_end(tiny_dir, tmp_path):
    path = copy(tiny_dir, tmp_path / "m")
    edit_json(path / "tokenizer_config.json", pad_token="<|im_end|>")
    assert codes(path) == ["pad-is-im-end"]


def test_template_missing(tiny_dir, tmp_path):
    path = copy(tiny_dir, tmp_path / "m")
    (path / "chat_template.jinja").unlink(missing_ok=True)
    edit_json(path / "tokenizer_config.json", chat_template=None)
    assert codes(path) == ["template-missing"]


def test_template_not_chatml(tiny_dir, tmp_path):
    path = copy(tiny_dir, tmp_path / "m")
    (path / "chat_template.jinja").write_text("{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n"
                                              "{% endfor %}", encoding="utf-8")
    assert codes(path) == ["template-not-chatml"]


def test_template_system_prompt(tmp_path):
    no_default = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                  "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    assert codes(family_dir(tmp_path / "f", template=no_default)) == ["template-system-prompt"]


def test_tied_lm_head_differs(tiny_dir, tmp_path):
    path = copy(tiny_dir, tmp_path / "m")  # untied: its lm_head differs from embed_tokens
    edit_json(path / "config.json", tie_word_embeddings=True)
    assert codes(path) == ["tied-lm-head-differs"]


def test_lm_head_missing_tied_flag_lost(tied_tiny_dir, tmp_path):
    path = copy(tied_tiny_dir, tmp_path / "m")
    edit_json(path / "config.json", tie_word_embeddings=False)
    assert codes(path) == ["lm-head-missing"]
    report = diagnose(family_dir(tmp_path / "f", tie_word_embeddings=False, head=False))
    assert report.codes() == ["lm-head-missing"] and "is tied" in report.findings[0].message


def test_adapter_lm_head_on_tied_base(tied_tiny_dir, tmp_path):
    adapter = peft_adapter(tied_tiny_dir, tmp_path / "a", modules_to_save=["lm_head"])
    # vLLM refuses modules_to_save too: the tied-base code comes on top of it, and only on a tied base
    assert codes(adapter) == ["adapter-lm-head-on-tied-base", "vllm-lora-unsupported"]


def test_quantization_config_leftover(tiny_dir, tmp_path):
    path = copy(tiny_dir, tmp_path / "m")
    edit_json(path / "config.json", quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True,
                                                         "bnb_4bit_quant_type": "nf4"})
    assert codes(path) == ["quantization-config-leftover"]


def test_embedding_rows_shrunk(tmp_path):
    assert codes(family_dir(tmp_path / "f", vocab_size=151665)) == ["embedding-rows-shrunk"]


def test_tokens_beyond_rows(tiny_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    model.resize_token_embeddings(400)  # the tokenizer has 480 tokens
    path = copy(tiny_dir, tmp_path / "m")
    model.save_pretrained(path)
    assert codes(path) == ["tokens-beyond-rows"]


def test_rope_scaling_inconsistent(tiny_dir, tmp_path):
    path = copy(tiny_dir, tmp_path / "m")  # max_position_embeddings 2048 = 2 x 1024, not the factor 4
    edit_json(path / "config.json", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                     "original_max_position_embeddings": 1024})
    assert codes(path) == ["rope-scaling-inconsistent"]


def test_rope_trained_past_window(tiny_dir, tmp_path):
    adapter = peft_adapter(tiny_dir, tmp_path / "a")
    (adapter / "qwenft.json").write_text(json.dumps({"model": {"source": "local", "path": str(tiny_dir)},
                                                     "data": {"max_seq_len": 4096}}), encoding="utf-8")
    assert codes(adapter) == ["rope-trained-past-window"]
    (adapter / "qwenft.json").write_text(json.dumps({  # the same length with YaRN x2 recorded: clean
        "model": {"source": "local", "path": str(tiny_dir), "rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
        "data": {"max_seq_len": 4096}}), encoding="utf-8")
    assert codes(adapter) == []


def test_rope_gguf_mismatch(qwenft_outputs, tmp_path):
    path = copy(qwenft_outputs["merged"], tmp_path / "m")  # its GGUF has no scaling; config.json gets YaRN x2
    edit_json(path / "config.json", rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6,
                                                     "original_max_position_embeddings": 1024})
    assert codes(path) == ["rope-gguf-mismatch"]


def test_vllm_lora_unsupported(plain_adapter, tmp_path):
    path = copy(plain_adapter, tmp_path / "a")
    edit_json(path / "adapter_config.json", use_dora=True)
    report = diagnose(path)
    assert report.codes() == ["vllm-lora-unsupported"] and "DoRA" in report.findings[0].message


def test_gguf_special_token_type(qwenft_outputs, tmp_path):
    import gguf

    src = qwenft_outputs["gguf"]
    im_end = gguf.GGUFReader(src).fields["tokenizer.ggml.eos_token_id"].contents()
    path = rewrite_gguf(src, tmp_path / "t.gguf", token_types={im_end: int(gguf.TokenType.NORMAL)})
    assert codes(path) == ["gguf-special-token-type"]


def test_gguf_template_missing(qwenft_outputs, tmp_path):
    path = rewrite_gguf(qwenft_outputs["gguf"], tmp_path / "t.gguf", drop=("tokenizer.chat_template",))
    assert codes(path) == ["template-missing"]


def test_gguf_eos_not_end(qwenft_outputs, tmp_path):
    import gguf

    path = rewrite_gguf(qwenft_outputs["gguf"], tmp_path / "t.gguf",
                        set_values={"tokenizer.ggml.eos_token_id": (100, gguf.GGUFValueType.UINT32)})
    assert codes(path) == ["gguf-eos-not-end"]


def family_gguf(path: Path, swap_im_end: bool = False) -> Path:
    """A GGUF with the 0.5B's metadata and vocabulary size, no tensors (the identification reads the token count;
    tied: no output.weight), the Qwen special tokens at their ids (or <|im_end|> moved to id 151646)."""
    import gguf

    from tests.doctor.conftest import CHATML

    writer = gguf.GGUFWriter(path, "qwen2")
    for add, value in ((writer.add_context_length, 32768), (writer.add_embedding_length, 896),
                       (writer.add_block_count, 24), (writer.add_feed_forward_length, 4864),
                       (writer.add_head_count, 14), (writer.add_head_count_kv, 2)):
        add(value)
    tokens = [f"t{i}" for i in range(151936)]
    types = [int(gguf.TokenType.NORMAL)] * 151936
    for index, text in ((151643, "<|endoftext|>"), (151644, "<|im_start|>"), (151645, "<|im_end|>")):
        index = 151646 if swap_im_end and text == "<|im_end|>" else index
        tokens[index], types[index] = text, int(gguf.TokenType.CONTROL)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_eos_token_id(151646 if swap_im_end else 151645)
    writer.add_chat_template(CHATML)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_special_token_id(tmp_path):
    assert codes(family_gguf(tmp_path / "clean.gguf")) == []
    assert codes(family_gguf(tmp_path / "moved.gguf", swap_im_end=True)) == ["gguf-special-token-id"]


def test_rope_theta_lost(tiny_dir, tmp_path):
    """A transformers-5 config.json (rope_theta only in rope_parameters) given a rope_scaling without rope_theta, as
    Qwen2.5's model cards write it: transformers 5 loads the RoPE base as 10,000, silently."""
    from transformers import AutoConfig

    path = copy(tiny_dir, tmp_path / "m")  # 2048 positions = 1024 x 2: a consistent YaRN x2
    scaling = {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024}
    edit_json(path / "config.json", rope_scaling=scaling)
    report = diagnose(path)
    assert report.codes() == ["rope-theta-lost"] and "1,000,000" in report.findings[0].message
    assert '"rope_theta": 1000000.0 inside rope_scaling' in report.findings[0].fix
    config = json.loads((path / "config.json").read_text())  # the fix as its text says, checked by transformers
    edit_json(path / "config.json", rope_scaling=dict(scaling, rope_theta=1e6),
              rope_parameters=dict(config["rope_parameters"], rope_theta=1e6))
    assert codes(path) == [] and AutoConfig.from_pretrained(path).rope_parameters["rope_theta"] == 1e6
    # no rope_theta written at all: the family member's (1,000,000) against transformers' default
    family = family_dir(tmp_path / "f", rope_theta=None)
    edit_json(family / "config.json", rope_theta=None)
    assert codes(family) == ["rope-theta-lost"] and "declares no rope_theta" in diagnose(family).findings[0].message
    edit_json(family / "config.json", rope_theta=1e6)  # the fix: at the top level when neither dict is there
    assert codes(family) == []


def test_rope_scaling_inconsistent_fix_text_loads_right(tmp_path):
    """The fix text of rope-scaling-inconsistent, applied as written, gives a config transformers loads with
    Qwen2.5's RoPE base (the old text, without rope_theta, led to rope-theta-lost)."""
    import re

    from transformers import AutoConfig

    path = family_dir(tmp_path / "f", max_position_embeddings=65536,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                      rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    edit_json(path / "config.json", rope_theta=None)
    report = diagnose(path)
    assert report.codes() == ["rope-scaling-inconsistent", "rope-theta-lost"]
    scaling = json.loads(re.search(r"\{.*?\}", report.findings[0].fix).group(0))
    edit_json(path / "config.json", rope_scaling=scaling, rope_parameters=scaling, max_position_embeddings=131072)
    assert codes(path) == [] and AutoConfig.from_pretrained(path).rope_parameters["rope_theta"] == 1e6


def test_adapter_base_mismatch(tmp_path):
    """A 0.5B adapter (896 wide) whose base_model_name_or_path names the 7B (3584 wide)."""
    from tests.doctor.conftest import header_only_safetensors

    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {f"{prefix}.lora_A.weight": ("F32", (16, 896)), f"{prefix}.lora_B.weight": ("F32", (896, 16))}
    wrong = hub_adapter(tmp_path / "wrong", "Qwen/Qwen2.5-7B-Instruct")
    header_only_safetensors(wrong / "adapter_model.safetensors", tensors)
    report = diagnose(wrong)
    assert report.codes() == ["adapter-base-mismatch"]
    assert f"{prefix}.lora_A.weight has shape [16, 896]" in report.findings[0].message
    assert "[16, 3584]" in report.findings[0].message and "1 more" in report.findings[0].message
    right = hub_adapter(tmp_path / "right", "Qwen/Qwen2.5-0.5B-Instruct")
    header_only_safetensors(right / "adapter_model.safetensors", tensors)
    assert codes(right) == []


def test_adapter_targets_mismatch(plain_adapter, tmp_path):
    """target_modules cut to q_proj while the weights hold q/k/v/o: peft would load only the q_proj matrices."""
    assert codes(plain_adapter) == []
    cut = copy(plain_adapter, tmp_path / "cut")
    edit_json(cut / "adapter_config.json", target_modules=["q_proj"])
    report = diagnose(cut)
    assert report.codes() == ["adapter-targets-mismatch"]
    assert "k_proj, o_proj, v_proj" in report.findings[0].message
    assert not any("vLLM can serve" in line for line in report.info)
    regex = copy(plain_adapter, tmp_path / "regex")  # peft's regex form naming all four: clean
    edit_json(regex / "adapter_config.json", target_modules=r".*\.(q|k|v|o)_proj")
    assert codes(regex) == []


def test_adapter_rank_mismatch(plain_adapter, tmp_path):
    """r says 16, the matrices are rank 8: peft refuses the adapter, vLLM would get --max-lora-rank 16."""
    wrong = copy(plain_adapter, tmp_path / "r16")
    edit_json(wrong / "adapter_config.json", r=16)
    report = diagnose(wrong)
    assert report.codes() == ["adapter-rank-mismatch"]
    assert "has rank 8" in report.findings[0].message and '"r": 8' in report.findings[0].fix


def test_adapter_without_weights_is_unreadable(plain_adapter, tmp_path):
    gone = copy(plain_adapter, tmp_path / "gone")
    (gone / "adapter_model.safetensors").unlink()
    with pytest.raises(QwenftError, match="no adapter_model.safetensors"):
        diagnose(gone)
    (gone / "adapter_model.bin").write_bytes(b"not a pickle")  # never read: said as skipped
    report = diagnose(gone)
    assert any("adapter_model.bin is a pickle, never read" in line for line in report.info)


def test_every_code_has_a_test():
    text = Path(__file__).read_text(encoding="utf-8")
    assert [code for code in CODES if f'"{code}"' not in text.split("def test_every_code_has_a_test")[0]] == []


# --- the command line ---------------------------------------------------------------------------------------------

def test_exit_codes_and_json(tiny_dir, tmp_path, capsys):
    clean = qwenft_in_process(capsys, "doctor", str(tiny_dir))
    assert clean.returncode == 0 and clean.stdout.strip().endswith("doctor: clean (no findings)")
    path = copy(tiny_dir, tmp_path / "m")
    (path / "generation_config.json").unlink()
    found = qwenft_in_process(capsys, "doctor", str(path), "--json")
    data = json.loads(found.stdout)
    assert found.returncode == 1 and data["exit_code"] == 1
    assert [f["code"] for f in data["findings"]] == ["generation-config-missing"] and data["findings"][0]["fix"]


@pytest.mark.parametrize("case", ["missing", "garbage", "corrupt-json", "corrupt-gguf", "empty-dir"])
def test_unreadable_exits_2(case, tmp_path, tiny_dir, capsys):
    path = tmp_path / "x"
    if case == "garbage":
        path.write_bytes(b"not a model at all")
    elif case == "corrupt-json":
        path = copy(tiny_dir, path)
        (path / "generation_config.json").write_text("{", encoding="utf-8")
    elif case == "corrupt-gguf":
        path.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    elif case == "empty-dir":
        path.mkdir()
    with pytest.raises(QwenftError):
        diagnose(path)
    result = qwenft_in_process(capsys, "doctor", str(path))
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and "x" in result.stderr


def test_docs_table_lists_every_code():
    from tests.conftest import ROOT

    text = (ROOT / "docs" / "doctor.md").read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip().strip("`"): line.split("|")[2].strip() for line in text.splitlines()
            if line.startswith("| `") and line.count("|") >= 4}
    assert {code: rows.get(code) for code in CODES} == {code: severity for code, (severity, _) in CODES.items()}


# --- inside train and merge (qwenft.doctor.guard) -----------------------------------------------------------------

def test_merge_refuses_a_stop_list_without_im_end(qwenft_outputs, tmp_path, monkeypatch):
    """Were qwenft's merge to write a stop list without <|im_end|> under its ChatML template (its own bug), the merge
    stops before anything is published."""
    from qwenft.doctor.guard import DoctorRefused
    from qwenft.export.merge import merge
    from tests.conftest import compose_config

    def stops_on_pad_only(model, tokenizer):
        model.generation_config.eos_token_id = [tokenizer.pad_token_id]

    monkeypatch.setattr("qwenft.export.build.set_end_tokens", stops_on_pad_only)
    out = tmp_path / "merged"
    with pytest.raises(DoctorRefused, match="eos-missing-im-end"):
        merge(compose_config(f"adapter={qwenft_outputs['adapter']}", f"out={out}", "merge.dtype=float32",
                             command="merge"), device="cpu")
    assert not out.exists() and not list(tmp_path.glob("merged.tmp-*"))


def test_guard_warns_on_load_and_refuses_only_new_own_faults(tiny_dir, tmp_path, caplog):
    from qwenft.doctor.guard import DoctorRefused, check_loaded, check_written

    path = copy(tiny_dir, tmp_path / "m")
    edit_json(path / "config.json", quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    (path / "generation_config.json").unlink()
    with caplog.at_level("WARNING", logger="qwenft.doctor"):
        found = check_loaded(path, "the base")
    assert found == {"quantization-config-leftover", "generation-config-missing"}
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "quantization-config-leftover" in warned[0]  # the stop list is fixed on write
    assert check_loaded(tmp_path / "absent", "the base") == set()
    check_written(path, "the output", inherited=found)  # the base's fault, carried along: warned, not refused
    with pytest.raises(DoctorRefused, match="quantization-config-leftover"):
        check_written(path, "the output")


def hub_adapter(path: Path, base: str, template: bool = True) -> Path:
    """An adapter directory as a peft script leaves it for a hub base that is not on this machine: its config, and
    (``template``) the tokenizer_config.json it was trained with, ChatML."""
    from tests.doctor.conftest import CHATML

    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 16, "lora_alpha": 32, "base_model_name_or_path": base,
        "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM"}), encoding="utf-8")
    if template:
        (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>",
                                                                "pad_token": "<|endoftext|>"}), encoding="utf-8")
    from qwenft.model.family import member
    from tests.doctor.conftest import header_only_safetensors

    known = member(base)  # layer 0's q/v matrices, rank 16, shaped for the base (headers only)
    tensors = {}
    if known is not None:
        hidden = known.config["hidden_size"]
        kv = hidden // known.config["num_attention_heads"] * known.config["num_key_value_heads"]
        for name, out in (("q_proj", hidden), ("v_proj", kv)):
            prefix = f"base_model.model.model.layers.0.self_attn.{name}"
            tensors.update({f"{prefix}.lora_A.weight": ("F32", (16, hidden)),
                            f"{prefix}.lora_B.weight": ("F32", (out, 16))})
    header_only_safetensors(path / "adapter_model.safetensors", tensors)
    return path


def test_adapter_on_a_hub_base_read_from_the_family_table(tmp_path):
    """The classic: a base model tuned on ChatML whose stops (the base's generation_config) lack <|im_end|>."""
    report = diagnose(hub_adapter(tmp_path / "base", "Qwen/Qwen2.5-7B"))
    assert report.codes() == ["eos-missing-im-end"] and "[151643]" in report.findings[0].message
    assert any("family table" in line for line in report.info)
    assert codes(hub_adapter(tmp_path / "instruct", "Qwen/Qwen2.5-7B-Instruct")) == []
    no_tokenizer = diagnose(hub_adapter(tmp_path / "bare", "Qwen/Qwen2.5-7B", template=False))
    assert no_tokenizer.codes() == [] and any(line.startswith("skipped: the chat template") for line in
                                              no_tokenizer.info)
    unknown = diagnose(hub_adapter(tmp_path / "unknown", "someone/some-model"))
    assert unknown.codes() == [] and any(line.startswith("skipped: every check of the base") for line in unknown.info)


def test_gguf_rope_scaling_keys(qwenft_outputs, tmp_path):
    """llama.cpp's qwen2.rope.scaling.* against qwen2.context_length (2048 in the tiny GGUF)."""
    import gguf

    def scaled(name: str, factor: float) -> Path:
        return rewrite_gguf(qwenft_outputs["gguf"], tmp_path / name, set_values={
            "qwen2.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING),
            "qwen2.rope.scaling.factor": (factor, gguf.GGUFValueType.FLOAT32),
            "qwen2.rope.scaling.original_context_length": (1024, gguf.GGUFValueType.UINT32)})

    assert codes(scaled("good.gguf", 2.0)) == []  # 2048 = 1024 x 2
    assert codes(scaled("bad.gguf", 4.0)) == ["rope-scaling-inconsistent"]


def test_train_refuses_an_adapter_whose_stops_lost_im_end(tmp_path):
    """Were train to save a generation_config without <|im_end|> (its own bug), the adapter is not published and the
    run ends with one line naming the code; the checkpoints stay."""
    from tests.conftest import run_train, train_overrides

    patch = ("import qwenft.chat\n"
             "def stops_on_pad_only(model, tokenizer):\n"
             "    model.generation_config.eos_token_id = [tokenizer.pad_token_id]\n"
             "    model.generation_config.pad_token_id = tokenizer.pad_token_id\n"
             "qwenft.chat.set_end_tokens = stops_on_pad_only\n")
    out = tmp_path / "run"
    result = run_train(train_overrides(tmp_path, out, "train.max_steps=2", "train.save_steps=2",
                                       "train.eval_steps=2"), patch=patch)
    assert result.returncode == 2 and "eos-missing-im-end" in result.stderr, result.stderr[-2000:]
    assert not (out / "adapter").exists() and list((out / "checkpoints").glob("checkpoint-*"))
