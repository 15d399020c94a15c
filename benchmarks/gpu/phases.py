"""Memory and bandwidth measures and the training rows of the one-GPU check (qlora_7b.py; the training arms are
in train_arms.py, the decode arms in decode.py)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Dict, List


class Memory:
    """Peak memory of a phase: ``torch.cuda.max_memory_allocated`` on CUDA, else the peak resident set (VmHWM,
    reset through ``/proc/self/clear_refs`` where the kernel allows it)."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.measure = "torch.cuda.max_memory_allocated" if self.cuda else "peak RSS of the process (VmHWM)"

    def reset(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:  # not permitted here: the peak then covers the process so far
            self.measure = "peak RSS of the process so far (VmHWM; no reset allowed)"

    def _status(self, key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        return 0

    def peak(self) -> int:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return self._status("VmHWM")

    def current(self) -> int:
        import torch

        return torch.cuda.memory_allocated() if self.cuda else self._status("VmRSS")


def copy_bandwidth(device: str, megabytes: int = 1024, repeats: int = 5) -> float:
    """Measured memory bandwidth of ``device`` in bytes/s: ``2 * size / time`` of ``dst.copy_(src)`` (median)."""
    import torch

    if not device.startswith("cuda"):
        from benchmarks.sampler import copy_bandwidth as cpu_copy

        return cpu_copy(min(megabytes, 128), repeats)
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * megabytes * 2**20 / statistics.median(times)


def random_rows(vocab: int, n: int, seq: int, seed: int) -> List[Dict[str, List[int]]]:
    """``n`` training rows of ``seq`` random token ids (ids >= 3: not the tiny tokenizer's special tokens), every
    token supervised (``labels == input_ids``)."""
    import torch

    ids = torch.randint(3, vocab, (n, seq), generator=torch.Generator().manual_seed(seed)).tolist()
    return [{"input_ids": row, "labels": list(row)} for row in ids]
