"""``qwenft doctor`` on what a new user found: broken files said as unreadable in one line (truncated safetensors,
a missing shard, a truncated GGUF, a safetensors file or a device given as PATH), ``--json`` for an unreadable PATH,
a directory holding an adapter and a model, findings on a GGUF inside a model directory naming the file, and the
GGUF's own texts (template fix, ``[PADn]`` placeholders past the rows)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from qwenft.config import QwenftError
from qwenft.doctor.command import diagnose
from tests.conftest import qwenft_in_process
from tests.doctor.conftest import copy, edit_json, rewrite_gguf

# test_doctor.py's group: the session's qwenft outputs (a train, a merge, a GGUF) are built once, on one worker
pytestmark = pytest.mark.xdist_group("doctor/test_doctor.py")


def test_truncated_safetensors_is_unreadable(tiny_dir, tmp_path, capsys):
    path = copy(tiny_dir, tmp_path / "m")
    weights = path / "model.safetensors"
    full = weights.stat().st_size
    os.truncate(weights, full // 2)  # the header intact, the data cut: a download stopped half-way
    edit_json(path / "config.json", tie_word_embeddings=True)  # it used to compare bytes past the end here
    with pytest.raises(QwenftError, match=f"truncated: its header promises {full} bytes but the file has "
                                          f"{full // 2}: an interrupted download or copy"):
        diagnose(path)
    result = qwenft_in_process(capsys, "doctor", str(path))
    assert result.returncode == 2 and "model.safetensors: truncated" in result.stderr


def test_shard_listed_in_the_index_but_missing_is_unreadable(tiny_dir, tmp_path):
    path = copy(tiny_dir, tmp_path / "m")
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(QwenftError, match=r"model-00002-of-00002\.safetensors: missing, though "
                                          r"model\.safetensors\.index\.json lists it"):
        diagnose(path)


def test_truncated_gguf_says_truncated(qwenft_outputs, tmp_path):
    path = tmp_path / "t.gguf"
    data = qwenft_outputs["gguf"].read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(QwenftError, match=r"truncated \(it ends, at \d+ bytes, before the data its header "
                                          r"describes\)") as caught:
        diagnose(path)
    assert "reshape" not in str(caught.value)


def test_a_safetensors_file_or_a_device_as_path(qwenft_outputs, tmp_path):
    weights = next(qwenft_outputs["merged"].glob("*.safetensors"))
    with pytest.raises(QwenftError, match=f"a safetensors file, .*pass its directory \\({qwenft_outputs['merged']}"):
        diagnose(weights)
    with pytest.raises(QwenftError, match="/dev/null: a character device, not a directory or a file"):
        diagnose("/dev/null")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(QwenftError, match="empty.gguf: an empty file"):
        diagnose(empty)


def test_json_for_an_unreadable_path(tmp_path, capsys):
    missing = tmp_path / "absent"
    result = qwenft_in_process(capsys, "doctor", str(missing), "--json")
    data = json.loads(result.stdout)
    assert result.returncode == 2 and data["exit_code"] == 2 and data["kind"] is None
    assert data["path"] == str(missing) and "does not exist" in data["error"]
    assert len(result.stderr.strip().splitlines()) == 1 and "does not exist" in result.stderr


def test_a_directory_with_an_adapter_and_a_model_checks_both(tiny_dir, plain_adapter, tmp_path):
    path = copy(tiny_dir, tmp_path / "both")  # a trainer's output: the adapter and a model saved beside it
    for item in plain_adapter.iterdir():
        (path / item.name).write_bytes(item.read_bytes())
    edit_json(path / "config.json", quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    report = diagnose(path)
    assert report.kind == "adapter" and report.codes() == ["quantization-config-leftover"]
    assert report.findings[0].message.startswith("as a model: ")
    assert any(line.startswith("this directory holds a model too") for line in report.info)


def test_gguf_findings_in_a_model_directory_name_the_file(qwenft_outputs, tmp_path, capsys):
    path = copy(qwenft_outputs["merged"], tmp_path / "m")
    name = next(path.glob("*.gguf")).name
    rewrite_gguf(qwenft_outputs["gguf"], path / name, drop=("tokenizer.chat_template",))
    report = diagnose(path)
    assert report.codes() == ["template-missing"] and report.findings[0].message.startswith(f"{name}: ")
    data = json.loads(qwenft_in_process(capsys, "doctor", str(path), "--json").stdout)
    assert [f["file"] for f in data["findings"]] == [name]
    assert "gguf-new-metadata IN.gguf OUT.gguf --chat-template-file" in report.findings[0].fix


def small_gguf(path: Path, tokens) -> Path:
    """A qwen2 GGUF with an 8-row token_embd and ``tokens``."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([int(gguf.TokenType.NORMAL)] * len(tokens))
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_pad_placeholders_past_the_rows_are_harmless(tmp_path):
    words = [f"w{i}" for i in range(8)]
    padded = diagnose(small_gguf(tmp_path / "pad.gguf", words + ["[PAD8]", "[PAD9]"]))
    assert "tokens-beyond-rows" not in padded.codes()
    real = diagnose(small_gguf(tmp_path / "real.gguf", words + ["[PAD8]", "w9"]))
    assert "tokens-beyond-rows" in real.codes() and "1 real tokens past them" in real.findings[-1].message
