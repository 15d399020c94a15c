"""Tokenization rows/s of qwenft's data pipeline: ``datasets.map`` with ``num_proc=2`` vs one process.

The rows are 2,000 real ones from ../shared/data (1,000 GSM8K math problems, question -> instruction and
answer -> output, and 1,000 Chinese Alpaca instructions), read and normalised once. Each arm runs
``qwenft.data.encode.tokenize_rows`` (chat template + response-only labels, the real Qwen2.5 tokenizer of
the embedded model, cache off) on all of them; the arms alternate (1, 2, 1, 2, ...) in one process so that
machine noise hits both. Reported: median rows/s per arm and the ratio parallel / single (target > 1 on
a machine with 2 free cores; process start-up and pickling the 10 MB tokenizer are included, as a user
pays them). Both arms must produce identical tokens.

    python benchmarks/data_tokenization.py            # 2,000 rows, 3 repeats
    python benchmarks/data_tokenization.py --quick    # 500 rows, 1 repeat
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, print_table, save_json  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def load_rows(n: int):
    """``n`` normalised rows: half GSM8K, half Chinese Alpaca."""
    from qwenft.config import DataSource
    from qwenft.data import read_source

    if not SHARED.is_dir():
        raise SystemExit(f"{SHARED} is not present: this benchmark needs the shared real data")
    gsm8k = DataSource(name="gsm8k", path=str(SHARED / "domain/gsm8k/train.jsonl"), max_rows=n // 2,
                       columns={"instruction": "question", "output": "answer"})
    general = DataSource(name="alpaca_zh", path=str(SHARED / "general/alpaca_zh_demo.json"), max_rows=n - n // 2)
    return read_source(gsm8k) + read_source(general)


def run_arm(rows, tokenizer, num_proc: int, fingerprint: str):
    """Tokenize ``rows`` with ``num_proc`` processes; returns ``(seconds, input_ids)``."""
    import datasets

    from qwenft.config import DataConfig, DataSource
    from qwenft.data.encode import tokenize_rows

    dcfg = DataConfig(max_seq_len=1024, num_proc=num_proc, cache=False)
    source = DataSource(name="bench", path="bench.jsonl")
    datasets.disable_progress_bars()
    start = time.perf_counter()
    encoded, _ = tokenize_rows(rows, tokenizer, dcfg, source, "line", fingerprint, "train")
    seconds = time.perf_counter() - start
    return seconds, encoded["input_ids"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="500 rows, 1 repeat")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    n = args.rows or (500 if args.quick else 2000)
    repeats = args.repeats or (1 if args.quick else 3)

    from qwenft.data import tokenizer_fingerprint
    from qwenft.model import embedded_model_dir, load_tokenizer

    tokenizer = load_tokenizer(str(embedded_model_dir()))
    fingerprint = tokenizer_fingerprint(tokenizer)
    rows = load_rows(n)
    run_arm(rows[:64], tokenizer, 1, fingerprint)  # warm-up: jinja compile, imports
    times = {1: [], 2: []}
    reference = None
    for r in range(repeats):
        for num_proc in (1, 2):
            seconds, ids = run_arm(rows, tokenizer, num_proc, fingerprint)
            if reference is None:
                reference = ids
            elif ids != reference:
                raise SystemExit(f"num_proc={num_proc} produced different tokens")
            times[num_proc].append(seconds)
            print(f"repeat {r + 1}/{repeats} num_proc={num_proc}: {seconds:.2f} s, {len(rows) / seconds:.0f} rows/s",
                  flush=True)
    medians = {k: statistics.median(v) for k, v in times.items()}
    rate = {k: len(rows) / medians[k] for k in medians}
    ratio = rate[2] / rate[1]
    tokens = sum(len(x) for x in reference)
    print_table(f"tokenization of {len(rows)} real rows ({tokens:,} tokens), median of {repeats}",
                ["arm", "seconds", "rows/s", "tokens/s"],
                [[f"num_proc={k}" + (" (baseline)" if k == 1 else ""), f"{medians[k]:.2f}", f"{rate[k]:.0f}",
                  f"{tokens / medians[k]:,.0f}"] for k in (1, 2)])
    load = os.getloadavg()
    print(f"\nratio parallel / single: {ratio:.2f}x  ({os.cpu_count()} cores; load average {load[0]:.1f} "
          f"{load[1]:.1f}: a second process only helps when a core is free)")
    save_json("data_tokenization", {
        "environment": {**environment(), "datasets": __import__("datasets").__version__,
                        "tokenizers": __import__("tokenizers").__version__,
                        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM"),
                        "load_average_1_5_15_min": load},
        "settings": {"rows": len(rows), "tokens": tokens, "repeats": repeats, "max_seq_len": 1024,
                     "train_on": "assistant", "batch_size": 64, "data": ["gsm8k train (first half)",
                                                                        "alpaca_zh_demo (second half)"]},
        "seconds": {f"num_proc={k}": v for k, v in times.items()},
        "median_seconds": {f"num_proc={k}": medians[k] for k in medians},
        "rows_per_s": {f"num_proc={k}": rate[k] for k in rate},
        "ratio_parallel_over_single": ratio,
    })


if __name__ == "__main__":
    main()
