"""``qwenft doctor`` on the real 0.5B outputs the slow export tests already share (``embedded_merge``: a qwenft
adapter on the embedded Qwen2.5-Coder-0.5B-Instruct, its float32 merge and, with llama.cpp installed, its f16 GGUF):
qwenft's own outputs are clean. Lives here because the shared merge is this room's fixture; no new build."""

from __future__ import annotations

import pytest


@pytest.mark.slow  # the real 0.5B merge (shared): doctor on its adapter, merged directory and GGUFs
@pytest.mark.xdist_group("embedded_merge")  # one worker builds the shared merge once
def test_doctor_finds_the_embedded_merge_clean(embedded_merge):
    from qwenft.doctor.command import diagnose

    adapter = embedded_merge.parent / "run" / "adapter"
    # the merged directory's own GGUFs are checked with it; those in its subfolders (the quantized ones) alone
    paths = [adapter, embedded_merge, *sorted(p for p in embedded_merge.rglob("*.gguf") if p.parent != embedded_merge)]
    for path in paths:
        report = diagnose(path)
        assert report.findings == [], report.text()
    merged = diagnose(embedded_merge)
    assert any(line.startswith("Qwen2.5 family: Qwen2.5 0.5B (Instruct") for line in merged.info), merged.text()
    assert any("Qwen2.5's Instruct template, unchanged" in line for line in merged.info), merged.text()
    assert any("base read from" in line for line in diagnose(adapter).info)
