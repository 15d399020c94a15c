"""Memory of this process: a phase's peak (:func:`peak_memory`), freed pages handed back to the system, and the
pages of memory-mapped safetensors files dropped once their weights were copied.

Linux facts read here: ``/proc/self/status`` (VmRSS, VmHWM), ``/proc/self/smaps`` (file mappings),
``/proc/self/clear_refs`` (reset of the high-water mark), ``madvise(MADV_DONTNEED)`` and glibc's ``malloc_trim`` /
``mallopt``; each is a no-op where the system lacks it. Why each is needed, with the measurements, is in
docs/performance.md ("Memory on a CPU").
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Dict, Iterator, Optional


def _status_bytes(field: str) -> Optional[int]:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes; None where it cannot be read."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def release_freed_memory() -> None:
    """Collect garbage and hand glibc's freed heap pages back to the kernel (``malloc_trim(0)``), so that a phase's
    peak counts what is live, not what an earlier phase (or a replaced weight) freed into the allocator; a no-op off
    glibc."""
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MADV_DONTNEED = 4  # Linux, <sys/mman.h>


def file_mappings(suffix: str = ".safetensors") -> list:
    """The process's mappings of files whose name ends with ``suffix``, from ``/proc/self/smaps``: a list of
    ``(start, end, anonymous_bytes)`` (addresses in bytes; ``anonymous_bytes`` counts the pages written since the
    mapping was made, copies that exist nowhere else). Empty where ``/proc`` cannot be read (not Linux)."""
    found: list = []
    current = None
    try:
        with open("/proc/self/smaps", encoding="utf-8", errors="replace") as smaps:
            for line in smaps:
                head = line.split(None, 5)
                if head and "-" in head[0] and not head[0].endswith(":"):
                    span = head[0].split("-")
                    current = None
                    if len(head) == 6 and head[5].rstrip("\n").endswith(suffix):
                        current = [int(span[0], 16), int(span[1], 16), 0]
                        found.append(current)
                elif current is not None and head[:1] == ["Anonymous:"]:
                    current[2] = int(head[1]) * 1024
    except (OSError, ValueError, IndexError):
        return []
    return [tuple(m) for m in found]


def drop_mapped_pages(ranges, mappings) -> int:
    """Drop from the resident set the pages of ``mappings`` (:func:`file_mappings`) that lie inside ``ranges``
    (``[(start, end)]`` byte addresses; each cut inward to whole pages), with ``madvise(MADV_DONTNEED)``: a mapped
    file's pages stay resident, and counted in the process's RSS, until the whole mapping goes, however few of them
    are still used. Only mappings with no written page (``anonymous_bytes`` 0) are touched: there a dropped page is
    read again from the file if anything touches it, so nothing can be lost. Returns the bytes advised (0 off Linux
    or where the call fails)."""
    import ctypes

    clean = [(a, b) for a, b, anonymous in mappings if anonymous == 0]
    try:
        madvise = ctypes.CDLL("libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dropped = 0
    for start, end in ranges:
        for low, high in clean:
            first = -(-max(start, low) // PAGE_BYTES) * PAGE_BYTES
            last = min(end, high) // PAGE_BYTES * PAGE_BYTES
            if last > first and madvise(first, last - first, MADV_DONTNEED) == 0:
                dropped += last - first
    return dropped


def release_mapped_weights(tensors) -> int:
    """Move every tensor of ``tensors`` (parameters or buffers, ``.data`` replaced in place) that still lives in a
    memory-mapped ``.safetensors`` file into ordinary memory, without the file's pages adding to the peak.

    transformers reads a checkpoint through a private mapping of the file; the pages the loading touched stay
    resident until the last tensor viewing the file is gone, so a plain copy would hold those pages and the copies at
    once (docs/performance.md, "Memory on a CPU"). Here the pages no tensor views are dropped first, and each
    tensor's own pages right after its copy (:func:`drop_mapped_pages`), so the copy costs one tensor at a time.
    Returns the bytes copied.
    """
    mappings = file_mappings()
    inside = [t for t in tensors if any(a <= t.data_ptr() < b for a, b, _ in mappings)]
    if not inside:
        return 0
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in inside)
    gaps, cursor = [], min(a for a, _, _ in mappings)
    for start, end in spans:  # the mapped bytes outside every viewing tensor, whole pages kept around each tensor
        gaps.append((cursor, start // PAGE_BYTES * PAGE_BYTES))
        cursor = max(cursor, -(-end // PAGE_BYTES) * PAGE_BYTES)
    gaps.append((cursor, max(b for _, b, _ in mappings)))
    drop_mapped_pages(gaps, mappings)
    copied = 0
    for tensor in inside:
        source = (tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size())
        tensor.data = tensor.data.clone()
        copied += source[1] - source[0]
        drop_mapped_pages([source], mappings)
    return copied


MMAP_THRESHOLD_BYTES = 1 << 20  # glibc serves allocations from this size on with their own mappings (mallopt)


def return_freed_memory_promptly() -> bool:
    """On glibc, serve every allocation of at least :data:`MMAP_THRESHOLD_BYTES` with its own mapping
    (``mallopt(M_MMAP_THRESHOLD, ...)``, which also stops glibc from raising that threshold by itself), so that a
    freed activation goes back to the system at once instead of staying resident in the heap (docs/performance.md,
    "Memory on a CPU"). Returns whether the setting was applied (False off glibc)."""
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, MMAP_THRESHOLD_BYTES))  # -3: M_MMAP_THRESHOLD (malloc.h)
    except (OSError, AttributeError):
        return False


@contextlib.contextmanager
def peak_memory(device: str) -> Iterator[Dict[str, object]]:
    """Measure the peak memory of the ``with`` block; yields a dict filled in when the block ends.

    CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (tensors only: no CUDA context, no
    allocator cache). CPU: the process's peak resident set (RSS, every page it holds: libraries, Python objects and
    tensors): the kernel's high-water mark is reset to the current RSS by writing ``5`` to ``/proc/self/clear_refs``
    (Linux ``Documentation/filesystems/proc.rst``) after freed memory was returned (:func:`release_freed_memory`),
    and ``VmHWM`` of ``/proc/self/status`` is read at the end. Where that is not possible (not Linux, no
    permission), ``resource.getrusage(RUSAGE_SELF).ru_maxrss``: the peak since the process started, with a note.

    Args:
        device: ``cuda[:N]`` or ``cpu`` (:func:`qwenft.runtime.default_device` for the process's own).

    Yields:
        ``{"bytes": peak (bytes), "start_bytes": bytes held when the block began, "kind": "cuda_max_allocated" |
        "cpu_peak_rss" | "cpu_max_rss_since_start", "seconds": wall-clock seconds of the block}``, plus ``"note"``
        for the fallback. Filled in even when the block raises.
    """
    import torch

    cuda = device.startswith("cuda")
    result: Dict[str, object] = {}
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
    else:
        release_freed_memory()
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
                refs.write("5")
            reset = True
        except OSError:
            reset = False
        start = _status_bytes("VmRSS") or 0
        reset = reset and start > 0
    began = time.perf_counter()
    try:
        yield result
    finally:
        if cuda:
            torch.cuda.synchronize(device)
            peak, kind, note = torch.cuda.max_memory_allocated(device), "cuda_max_allocated", None
        else:
            peak = _status_bytes("VmHWM") if reset else None
            kind, note = "cpu_peak_rss", None
            if peak is None:
                import resource
                import sys

                scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
                kind = "cpu_max_rss_since_start"
                note = "the RSS high-water mark could not be reset: ru_maxrss, the peak since the process started"
        result.update({"bytes": int(peak), "start_bytes": int(start), "kind": kind,
                       "seconds": round(time.perf_counter() - began, 3), **({"note": note} if note else {})})


def describe_peaks(memory: Dict[str, Dict[str, object]]) -> str:
    """One line for report.md: each phase's peak (GiB, as :func:`peak_memory` measured it) and its seconds."""
    parts = [f"{phase} {int(m['bytes']) / 2**30:.2f} GiB ({m['kind']}, {float(m['seconds']):.1f} s)"
             for phase, m in memory.items() if isinstance(m, dict) and "bytes" in m]
    return "- peak memory: " + ("; ".join(parts) if parts else "not measured")
