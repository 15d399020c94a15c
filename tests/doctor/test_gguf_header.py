"""``qwenft doctor`` on a GGUF whose header claims more than the file holds (qwenft/doctor/gguf.py: ``scan_header``):
an array count of 2^40 (``GGUFReader`` looped over it, eating gigabytes), a string of 2^62 bytes (read short and
reported clean), a key-value or tensor count no file could hold, a vocabulary cut off mid-array: each exits 2 with
one line naming the file, the key and the claimed and available bytes, within a second. A file that could hang runs
in a new process under a timeout and a memory limit, so a regression fails instead of hanging the suite."""

from __future__ import annotations

import resource
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qwenft.config import QwenftError
from qwenft.doctor.gguf import read_gguf, scan_header
from tests.conftest import ROOT, qwenft_in_process

# test_doctor.py's group, as test_unreadable.py: the doctor room's files run on one worker
pytestmark = pytest.mark.xdist_group("doctor/test_doctor.py")

UINT8, INT32, STRING, ARRAY = 0, 5, 8, 9


def text(value: str) -> bytes:
    """A GGUF string: uint64 length, then the bytes."""
    raw = value.encode()
    return struct.pack("<Q", len(raw)) + raw


def gguf_bytes(kvs: bytes = b"", kv_count: int = 0, tensor_count: int = 0) -> bytes:
    """The header (magic, version 3, tensor count, key-value count), then ``kvs`` as they are."""
    return struct.pack("<4sIQQ", b"GGUF", 3, tensor_count, kv_count) + kvs


def array(key: str, item: int, count: int, items: bytes = b"") -> bytes:
    """A key-value holding an array: key, type ARRAY, item type, count, then ``items`` as they are."""
    return text(key) + struct.pack("<IIQ", ARRAY, item, count) + items


def _no_more_than_4_gib() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def doctor_in_new_process(path: Path) -> subprocess.CompletedProcess:
    """``python -m qwenft doctor PATH``, killed after 60 s and limited to 4 GiB: what hung without the pre-scan."""
    try:
        return subprocess.run([sys.executable, "-m", "qwenft", "doctor", str(path)], cwd=ROOT, capture_output=True,
                              text=True, timeout=60, preexec_fn=_no_more_than_4_gib)
    except subprocess.TimeoutExpired:
        pytest.fail(f"doctor {path.name} still running after 60 s: GGUFReader looping over a count the file "
                    "cannot hold")


# each: the file's bytes, then what its error line says (after "corrupt or truncated GGUF: ")
HUGE = {
    "array-count": (gguf_bytes(array("tokenizer.ggml.token_type", INT32, 1 << 40, b"\0" * 8), 1),
                    f"key 'tokenizer.ggml.token_type': an array of {1 << 40} int32: {4 << 40} bytes claimed at offset "
                    "73, only 8 available (the file has 81)"),
    "string-array-count": (gguf_bytes(array("tokenizer.ggml.tokens", STRING, 1 << 40, text("a") + text("b")), 1),
                           f"key 'tokenizer.ggml.tokens': an array of {1 << 40} string: {8 << 40} bytes claimed"),
    "string-length": (gguf_bytes(text("general.name") + struct.pack("<IQ", STRING, 1 << 62) + b"Qwen", 1),
                      f"key 'general.name': a string: {1 << 62} bytes claimed at offset 56, only 4 available (the "
                      "file has 60)"),
    "kv-count": (gguf_bytes(text("general.name") + struct.pack("<I", STRING) + text("x"), 1 << 60),
                 f"the header's {1 << 60} key-values (at least 13 bytes each): {13 << 60} bytes claimed at offset 24"),
    "tensor-count": (gguf_bytes(text("general.name") + struct.pack("<I", STRING) + text("x"), 1, 1 << 62),
                     f"the header's {1 << 62} tensor infos (at least 24 bytes each): {24 << 62} bytes claimed"),
}


@pytest.mark.parametrize("case", sorted(HUGE))
def test_a_count_or_length_past_the_end_is_unreadable(case, tmp_path):
    data, said = HUGE[case]
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(data)
    result = doctor_in_new_process(path)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"qwenft: error: {path}: corrupt or truncated GGUF: "), lines
    assert said in lines[0]
    with pytest.raises(QwenftError, match="corrupt or truncated GGUF"):  # in process too (the hang guard: above)
        read_gguf(path)


def test_an_unknown_value_type_is_unreadable(tmp_path, capsys):
    path = tmp_path / "t.gguf"
    path.write_bytes(gguf_bytes(text("general.name") + struct.pack("<I", 77) + b"\0" * 8, 1))
    result = qwenft_in_process(capsys, "doctor", str(path))
    assert result.returncode == 2
    assert f"{path}: corrupt GGUF: key 'general.name' has value type 77, not a GGUF type (0-12)" in result.stderr


def write_tiny(path: Path, tokens: list, **writer) -> None:
    """A tiny qwen2 GGUF as gguf's GGUFWriter writes it: a name, a vocabulary with token types, a nested array and
    one tensor."""
    import gguf

    out = gguf.GGUFWriter(path, "qwen2", **writer)
    out.add_name("tiny")
    out.add_context_length(32)
    out.add_token_list(tokens)
    out.add_token_types([1] * (len(tokens) - 1) + [3])
    out.add_array("test.nested", [[1, 2, 3], ["a", "bc"]])
    out.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), dtype=np.float32))
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()


@pytest.mark.parametrize("order", ["little", "big"])
def test_a_valid_gguf_still_reads(order, tmp_path):
    import gguf

    path = tmp_path / "tiny.gguf"
    endian = gguf.GGUFEndian.BIG if order == "big" else gguf.GGUFEndian.LITTLE
    write_tiny(path, [f"t{i}" for i in range(100)] + ["<|im_end|>"], endianess=endian)
    scan_header(path)
    facts = read_gguf(path)
    assert facts.n_tokens == 101 and facts.tensors == ["token_embd.weight"] and facts.embed_rows == 101
    assert facts.values["general.name"] == "tiny" and facts.special["<|im_end|>"] == (100, 3)


def test_a_vocabulary_cut_short_names_the_key(tmp_path, capsys):
    path = tmp_path / "cut.gguf"
    write_tiny(path, [f"token{i:04d}" for i in range(1000)])
    data = path.read_bytes()
    cut = data.index(b"token0500")  # half-way through tokenizer.ggml.tokens
    path.write_bytes(data[:cut])
    result = qwenft_in_process(capsys, "doctor", str(path))
    assert result.returncode == 2
    assert (f"{path}: corrupt or truncated GGUF: key 'tokenizer.ggml.tokens': string 500 of the array: 9 bytes "
            f"claimed at offset {cut}, only 0 available (the file has {cut})") in result.stderr
