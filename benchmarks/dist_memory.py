"""Per-process training memory under ``dist=fsdp`` on 2 CPU processes (gloo) against one process, and what
``qwenft plan`` predicts for it.

Both runs train the same model with the same micro-batch per process (``train.batch_size`` rows of
``data.max_seq_len`` tokens), so the activations are the same in every process and only the sharded parts differ.
Each process records its resident memory (RSS) when training begins (``on_train_begin``: the model is loaded,
LoRA attached and, under FSDP, already sharded by ``accelerator.prepare``) and its peak RSS over the training steps
(``VmHWM`` reset at that moment through ``/proc/self/clear_refs``, read at the last ``on_step_end``, before the
final checkpoint: saving under ``FULL_STATE_DICT`` gathers the model on rank 0, which is not a training step). The whole-process peak
is useless here: every rank loads the whole model before FSDP shards it (``cpu_ram_efficient_loading: false``).

RSS on a CPU also holds the Python/torch runtime, gloo's buffers and the allocator's slack, which the plan does not
count; so the benchmark compares differences: ``1 process - per process`` of the train-phase peak, measured, against
the same difference of the plan's peaks (:func:`qwenft.plan.make_plan`, ``plan.processes``). glibc's mmap threshold
is fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_``) so that freed tensors go back to the system and RSS tracks live
memory (as in benchmarks/plan_accuracy.py).

Measured (2026-12-02, 2 cores shared with a CI run; embedded 0.5B in fp32, LoRA r=8, batch 1 x 64, 3 steps, no
gradient checkpointing): at the start of training 1 process 3,074 MiB, the 2 ranks 1,886 / 1,889 MiB: 1,185 MiB less,
planned 1,210 (half the weights and LoRA weights). Train-phase peak 3,344 MiB in 1 process, 3,758 / 3,679 MiB per
rank: 414 MiB more per process, planned 294 MiB more (2,639 vs 2,933 MiB): on the 0.5B the lm_head (545 MiB in fp32,
a fifth of the weights) is gathered whole, three times at its gloo all-gather, which outweighs the halved layers.
Per step, the forward+backward peak over the step's start RSS: 1 process 246, 98, 72 MiB; the ranks 1,860 / 1,740
MiB at step 1 and 1,618-1,672 MiB at steps 2-3 (benchmarks/results/dist_memory.json, "steps"): the gathered lm_head,
not a first-step cost. RSS includes the Python/torch runtime (~670 MiB in both runs at the start, less the weights),
hence the differences.

ZeRO-2 and ZeRO-3 (``--dist deepspeed_zero2|3``, deepspeed 0.19.8's CPU accelerator, the 1-process record reused
from dist_memory.json with ``--one-process-from``; 2026-12-02, 2 cores shared with test runs): ZeRO-2 starts at
3,117 / 3,116 MiB per rank (43 MiB over one process, planned 0: the weights stay whole) and peaks at 3,422 / 3,380
MiB, 78 MiB over one process, planned 17 MiB over (its halved LoRA gradients and states are small; its reduce
buckets on a CPU hold the LoRA gradients); the rest is DeepSpeed's own state, not modelled. ZeRO-3 starts at 1,958 /
1,957 MiB (1,116 MiB under one process, planned 1,210) but peaks at 3,393 / 3,293 MiB, 49 MiB over one process: a
training step rises 1.27-1.33 GiB over its start RSS.
``--probe`` (2026-12-03, a rerun: peaks 3,382 / 3,286 MiB) shows why: no decoder-layer parameter is gathered at the
loss or when the last layer's backward starts, in any step, and DeepSpeed's ``reset_step`` never runs (it is called
by the root module's forward pre-hook; qwenft's loss runs the body), so its trace never completes and its
keep-for-reuse rule never applies. The peak is at the lm_head's gather in the loss: 1,038-1,039 MiB over the RSS
before it, 2 x the 519 MiB lm_head (the parameter and gloo's output). Planned now: 225 MiB under one process (was
674 over with 24 kept layers, 708 under before that), measured 49 over (rank 0); the 274 MiB left are DeepSpeed's
memory at the start (94 MiB) and rank 0's RSS before the loss rising 135 MiB more than one process's by step 3
(rank 1: 8 MiB), not modelled (benchmarks/results/dist_memory_deepspeed_zero2.json, _zero3.json, "probe").

    python benchmarks/dist_memory.py            # the embedded 0.5B, fp32, batch 1 x 64 tokens, 3 steps (~5 min)
    python benchmarks/dist_memory.py --dist deepspeed_zero3 --one-process-from benchmarks/results/dist_memory.json
    python benchmarks/dist_memory.py --dist deepspeed_zero3 --probe ...   # + gathered parameters at the loss
    python benchmarks/dist_memory.py --quick    # a scaled-up tiny-random model (seconds)

Results: benchmarks/results/dist_memory.json (dist_memory_quick.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, save_json  # noqa: E402

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]
TINY_SHAPE = ["model=tiny-random", "model.tiny.hidden_size=512", "model.tiny.intermediate_size=2048",
              "model.tiny.num_hidden_layers=4", "model.tiny.num_attention_heads=8", "model.tiny.num_key_value_heads=2",
              "model.tiny.vocab_size=32000"]

# Run by `python LAUNCHER train ...` (one process) or torchrun (two): a callback writes mem-rank<R>.json.
LAUNCHER = """
import os, sys, json
from pathlib import Path
from transformers import TrainerCallback
import qwenft.train.run as run_module
from qwenft.memory import _status_bytes, release_freed_memory

class TrainPeak(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        release_freed_memory()
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # VmHWM := VmRSS
        self.start = _status_bytes("VmRSS")

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps_peak = max(getattr(self, "steps_peak", 0), _status_bytes("VmHWM"))
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # per step: VmHWM := VmRSS
        self.step = {"begin_rss": _status_bytes("VmRSS")}

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.step["forward_backward_peak"] = _status_bytes("VmHWM")

    def on_step_end(self, args, state, control, **kwargs):
        self.step["step_peak"] = _status_bytes("VmHWM")  # before this step's checkpoint, if any
        self.steps_peak = max(self.steps_peak, self.step["step_peak"])
        self.steps = getattr(self, "steps", []) + [self.step]

    def on_train_end(self, args, state, control, **kwargs):
        rank = os.environ.get("RANK", "0")
        Path(os.environ["MEM_OUT"], f"mem-rank{rank}.json").write_text(json.dumps(
            {"rank": int(rank), "start_rss": self.start, "peak_rss": self.steps_peak, "steps": self.steps,
             "peak_rss_with_final_save": _status_bytes("VmHWM"), "end_rss": _status_bytes("VmRSS")}))

_make = run_module.make_trainer
def make_trainer(*args, **kwargs):
    trainer = _make(*args, **kwargs)
    trainer.add_callback(TrainPeak())
    return trainer
run_module.make_trainer = make_trainer
if os.environ.get("RANK") == "1":
    import time
    time.sleep(1.5)  # distinct default run names (see tests/train/conftest.py)
from qwenft.cli import main
main(sys.argv[1:])
"""


# With --probe (ZeRO-3): at the loss (inside qwenft's lm_head gather) and when the last layer's backward starts, each
# rank writes the MiB of parameters DeepSpeed holds gathered (ds_status not NOT_AVAILABLE, ds_persist left out) by
# part, its RSS and VmHWM, and how often DeepSpeed's trace was reset (reset_step) so far.
PROBE = """
import contextlib, re
import qwenft.train.loss as loss_module
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from qwenft.memory import _status_bytes
PROBED = {"model": None, "step": 0, "resets": 0}

def census(where):
    parts = {"embed_tokens": 0, "lm_head": 0, "layers": 0, "other": 0}
    layers = set()
    for name, p in PROBED["model"].named_parameters():
        if not hasattr(p, "ds_id") or p.ds_persist or p.ds_status == ZeroParamStatus.NOT_AVAILABLE:
            continue
        layer = re.search(r"layers\\.(\\d+)\\.", name)
        part = next((k for k in ("embed_tokens", "lm_head") if k in name), "layers" if layer else "other")
        parts[part] += p.ds_numel * p.element_size() / 2**20
        layers.update([int(layer.group(1))] if layer else [])
    record = {"where": where, "step": PROBED["step"], "gathered_mib": parts, "gathered_layers": len(layers),
              "rss_mib": _status_bytes("VmRSS") / 2**20, "hwm_mib": _status_bytes("VmHWM") / 2**20,
              "reset_step_calls": PROBED["resets"]}
    with open(Path(os.environ["MEM_OUT"], f"probe-rank{os.environ.get('RANK', '0')}.jsonl"), "a") as out:
        out.write(json.dumps(record) + "\\n")

_reset = Coordinator.reset_step
def reset_step(self):
    PROBED["resets"] += 1
    _reset(self)
Coordinator.reset_step = reset_step
_gathered = loss_module._gathered
@contextlib.contextmanager
def gathered(weight):
    census("loss, before the lm_head gather")
    with _gathered(weight) as whole:
        census("loss, lm_head gathered")
        yield whole
loss_module._gathered = gathered

class Probe(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        PROBED["model"] = model
        last = (model.get_base_model() if hasattr(model, "get_base_model") else model).model.layers[-1]
        def forward_end(module, inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            if hidden.requires_grad:
                hidden.register_hook(lambda grad: census("backward of the last layer starts"))
        last.register_forward_hook(forward_end)

    def on_step_begin(self, args, state, control, **kwargs):
        PROBED["step"] += 1
"""


def overrides(quick: bool, rows: Path, steps: int, seq: int) -> list:
    model = [*TINY_SHAPE] if quick else ["model=qwen2.5-coder-0.5b-embedded"]
    # fp32 weights: converted from the bf16 file into anonymous memory when loaded, so RSS holds them from the start
    # (bf16 weights stay mapped from the safetensors file and count in RSS only once touched, the embedding's rows
    # one by one; measured: a 1-process start RSS 765 MiB with 1.17 GiB of weights)
    return [*model, "model.dtype=float32", "quant=none", "lora.r=8", "lora.lora_dropout=0.0", "train.gradient_checkpointing=false",
            f"data.sources=[{{name: toy, path: '{rows}', format: alpaca, weight: 1.0, eval_rows: 2}}]",
            f"data.max_seq_len={seq}", f"train.max_steps={steps}", "train.save_steps=1000", "train.eval_steps=1000",
            "train.logging_steps=1", "train.batch_size=1", "eval.after_train=false", "logger=none"]


def launch(work: Path, args: list, processes: int, timeout: int, dist: str = "fsdp", probe: bool = False) -> list:
    """Train in ``work`` with 1 process or ``processes`` torchrun ranks; the per-rank memory records (with the
    ``probe`` records of :data:`PROBE` when asked)."""
    work.mkdir(parents=True, exist_ok=True)
    launcher = work / "launch.py"
    launcher.write_text(LAUNCHER.replace("    trainer.add_callback(TrainPeak())\n",
                                         "    trainer.add_callback(TrainPeak())\n    trainer.add_callback(Probe())\n")
                        .replace("from qwenft.cli import main\n", PROBE + "from qwenft.cli import main\n")
                        if probe else LAUNCHER)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT), "MEM_OUT": str(work),
           "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
    if processes == 1:
        command = [sys.executable, str(launcher), "train", *args, "dist=none", f"out_dir={work / 'run'}"]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
                   str(launcher), "train", *args, f"dist={dist}"]
    done = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{command} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    records = [json.loads(p.read_text()) for p in sorted(work.glob("mem-rank*.json"))]
    for record in records if probe else []:
        lines = (work / f"probe-rank{record['rank']}.jsonl").read_text().splitlines()
        record["probe"] = [json.loads(line) for line in lines]
    return records


def predicted(args: list, processes: int, dist: str = "fsdp") -> dict:
    """The plan's training peak and its rows on a CPU for ``processes`` (``dist``) or one process."""
    from qwenft.plan import make_plan
    from tests.conftest import compose_config

    preset = [f"dist={dist}", f"plan.processes={processes}"] if processes > 1 else ["dist=none"]
    plan = make_plan(compose_config(*args, *preset, "plan.device=cpu"))
    return plan["training"]["without_checkpointing"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--measured", default=None, help="reuse the 'one_process'/'two_processes' of a results JSON")
    parser.add_argument("--dist", default="fsdp", choices=["fsdp", "deepspeed_zero2", "deepspeed_zero3"],
                        help="the preset of the 2-process run (deepspeed: installed, its CPU accelerator)")
    parser.add_argument("--one-process-from", default=None,
                        help="reuse the 'one_process' record of a results JSON with the same overrides")
    parser.add_argument("--probe", action="store_true",
                        help="deepspeed_zero3: record the gathered parameters at the loss and the first backward")
    opts = parser.parse_args()
    from tests.conftest import write_rows

    with tempfile.TemporaryDirectory(prefix="dist_memory_") as tmp:
        rows = write_rows(Path(tmp) / "rows.jsonl", n=16)
        args = overrides(opts.quick, rows, opts.steps, opts.seq)
        if opts.measured:
            old = json.loads(Path(opts.measured).read_text())
            one, two = old["one_process"], old["two_processes"]
        else:
            one = (json.loads(Path(opts.one_process_from).read_text())["one_process"] if opts.one_process_from
                   else launch(Path(tmp) / "one", args, 1, 1800))
            print("1 process:", one, flush=True)
            two = launch(Path(tmp) / "two", args, 2, 1800, opts.dist, opts.probe)
            print("2 processes:", two, flush=True)
    plan1, plan2 = predicted(args, 1), predicted(args, 2, opts.dist)
    peak1 = one[0]["peak_rss"]
    per_rank = [r["peak_rss"] for r in two]
    measured_delta = peak1 - max(per_rank)
    predicted_delta = plan1["peak"] - plan2["peak"]
    result = {
        "what": f"train-phase peak RSS per process: 1 process (dist=none) vs 2 torchrun ranks (dist={opts.dist}, gloo)",
        "one_process_from": opts.one_process_from,
        "overrides": [a for a in args if not a.startswith("data.sources")],
        "one_process": one, "two_processes": two,
        "plan": {"one_process": plan1, "two_processes": plan2},
        # at on_train_begin: the shards against the whole model (plan: weights + LoRA weights)
        "start_delta_measured_bytes": one[0]["start_rss"] - max(r["start_rss"] for r in two),
        "start_delta_predicted_bytes": sum(plan1[k] - plan2[k] for k in ("weights", "lora_weights")),
        "measured_delta_bytes": measured_delta, "predicted_delta_bytes": predicted_delta,
        "delta_ratio": measured_delta / predicted_delta if predicted_delta else None,
        "environment": environment(),
    }
    name = "dist_memory" + ("" if opts.dist == "fsdp" else f"_{opts.dist}") + ("_quick" if opts.quick else "")
    path = save_json(name, result)
    print(f"1 process: peak {peak1 / MIB:,.0f} MiB (start {one[0]['start_rss'] / MIB:,.0f}); 2 processes: peaks "
          + ", ".join(f"{p / MIB:,.0f}" for p in per_rank) + " MiB (start "
          + ", ".join(f"{r['start_rss'] / MIB:,.0f}" for r in two) + ")")
    print(f"at the start of training, 1 - per process: measured {result['start_delta_measured_bytes'] / MIB:,.0f} MiB, "
          f"planned {result['start_delta_predicted_bytes'] / MIB:,.0f} MiB (weights + LoRA weights)")
    print(f"1 - per process: measured {measured_delta / MIB:,.0f} MiB, planned {predicted_delta / MIB:,.0f} MiB "
          f"(plan peaks {plan1['peak'] / MIB:,.0f} vs {plan2['peak'] / MIB:,.0f} MiB); written to {path}")


if __name__ == "__main__":
    main()
