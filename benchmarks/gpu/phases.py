"""Memory and bandwidth measures, the training rows and the alternated decode of the one-GPU check (qlora_7b.py;
the training arms are in train_arms.py)."""

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


def decode_phase(model, tokenizer, args, memory, bandwidth: float) -> List[dict]:
    """Greedy decode of ``args.new_tokens`` tokens per row at each of ``args.decode_batches``, qwenft's sampler and
    ``model.generate`` alternating (``args.repeats`` timed calls each, after a 2-token warm-up)."""
    import torch

    from benchmarks.sampler import DecodeClock, weight_bytes_per_step
    from qwenft.config import GenerateConfig
    from qwenft.generation import Sampler

    device = next(model.parameters()).device
    sampler = Sampler(model, tokenizer, GenerateConfig())  # every setting from the model's generation_config
    weights = weight_bytes_per_step(model)
    floor = weights / bandwidth
    clock = DecodeClock(model)
    generator = torch.Generator().manual_seed(args.seed + 1)
    vocab = model.config.vocab_size
    n = args.new_tokens
    rows = []
    for batch in args.decode_batches:
        prompts = torch.randint(3, vocab, (batch, args.prompt_len), generator=generator)
        ids = prompts.to(device)
        mask = torch.ones_like(ids)
        lists = prompts.tolist()

        def ours(k):
            return sampler.generate(lists, max_new_tokens=k, min_new_tokens=k, do_sample=False)

        def hf(k):
            with torch.inference_mode():
                return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k,
                                      do_sample=False)

        ours(2), hf(2)  # warm-up
        speeds, peaks, tokens = {"ours": [], "hf": []}, {"ours": 0, "hf": 0}, {}
        kv_bytes = 0
        for _ in range(args.repeats):
            for arm, fn in (("ours", ours), ("hf", hf)):
                memory.reset()
                out, speed, _, _ = clock.measure(lambda: fn(n), batch)
                peaks[arm] = max(peaks[arm], memory.peak())
                speeds[arm].append(speed)
                if arm == "ours":
                    tokens[arm] = [s.token_ids for s in out.sequences]
                    kv_bytes = out.stats.kv_cache_bytes
                else:
                    tokens[arm] = out[:, ids.shape[1]:].tolist()
        row = {"batch": batch, "new_tokens": n, "prompt_len": args.prompt_len,
               "same_tokens": tokens["ours"] == tokens["hf"],
               "generated_per_row": [len(t) for t in tokens["ours"]], "weight_bytes_per_step": weights,
               "floor_s_per_step": floor, "ceiling_tokens_per_s": batch / floor, "kv_cache_bytes": kv_bytes}
        for arm in ("ours", "hf"):
            row[f"{arm}_tokens_per_s_runs"] = speeds[arm]
            row[f"{arm}_tokens_per_s"] = statistics.median(speeds[arm])
            row[f"{arm}_fraction_of_ceiling"] = row[f"{arm}_tokens_per_s"] / row["ceiling_tokens_per_s"]
            row[f"{arm}_peak_memory_bytes"] = peaks[arm]
        row["ratio"] = row["ours_tokens_per_s"] / row["hf_tokens_per_s"]
        rows.append(row)
        print(f"  decode batch {batch}: ours {row['ours_tokens_per_s']:.1f} tok/s, HF {row['hf_tokens_per_s']:.1f} "
              f"tok/s, ratio {row['ratio']:.3f}, same tokens {row['same_tokens']}", flush=True)
    for handle in clock.handles:
        handle.remove()
    return rows
