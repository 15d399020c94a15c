"""``qwenft data`` at 10k / 100k / 1M rows vs a plain ``load_dataset("json")`` + batched ``map`` (issue 28, item 7).

Rows: alpaca rows ``{instruction, input, output}`` generated from ../shared/data (``general/alpaca_en_demo.json``
and, when present, ``domain/gsm8k/train.jsonl`` with question -> instruction and answer -> output), interleaved
and repeated to N rows; every row's instruction starts with ``[RUN:i] `` (RUN: a token of this run, i: the row),
so every row is unique and a cache from an earlier run never answers the first qwenft arm. One JSON Lines file per
size, in a temporary folder removed at the end.

Per size, each arm is its own child process (a fresh interpreter; wall time and peak RSS from ``os.wait4``, which
counts the child and every process it waited for, e.g. ``datasets.map`` workers, by the largest one):

1. ``qwenft``: ``python -m qwenft data 'data.sources=[{name: bench, path: FILE}]'`` (the embedded model's
   tokenizer, max_seq_len 1024, defaults otherwise: read, validate, template + response-only masks, statistics,
   preview; the tokenized cache on, a miss);
2. ``plain``: ``datasets.load_dataset("json", data_files=FILE)`` (its own fresh cache folder) and one batched
   ``map`` (batch 1,000) with ``tokenizer.apply_chat_template(conversations, tokenize=True)`` (the same
   tokenizer's ChatML template, token ids only: no masks, no truncation, no statistics), what a user writes by hand;
3. ``qwenft (cache hit)``: the qwenft command again on the same file: its wall time, and the seconds it reports as
   "data ready in" (tokenizer load + build: what a second run spends on data before training starts).

Both wall times include the interpreter, imports and the tokenizer load (what a user waits for); the plain child
also reports the seconds of its load and map alone. The qwenft cache entries the run made are removed at the end
(their size on disk is recorded): the qwenft children run with a cache folder of their own whose
models are links to the real cache's. Reported per size: wall seconds and peak RSS per arm, the ratios qwenft / plain
(targets of issue 28 at 100k and 1M: wall <= 1.0x; peak RSS at 1M <= 1.5 GB and <= 300 MB above the 100k peak).

    python benchmarks/data_scale.py                        # 10k, 100k, 1M rows (1M: qwenft alone ~7.5 min idle)
    python benchmarks/data_scale.py --rows 10000,100000
    python benchmarks/data_scale.py --quick                # 2,000 rows (the test)
    python benchmarks/data_scale.py --shared /work/shared/data   # where the shared data lives

A missing ../shared/data/general/alpaca_en_demo.json prints ``SKIPPED: ...`` and exits 0.
Results: benchmarks/results/data_scale.json (data_scale_quick.json).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, print_table, save_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
ALPACA, GSM8K = "general/alpaca_en_demo.json", "domain/gsm8k/train.jsonl"
MB = 1 << 20


def base_rows(shared: Path) -> List[Dict[str, str]]:
    """The shared alpaca rows and GSM8K problems as alpaca rows, interleaved (one GSM8K problem per alpaca row
    while both last, then the rest of the longer file)."""
    alpaca = [{"instruction": r["instruction"], "input": r.get("input", ""), "output": r["output"]}
              for r in json.loads((shared / ALPACA).read_text(encoding="utf-8"))]
    gsm8k = []
    if (shared / GSM8K).is_file():
        lines = (shared / GSM8K).read_text(encoding="utf-8").splitlines()
        gsm8k = [{"instruction": r["question"], "input": "", "output": r["answer"]}
                 for r in map(json.loads, filter(str.strip, lines))]
    mixed = [row for pair in zip(alpaca, gsm8k) for row in pair]
    n = min(len(alpaca), len(gsm8k))
    return mixed + alpaca[n:] + gsm8k[n:]


def write_rows(path: Path, base: List[Dict[str, str]], n: int, run: str) -> int:
    """Write ``n`` unique rows (``[RUN:i] `` before each instruction) as JSON Lines; returns the file's bytes."""
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            row = base[i % len(base)]
            f.write(json.dumps({**row, "instruction": f"[{run}:{i}] {row['instruction']}"}, ensure_ascii=False))
            f.write("\n")
    return path.stat().st_size


def measured(command: List[str], env: Dict[str, str], cwd: Path, log: Path) -> Dict[str, Any]:
    """Run ``command`` as a child process, its output to ``log``; returns exit status, wall seconds, peak RSS.

    The disk writes still pending from the arm before (gigabytes at 1M rows: the qwenft entry, the plain arm's
    datasets cache) are flushed first (``os.sync``, not timed): otherwise their write-back competes with this arm's
    reads (a cache hit on 1M rows measured 30-38 s right after the plain arm, 13-15 s after a flush)."""
    os.sync()
    with log.open("w", encoding="utf-8") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's rusage: ru_maxrss in KiB on Linux
        seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"exit": proc.returncode, "seconds": seconds, "peak_rss_bytes": usage.ru_maxrss * 1024}


def plain_arm(file: str, tokenizer_dir: str, cache: str) -> None:
    """The baseline child: load the JSON Lines file with ``datasets``, map the chat template to token ids."""
    start = time.perf_counter()
    import datasets
    import pyarrow.compute as pc
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    loaded = time.perf_counter()
    dataset = datasets.load_dataset("json", data_files=file, split="train", cache_dir=cache)

    def encode(batch):
        conversations = [[{"role": "user", "content": f"{q}\n\n{x}" if x else q},
                          {"role": "assistant", "content": a}]
                         for q, x, a in zip(batch["instruction"], batch["input"], batch["output"])]
        return {"input_ids": tokenizer.apply_chat_template(conversations, tokenize=True, return_dict=False)}

    read = time.perf_counter()
    encoded = dataset.map(encode, batched=True, batch_size=1000, remove_columns=dataset.column_names)
    done = time.perf_counter()
    tokens = pc.sum(pc.list_value_length(encoded.data.column("input_ids"))).as_py()
    print("PLAIN " + json.dumps({"rows": len(encoded), "tokens": tokens, "startup_s": loaded - start,
                                 "load_s": read - loaded, "map_s": done - read}))


def qwenft_counts(log: Path) -> Dict[str, Any]:
    """Training examples, cache hits/misses and the data seconds (``data_s``: the tokenizer's load and the build,
    what a second run spends on data before training starts; the rest of the wall time is the interpreter, imports
    and printing) from a ``qwenft data`` output (None where not found)."""
    text = log.read_text(encoding="utf-8", errors="replace")
    examples = re.search(r"training examples: (\d+)", text)
    cache = re.search(r"tokenized cache: (\d+) hit\(s\), (\d+) miss", text)
    ready = re.search(r"data ready in ([\d.]+) s \(tokenizer ([\d.]+) s, build ([\d.]+) s\)", text)
    return {"train_examples": int(examples.group(1)) if examples else None,
            "cache_hits": int(cache.group(1)) if cache else None,
            "cache_misses": int(cache.group(2)) if cache else None,
            "data_s": float(ready.group(1)) if ready else None,
            "tokenizer_s": float(ready.group(2)) if ready else None,
            "build_s": float(ready.group(3)) if ready else None}


def tail(log: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a child's output, for a failure message."""
    return "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


def run_size(n: int, base, work: Path, env: Dict[str, str], tokenizer_dir: str, run: str) -> Dict[str, Any]:
    """The three arms on ``n`` generated rows (``env``'s ``QWENFT_CACHE``: this run's own cache, see :func:`main`)."""
    file = work / f"rows_{n}.jsonl"
    size = write_rows(file, base, n, run)
    data_cache = Path(env["QWENFT_CACHE"]) / "data"
    qwenft = [sys.executable, "-m", "qwenft", "data", f"data.sources=[{{name: bench, path: {file}}}]",
              "data.max_seq_len=1024", "model=qwen2.5-coder-0.5b-embedded"]
    result: Dict[str, Any] = {"rows": n, "file_bytes": size}
    arms = [("qwenft", qwenft), ("plain", [sys.executable, str(Path(__file__).resolve()), "--plain-arm", str(file),
                                           tokenizer_dir, str(work / f"hf_cache_{n}")]),
            ("qwenft_cache_hit", qwenft)]
    made: List[Path] = []
    try:
        for name, command in arms:
            log = work / f"{name}_{n}.log"
            arm = measured(command, env, ROOT, log)
            if arm["exit"] != 0:
                raise SystemExit(f"{name} on {n} rows failed (exit status {arm['exit']}):\n{tail(log)}")
            if name == "plain":
                line = next(x for x in log.read_text().splitlines() if x.startswith("PLAIN "))
                arm.update(json.loads(line[len("PLAIN "):]))
            else:
                arm.update(qwenft_counts(log))
                if arm["train_examples"] != n:
                    raise SystemExit(f"{name} on {n} rows used {arm['train_examples']} examples:\n{tail(log)}")
            result[name] = arm
            print(f"{n} rows, {name}: {arm['seconds']:.1f} s, peak RSS {arm['peak_rss_bytes'] / MB:.0f} MB",
                  flush=True)
        if (result["qwenft"]["cache_misses"], result["qwenft_cache_hit"]["cache_hits"]) != (1, 1):
            raise SystemExit(f"expected a cache miss then a hit: {result['qwenft']}, {result['qwenft_cache_hit']}")
    finally:  # the entries this size made: measured, then removed (a 1M-row entry is gigabytes)
        made = sorted(data_cache.iterdir()) if data_cache.is_dir() else []
        result["qwenft_cache_bytes"] = sum(f.stat().st_size for d in made for f in d.rglob("*") if f.is_file())
        shutil.rmtree(data_cache, ignore_errors=True)
    result["ratio_wall_qwenft_over_plain"] = result["qwenft"]["seconds"] / result["plain"]["seconds"]
    result["ratio_rss_qwenft_over_plain"] = result["qwenft"]["peak_rss_bytes"] / result["plain"]["peak_rss_bytes"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="10000,100000,1000000", help="comma-separated sizes")
    parser.add_argument("--quick", action="store_true", help="2,000 rows")
    parser.add_argument("--shared", default=str(SHARED), help="the shared data folder (default: %(default)s)")
    parser.add_argument("--plain-arm", nargs=3, metavar=("FILE", "TOKENIZER_DIR", "CACHE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_arm:
        plain_arm(*args.plain_arm)
        return
    shared = Path(args.shared)
    if not (shared / ALPACA).is_file():
        print(f"SKIPPED: {shared / ALPACA} is not present (the rows are generated from the shared data)")
        return
    sizes = [2000] if args.quick else [int(s.replace("_", "")) for s in args.rows.split(",") if s.strip()]

    from qwenft.model import embedded_model_dir
    from qwenft.runtime import cache_dir

    tokenizer_dir = str(embedded_model_dir())  # converted once, before any arm (not timed)
    base = base_rows(shared)
    # TOKENIZERS_PARALLELISM as the user has it (unset: the tokenizers library's default, its batch encoding on
    # every core, in both arms); it is recorded with the results
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", COLUMNS="120",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = f"{os.getpid():x}{int(time.time()) % 100000:x}"
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="qwenft-data-scale-"))
    # The qwenft arms get a cache of their own, holding links to the real cache's models, so that their data
    # entries are theirs alone to measure and remove (another process may write the real cache meanwhile).
    own_cache = work / "qwenft-cache"
    own_cache.mkdir()
    for entry in cache_dir().iterdir() if cache_dir().is_dir() else []:
        if entry.name != "data":
            (own_cache / entry.name).symlink_to(entry.resolve())
    env["QWENFT_CACHE"] = str(own_cache)
    try:
        results = [run_size(n, base, work, env, tokenizer_dir, run) for n in sizes]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    print_table(f"qwenft data vs load_dataset + map(apply_chat_template), {len(base)} base rows, every row unique",
                ["rows", "qwenft s", "qwenft MB", "plain s", "plain MB", "wall ratio", "RSS ratio", "2nd run s",
                 "2nd run data s", "plain map s"],
                [[f"{r['rows']:,}", f"{r['qwenft']['seconds']:.1f}", f"{r['qwenft']['peak_rss_bytes'] / MB:.0f}",
                  f"{r['plain']['seconds']:.1f}", f"{r['plain']['peak_rss_bytes'] / MB:.0f}",
                  f"{r['ratio_wall_qwenft_over_plain']:.2f}x", f"{r['ratio_rss_qwenft_over_plain']:.2f}x",
                  f"{r['qwenft_cache_hit']['seconds']:.1f}", f"{r['qwenft_cache_hit']['data_s']:.1f}",
                  f"{r['plain']['map_s']:.1f}"] for r in results])
    print(f"\nload average before {load_before[0]:.1f}, after {load_after[0]:.1f} ({os.cpu_count()} cores)")
    save_json("data_scale_quick" if args.quick else "data_scale", {
        "environment": {**environment(), "datasets": __import__("datasets").__version__,
                        "tokenizers": __import__("tokenizers").__version__,
                        "load_average_before_after": [load_before, load_after],
                        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "(unset)")},
        "settings": {"sizes": sizes, "base_rows": len(base), "max_seq_len": 1024, "plain_batch_size": 1000,
                     "tokenizer": "qwen2.5-coder-0.5b-embedded", "data": [ALPACA, GSM8K], "quick": args.quick},
        "results": results,
    })


if __name__ == "__main__":
    main()
