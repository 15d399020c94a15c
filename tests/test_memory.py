"""The peak memory of a phase (metrics.json's ``memory``): the CPU high-water mark is reset at the phase's start."""

from __future__ import annotations

import builtins
import os
import sys

import pytest
import torch

from qwenft.memory import describe_peaks, peak_memory

MiB = 1 << 20

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/clear_refs is Linux's")


@linux_only
def test_cpu_peak_is_the_phase_own_not_the_process_history():
    big = 256 * MiB
    with peak_memory("cpu") as first:
        block = torch.ones(big // 4)  # touched pages: resident
        del block
    with peak_memory("cpu") as second:
        small = torch.ones(16 * MiB // 4)
        del small
    assert first["kind"] == second["kind"] == "cpu_peak_rss" and "note" not in first
    # The 256 MiB block is in the first phase's peak (less what the allocator had resident already, at most a few
    # MiB here), and not in the second's: the high-water mark was reset to the RSS of the moment in between.
    assert first["bytes"] - first["start_bytes"] >= big - 16 * MiB
    assert second["bytes"] - second["start_bytes"] < 128 * MiB
    assert second["bytes"] < first["bytes"] - 128 * MiB
    assert first["seconds"] >= 0 and isinstance(first["seconds"], float)


def test_without_clear_refs_the_peak_since_start_is_reported_with_a_note(monkeypatch):
    real_open = builtins.open

    def refuse(path, *args, **kwargs):
        if str(path) == "/proc/self/clear_refs":
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refuse)
    with peak_memory("cpu") as phase:
        pass
    assert phase["kind"] == "cpu_max_rss_since_start" and "since the process started" in phase["note"]
    assert phase["bytes"] > 10 * MiB  # a Python process with torch loaded holds far more than that


def test_the_dict_is_filled_when_the_block_raises_and_the_report_line():
    with pytest.raises(RuntimeError):
        with peak_memory("cpu") as phase:
            raise RuntimeError("boom")
    assert phase["bytes"] > 0
    line = describe_peaks({"train": {"bytes": 3 * 2**30, "kind": "cpu_peak_rss", "seconds": 12.5},
                           "eval": {"bytes": 2**30 + 2**29, "kind": "cpu_peak_rss", "seconds": 4.0}})
    assert line == "- peak memory: train 3.00 GiB (cpu_peak_rss, 12.5 s); eval 1.50 GiB (cpu_peak_rss, 4.0 s)"
    assert describe_peaks({}) == "- peak memory: not measured"


HEAP_PATTERN = """
import sys, torch
from qwenft.memory import _status_bytes, return_freed_memory_promptly
MiB = 1 << 20
if sys.argv[1] == "on":
    assert return_freed_memory_promptly()
x = torch.ones(8 * MiB); del x  # a freed 32 MiB block: glibc raises its mmap threshold to 32 MiB
before, keep = _status_bytes("VmRSS"), []
for step in range(20):  # an evaluation's shape: activations of 1.5-4.5 MiB freed around a growing KV cache
    acts = [torch.ones((2 + i % 5) * MiB // 4 * 3) for i in range(12)]
    keep.append(torch.ones(100_000))
    del acts
print((_status_bytes("VmRSS") - before) // MiB)
"""


@linux_only
def test_freed_activations_of_a_few_mib_leave_the_resident_set():
    """With glibc's default the freed activations stay resident in the heap (measured: ~170 MiB here); after
    return_freed_memory_promptly each has its own mapping and leaves when freed. Fresh processes: the setting is
    process-wide."""
    import subprocess

    from tests.conftest import ROOT

    def stayed(mode: str) -> int:
        proc = subprocess.run([sys.executable, "-c", HEAP_PATTERN, mode], cwd=ROOT, capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stderr[-2000:]
        return int(proc.stdout.split()[-1])

    off, on = stayed("off"), stayed("on")
    assert on < 32 <= off, f"MiB left resident: {off} by default, {on} with the setting"


def _mapped_rss(path) -> int:
    """Resident bytes of the mappings of ``path`` (smaps' ``Rss``)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                inside = len(head) == 6 and head[5] == str(path)
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def _mapped_tensors(path, sizes):
    """A file of float32 tensors of ``sizes`` elements, mapped privately (as transformers maps a checkpoint), and
    float32 views of it; every page read once (as quantizing reads them)."""
    import mmap

    values = [torch.arange(n, dtype=torch.float32) + 1000 * k for k, n in enumerate(sizes)]
    path.write_bytes(b"".join(v.numpy().tobytes() for v in values))
    with open(path, "r+b") as handle:
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    views, offset = [], 0
    for n in sizes:
        views.append(torch.frombuffer(mapping, dtype=torch.float32, count=n, offset=offset))
        offset += 4 * n
    assert sum(float(v.sum()) for v in views) > 0  # reads every page
    return values, views, mapping


@linux_only
def test_weights_leave_a_mapped_checkpoint_without_its_pages_adding_to_the_peak(tmp_path):
    from qwenft.memory import file_mappings, release_mapped_weights

    path = tmp_path / "model.safetensors"
    sizes = [8 * MiB // 4, 16 * MiB // 4, 4 * MiB // 4]  # the middle one stands for weights quantized away
    values, views, mapping = _mapped_tensors(path, sizes)  # held: the mapping outlives the views
    assert _mapped_rss(path) >= 27 * MiB  # 28 MiB read: resident
    kept = [torch.nn.Parameter(views[0], requires_grad=False), torch.nn.Parameter(views[2], requires_grad=False)]
    del views
    copied = release_mapped_weights(kept)
    assert copied == 12 * MiB
    for param, value in zip(kept, (values[0], values[2])):
        assert torch.equal(param.data, value)  # the copies hold the file's values
        assert not any(a <= param.data_ptr() < b for a, b, _ in file_mappings())
    # The mapping is still there (held), its pages no longer resident: at most a page at each tensor boundary.
    assert _mapped_rss(path) <= 4 * 4096
    mapping.close()


@linux_only
def test_a_written_mapping_is_copied_but_none_of_its_pages_dropped(tmp_path):
    from qwenft.memory import release_mapped_weights

    path = tmp_path / "model.safetensors"
    values, views, mapping = _mapped_tensors(path, [4 * MiB // 4, 4 * MiB // 4])
    views[1][0] = -7.0  # a private copy of that page now: dropping it would bring back the file's 1000.0
    kept = [torch.nn.Parameter(v, requires_grad=False) for v in views]
    del views
    assert release_mapped_weights(kept) == 8 * MiB
    assert float(kept[1].data[0]) == -7.0 and torch.equal(kept[1].data[1:], values[1][1:])
    assert torch.equal(kept[0].data, values[0])
    assert _mapped_rss(path) >= 7 * MiB  # nothing dropped: the mapping had a written page
    mapping.close()
