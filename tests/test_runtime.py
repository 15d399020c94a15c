"""The peak memory of a phase (metrics.json's ``memory``): the CPU high-water mark is reset at the phase's start."""

from __future__ import annotations

import builtins
import os
import sys

import pytest
import torch

from qwenft.runtime import describe_peaks, peak_memory

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
from qwenft.runtime import _status_bytes, return_freed_memory_promptly
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
