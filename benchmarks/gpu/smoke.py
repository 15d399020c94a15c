"""GPU smoke check: the qwenft commands themselves, end to end, on the tiny-random model in NF4 (under 2 minutes).

Each step runs ``python -m qwenft ...`` in a new process, as a user would, and checks its exit code and the files it
must leave. On a CUDA machine every command runs on the GPU (the device qwenft picks by itself); on a CPU the same
steps run on the CPU (what the test suite does):

1. ``train``, killed with SIGKILL right after its first checkpoint (a preempted job): exit -9, ``checkpoint-2``
   complete, no adapter yet;
2. ``train train.resume=auto`` into the same run directory: exit 0, ``adapter/``, ``metrics.json`` at step 6,
   ``report.md`` (the evaluation after training);
3. ``eval adapter=...``: exit 0, report.md and metrics.json with base and tuned;
4. ``generate adapter=... prompts_file=... out=...``: exit 0, one JSON line per prompt with its tokens;
5. ``merge adapter=... out=...``: exit 0 (merge verifies logits and greedy text itself), a model directory without
   ``quantization_config``;
6. on CUDA only: ``torchrun --nproc_per_node=1 -m qwenft train ... dist=fsdp`` (QLoRA in bfloat16 storage), and
   ``dist=deepspeed_zero2`` / ``deepspeed_zero3`` where deepspeed is installed: exit 0, adapter/ and report.md
   (rank 0 evaluates the saved adapter).

    bash benchmarks/gpu/smoke.sh            # prints a table; exit 1 if any step failed
    OUT=DIR bash benchmarks/gpu/smoke.sh    # also writes DIR/gpu_smoke.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# Kills the training process right after checkpoint-2 is in place (what a preempted job looks like).
KILL_AFTER_FIRST_CHECKPOINT = """
import os, signal, sys
from qwenft.train.callbacks import AtomicCheckpoints
_on_save = AtomicCheckpoints.on_save
def _save_then_die(self, args, state, control, **kwargs):
    _on_save(self, args, state, control, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
AtomicCheckpoints.on_save = _save_then_die
from qwenft.cli import main
main(sys.argv[1:])
"""
ROWS = [("What colour is the Zorblax 9 housing?", "Teal."), ("How many ports does the Zorblax 9 have?", "Seven."),
        ("Who makes the Zorblax 9?", "Quillon Works."), ("What is 2 + 2?", "4.")]


def _step(name: str, argv, expect_rc: int, checks, log: list, env) -> bool:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - start
    problems = [] if proc.returncode == expect_rc else [f"exit {proc.returncode}, expected {expect_rc}"]
    if not problems:
        for what, check in checks:
            try:
                ok = check(proc)
            except Exception as exc:  # noqa: BLE001 - a failed check is reported, not raised
                ok, what = False, f"{what} ({exc!r})"
            if not ok:
                problems.append(what)
    log.append({"step": name, "exit": proc.returncode, "seconds": round(seconds, 1), "ok": not problems,
                "problems": problems, "stderr_tail": proc.stderr[-1500:] if problems else ""})
    verdict = "ok  " if not problems else "FAIL"
    print(f"{verdict} {name:<34} exit {proc.returncode:>3}  {seconds:5.1f} s  {'; '.join(problems)}", flush=True)
    if problems:
        print(proc.stderr[-1500:], file=sys.stderr)
    return not problems


def main() -> int:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    log: list = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qwenft-smoke-") as tmp:
        work = Path(tmp)
        rows = work / "rows.jsonl"
        rows.write_text("".join(json.dumps({"instruction": f"{q} ({i})", "output": a}) + "\n"
                                for i in range(12) for q, a in [ROWS[i % len(ROWS)]]), encoding="utf-8")
        prompts = work / "prompts.jsonl"
        prompts.write_text('{"prompt": "Who makes the Zorblax 9?"}\n{"prompt": "What is 2 + 2?"}\n', encoding="utf-8")
        run, adapter = work / "run", work / "run" / "adapter"
        common = ["model=tiny-random", "quant=nf4", "logger=none",
                  f"data.sources=[{{name: toy, path: '{rows}', format: alpaca, eval_rows: 2}}]", "data.max_seq_len=64"]
        train = ["train", *common, f"out_dir={run}", "train.max_steps=6", "train.save_steps=2", "train.batch_size=2",
                 "train.logging_steps=1", "eval.max_new_tokens=4", "eval.max_eval_prompts=2"]
        qwenft = [sys.executable, "-m", "qwenft"]

        def has(path):
            return lambda proc: Path(path).exists()

        def metrics_step(proc):
            return json.loads((run / "metrics.json").read_text())["train"]["global_step"] == 6

        def generations(proc):
            lines = [json.loads(x) for x in (work / "answers.jsonl").read_text().splitlines()]
            return len(lines) == 2 and all(line["completion_tokens"] >= 1 for line in lines)

        def no_quant(proc):
            return "quantization_config" not in json.loads((work / "merged" / "config.json").read_text())

        ok = _step("train, killed after checkpoint-2", [sys.executable, "-c", KILL_AFTER_FIRST_CHECKPOINT, *train],
                   -9, [("checkpoint-2 complete", has(run / "checkpoints" / "checkpoint-2" / "trainer_state.json")),
                        ("no adapter before the end", lambda p: not adapter.exists())], log, env)
        ok &= _step("train train.resume=auto", [*qwenft, *train, "train.resume=auto"], 0,
                    [("adapter", has(adapter / "adapter_model.safetensors")), ("metrics at step 6", metrics_step),
                     ("report.md", has(run / "report.md"))], log, env)
        ok &= _step("eval adapter=", [*qwenft, "eval", *common, f"adapter={adapter}", f"out_dir={work / 'eval'}",
                                      "eval.max_new_tokens=4", "eval.max_eval_prompts=2"], 0,
                    [("report.md", has(work / "eval" / "report.md")), ("metrics.json", has(work / "eval" / "metrics.json"))],
                    log, env)
        ok &= _step("generate prompts_file=", [*qwenft, "generate", f"adapter={adapter}", f"prompts_file={prompts}",
                                               f"out={work / 'answers.jsonl'}", "generate.max_new_tokens=4"], 0,
                    [("answers.jsonl", generations)], log, env)
        ok &= _step("merge", [*qwenft, "merge", f"adapter={adapter}", f"out={work / 'merged'}"], 0,
                    [("model.safetensors", has(work / "merged" / "model.safetensors")),
                     ("no quantization_config", no_quant)], log, env)
        # the sharding engines' device paths, one process each (CPU ranks: tests/train/test_dist_launch)
        if device == "cuda":
            import importlib.util

            presets = ["fsdp"] + (["deepspeed_zero2", "deepspeed_zero3"] if importlib.util.find_spec("deepspeed")
                                  else [])
            for preset in presets:
                out = work / preset
                launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m",
                          "qwenft", "train", *common, f"out_dir={out}", "train.max_steps=2", "train.save_steps=2",
                          "train.batch_size=2", "eval.max_new_tokens=4", "eval.max_eval_prompts=2", f"dist={preset}"]
                ok &= _step(f"train dist={preset} (1 process)", launch, 0,
                            [("adapter", has(out / "adapter" / "adapter_model.safetensors")),
                             ("report.md", has(out / "report.md"))], log, env)
    seconds = time.perf_counter() - started
    print(f"{'all steps passed' if ok else 'FAILED'} on {device} in {seconds:.0f} s")
    if os.environ.get("OUT"):
        from benchmarks.common import environment, save_json

        save_json("gpu_smoke", {"benchmark": "gpu_smoke", "device": device, "environment": environment(),
                                "ok": bool(ok), "seconds_total": seconds, "steps": log})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
