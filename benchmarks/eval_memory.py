"""The evaluation's peak memory after ``train`` vs a later ``qwenft eval`` of the same adapter vs ``qwenft plan``.

Issue 26, item 7: the evaluation that runs at the end of ``train`` (``eval.after_train``) should take what a fresh
``qwenft eval adapter=RUN/adapter`` takes, and the planner's evaluation figure should predict both. Targets: the
after-train peak within 10% of the later eval's, and both within 15% of the plan's ``evaluation.peak``.

Each step is its own ``python -m qwenft`` child process (repo root, ``HF_HUB_OFFLINE=1 WANDB_MODE=offline``):

1. synthetic MedQuAD-shaped rows (seeded, nothing downloaded or copied from a dataset): alpaca rows
   ``{"instruction": "What are the treatments of <condition>? (question i)", "output": ...}`` whose output is ~300
   words drawn from a fixed list (half common words, half medical terms), ~3,200 characters; instruction + output
   is 663-797 tokens with Qwen2.5's tokenizer (mean 733 at the default seed; ~750 with the chat template, so about
   a third of the rows reach ``data.max_seq_len=768`` and are truncated to it);
2. ``train +recipe=domain model=qwen2.5-coder-0.5b-embedded`` on them (NF4, its after-train evaluation with the
   recipe's MMLU retention set), ``data.max_seq_len=768``, batch 4, ``--steps`` steps, 8 + 4 held-out rows,
   8 generated prompts of 32 new tokens;
3. ``eval`` with the same data and evaluation settings and ``adapter=RUN/adapter``;
4. ``plan`` with the same settings and ``plan.device`` the device the run used; its ``evaluation.peak``.

Measured figures: ``memory.eval.bytes`` of each run's metrics.json (:func:`qwenft.memory.peak_memory`: the peak
resident set on a CPU, ``torch.cuda.max_memory_allocated`` on CUDA), beside ``memory.train`` of the training run.
Reported: the three figures, the ratios after-train / later, after-train / plan and later / plan with each target's
pass/fail, each command's exit status and wall seconds, and the load average around each command. The default run
exits with status 1 (after saving the JSON) when a command fails or a target is missed. ``--quick``: the same flow
on tiny-random (no quantization, short rows, 2 steps, ``data.max_seq_len=128``, no benchmarks); the targets are
reported but not enforced (a tiny model's figures are the process baseline).

    python benchmarks/eval_memory.py                  # the embedded 0.5B, 30 training steps
    python benchmarks/eval_memory.py --steps 10 --keep /tmp/eval-memory   # fewer steps; keep the run folders
    python benchmarks/eval_memory.py --quick          # tiny-random (well under a minute on 2 cores)

Cost: ``--steps 1`` took 58 min on 2 cores at load average 2-6 (2026-12-02; train with its evaluation 33 min, the
later eval 24 min); the default 30 steps add about half an hour: 30 x 4 rows of ~750 tokens at the
quickstart's ~30-40 training tokens/s, then two evaluations (after train, later), each base and tuned on 64 MMLU
questions. The quick run took 53 s on 2 cores at load average ~2 (2026-12-02). Not in ``python -m benchmarks``:
the default run alone exceeds the suite's 20 minutes.

Results: benchmarks/results/eval_memory.json (eval_memory_quick.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, print_table, save_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
SAME_TARGET = 0.10  # after-train peak vs the later eval's
PLAN_TARGET = 0.15  # each measured peak vs the plan's evaluation.peak

CONDITIONS = ["chronic kidney disease", "atrial fibrillation", "plaque psoriasis", "migraine", "type 2 diabetes",
              "osteoarthritis", "asthma", "hypothyroidism", "iron deficiency anemia", "glaucoma", "gout", "sciatica"]
COMMON = ["treatment", "therapy", "patients", "symptoms", "dose", "clinical", "doctor", "blood", "pressure",
          "recommended", "daily", "management", "diagnosis", "pain", "monitoring", "lifestyle", "diet", "exercise",
          "severe", "mild", "reduce", "risk", "tests", "levels", "support", "weeks", "months", "often", "may", "with"]
# Qwen's tokenizer splits these into 2-5 tokens each: with the common words, ~4.4 characters a token (MedQuAD-like)
TERMS = ["corticosteroids", "immunosuppressive", "methotrexate", "glomerular", "nephropathy", "anticoagulant",
         "echocardiogram", "antihistamines", "bronchodilators", "phototherapy", "levothyroxine", "erythropoietin",
         "subcutaneous", "contraindicated", "rheumatologist", "physiotherapy", "angiotensin", "hemoglobin",
         "triptans", "allopurinol", "prostaglandin", "metformin", "biologics", "ophthalmologist", "colchicine",
         "neuropathic", "epidural", "trabeculoplasty", "cardioversion", "dialysis"]


def synthetic_rows(seed: int, count: int, words: int) -> List[Dict[str, str]]:
    """``count`` alpaca rows, each answer at least ``words`` words in sentences of 8-18, seeded."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        condition = rng.choice(CONDITIONS)
        sentences, total = [], 0
        while total < words:
            k = rng.randint(8, 18)
            text = " ".join(rng.choice(TERMS if rng.random() < 0.5 else COMMON) for _ in range(k))
            sentences.append(text[0].upper() + text[1:] + ".")
            total += k
        rows.append({"instruction": f"What are the treatments of {condition}? (question {i})",
                     "output": f"Treatments of {condition} include the following. " + " ".join(sentences)})
    return rows


def load_average() -> List[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def run_command(name: str, args: List[str], work: Path) -> Dict[str, Any]:
    """``python -m qwenft ARGS`` in the repo root, output to ``work/NAME.log``; exit status, seconds, load."""
    command = [sys.executable, "-m", "qwenft", *args]
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline",
               TOKENIZERS_PARALLELISM=os.environ.get("TOKENIZERS_PARALLELISM", "false"))
    log = work / f"{name}.log"
    print(f"{name}: {' '.join(command[1:])}\n  log {log}", flush=True)
    before = load_average()
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        returncode = subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-30:]
    print(f"  exit status {returncode} in {seconds:.1f} s, load average {before} -> {load_average()}", flush=True)
    if returncode != 0:
        print("\n".join(tail), flush=True)
    return {"name": name, "command": command[1:], "returncode": returncode, "seconds": seconds,
            "load_average_before": before, "load_average_after": load_average(),
            "output_tail": tail if returncode != 0 else tail[-5:]}


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a and b else None


def _within(ratio: Optional[float], tolerance: float) -> Optional[bool]:
    return None if ratio is None else abs(ratio - 1) <= tolerance


def _plan_device() -> str:
    """Where the children run (``qwenft.runtime.default_device``), as ``plan.device`` names it."""
    from qwenft.runtime import default_device

    return "cuda" if default_device().startswith("cuda") else "cpu"


def measure(args, work: Path) -> Dict[str, Any]:
    rows_path = work / "rows.jsonl"
    rows = synthetic_rows(args.seed, args.rows, args.words)
    rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    if args.quick:
        shared = ["+recipe=domain", "model=tiny-random", "quant=none", f"data.sources.0.path={rows_path}",
                  "data.max_seq_len=128", "data.sources.0.eval_rows=4", "data.sources.1.eval_rows=2",
                  "eval.max_eval_prompts=4", "eval.max_new_tokens=8", "eval.benchmarks=[]"]
        batch = ["train.batch_size=2", "train.grad_accum=1"]
    else:
        shared = ["+recipe=domain", "model=qwen2.5-coder-0.5b-embedded", f"data.sources.0.path={rows_path}",
                  "data.max_seq_len=768", "data.sources.0.eval_rows=8", "data.sources.1.eval_rows=4",
                  "eval.max_eval_prompts=8", "eval.max_new_tokens=32"]
        batch = ["train.batch_size=4", "train.grad_accum=1"]
    steps = [f"train.max_steps={args.steps}", "train.save_steps=1000", "train.eval_steps=1000"]
    run_dir, eval_dir, plan_json = work / "run", work / "eval", work / "plan.json"
    device = _plan_device()
    commands = [run_command("train", ["train", *shared, *batch, *steps, f"out_dir={run_dir}"], work)]
    if commands[0]["returncode"] == 0:
        commands.append(run_command("eval", ["eval", *shared, f"adapter={run_dir / 'adapter'}",
                                             f"out_dir={eval_dir}"], work))
    commands.append(run_command("plan", ["plan", *shared, *batch, f"plan.device={device}", f"plan.out={plan_json}",
                                         f"out_dir={work / 'plan'}"], work))

    run_metrics, eval_metrics, plan = (_read_json(p) for p in (run_dir / "metrics.json",
                                                                eval_dir / "metrics.json", plan_json))
    memory = (run_metrics or {}).get("memory", {})
    after = memory.get("eval", {}).get("bytes")
    later = ((eval_metrics or {}).get("memory") or {}).get("eval", {}).get("bytes")
    planned = ((plan or {}).get("evaluation") or {}).get("peak")
    ratios = {"after_train_over_later": _ratio(after, later), "after_train_over_plan": _ratio(after, planned),
              "later_over_plan": _ratio(later, planned)}
    targets = {"after_train_over_later": _within(ratios["after_train_over_later"], SAME_TARGET),
               "after_train_over_plan": _within(ratios["after_train_over_plan"], PLAN_TARGET),
               "later_over_plan": _within(ratios["later_over_plan"], PLAN_TARGET)}
    return {"commands": commands, "plan_device": device, "rows_path": str(rows_path),
            # the training run's rows (data.stats): token lengths before truncation, rows cut at data.max_seq_len
            "train_tokens": (run_metrics or {}).get("data", {}).get("tokens"),
            "truncated_rows": (run_metrics or {}).get("data", {}).get("truncated"),
            "peak_bytes": {"after_train": after, "later_eval": later, "plan": planned},
            "memory": {"train": memory.get("train"), "eval_after_train": memory.get("eval"),
                       "eval_later": ((eval_metrics or {}).get("memory") or {}).get("eval")},
            "plan_evaluation": (plan or {}).get("evaluation"), "ratios": ratios, "targets_met": targets}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny-random, short rows, 2 steps (the flow only)")
    parser.add_argument("--steps", type=int, default=None, help="train.max_steps (default 30; quick 2)")
    parser.add_argument("--rows", type=int, default=None, help="synthetic rows (default 220; quick 24)")
    parser.add_argument("--seed", type=int, default=0, help="random.Random seed of the synthetic rows")
    parser.add_argument("--keep", default=None, help="run in DIR and keep it (rows, run/, eval/, plan.json, logs)")
    args = parser.parse_args()
    args.steps = args.steps or (2 if args.quick else 30)
    args.rows = args.rows or (24 if args.quick else 220)
    args.words = 20 if args.quick else 300  # quick: ~300 tokens of tiny-random's byte-level BPE, cut at 128
    started, load_start = time.perf_counter(), load_average()
    if args.keep:
        work = Path(args.keep).resolve()
        work.mkdir(parents=True, exist_ok=True)
        result = measure(args, work)
    else:
        with tempfile.TemporaryDirectory(prefix="qwenft-eval-memory-") as tmp:
            result = measure(args, Path(tmp))
    total, load_end = time.perf_counter() - started, load_average()

    peaks, ratios, met = result["peak_bytes"], result["ratios"], result["targets_met"]

    def gib(value):
        return f"{value / GIB:.3f}" if value else "-"

    def verdict(key):
        return {True: "pass", False: "FAIL", None: "-"}[met[key]]

    print_table(f"evaluation peak memory (GiB), {'tiny-random (quick)' if args.quick else 'embedded 0.5B NF4'}, "
                f"{args.steps} steps, {total / 60:.1f} min",
                ["figure", "GiB", "ratio", "value", "target", "result"],
                [["after train", gib(peaks["after_train"]), "after train / later",
                  f"{ratios['after_train_over_later']:.3f}" if ratios["after_train_over_later"] else "-",
                  f"within {SAME_TARGET:.0%}", verdict("after_train_over_later")],
                 ["later eval", gib(peaks["later_eval"]), "after train / plan",
                  f"{ratios['after_train_over_plan']:.3f}" if ratios["after_train_over_plan"] else "-",
                  f"within {PLAN_TARGET:.0%}", verdict("after_train_over_plan")],
                 ["plan", gib(peaks["plan"]), "later / plan",
                  f"{ratios['later_over_plan']:.3f}" if ratios["later_over_plan"] else "-",
                  f"within {PLAN_TARGET:.0%}", verdict("later_over_plan")]])
    train_peak = (result["memory"]["train"] or {}).get("bytes")
    print(f"train phase peak {gib(train_peak)} GiB; commands: " + ", ".join(
        f"{c['name']} exit {c['returncode']} {c['seconds']:.0f} s" for c in result["commands"]))
    print(f"load average (1, 5, 15 min) at start {load_start}, at end {load_end}; {os.cpu_count()} CPUs")
    save_json("eval_memory_quick" if args.quick else "eval_memory", {
        "benchmark": "eval_memory", "quick": args.quick, "environment": environment(),
        "settings": {"steps": args.steps, "rows": args.rows, "seed": args.seed, "words_per_answer": args.words,
                     "model": "tiny-random" if args.quick else "qwen2.5-coder-0.5b-embedded",
                     "kept": str(Path(args.keep).resolve()) if args.keep else None},
        "targets": {"after_train_over_later": f"within {SAME_TARGET:.0%}",
                    "after_train_over_plan": f"within {PLAN_TARGET:.0%}",
                    "later_over_plan": f"within {PLAN_TARGET:.0%}",
                    "enforced": not args.quick},
        "peak_gib": {k: (v / GIB if v else None) for k, v in peaks.items()},
        **result, "seconds_total": total, "load_average_start": load_start, "load_average_end": load_end,
    })
    failed = [c["name"] for c in result["commands"] if c["returncode"] != 0]
    missing = [k for k, v in peaks.items() if not v]
    if failed or missing:
        print(f"FAILED: commands {failed or '-'}; figures missing {missing or '-'}", file=sys.stderr)
        return 1
    if not args.quick and not all(met.values()):
        print(f"FAILED: targets missed: {[k for k, v in met.items() if not v]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
