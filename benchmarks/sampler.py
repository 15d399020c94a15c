"""Decode tokens/s of qwenft's KV-cached sampler vs transformers' ``model.generate``, greedy, same model.

For each weight format (bf16; NF4 with the configured ``quant.compute_dtype``, ``auto`` by default: bf16
where bf16 matmuls are native, float32 elsewhere) of the embedded Qwen2.5 0.5B model and each batch size
(1, 8), the two arms alternate in one process in ABBA order (ours, HF, HF, ours, ours, HF, ...) so that machine
noise and drift hit both.
Both generate exactly N new tokens (``min_new_tokens = max_new_tokens = N``, greedy, the model's own
repetition_penalty) from the same chat prompts. Decode time is measured the same way for both arms, by a
forward pre-hook on the model: from the start of the first decode forward (the second forward of the call)
to the return of the call, so the prefill is excluded and every per-step cost outside the model (inputs,
processors, token choice, stop checks) is included. Decode tokens/s = ``batch * decode forwards / time``,
median over the repeats. (A difference of whole-call times, T(N) - T(1), is too noisy where the prefill
dominates, as it does on a CPU without native bf16.)

Three ratios are reported. ``ratio``: of the whole-decode rates (median over repeats). ``ratio, median step``:
of ``batch / median step seconds`` (not moved by a single slow step). ``ratio, paired steps``: the median over
every decode step of ``HF step seconds / ours step seconds``, pairing step i of an ours call with step i of the
HF call right after it (the same token fed, the same cache length, seconds apart), with a 95% bootstrap
interval; it removes both the spikes and the drift between repeats. Beside them: the same pairing of the model
forwards alone (``forward_ratio_paired``, ~1.0 when both arms feed the model the same inputs, which they do) and
``ratio_from_host_time`` = (F + host_HF) / (F + host_ours), F the median decode forward of both arms: the step
ratio that follows from the measured host times when the forwards are equal, i.e. what the sampler's own code
decides, without the forward's noise (which at NF4 batch 1 on a CPU is several times the host difference).

Memory-bandwidth floor: a decode step must read every weight once (the input embedding excepted: only
``batch`` rows of it), so one step takes at least ``weight_bytes / bandwidth`` seconds, where bandwidth is
a measured large-tensor copy (STREAM "copy" convention: bytes read + bytes written, per second). The
ceiling is ``batch / floor`` tokens/s; the table shows the fraction of it each arm reaches. Target:
ours / HF >= 1.0.

    python benchmarks/sampler.py            # N=32, 3 repeats, bf16 + NF4, batch 1 + 8
    python benchmarks/sampler.py --quick    # N=16, 1 repeat
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, print_table, save_json  # noqa: E402

QUESTIONS = ["What is 2+2?", "春天的诗", "Write a haiku about the sea.", "Name three primary colors.",
             "Explain recursion in one sentence.", "Translate 'good morning' to French.",
             "What is the capital of Japan, and why is it famous?", "List two prime numbers."]


def copy_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Measured memory bandwidth in bytes/s: ``2 * size / time`` of a large ``dst.copy_(src)`` (median)."""
    import torch

    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages once
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / statistics.median(times)


def weight_bytes_per_step(model) -> int:
    """Bytes of weights a decode step reads: every parameter and quantization state, once, except the input
    embedding matrix (a lookup reads only ``batch`` rows). A packed 4-bit weight counts its packed bytes plus
    its absmax scales (and their own scales under double quantization)."""
    import torch

    embedding = model.get_input_embeddings().weight
    total, counted = 0, set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if param is embedding or id(param) in counted:
                continue
            counted.add(id(param))
            total += param.numel() * param.element_size()
            state = getattr(param, "quant_state", None)
            while state is not None:  # nested states under double quantization
                for name in ("absmax", "code", "offset"):
                    value = getattr(state, name, None)
                    if isinstance(value, torch.Tensor):
                        total += value.numel() * value.element_size()
                state = getattr(state, "state2", None)
    return total


class DecodeClock:
    """Times the decode phase of one generate call through forward hooks on the model.

    Besides decode tokens/s it gives the host time per step spent outside the model (preparing inputs,
    processors, choosing the token, stop checks): the one part of a step in which the two arms differ, and
    a measure that stays stable on a noisy machine because it is taken between adjacent forwards.
    """

    def __init__(self, model):
        import torch

        self.starts, self.ends = [], []
        self.last_steps: list = []  # seconds of each decode step of the last measure() call, in order
        self.last_forwards: list = []  # seconds of each decode forward (the model alone) of that call
        self.cuda = torch.cuda.is_available() and next(model.parameters()).is_cuda
        self.record_inputs = False  # when set, measure() also keeps what every forward was given (last_inputs)
        self.last_inputs: list = []
        # registered first, so its own cost falls outside the timed forward
        self.handles = [model.register_forward_pre_hook(self._record, with_kwargs=True),
                        model.register_forward_pre_hook(lambda *a: self._mark(self.starts)),
                        model.register_forward_hook(lambda *a: self._mark(self.ends))]

    def _record(self, module, args, kwargs):
        """Keep a comparable copy of one forward's inputs: tensor values (small ones) or shape and dtype, and
        the type of anything else (e.g. the cache class)."""
        import torch

        if not self.record_inputs:
            return None
        seen = {}
        for key, value in sorted(kwargs.items()):
            if isinstance(value, torch.Tensor):
                seen[key] = (tuple(value.shape), str(value.dtype),
                             value.tolist() if value.numel() <= 1 << 14 else None)
            elif value is None:  # the same as not passing it
                continue
            elif isinstance(value, (bool, int, float, str)):
                seen[key] = value
            else:
                seen[key] = type(value).__name__
        seen.setdefault("return_dict", True)  # generate passes the model's default explicitly
        self.last_inputs.append(seen)
        return None

    def _mark(self, marks):
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        marks.append(time.perf_counter())

    def measure(self, fn, batch: int):
        """Run ``fn``; returns ``(result, decode tokens/s, median host seconds per decode step outside the model,
        median-step decode tokens/s)``.

        The median-step figure is ``batch / median(step seconds)``, a step being one decode forward plus the host
        work up to the next one (the last step ends when the call returns): unlike the whole-decode rate it is not
        moved by a single slow step, which on a shared machine is the main source of spread between repeats.
        """
        self.starts.clear()
        self.ends.clear()
        self.last_inputs = []
        result = fn()
        end = time.perf_counter()
        decode_forwards = len(self.starts) - 1
        gaps = [self.starts[i + 1] - self.ends[i] for i in range(1, len(self.starts) - 1)]
        steps = [b - a for a, b in zip(self.starts[1:], [*self.starts[2:], end])]
        self.last_steps = steps
        self.last_forwards = [self.ends[i] - self.starts[i] for i in range(1, len(self.starts))]
        return (result, batch * decode_forwards / (end - self.starts[1]), statistics.median(gaps),
                batch / statistics.median(steps))


def bootstrap_median_ci(groups, resamples: int = 2000, seed: int = 0):
    """95% percentile-bootstrap interval ``[low, high]`` of the median of the pooled values of ``groups`` (one
    list per repeat), resampling whole repeats (a cluster bootstrap, Davison & Hinkley 1997, sec. 3.8): the
    steps of one call share the machine's state at that moment, so they are not independent draws. The
    interval is the 2.5th and 97.5th percentiles of ``resamples`` seeded resamples."""
    import random

    rng = random.Random(seed)
    medians = sorted(statistics.median(sum(rng.choices(groups, k=len(groups)), [])) for _ in range(resamples))
    return [medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]]


def bench_model(quant: str, batches, new_tokens: int, repeats: int, bandwidth: float, model_preset=None):
    import torch

    from qwenft.cli.compose import validate
    from qwenft.cli.compose import register_resolvers
    from qwenft.generation.kv_cache import left_pad
    from qwenft.model import load_model
    from qwenft.generation import Sampler

    register_resolvers()
    preset = [f"model={model_preset}"] if model_preset else []
    config = validate("generate", [*preset, f"quant={quant}", "model.dtype=bfloat16"])[0]
    model, tokenizer = load_model(config, device="cpu")
    model.eval()
    sampler = Sampler(model, tokenizer, config.generate)
    weights = weight_bytes_per_step(model)
    compute_dtype = model.lm_head.weight.dtype  # a layer bitsandbytes leaves unquantized
    floor_s = weights / bandwidth
    rows = []
    clock = DecodeClock(model)
    for batch in batches:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
                   for q in (QUESTIONS * batch)[:batch]]
        ids, mask = left_pad(prompts, tokenizer.pad_token_id)

        def ours(n):
            return sampler.generate(prompts, max_new_tokens=n, min_new_tokens=n, do_sample=False)

        def hf(n):
            with torch.inference_mode():
                return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False)

        ours(2), hf(2)  # warm-up
        speeds, host, step_speeds = {"ours": [], "hf": []}, {"ours": [], "hf": []}, {"ours": [], "hf": []}
        internal, tokens, paired, paired_forwards, forwards = [], {}, [], [], []
        same_inputs = None
        arms = {"ours": lambda: ours(new_tokens), "hf": lambda: hf(new_tokens)}
        for repeat in range(repeats):
            clock.record_inputs = repeat == 0  # once: recording costs host time (in both arms alike)
            seen = {}
            # ABBA order (ours first on even repeats, HF first on odd): a machine that speeds up or slows down
            # during the run does not favour the arm that always runs second.
            for arm in (("ours", "hf") if repeat % 2 == 0 else ("hf", "ours")):
                out, speed, gap, step_speed = clock.measure(arms[arm], batch)
                seen[arm] = (clock.last_steps, clock.last_forwards, clock.last_inputs)
                step_speeds[arm].append(step_speed)
                speeds[arm].append(speed)
                host[arm].append(gap)
                if arm == "ours":
                    internal.append(out.stats)
                    tokens["ours"] = [s.token_ids for s in out.sequences]
                else:
                    tokens["hf"] = [row[ids.shape[1]:].tolist() for row in out]
            (ours_steps, ours_forwards, ours_inputs), (hf_steps, hf_forwards, hf_inputs) = seen["ours"], seen["hf"]
            if clock.record_inputs:  # every forward (prefill and decode) given the same inputs in both arms
                same_inputs = ours_inputs == hf_inputs
            if len(hf_steps) == len(ours_steps):  # step i of both arms: same token, same cache length
                paired.append([h / o for o, h in zip(ours_steps, hf_steps)])
                paired_forwards.append([h / o for o, h in zip(ours_forwards, hf_forwards)])
                forwards.extend([*ours_forwards, *hf_forwards])
        result = {"quant": "nf4" if quant == "nf4" else "bf16", "batch": batch, "new_tokens": new_tokens,
                  "compute_dtype": str(compute_dtype).replace("torch.", ""),
                  "repeats": repeats, "same_tokens": tokens["ours"] == tokens["hf"],
                  "same_forward_inputs": same_inputs, "weight_bytes_per_step": weights,
                  "floor_s_per_step": floor_s, "ceiling_tokens_per_s": batch / floor_s}
        for arm in ("ours", "hf"):
            result[f"{arm}_decode_tokens_per_s_runs"] = speeds[arm]
            result[f"{arm}_decode_tokens_per_s"] = statistics.median(speeds[arm])
            result[f"{arm}_host_ms_per_step"] = 1000 * statistics.median(host[arm])
            result[f"{arm}_fraction_of_ceiling"] = result[f"{arm}_decode_tokens_per_s"] / result["ceiling_tokens_per_s"]
        result["ratio"] = result["ours_decode_tokens_per_s"] / result["hf_decode_tokens_per_s"]
        for arm in ("ours", "hf"):
            result[f"{arm}_median_step_tokens_per_s"] = statistics.median(step_speeds[arm])
        result["ratio_median_step"] = result["ours_median_step_tokens_per_s"] / result["hf_median_step_tokens_per_s"]
        if paired:
            result["ratio_paired_steps"] = statistics.median(sum(paired, []))
            result["ratio_paired_steps_ci95"] = bootstrap_median_ci(paired)
            result["paired_steps"] = len(sum(paired, []))
            # The model forward alone, paired the same way: ~1.0 when both arms feed the model the same inputs.
            result["forward_ratio_paired"] = statistics.median(sum(paired_forwards, []))
            result["forward_ratio_paired_ci95"] = bootstrap_median_ci(paired_forwards)
            # Step = forward + host work; with the forwards equal, the step ratio is (F + host_HF) / (F + host_ours),
            # F the median forward of both arms pooled: the part of the ratio the sampler's own code decides.
            forward_s = statistics.median(forwards)
            result["median_forward_ms"] = 1000 * forward_s
            result["ratio_from_host_time"] = ((forward_s + statistics.median(host["hf"]))
                                              / (forward_s + statistics.median(host["ours"])))
        result["ours_internal_decode_tokens_per_s"] = statistics.median(s.decode_tokens_per_s for s in internal)
        result["ours_internal_prefill_tokens_per_s"] = statistics.median(s.prefill_tokens_per_s for s in internal)
        result["kv_cache_bytes"] = internal[-1].kv_cache_bytes
        rows.append(result)
        print(f"  {result['quant']} batch {batch}: ours {result['ours_decode_tokens_per_s']:.1f} tok/s, "
              f"HF {result['hf_decode_tokens_per_s']:.1f} tok/s, ratio {result['ratio']:.3f} (median step "
              f"{result['ratio_median_step']:.3f}, paired steps {result.get('ratio_paired_steps', float('nan')):.3f}); "
              f"host ms/step "
              f"ours {result['ours_host_ms_per_step']:.1f}, HF {result['hf_host_ms_per_step']:.1f}", flush=True)
    for handle in clock.handles:
        handle.remove()
    del model, sampler
    gc.collect()
    return rows


def _paired(result) -> str:
    if "ratio_paired_steps" not in result:
        return "-"
    low, high = result["ratio_paired_steps_ci95"]
    return f"{result['ratio_paired_steps']:.3f} [{low:.3f}, {high:.3f}]"


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N=16 new tokens, 1 repeat")
    parser.add_argument("--new-tokens", type=int, default=None, help="N, tokens generated per row (default 32)")
    parser.add_argument("--repeats", type=int, default=None, help="alternated repeats per arm (default 3)")
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--quants", default="none,nf4", help="comma-separated: none (bf16) and/or nf4")
    parser.add_argument("--model", default=None,
                        help="model preset (conf/model, e.g. tiny-random for a smoke run); default: the embedded 0.5B")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's); 1 avoids oversubscription on a shared machine")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    new_tokens = args.new_tokens or (16 if args.quick else 32)
    repeats = args.repeats or (1 if args.quick else 3)
    batches = [int(b) for b in args.batches.split(",")]
    bandwidth = copy_bandwidth(128 if args.quick else 256)
    print(f"copy bandwidth: {bandwidth / 1e9:.2f} GB/s (read + write)", flush=True)
    rows = []
    for quant in args.quants.split(","):
        rows.extend(bench_model(quant, batches, new_tokens, repeats, bandwidth, args.model))
    print_table(f"decode tokens/s, greedy, {new_tokens} new tokens, median of {repeats} (ours vs transformers)",
                ["weights", "batch", "ours tok/s", "HF tok/s", "ratio", "ratio (median step)",
                 "ratio (paired steps) [95% CI]", "forward ratio (paired)", "ratio from host time",
                 "host ms/step ours|HF", "same forward inputs",
                 "ceiling tok/s",
                 "ours frac", "HF frac", "same tokens"],
                [[r["quant"], r["batch"], f"{r['ours_decode_tokens_per_s']:.1f}", f"{r['hf_decode_tokens_per_s']:.1f}",
                  f"{r['ratio']:.3f}", f"{r['ratio_median_step']:.3f}", _paired(r),
                  f"{r.get('forward_ratio_paired', float('nan')):.3f}", f"{r.get('ratio_from_host_time', float('nan')):.4f}",
                  f"{r['ours_host_ms_per_step']:.1f} | {r['hf_host_ms_per_step']:.1f}", r["same_forward_inputs"],
                  f"{r['ceiling_tokens_per_s']:.1f}", f"{r['ours_fraction_of_ceiling']:.1%}",
                  f"{r['hf_fraction_of_ceiling']:.1%}", r["same_tokens"]] for r in rows])
    save_json("sampler", {"benchmark": "sampler", "environment": environment(), "copy_bandwidth_bytes_per_s": bandwidth,
                          "settings": {"new_tokens": new_tokens, "repeats": repeats, "batches": batches,
                                       "quants": args.quants, "threads": _threads(),
                                       "decoding": "greedy, min_new_tokens=max_new_tokens",
                                       "model": args.model or "embedded Qwen2.5-Coder-0.5B-Instruct"},
                          "results": rows, "target": "ratio >= 1.0"})


if __name__ == "__main__":
    main()
