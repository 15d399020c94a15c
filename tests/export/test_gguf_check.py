"""The GGUF checked by llama.cpp itself (qwenft.export.llama_check, ``merge.verify_gguf``).

The rules are tested on fake token lists and fake llama.cpp reports (no llama.cpp needed); the check itself runs
on tiny-random (a merge, and two broken GGUFs it must reject) and, slow, on the embedded 0.5B model. Tests that
run llama.cpp skip when llama-cpp-python (the ``qwenft[gguf-check]`` extra) is not installed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from qwenft.config import ConfigError
from qwenft.export.llama_check import MIN_IDENTICAL, NEW_TOKENS, TIE_NATS, agreement, check_llama, wanted
from tests.conftest import compose_config
from tests.export.conftest import make_adapter, merge_config

HF_EOS = [151645, 151643]
CHAT = {"text": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "ids": [151644, 872, 198, 6023]}


def fake_report(argmax, **changes):
    """A llama.cpp report as run_llama returns it, agreeing with CHAT and HF_EOS unless ``changes`` say otherwise."""
    report = {"argmax": argmax, "gaps": [[0.5] * len(a) for a in argmax], "has_template": True,
              "chat_text": CHAT["text"], "chat_ids": list(CHAT["ids"]), "eos": 151645, "eot": 151645,
              "eog": {"151645": True, "151643": True}, "load_seconds": 0.1, "decode_seconds": 0.2}
    report.update(changes)
    return report


def test_agreement_counts_identical_steps_and_the_first_difference():
    assert agreement([1, 2, 3], [1, 2, 3]) == {"identical": 3, "compared": 3, "first_difference": None}
    # got[k] is llama.cpp's choice after HF's own prefix: agreement after a difference still counts.
    assert agreement([1, 2, 3, 4], [1, 9, 3, 4]) == {"identical": 3, "compared": 4, "first_difference": 1}
    assert agreement([1, 2, 3], [1, 2]) == {"identical": 2, "compared": 3, "first_difference": 2}
    assert agreement([], []) == {"identical": 0, "compared": 0, "first_difference": None}


def test_f16_needs_every_token_identical():
    hf = [list(range(NEW_TOKENS)), [5, 6, 151645]]
    verdict = check_llama(fake_report([list(hf[0]), [5, 6, 151645]]), hf, CHAT, HF_EOS, "f16")
    assert verdict.passed and (verdict.identical, verdict.compared) == (NEW_TOKENS + 3, NEW_TOKENS + 3)
    assert verdict.as_dict()["prompts"][1]["hf_tokens"] == [5, 6, 151645]

    off = list(hf[0])
    off[20] = 777  # one step of 35 differs
    verdict = check_llama(fake_report([off, [5, 6, 151645]]), hf, CHAT, HF_EOS, "f16",
                          hf_gaps=[[0.25] * NEW_TOKENS, [0.0] * 3])
    assert not verdict.passed and verdict.identical == NEW_TOKENS + 2
    first = verdict.prompts[0]
    assert first["first_difference"] == 20
    assert first["at_first_difference"] == {"hf": 20, "llama_cpp": 777, "llama_cpp_gap": 0.5, "hf_gap": 0.25}
    assert "34/35" in verdict.problems[0] and "100% required for f16" in verdict.problems[0]
    # the same difference where transformers scores both tokens alike (gap 0, within TIE_NATS): a tie, not a flip
    tied = check_llama(fake_report([off, [5, 6, 151645]]), hf, CHAT, HF_EOS, "f16",
                       hf_gaps=[[0.0] * NEW_TOKENS, [0.0] * 3])
    assert tied.passed and (tied.identical, tied.ties) == (NEW_TOKENS + 2, 1) and tied.as_dict()["ties"] == 1


def test_a_flip_within_one_step_of_16_bit_logits_is_a_tie():
    """transformers in bfloat16 returns bfloat16 logits: two of them one unit in the last place apart (2^-9 at |z| in
    [0.25, 0.5)) cannot be told apart, and llama.cpp's f16 may pick either (seen on an AVX2-only CPU)."""
    from qwenft.export.llama_check import logit_resolution

    assert logit_resolution("bfloat16", 0.3, -0.1) == 2.0 ** -9
    assert logit_resolution("bfloat16", 20.0) == 2.0 ** -3 and logit_resolution("float16", 1.5) == 2.0 ** -10
    assert logit_resolution("float32", 0.3) < TIE_NATS and logit_resolution("bfloat16", 0.0) == 0.0
    hf = [list(range(NEW_TOKENS)), [5, 6, 151645]]
    off = list(hf[0])
    off[4] = 403
    gaps = [[2.0 ** -9] * NEW_TOKENS, [0.0] * 3]  # one bfloat16 step at |z| ~ 0.3: above TIE_NATS
    strict = check_llama(fake_report([off, [5, 6, 151645]]), hf, CHAT, HF_EOS, "f16", hf_gaps=gaps)
    assert not strict.passed  # a float32 reference (no tie_nats): a real difference
    resolution = [[logit_resolution("bfloat16", 0.3)] * NEW_TOKENS, [0.0] * 3]
    tied = check_llama(fake_report([off, [5, 6, 151645]]), hf, CHAT, HF_EOS, "f16", hf_gaps=gaps, tie_nats=resolution)
    assert tied.passed and tied.ties == 1
    # two steps apart is a preference transformers could express: still a difference
    wider = check_llama(fake_report([off, [5, 6, 151645]]), hf, CHAT, HF_EOS, "f16",
                        hf_gaps=[[2.0 ** -8] * NEW_TOKENS, [0.0] * 3], tie_nats=resolution)
    assert not wider.passed and "100% required for f16" in wider.problems[0]


def test_q8_0_needs_90_percent_of_the_tokens():
    assert MIN_IDENTICAL["q8_0"] == 0.9
    hf = [list(range(NEW_TOKENS))] * 3  # 96 steps: 87 identical (90.6%) pass, 86 (89.6%) fail
    for wrong, passed in ((9, True), (10, False)):
        argmax = [list(tokens) for tokens in hf]
        for k in range(wrong):
            argmax[k % 3][k] = -1
        verdict = check_llama(fake_report(argmax), hf, CHAT, HF_EOS, "q8_0")
        assert verdict.passed is passed and verdict.identical == 96 - wrong, wrong
        assert verdict.as_dict()["required"] == 0.9


@pytest.mark.parametrize("changes, message", [
    ({"chat_text": CHAT["text"] + " "}, "renders a two-turn conversation differently"),
    ({"chat_ids": [151643] + CHAT["ids"]}, "tokenizes the two-turn conversation to other ids"),
    ({"has_template": False}, "has no tokenizer.chat_template"),
    ({"eos": 151644}, "eos id 151644 is not in generation_config's EOS list"),
    ({"eot": 0}, "eot id 0 is not in"),
    ({"eog": {"151645": True, "151643": False}}, "does not end a generation on [151643]"),
])
def test_chat_template_and_end_token_mismatches_fail(changes, message):
    hf = [[1, 2, 151645]]
    verdict = check_llama(fake_report([[1, 2, 151645]], **changes), hf, CHAT, HF_EOS, "f16")
    assert not verdict.passed and verdict.identical == 3
    assert any(message in p for p in verdict.problems), verdict.problems
    assert verdict.chat["problems"]
    assert check_llama(fake_report([[1, 2, 151645]], eot=-1), hf, CHAT, HF_EOS, "f16").passed  # no EOT is fine


def test_verify_gguf_config(monkeypatch):
    import importlib.util

    assert wanted("none", None) is False and wanted("f16", False) is False and wanted("q8_0", True) is True
    assert compose_config("merge.gguf=f16", command="merge").merge.verify_gguf is None  # auto
    with pytest.raises(ConfigError, match="merge.gguf=f16 or merge.gguf=q8_0"):
        compose_config("merge.verify_gguf=true", command="merge")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    assert wanted("f16", None) is False  # auto without the package: no check
    with pytest.raises(ConfigError) as error:
        compose_config("merge.gguf=f16", "merge.verify_gguf=true", command="merge")
    assert "merge.verify_gguf" in str(error.value) and "pip install 'qwenft[gguf-check]'" in str(error.value)
    assert "\n" not in str(error.value)
    assert compose_config("merge.gguf=f16", "merge.verify_gguf=false", command="merge").merge.verify_gguf is False


def _llama_again(gguf_path: Path, record: dict, tokenizer, qtype: str):
    """Run llama.cpp on ``gguf_path`` against the HF tokens recorded by a merge's check."""
    from qwenft.export.llama_check import check_llama, hf_chat, run_llama
    from qwenft.export.verify import PROMPTS, render

    done = record["verification"]["llama_cpp"]
    hf_tokens = [p["hf_tokens"] for p in done["prompts"]]
    report = run_llama(gguf_path, [render(tokenizer, t) for t in PROMPTS], hf_tokens, done["chat"]["hf_eos"])
    return check_llama(report, hf_tokens, hf_chat(tokenizer), done["chat"]["hf_eos"], qtype)


def test_tiny_random_merge_is_checked_by_llama_cpp_and_broken_ggufs_are_rejected(tmp_path):
    pytest.importorskip("llama_cpp")
    from qwenft.export.merge import merge
    from qwenft.export.gguf_file import write_gguf
    from qwenft.model import load_tokenizer

    adapter = tmp_path / "run" / "adapter"
    make_adapter(adapter, "quant=none")
    out = tmp_path / "merged"
    merge(merge_config(adapter, out, "merge.dtype=float32", "merge.gguf=f16", "merge.verify_gguf=true"),
          device="cpu")
    record = json.loads((out / "qwenft_merge.json").read_text())
    check = record["verification"]["llama_cpp"]
    assert check["passed"] and check["identical"] == check["compared"] == 3 * NEW_TOKENS
    assert check["chat"]["problems"] == [] and record["request"]["merge"]["verify_gguf"] is True
    assert "GGUF run by llama.cpp" in (out / "README.md").read_text()
    tokenizer = load_tokenizer(str(out))

    # A GGUF of the base without the adapter: llama.cpp's tokens are not the merged model's.
    base = tmp_path / "base.gguf"
    write_gguf(Path(record["base"]["path"]), base, "f16", tokenizer, "base")
    verdict = _llama_again(base, record, tokenizer, "f16")
    print(f"tiny-random, base GGUF vs merged model: {verdict.identical}/{verdict.compared} identical")
    assert not verdict.passed and verdict.identical < verdict.compared and not verdict.chat["problems"]

    # The merged weights with another chat template: the tokens agree, the template check fails.
    tokenizer.chat_template = tokenizer.chat_template.replace("<|im_start|>assistant", "<|im_start|>bot")
    other = tmp_path / "template.gguf"
    write_gguf(out, other, "f16", tokenizer, "merged")
    verdict = _llama_again(other, record, load_tokenizer(str(out)), "f16")
    assert verdict.identical == verdict.compared and not verdict.passed
    assert any("renders a two-turn conversation differently" in p for p in verdict.chat["problems"])


@pytest.mark.slow  # the real 0.5B merge (shared): its GGUFs run by llama.cpp
@pytest.mark.xdist_group("embedded_merge")  # one worker builds the shared merge once
def test_embedded_merge_checked_by_llama_cpp(tmp_path, embedded_merge):
    """The 0.5B model with a random r=8 adapter, merged in float32 with an f16 GGUF run by llama.cpp (the merge the
    conftest fixture shares); then a q8_0 GGUF of the same merge against the same HF tokens."""
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
