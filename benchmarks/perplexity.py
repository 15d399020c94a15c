"""Perplexity tokens/s of qwenft's evaluator: windows batched (eval batch 8) vs one window per forward.

Both arms call ``qwenft.evaluate.perplexity.perplexity_of_ids`` on the same model and the same token ids (the
first N tokens of WikiText-2 test, raw, ``../shared/data/ppl/wiki.test.raw``) with the same sliding window and
stride; only ``batch_size`` differs. The arms alternate in one process (single, batched, batched, single, ...)
so that machine noise hits both. Reported: scored tokens/s per arm (median over the repeats; each token is
scored once, so both arms score exactly the same tokens) and the ratio batched / single (target >= 1.0).

Both arms must give the same perplexity: the script stops with an error when the scored token counts differ
or the perplexities differ by more than 1e-4 relative. Only fp32 rounding may separate them: a batch of 8
windows runs the matmuls with other shapes, hence another summation order, than one window (about 1e-6
relative per logit), and the last batch's right padding is masked out; the NLLs are summed in float64.
Scoring one token wrongly (a padded position, a context-only position, an off-by-one label) moves the
perplexity of N = 288 tokens by about ``|nll_t - mean| / N`` ~ 1e-2 relative, a hundred times the tolerance.

Model: the embedded Qwen2.5-Coder-0.5B-Instruct, ``quant=none``, ``model.dtype=auto`` (float32 on a CPU
without native bf16). ``--quick``: the tiny-random model and its tokenizer, for a smoke run (seconds).

    python benchmarks/perplexity.py            # 288 tokens, window 64, stride 32 (8 windows), batch 8, 2 repeats
    python benchmarks/perplexity.py --tokens 2048 --window 256 --stride 128    # longer (~15 min on 2 cores)
    python benchmarks/perplexity.py --quick    # tiny-random, 512 tokens, 1 repeat

The default is small because the 0.5B model in float32 pushes only ~7-30 tokens/s through a forward on 2 cores
(its 151,936-word lm_head is a fifth of the compute): 8 windows of 64 tokens are exactly one eval batch of 8,
512 tokens through the model per pass. Measured with other jobs on the machine (load average 5): 4.5 minutes
in all, the batch-1 passes 65-85 s each (many small forwards suffer most from busy cores), the batched ones 19 s;
on 2 idle cores it should take well under half of that.

Skips (exit status 0, a line starting with ``SKIPPED:``, no JSON) when the WikiText file is absent.
Results: benchmarks/results/perplexity.json (perplexity_quick.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, print_table, save_json  # noqa: E402

WIKI = Path(__file__).resolve().parents[2] / "shared" / "data" / "ppl" / "wiki.test.raw"
TOLERANCE = 1e-4  # relative perplexity difference allowed between the arms (see the module docstring)


def text_ids(tokenizer, path: Path, n_tokens: int):
    """The first ``n_tokens`` token ids of the text file at ``path`` (fewer when the file is shorter)."""
    text = path.read_text(encoding="utf-8")
    chars = n_tokens * 6  # WikiText averages ~4.5 characters per Qwen token; grow the slice until it suffices
    while True:
        ids = tokenizer(text[:chars], add_special_tokens=False).input_ids
        if len(ids) > n_tokens or chars >= len(text):
            return ids[:n_tokens]
        chars *= 2


def run_arm(model, ids, window: int, stride: int, batch_size: int, pad_id: int):
    """One timed perplexity pass; returns ``(seconds, Perplexity)``."""
    from qwenft.evaluate.perplexity import perplexity_of_ids

    start = time.perf_counter()
    result = perplexity_of_ids(model, [ids], window=window, stride=stride, batch_size=batch_size, pad_id=pad_id)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny-random model, 512 tokens, 1 repeat")
    parser.add_argument("--tokens", type=int, default=None, help="first N tokens of the text (default 288)")
    parser.add_argument("--window", type=int, default=64, help="tokens per window (eval.ppl_window)")
    parser.add_argument("--stride", type=int, default=32, help="tokens between window starts (eval.ppl_stride)")
    parser.add_argument("--batch", type=int, default=8, help="windows per forward in the batched arm")
    parser.add_argument("--repeats", type=int, default=None, help="timed passes per arm (default 2; quick 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if not WIKI.is_file():
        print(f"SKIPPED: {WIKI} is not present (this benchmark reads the shared WikiText-2 test file)")
        return
    import torch

    from qwenft.model import load_model
    from tests.conftest import compose_config

    if args.threads:
        torch.set_num_threads(args.threads)
    n_tokens = args.tokens or (512 if args.quick else 288)
    repeats = args.repeats or (1 if args.quick else 2)
    overrides = ["model=tiny-random"] if args.quick else []
    config = compose_config(*overrides, "quant=none", "out_dir=/tmp/qwenft-bench-perplexity", command="eval")
    model, tokenizer = load_model(config, device="cpu")
    model.eval()
    ids = text_ids(tokenizer, WIKI, n_tokens)
    pad_id = tokenizer.pad_token_id
    from qwenft.evaluate.perplexity import windows

    spans = windows(len(ids), args.window, args.stride)
    processed = sum(end - begin for begin, end, _ in spans)
    print(f"{config.model.name} ({model.dtype}): {len(ids)} tokens, {len(spans)} windows of <= {args.window} "
          f"(stride {args.stride}), {processed} tokens through the model per pass", flush=True)
    arms = {"single": 1, "batched": args.batch}
    head = ids[:min(len(ids), args.window + 1)]
    for size in arms.values():  # warm-up: kernels, thread pools, allocator
        run_arm(model, head, args.window, args.stride, size, pad_id)
    seconds = {arm: [] for arm in arms}
    results = {}
    for r in range(repeats):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for arm in order:
            took, result = run_arm(model, ids, args.window, args.stride, arms[arm], pad_id)
            seconds[arm].append(took)
            results[arm] = result
            print(f"repeat {r + 1}/{repeats} {arm} (batch {arms[arm]}): {took:.2f} s, "
                  f"{result.tokens / took:.1f} scored tokens/s, perplexity {result.perplexity:.4f}", flush=True)
    single, batched = results["single"], results["batched"]
    if single.tokens != batched.tokens:
        raise SystemExit(f"the arms scored different token counts: {single.tokens} vs {batched.tokens}")
    rel_diff = abs(batched.perplexity / single.perplexity - 1)
    if not rel_diff <= TOLERANCE:
        raise SystemExit(f"batched perplexity {batched.perplexity!r} differs from batch-1 {single.perplexity!r} "
                         f"by {rel_diff:.2e} relative (tolerance {TOLERANCE:g})")
    medians = {arm: statistics.median(v) for arm, v in seconds.items()}
    rate = {arm: single.tokens / medians[arm] for arm in arms}
    ratio = rate["batched"] / rate["single"]
    print_table(f"perplexity of {single.tokens} scored tokens ({config.model.name}, window {args.window}, stride "
                f"{args.stride}), median of {repeats}",
                ["arm", "batch", "seconds", "scored tok/s", "model tok/s", "perplexity"],
                [[arm, arms[arm], f"{medians[arm]:.2f}", f"{rate[arm]:.1f}", f"{processed / medians[arm]:.1f}",
                  f"{results[arm].perplexity:.4f}"] for arm in arms])
    print(f"\nratio batched / single tokens/s: {ratio:.3f} (target >= 1.0); perplexities agree to {rel_diff:.1e}")
    save_json("perplexity_quick" if args.quick else "perplexity", {
        "benchmark": "perplexity", "environment": environment(),
        "settings": {"model": config.model.name, "dtype": str(model.dtype).replace("torch.", ""), "quant": "none",
                     "text": str(WIKI), "tokens": len(ids), "window": args.window, "stride": args.stride,
                     "batch": args.batch, "repeats": repeats, "threads": torch.get_num_threads(),
                     "windows": len(spans), "tokens_through_model_per_pass": processed},
        "seconds": seconds, "median_seconds": medians, "scored_tokens_per_s": rate,
        "perplexity": {arm: results[arm].perplexity for arm in arms}, "scored_tokens": single.tokens,
        "relative_difference": rel_diff, "tolerance": TOLERANCE,
        "ratio_batched_over_single": ratio, "target": "ratio >= 1.0",
    })


if __name__ == "__main__":
    main()
