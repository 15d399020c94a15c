"""Seconds per DPO step and peak memory of qwenft's preference trainer vs TRL's DPOTrainer + peft.

Same model (default: the embedded Qwen2.5 0.5B in NF4, compute dtype and precision as qwenft resolves ``auto``),
same pairs (the dpo recipe's data/style_pairs.jsonl, all 80: none held out, so neither arm evaluates), the same
tokens, batch, LoRA (r=16 on all seven projections), optimizer, learning-rate schedule and seed; plain DPO with
TRL's sigmoid loss, beta 0.1, no gradient checkpointing, a log every step in both arms (:data:`PINNED`).

- qwenft: built as ``python -m qwenft train +recipe=dpo`` builds it (:func:`qwenft.train.run.run`): ``load_model``,
  ``attach_lora`` (the k-bit preparation, :func:`qwenft.model.lora.prepare_kbit`), :func:`qwenft.train.preference.make_preference_trainer` (padded or
  padding-free as ``pref.padding_free`` resolves, recorded), freed memory handed back promptly on a CPU
  (``return_freed_memory_promptly``, as ``qwenft train`` does).
- TRL: what its QLoRA documentation has a user write: ``from_pretrained`` with a ``BitsAndBytesConfig``,
  ``DPOTrainer(model, args=DPOConfig(...), train_dataset, processing_class=tokenizer, peft_config=LoraConfig(...))``.
  With a ``peft_config`` TRL wraps the model itself, and its reference is that model with the adapter disabled (the
  base), as qwenft's. TRL tokenizes its own dataset: it is given qwenft's training pairs in qwenft's order as plain
  text (the chat-template render qwenft tokenized, decoded), and its tokenized ``prompt_ids`` / ``chosen_ids`` /
  ``rejected_ids`` are checked equal to qwenft's, row for row. (In conversational form TRL's render would add the
  template's ``\\n`` after each answer's ``<|im_end|>``: one token more per sequence than qwenft trains on.)
  ``max_length`` = ``data.max_seq_len`` with ``keep_start``, which cuts where qwenft's answer budget does; on these
  pairs nothing is cut (the longest sequence is well under 192 tokens).

Each arm runs in a fresh child process (its own allocator and peak RSS; both import the same libraries, so they start
from the same baseline) for ``--steps`` optimizer steps of ``trainer.train()``, timed by a callback from step begin
to step end, as benchmarks/train_step.py times them; the first step of each child is warm-up and not counted. The
children alternate ABBA (qwenft, TRL, TRL, qwenft, ...). Round ``r`` uses seed ``42 + r`` in both arms, so both draw
the same pairs in the same order (checked through the token counts) and the steps pair up; the time ratio is the
median over the paired steps. Memory: the peak RSS of the steps (``VmHWM``, reset just before ``trainer.train()``,
read at the end of each step; on CUDA ``max_memory_allocated``), whole and above the process before its model was
loaded, and the peak while the model was loaded and the trainer built (peft's k-bit preparation, which qwenft used
until 2026-12-07, cast the embedding and lm_head to fp32 there). The first step's loss must be
ln 2 = 0.6931 in both arms (the policy is the reference until the first update: LoRA's B starts at zero); the
first gradient norms are compared (the same LoRA init: they agree to bf16 rounding) and so are the later losses.
Targets (issue): qwenft <= 1.0x TRL's seconds per step and <= 0.8x its peak memory.

On a CUDA machine the same code runs on the GPU (``--device auto``): NF4 in bf16, the optimizer qwenft resolves
there (paged 8-bit AdamW) in both arms, results in ``dpo_step_cuda.json``.

    python benchmarks/dpo_step.py                     # 0.5B NF4, 2 pairs a step, 3 rounds x 3 steps per arm
    python benchmarks/dpo_step.py --threads 1         # one torch thread per arm: steadier on a shared CPU
    python benchmarks/dpo_step.py --quick             # tiny-random, for a smoke run
    python benchmarks/dpo_step.py --quick --in-process --rounds 1   # the arms in this process (what the test runs)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, print_table, save_json  # noqa: E402

ARMS = ("qwenft", "trl")
PAIRS = Path(__file__).resolve().parents[1] / "data" / "style_pairs.jsonl"  # the dpo recipe's pairs, named here
# What the comparison is about, pinned rather than taken from the recipe (which may change): plain DPO, TRL's
# sigmoid loss (no RPO term, no label smoothing), beta 0.1, r=16 LoRA on the seven projections, lr 5e-5 on a cosine
# schedule without warm-up (so the loss moves from the second step), no gradient checkpointing.
PINNED = ("train.objective=dpo", "pref.beta=0.1", "pref.rpo_alpha=0", "pref.label_smoothing=0", "train.lr=5e-5",
          "train.lr_scheduler=cosine", "train.warmup_ratio=0", "train.weight_decay=0", "train.grad_accum=1",
          "train.gradient_checkpointing=false", "lora.r=16", "lora.lora_alpha=32", "lora.lora_dropout=0",
          "pref.precompute_ref=false")
LN2 = math.log(2.0)
# Policy and reference give the same log-probs before the first update (LoRA B = 0, dropout 0: the same sums), so
# the first loss is -log sigmoid(0) computed in fp32: ln 2 to within float32 rounding (6e-8 relative).
FIRST_LOSS_TOLERANCE = 1e-5
GIB = 2**30


def _status(field: str) -> int:
    """A ``kB`` field of this process's /proc status (``VmRSS``: resident now, ``VmHWM``: its peak) in bytes; 0
    where it cannot be read."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _quartiles(values: List[float]) -> Dict[str, float]:
    if len(values) < 2:
        return {"p25": values[0], "p75": values[0]} if values else {"p25": None, "p75": None}
    q = statistics.quantiles(values, n=4, method="inclusive")
    return {"p25": q[0], "p75": q[2]}


class StepTimer:
    """A TrainerCallback recording the wall time of every optimizer step (benchmarks/train_step.py's, with a CUDA
    synchronisation at both ends), and what each batch the collator built holds.

    Per batch: ``tokens`` (not padding), ``positions`` (the batch's ``input_ids`` size, padding included: what the
    model body runs over) and ``answer_tokens`` (the tokens whose log-probs count). ``step_peaks``: the peak memory
    so far at the end of each step (``VmHWM``; CUDA: ``max_memory_allocated``), so that the peak of the steps
    themselves is known apart from what ``trainer.train()`` does after the last one (qwenft's Trainer saves a
    checkpoint there).
    """

    def __init__(self, cuda: bool):
        import torch
        from transformers import TrainerCallback

        timer = self

        def now() -> float:
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer.start = now()

            def on_step_end(self, args, state, control, **kwargs):
                timer.steps.append(now() - timer.start)
                timer.step_peaks.append(torch.cuda.max_memory_allocated() if cuda else _status("VmHWM"))

        self.callback = _Callback()
        self.steps: List[float] = []
        self.step_peaks: List[int] = []
        self.batches: List[Dict[str, int]] = []
        self.start = 0.0

    def wrap(self, trainer) -> None:
        """Record every batch the trainer's collator builds (qwenft's: ``labels``, padded with an ``attention_mask``
        or padding-free without one; TRL's: padded, ``attention_mask`` and ``completion_mask``)."""
        collate = trainer.data_collator

        def counting(features):
            batch = collate(features)
            ids = batch["input_ids"]
            mask = batch.get("attention_mask")
            answers = batch["completion_mask"].sum() if "completion_mask" in batch else (batch["labels"] != -100).sum()
            self.batches.append({"tokens": int(mask.sum()) if mask is not None else int(ids.numel()),
                                 "positions": int(ids.numel()), "answer_tokens": int(answers)})
            return batch

        trainer.data_collator = counting


def _overrides(opts, seed: int, out_dir: Path) -> List[str]:
    model = ["model=tiny-random", "quant=none"] if opts.quick else []
    return ["+recipe=dpo", *model, f"data.sources.0.path={PAIRS}", "data.sources.0.eval_rows=0",
            f"out_dir={out_dir}", f"train.seed={seed}", f"train.max_steps={opts.steps}",
            f"train.batch_size={opts.batch}", f"data.max_seq_len={opts.seq}", *PINNED, "train.logging_steps=1",
            "train.save_steps=100000", "eval.after_train=false"]


def build_qwenft(config, tokenizer, bundle, device: str, tmp: Path):
    """qwenft's arm, as :func:`qwenft.train.run.run` builds it."""
    from transformers import set_seed

    from qwenft.kernels import resolve_kernels
    from qwenft.model import attach_lora, load_model
    from qwenft.train.preference import make_preference_trainer
    from qwenft.train.trainer import autocast_dtype

    model, tokenizer = load_model(config, device=device, tokenizer=tokenizer)
    set_seed(config.train.seed)  # LoRA A is initialised randomly: the same seed gives the same run
    model = attach_lora(model, config.lora, gradient_checkpointing=config.train.gradient_checkpointing,
                        kernels=config.train.kernels, autocast_dtype=autocast_dtype(config, device))
    kernels = resolve_kernels(config.train.kernels, device.startswith("cuda"))
    trainer = make_preference_trainer(config, model, tokenizer, bundle, tmp / "checkpoints", kernels)
    return trainer, {"kernels": kernels, "padding_free": trainer.data_collator.padding_free}


def build_trl(config, bundle, device: str, tmp: Path):
    """TRL's arm: its documented QLoRA DPO setup, on qwenft's pairs as plain text (module docstring)."""
    import datasets
    import torch
    import trl
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
    from trl import DPOConfig, DPOTrainer
    from trl.kernels.chunked_logprob import _use_triton

    from qwenft.model import resolve_model_dir
    from qwenft.runtime import torch_dtype
    from qwenft.train.trainer import _precision_and_optim

    path = resolve_model_dir(config.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    nf4 = config.quant.method == "nf4"
    compute = torch_dtype(config.quant.compute_dtype if nf4 else config.model.dtype, device)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_use_double_quant=config.quant.double_quant,
                               bnb_4bit_compute_dtype=compute) if nf4 else None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=compute, quantization_config=quant,
                                                 attn_implementation=config.model.attn_implementation,
                                                 device_map={"": device})
    if quant is not None and device == "cpu":
        # The bitsandbytes CPU setting qwenft applies (benchmarks/train_step.py does the same). It changes only a
        # no-grad forward in eval mode, and TRL's reference forward runs in train mode: no effect on this arm.
        for module in model.modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
    precision, optim = _precision_and_optim(config, model)  # qwenft's own choice for this device, not a copy of it
    rows = bundle.train
    text = datasets.Dataset.from_dict({name: [tokenizer.decode(ids) for ids in rows[f"{name}_ids"]]
                                       for name in ("prompt", "chosen", "rejected")})
    t, lora = config.train, config.lora
    args = DPOConfig(output_dir=str(tmp / "trl"), max_steps=t.max_steps, per_device_train_batch_size=t.batch_size,
                     gradient_accumulation_steps=t.grad_accum, learning_rate=t.lr, lr_scheduler_type=t.lr_scheduler,
                     warmup_steps=t.warmup_ratio, weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm,
                     optim=optim, seed=t.seed, data_seed=t.seed, save_strategy="no", report_to=[],
                     logging_steps=t.logging_steps, use_cpu=device == "cpu", disable_tqdm=True,
                     dataloader_num_workers=0, gradient_checkpointing=t.gradient_checkpointing,
                     bf16=precision["bf16"], fp16=precision["fp16"], beta=config.pref.beta, loss_type=["sigmoid"],
                     max_length=config.data.max_seq_len, truncation_mode="keep_start")
    peft_config = LoraConfig(r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout,
                             target_modules=list(lora.target_modules), bias=lora.bias, task_type="CAUSAL_LM")
    trainer = DPOTrainer(model=model, args=args, train_dataset=text, processing_class=tokenizer,
                         peft_config=peft_config)
    prepared = trainer.train_dataset
    columns = ("prompt_ids", "chosen_ids", "rejected_ids")
    same = len(prepared) == len(rows) and all(prepared[i][c] == rows[i][c] for i in range(len(rows)) for c in columns)
    return trainer, {"version": trl.__version__, "same_tokens_as_qwenft": same, "optim": optim, **precision,
                     "projects_every_position": not _use_triton(torch.device(device))}


def child(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One arm, one round: build, train ``steps`` steps, report (module docstring)."""
    import torch

    from qwenft.memory import peak_memory, release_freed_memory, return_freed_memory_promptly

    cuda = spec["device"].startswith("cuda")
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    if not cuda and (spec["arm"] == "qwenft" or spec["malloc"] == "both"):
        return_freed_memory_promptly()  # what `qwenft train` does first on a CPU (qwenft.train.run.run)
    # Both arms import the same libraries before measuring, so their baselines match.
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import trl  # noqa: F401
    from trl import DPOTrainer  # noqa: F401

    from qwenft.model import load_tokenizer, resolve_model_dir
    from qwenft.preference.pipeline import build_run_data
    from qwenft.train.preference import make_preference_trainer  # noqa: F401
    from tests.conftest import compose_config

    load_before = [round(x, 2) for x in os.getloadavg()]
    tmp = Path(spec["tmp"])
    config = compose_config(*spec["overrides"])
    tokenizer = load_tokenizer(resolve_model_dir(config.model))
    bundle = build_run_data(config, tokenizer)
    release_freed_memory()
    baseline = torch.cuda.memory_allocated() if cuda else _status("VmRSS")
    with peak_memory(spec["device"]) as load_memory:
        if spec["arm"] == "qwenft":
            trainer, facts = build_qwenft(config, tokenizer, bundle, spec["device"], tmp)
        else:
            trainer, facts = build_trl(config, bundle, spec["device"], tmp)
    timer = StepTimer(cuda)
    timer.wrap(trainer)
    trainer.add_callback(timer.callback)
    with peak_memory(spec["device"]) as train_memory:
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    first = {k: logs[0][k] for k in ("logps/chosen", "logps/rejected", "rewards/margins") if logs and k in logs[0]}
    result = {"arm": spec["arm"], "seed": config.train.seed, "threads": torch.get_num_threads(),
              "seconds_per_step": timer.steps, "step_peak_bytes": timer.step_peaks,
              "batches": timer.batches[:len(timer.steps)], "losses": [h["loss"] for h in logs],
              "grad_norms": [h.get("grad_norm") for h in logs],
              "first_step_metrics": first, "baseline_bytes": baseline, "load_memory": load_memory,
              "train_memory": train_memory, "load_average": [load_before, [round(x, 2) for x in os.getloadavg()]],
              "facts": facts, "config": {"model": config.model.name, "quant": config.quant.method,
                                         "compute_dtype": config.quant.compute_dtype, "beta": config.pref.beta,
                                         "objective": config.train.objective, "lr": config.train.lr,
                                         "lr_scheduler": config.train.lr_scheduler, "lora_r": config.lora.r,
                                         "lora_alpha": config.lora.lora_alpha,
                                         "targets": list(config.lora.target_modules),
                                         "gradient_checkpointing": config.train.gradient_checkpointing},
              "train_pairs": len(bundle.train), "data_stats": {
                  k: bundle.stats[k] for k in ("tokens", "truncated", "dropped", "max_seq_len")}}
    del trainer, timer, bundle
    gc.collect()
    return result


def run_arm(spec: Dict[str, Any], in_process: bool) -> Dict[str, Any]:
    """``child(spec)`` in a new interpreter (``--child``), or here with ``in_process``."""
    if in_process:
        return child(spec)
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{spec['arm']} ({' '.join(spec['overrides'])}) failed, exit {proc.returncode}:\n"
                         f"{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def summarise(runs: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Any]:
    """Per arm: timed steps (each child's first left out), quartiles, tokens/s, memory; the ratios qwenft / TRL."""
    out: Dict[str, Any] = {"arms": {}}
    for arm, rounds in runs.items():
        steps = [s for r in rounds for s in r["seconds_per_step"][1:]]
        tokens = [b["tokens"] for r in rounds for b in r["batches"][1:]]
        median = statistics.median(steps)
        train_peaks = [int(r["step_peak_bytes"][-1]) for r in rounds]  # the steps' peak (StepTimer)
        above = [peak - int(r["baseline_bytes"]) for peak, r in zip(train_peaks, rounds)]
        call_peaks = [int(r["train_memory"]["bytes"]) for r in rounds]
        load_peaks = [int(r["load_memory"]["bytes"]) for r in rounds]
        quartiles = _quartiles(steps)
        out["arms"][arm] = {
            "timed_steps": len(steps), "median_s_per_step": median, "p25_s_per_step": quartiles["p25"],
            "p75_s_per_step": quartiles["p75"], "min_s_per_step": min(steps), "max_s_per_step": max(steps),
            "tokens_per_s": sum(tokens) / sum(steps),
            "peak_train_bytes": statistics.median(train_peaks),
            "peak_train_above_baseline_bytes": statistics.median(above),
            "peak_train_call_bytes": statistics.median(call_peaks),  # the whole train(): the steps, then a save
            "peak_load_bytes": statistics.median(load_peaks),
            "baseline_bytes": statistics.median([int(r["baseline_bytes"]) for r in rounds]),
            "memory_kind": rounds[0]["train_memory"]["kind"],
            "first_step_losses": [r["losses"][0] for r in rounds],
            "first_step_grad_norms": [r["grad_norms"][0] for r in rounds],
            "first_step_metrics": [r["first_step_metrics"] for r in rounds],
            "losses": [r["losses"] for r in rounds]}
    q, t = runs["qwenft"], runs["trl"]
    same_rows = all([b["tokens"] for b in a["batches"]] == [b["tokens"] for b in b_["batches"]]
                    for a, b_ in zip(q, t))
    paired = [qs / ts for a, b_ in zip(q, t) for qs, ts in zip(a["seconds_per_step"][1:], b_["seconds_per_step"][1:])]
    arms = out["arms"]
    out.update({
        "same_rows": same_rows, "same_tokens": all(r["facts"]["same_tokens_as_qwenft"] for r in t),
        "paired_ratios": paired,
        "ratio_qwenft_over_trl": statistics.median(paired) if same_rows else
        arms["qwenft"]["median_s_per_step"] / arms["trl"]["median_s_per_step"],
        "ratio_method": "median of paired steps" if same_rows else "ratio of medians",
        "ratio_of_medians": arms["qwenft"]["median_s_per_step"] / arms["trl"]["median_s_per_step"],
        "memory_ratio_qwenft_over_trl": arms["qwenft"]["peak_train_bytes"] / arms["trl"]["peak_train_bytes"],
        "memory_ratio_above_baseline": arms["qwenft"]["peak_train_above_baseline_bytes"] /
        max(arms["trl"]["peak_train_above_baseline_bytes"], 1),
        "load_memory_ratio": arms["qwenft"]["peak_load_bytes"] / arms["trl"]["peak_load_bytes"],
        "first_step_loss_is_ln2": all(abs(r["losses"][0] - LN2) < FIRST_LOSS_TOLERANCE for r in q + t),
        # the same LoRA init, pairs and loss: the first gradients agree up to the arms' float rounding
        "first_grad_norm_rel_diff": max(abs(a["grad_norms"][0] / b_["grad_norms"][0] - 1) for a, b_ in zip(q, t)),
        "second_step_loss_abs_diff": max((abs(a["losses"][1] - b_["losses"][1]) for a, b_ in zip(q, t)
                                          if len(a["losses"]) > 1 and len(b_["losses"]) > 1), default=None),
    })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny-random, for a smoke run")
    parser.add_argument("--rounds", type=int, default=3, help="children per arm, alternated ABBA")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per child (the first is warm-up)")
    parser.add_argument("--batch", type=int, default=2, help="pairs per step")
    parser.add_argument("--seq", type=int, default=None,
                        help="data.max_seq_len = TRL's max_length (default 192, the recipe's; 512 with --quick, where "
                             "the tiny tokenizer's longer sequences would otherwise be cut)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: CUDA when available (qwenft.runtime.default_device)")
    parser.add_argument("--malloc", choices=("as-run", "both"), default="as-run",
                        help="as-run: only qwenft's process returns freed memory promptly, as `qwenft train` does; "
                             "both: TRL's too (separates the allocator setting from the code)")
    parser.add_argument("--in-process", action="store_true",
                        help="the arms in this process one after another (fast; they share one allocator, so the "
                             "malloc setting holds for both and the memory figures are rough)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads in each arm (default: torch's, one per core). On a CPU shared with other "
                             "work, 2 threads wait on each other at every small op (the AdamW step over the 0.5B's "
                             "336 LoRA tensors: 5.4-7.4 s with 2 threads, 0.04-0.09 s with 1, load average 3.4-4 on "
                             "2 cores)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        print("RESULT " + json.dumps(child(json.loads(opts.child)), default=str), flush=True)
        return
    opts.seq = opts.seq or (512 if opts.quick else 192)
    if opts.steps < 2:
        parser.error("--steps must be >= 2 (the first step of each child is not timed)")

    from qwenft.runtime import default_device

    device = default_device() if opts.device == "auto" else "cuda:0" if opts.device == "cuda" else "cpu"
    started = time.perf_counter()
    runs: Dict[str, List[Dict[str, Any]]] = {arm: [] for arm in ARMS}
    order: List[str] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        for round_ in range(opts.rounds):
            for arm in (ARMS if round_ % 2 == 0 else ARMS[::-1]):  # ABBA
                tmp = Path(tmp_name) / f"{arm}-{round_}"
                spec = {"arm": arm, "device": device, "malloc": "both" if opts.in_process else opts.malloc,
                        "threads": opts.threads,
                        "tmp": str(tmp), "overrides": _overrides(opts, 42 + round_, tmp / "run")}
                result = run_arm(spec, opts.in_process)
                runs[arm].append(result)
                order.append(arm)
                peak = int(result["step_peak_bytes"][-1]) / GIB
                print(f"round {round_} {arm}: s/step {[round(s, 3) for s in result['seconds_per_step']]}, losses "
                      f"{[round(x, 4) for x in result['losses']]}, peak {peak:.2f} GiB, load average "
                      f"{result['load_average']}", flush=True)
    summary = summarise(runs)
    arms = summary["arms"]
    first = runs["qwenft"][0]
    stats = first["data_stats"]
    what = "RSS" if not device.startswith("cuda") else "CUDA allocated"
    rows = [(arm, f"{a['median_s_per_step']:.3f}", f"{a['p25_s_per_step']:.3f}", f"{a['p75_s_per_step']:.3f}",
             f"{a['tokens_per_s']:.1f}", f"{a['peak_train_bytes'] / GIB:.2f}",
             f"{a['peak_train_above_baseline_bytes'] / GIB:.2f}", f"{a['peak_load_bytes'] / GIB:.2f}", a["timed_steps"])
            for arm, a in arms.items()]
    print_table(f"DPO step, {opts.batch} pairs, {opts.rounds} rounds x {opts.steps} steps per arm ({device})",
                ["arm", "median s/step", "p25", "p75", "tokens/s", f"peak {what} train GiB", "above baseline",
                 "peak load GiB", "steps timed"], rows)
    print(f"same tokens in both arms: {summary['same_tokens']}; same pairs in the same order: {summary['same_rows']}")
    print(f"qwenft / TRL seconds per step ({summary['ratio_method']}): {summary['ratio_qwenft_over_trl']:.3f} "
          f"(target <= 1.0; ratio of medians {summary['ratio_of_medians']:.3f})")
    print(f"qwenft / TRL peak {what} in training: {summary['memory_ratio_qwenft_over_trl']:.3f} (target <= 0.8); "
          f"above the baseline {summary['memory_ratio_above_baseline']:.3f}; while loading "
          f"{summary['load_memory_ratio']:.3f}")
    print(f"first-step losses (ln 2 = {LN2:.4f}): qwenft {arms['qwenft']['first_step_losses']}, "
          f"TRL {arms['trl']['first_step_losses']}: {'ok' if summary['first_step_loss_is_ln2'] else 'NOT ln 2'}; "
          f"first gradient norms differ by {summary['first_grad_norm_rel_diff']:.1e} (relative), second-step losses by "
          f"{summary['second_step_loss_abs_diff']:.1e}")
    config_facts = runs["trl"][0]["facts"]
    name = "".join(["dpo_step", "_cuda" if device.startswith("cuda") else "",
                    f"_threads{opts.threads}" if opts.threads else "",
                    "_malloc_both" if opts.malloc == "both" and not opts.in_process else "",
                    "_quick" if opts.quick else ""])
    save_json(name, {
        "environment": environment(),
        "settings": {"recipe": "dpo", **first["config"], "device": device, "pairs_per_step": opts.batch,
                     "max_seq_len": opts.seq, "rounds": opts.rounds, "steps_per_child": opts.steps,
                     "order": order, "seeds": [42 + r for r in range(opts.rounds)], "malloc": opts.malloc,
                     "threads": opts.threads or first["threads"],
                     "in_process": opts.in_process, "overrides": _overrides(opts, 42, Path("RUN")),
                     "train_pairs": first["train_pairs"], "data_stats": stats,
                     "qwenft": first["facts"], "trl": config_facts, "trl_loss_type": "sigmoid"},
        "runs": runs, **summary, "targets": {"time": 1.0, "memory": 0.8},
        "seconds_total": time.perf_counter() - started,
    })


if __name__ == "__main__":
    main()
