"""The CPU benchmark suite: every ratio benchmark, one after another, then one summary (suite.json + a table).

Each benchmark runs as its own child process (``python benchmarks/NAME.py OPTIONS``: a fresh interpreter, so
memory from one never weighs on the next), with options sized so that the whole suite takes under 20 minutes
on 2 idle cores. Measured on an idle machine (2026-11-29): 8.8 minutes with one sampler repeat (sampler 2.4,
train step 4.0 with 2 rounds of 4 steps, tokenization 0.5, perplexity 1.0, plan accuracy 0.9); one repeat left
the sampler's ratios at the mercy of a single call (0.83-1.08), so it now runs 3 repeats (~4.5 min). A busy
machine takes longer (the quick suite alone took 7 minutes at load average 5.5). Each child writes its own JSON;
the suite collects the ratios from them:

==================  ============================================================  ======================
benchmark           ratio(s)                                                      target
==================  ============================================================  ======================
sampler             ours / transformers decode tokens/s, per weights and batch    >= 1.0
train_step          qwenft / plain Trainer + peft seconds per step                <= 1.05
data_tokenization   num_proc=2 / num_proc=1 rows per second                       > 1 with 2 free cores
perplexity          batched (8 windows) / one window per forward, tokens/s        >= 1.0
plan_accuracy       planned / measured peak memory of a training step, per case   within 15%
bench_eval          qwenft / lm-eval HFLM MMLU questions/s, per dtype             >= 3
dpo_step            qwenft / TRL DPOTrainer seconds per step; peak RSS            <= 1.0; <= 0.8
==================  ============================================================  ======================

bench_eval (4 MMLU subjects x 6 questions, float32 then bfloat16) was added after the timings above and is not
in them: alone it took 9.6 minutes at load average 5-7 (2026-12-01); not yet timed on idle cores.
dpo_step (2 rounds: 4 processes of 3 DPO steps on the 0.5B) was added later too: standalone, 3 rounds took 5.9
minutes with one torch thread a process at load average 1.4-2.6 and 11.9 minutes with torch's two at load 1-4
(2026-12-07), so about 4-8 minutes in the suite; not yet timed inside it.

    python -m benchmarks                  # the suite (benchmarks/results/*.json + suite.json), < 20 min
    python -m benchmarks --quick          # every script in its --quick mode (tiny models), results/quick/
    python -m benchmarks --only perplexity,train_step
    python -m benchmarks --quiet          # only the summary (a failing benchmark's output tail is shown)

A benchmark that fails does not stop the suite; the exit status is 1 when any failed. A benchmark whose data
is absent reports ``SKIPPED`` and counts as skipped. The GPU check is separate: ``bash benchmarks/gpu/run.sh``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, environment, print_table, save_json  # noqa: E402

HERE = Path(__file__).resolve().parent


def _sampler(d: dict) -> Dict[str, float]:
    return {f"{r['quant']}_batch{r['batch']}": r["ratio"] for r in d["results"]}


def _plan(d: dict) -> Dict[str, float]:
    return {r["case"]: 1 + r["peak_error"] for r in d["results"]}


# name, full-suite options, quick options, ratio extractor, what the ratio is, target
SUITE: List[Tuple[str, List[str], List[str], Callable[[dict], Dict[str, float]], str, str]] = [
    # bf16 GEMMs are ~20x slower than fp32 on an AVX2-only CPU, and the bf16 batch-8 prefill dominates: few tokens.
    ("sampler", ["--new-tokens", "8", "--repeats", "3"], ["--quick", "--model", "tiny-random", "--new-tokens", "4"],
     _sampler, "ours / transformers decode tokens/s", ">= 1.0"),
    ("train_step", ["--rounds", "2", "--steps", "4"], ["--quick"],
     lambda d: {"qwenft_over_plain": d["ratio_qwenft_over_plain"]}, "qwenft / plain seconds per step", "<= 1.05"),
    ("data_tokenization", [], ["--quick"],
     lambda d: {"parallel_over_single": d["ratio_parallel_over_single"]}, "num_proc=2 / num_proc=1 rows/s", "> 1"),
    ("perplexity", [], ["--quick"],
     lambda d: {"batched_over_single": d["ratio_batched_over_single"]}, "batched / batch-1 scored tokens/s",
     ">= 1.0"),
    ("plan_accuracy", [], ["--quick"], _plan, "planned / measured peak memory", "within 1 +- 0.15"),
    ("bench_eval", [], ["--quick"], lambda d: dict(d["ratio_qwenft_over_hflm"]),
     "qwenft / lm-eval HFLM MMLU questions/s", ">= 3"),
    # each arm a fresh interpreter per round: 2 rounds (ABBA) keep it to 4 children
    ("dpo_step", ["--rounds", "2"], ["--quick", "--rounds", "2"],
     lambda d: {"time_qwenft_over_trl": d["ratio_qwenft_over_trl"],
                "memory_qwenft_over_trl": d["memory_ratio_qwenft_over_trl"]},
     "qwenft / TRL DPOTrainer s/step; peak RSS", "<= 1.0; <= 0.8"),
]
NAMES = [entry[0] for entry in SUITE]


def run_one(name: str, options: List[str], out_dir: Path, quiet: bool) -> Dict[str, Any]:
    """Run ``benchmarks/NAME.py OPTIONS`` with ``OUT=out_dir``; returns status, seconds, JSON path, output tail."""
    command = [sys.executable, str(HERE / f"{name}.py"), *options]
    env = dict(os.environ, OUT=str(out_dir), HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"),
               WANDB_MODE=os.environ.get("WANDB_MODE", "offline"),
               TOKENIZERS_PARALLELISM=os.environ.get("TOKENIZERS_PARALLELISM", "false"))
    if not quiet:
        print(f"\n=== {name}: {' '.join(command[1:])}", flush=True)
    tail: deque = deque(maxlen=60)
    saved, skipped = [], None
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=HERE.parent, bufsize=1)
    assert proc.stdout is not None
    for line in proc.stdout:
        tail.append(line)
        if not quiet:
            sys.stdout.write(line)
            sys.stdout.flush()
        if line.startswith("saved "):
            saved.append(line[len("saved "):].strip())
        elif line.startswith("SKIPPED:"):
            skipped = line[len("SKIPPED:"):].strip()
    returncode = proc.wait()
    seconds = time.perf_counter() - start
    status = "ok" if returncode == 0 and saved else "skipped" if returncode == 0 and skipped else "failed"
    if status == "failed" and quiet:
        sys.stdout.write(f"\n=== {name} failed (exit status {returncode}); last lines:\n" + "".join(tail))
    return {"name": name, "status": status, "returncode": returncode, "seconds": seconds, "command": command[1:],
            "json": saved[-1] if saved else None, "skip_reason": skipped}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every script in its --quick mode (tiny models)")
    parser.add_argument("--only", default=None, help=f"comma-separated subset of: {','.join(NAMES)}")
    parser.add_argument("--out", default=None, help="results folder (default: $OUT, else benchmarks/results, "
                                                    "benchmarks/results/quick with --quick)")
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    args = parser.parse_args(argv)
    chosen = NAMES if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in NAMES]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(NAMES)}")
    out_dir = Path(args.out or os.environ.get("OUT") or (RESULTS / "quick" if args.quick else RESULTS)).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    entries = []
    for name, full, quick, extract, meaning, target in SUITE:
        if name not in chosen:
            continue
        entry = run_one(name, quick if args.quick else full, out_dir, args.quiet)
        entry.update({"ratio_meaning": meaning, "target": target, "ratios": {}})
        if entry["status"] == "ok":
            try:
                entry["ratios"] = extract(json.loads(Path(entry["json"]).read_text(encoding="utf-8")))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                entry.update(status="failed", error=f"reading {entry['json']}: {type(exc).__name__}: {exc}")
        entries.append(entry)
        if not args.quiet:
            print(f"=== {name}: {entry['status']} in {entry['seconds']:.0f} s", flush=True)
    total = time.perf_counter() - started
    print_table(f"benchmark suite{' (quick)' if args.quick else ''}: {total / 60:.1f} min",
                ["benchmark", "status", "seconds", "ratio(s)", "target", "JSON"],
                [[e["name"], e["status"], f"{e['seconds']:.0f}",
                  ", ".join(f"{k} {v:.3f}" for k, v in e["ratios"].items()) or e.get("skip_reason") or "-",
                  e["target"], e["json"] or "-"] for e in entries])
    save_json("suite", {"suite": "cpu", "quick": args.quick, "environment": environment(), "total_seconds": total,
                        "benchmarks": entries}, out_dir)
    return 1 if any(e["status"] == "failed" for e in entries) else 0


if __name__ == "__main__":
    sys.exit(main())
