"""How close `qwenft plan` comes to the memory a LoRA training step really takes.

Each case runs in a fresh child process: record the resident memory (RSS) after the imports, load the model with
``qwenft.model.load_model`` (tokenizer dropped afterwards: the plan counts model memory only), attach LoRA with
``qwenft.model.attach_lora``, then run one training step the way qwenft's Trainer does (its loss,
``qwenft.train.loss.supervised_loss_sum``, under the run's autocast with an untied lm_head in the autocast dtype; backward,
gradient clipping, AdamW step, ``zero_grad(set_to_none=True)``); a preference case (DPO, SimPO) runs
``PreferenceTrainer.preference_outputs`` (:mod:`qwenft.train.preference`: the policy forward over ``2B`` sequences,
the reference forward with the adapter off, the objective) on ``B`` pairs of full-length sequences (a 32-token prompt,
the last rejected answer 3 tokens short so that the padded layout has padding), then the same backward and step. The
child reports the RSS
increase after loading (the static part) and the peak RSS increase during the step (``VmHWM``, reset just before
the step through ``/proc/self/clear_refs``). The parent compares both with the plan's first-step prediction
(:func:`qwenft.plan.preference.step_memory` with ``steady=False``: the AdamW states do not exist before the first
step; ``plan.supervised_fraction`` set to the answers' share of the predicted positions for a preference case).

glibc's allocator keeps freed heap memory mapped (its mmap threshold grows up to 32 MiB after frees), so RSS
over-reports live tensors. The main cases fix the threshold at 64 KiB (``mallopt(M_MMAP_THRESHOLD)``) so that
freed tensors go back to the system and RSS tracks live memory; ``--full`` also measures the default allocator
to show the size of that effect. The embedded model runs NF4 with fp32 compute: bf16 matmuls in bitsandbytes'
backward are several times slower on a CPU without AVX512-BF16.

    python benchmarks/plan_accuracy.py            # the embedded 0.5B, NF4: SFT 1 x 128 tokens, DPO 2 pairs x 192
    python benchmarks/plan_accuracy.py --full     # + gradient checkpointing, + the default allocator, + --dpo's
    python benchmarks/plan_accuracy.py --dpo      # the preference cases only: DPO padding-free / padded / with
                                                  # gradient checkpointing, SimPO (no reference forward)
    python benchmarks/plan_accuracy.py --quick    # a scaled-up tiny-random model only (seconds)
    python benchmarks/plan_accuracy.py --device cuda   # torch.cuda.max_memory_allocated vs the CUDA plan

Results: benchmarks/results/plan_accuracy.json (plan_accuracy_quick.json, plan_accuracy_cuda.json,
plan_accuracy_dpo.json).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, print_table, save_json  # noqa: E402

MIB = 1 << 20
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
TINY_SHAPE = ["model=tiny-random", "model.tiny.hidden_size=512", "model.tiny.intermediate_size=2048",
              "model.tiny.num_hidden_layers=4", "model.tiny.num_attention_heads=8", "model.tiny.num_key_value_heads=2",
              "model.tiny.vocab_size=32000"]
DPO_SEQ = 192  # the dpo recipe's data.max_seq_len
PROMPT_TOKENS = 32  # of each preference sequence; the rest is the answer


def _preference(objective: str, seq: int):
    """Overrides of a preference case: the objective, no training sources (the child makes the pairs), and the
    answers' share of the predicted positions (``PROMPT_TOKENS`` of each sequence are the prompt)."""
    return [f"train.objective={objective}", "data.sources=[]", f"data.max_seq_len={seq}",
            f"plan.supervised_fraction={(seq - PROMPT_TOKENS) / (seq - 1):.6f}"]


def _cases(args):
    """(name, overrides, batch, seq, malloc) of each case to run."""
    nf4 = ["quant=nf4", "quant.compute_dtype=float32", "train.precision=fp32", "lora.r=16"]
    if args.device == "cuda":
        return [("0.5B nf4 bf16 GC", ["quant=nf4", "lora.r=16", "train.gradient_checkpointing=true"], 2, 512, "-"),
                ("0.5B nf4 bf16", ["quant=nf4", "lora.r=16", "train.gradient_checkpointing=false"], 2, 512, "-")]
    if args.quick:
        # bf16 compute: the tiny model's file is fp32, and fp32 weights would be mapped from the file rather than
        # copied, so RSS would count them only page by page as they are touched.
        tiny = [*TINY_SHAPE, "quant=nf4", "quant.compute_dtype=bfloat16", "train.precision=fp32", "lora.r=16"]
        return [("tiny-512 nf4", [*tiny, "train.gradient_checkpointing=false"], 2, 256, "64k"),
                ("tiny-512 nf4 GC", [*tiny, "train.gradient_checkpointing=true"], 2, 256, "64k"),
                ("tiny-512 nf4 DPO", [*tiny, *_preference("dpo", 256), "train.gradient_checkpointing=false"], 2,
                 256, "64k")]
    dpo = [*nf4, *_preference("dpo", DPO_SEQ)]
    dpo_cases = [("0.5B nf4 DPO", [*dpo, "train.gradient_checkpointing=false"], 2, DPO_SEQ, "64k")]
    if args.full or args.dpo:
        dpo_cases += [
            ("0.5B nf4 DPO GC", [*dpo, "train.gradient_checkpointing=true"], 2, DPO_SEQ, "64k"),
            ("0.5B nf4 DPO padded", [*dpo, "pref.padding_free=false", "train.gradient_checkpointing=false"], 2,
             DPO_SEQ, "64k"),
            ("0.5B nf4 SimPO", [*nf4, *_preference("simpo", DPO_SEQ), "train.gradient_checkpointing=false"], 2,
             DPO_SEQ, "64k")]
    if args.dpo:
        return dpo_cases
    cases = [("0.5B nf4", [*nf4, "train.gradient_checkpointing=false"], 1, 128, "64k")]
    if args.full:
        cases += [("0.5B nf4 GC", [*nf4, "train.gradient_checkpointing=true"], 1, 128, "64k"),
                  ("0.5B nf4 (glibc default)", [*nf4, "train.gradient_checkpointing=false"], 1, 128, "default")]
    return cases + dpo_cases


def _rss():
    """Current and peak resident bytes of this process (Linux /proc)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def child(spec: dict) -> dict:
    """Measure one case in this (fresh) process; see the module docstring."""
    import ctypes
    import gc

    libc = ctypes.CDLL("libc.so.6")
    if spec["malloc"] == "64k":
        libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    import torch

    from tests.conftest import compose_config

    config = compose_config(*spec["overrides"], "out_dir=/tmp/qwenft-plan-accuracy")
    cuda = spec["device"] == "cuda"
    torch.manual_seed(0)
    # Warm-up on the default tiny model with the same settings: lazy imports, bitsandbytes' native library, the
    # BLAS/oneDNN kernels and thread pools get their memory now, so the baseline below holds them.
    warm = compose_config("model=tiny-random", *[o for o in spec["overrides"] if not o.startswith("model")],
                          "out_dir=/tmp/qwenft-plan-accuracy")
    _step(_load(warm, cuda)[0], cuda, warm, 1, 16 if warm.train.objective == "sft" else 48)
    gc.collect()
    libc.malloc_trim(0)

    def reset_peak():
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            Path("/proc/self/clear_refs").write_text("5")

    def now():
        return (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()) if cuda else _rss()

    base, _ = now()
    reset_peak()
    model, load_peak = _load(config, cuda, lambda: now()[1] - base)
    gc.collect()
    libc.malloc_trim(0)
    static = now()[0] - base
    reference = None
    if config.train.objective != "sft":  # the reference forward's own transient, measured alone first
        reference = _reference_transient(model, config, spec["batch"], spec["seq"], now, reset_peak)
        gc.collect()
        libc.malloc_trim(0)
    reset_peak()
    loss = _step(model, cuda, config, spec["batch"], spec["seq"])
    return {"static": static, "peak": now()[1] - base, "load_peak": load_peak, "loss": loss,
            "reference_transient": reference}


def _load(config, cuda: bool, load_peak=lambda: 0):
    """The model as qwenft trains it (tokenizer dropped), and ``load_peak()`` taken right after loading."""
    from qwenft.model import attach_lora, load_model
    from qwenft.train.trainer import autocast_dtype

    model, tokenizer = load_model(config, device="cuda" if cuda else "cpu")
    peak = load_peak()
    del tokenizer
    model = attach_lora(model, config.lora, gradient_checkpointing=config.train.gradient_checkpointing,
                        autocast_dtype=autocast_dtype(config, "cuda" if cuda else "cpu"))
    model.train()
    return model, peak


def _amp(config) -> bool:
    """Whether the run trains under bf16 autocast (``train.precision`` as qwenft resolves it on this CPU)."""
    precision = config.train.precision
    return precision == "bf16" or (precision == "auto" and config.quant.compute_dtype == "bfloat16")


def _preference_trainer(model, config):
    """An object that runs :class:`qwenft.train.preference.PreferenceTrainer`'s ``preference_outputs`` and
    ``reference_logprobs`` (the Trainer's own code) with the run's objective, ``pref`` section and autocast."""
    import types

    import torch

    from qwenft.train.preference import PreferenceTrainer

    accelerator = types.SimpleNamespace(
        autocast=lambda: torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=_amp(config)))
    trainer = types.SimpleNamespace(objective=config.train.objective, pref=config.pref, accelerator=accelerator)
    trainer.reference_logprobs = types.MethodType(PreferenceTrainer.reference_logprobs, trainer)
    trainer.preference_outputs = types.MethodType(PreferenceTrainer.preference_outputs, trainer)
    return trainer


def _reference_transient(model, config, pairs: int, seq: int, now, reset_peak):
    """Bytes one reference forward (``reference_logprobs``: no grad, adapter off) adds at its peak to the memory
    before it, alone (no policy graph alive); None when the objective's step runs none."""
    import ctypes
    import gc

    from qwenft.preference.loss import needs_reference

    if not needs_reference(config.train.objective) or config.pref.precompute_ref:
        return None
    batch = _preference_batch(model, config, pairs, seq)
    trainer = _preference_trainer(model, config)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = now()[0]
    reset_peak()
    trainer.reference_logprobs(model, batch)
    return now()[1] - before


def _preference_batch(model, config, pairs: int, seq: int):
    """``pairs`` pairs of ``seq``-token sequences (a ``PROMPT_TOKENS`` prompt, random ids, the last rejected answer 3
    tokens short), collated as the run's :class:`qwenft.train.preference.PreferenceCollator` does."""
    import torch

    from qwenft.train.preference import PreferenceCollator, padding_free_of

    vocab = model.config.vocab_size

    def ids(n):
        return torch.randint(vocab // 10, vocab - vocab // 10, (n,)).tolist()

    answer = seq - PROMPT_TOKENS
    rows = [{"prompt_ids": ids(PROMPT_TOKENS), "chosen_ids": ids(answer),
             "rejected_ids": ids(answer - (3 if i == pairs - 1 else 0))} for i in range(pairs)]
    if config.pref.precompute_ref:
        rows = [{**row, "ref_chosen_logps": -1.0, "ref_rejected_logps": -1.0} for row in rows]
    batch = PreferenceCollator(0, padding_free_of(config))(rows)
    return {k: v.to(model.device) for k, v in batch.items()}


def _preference_loss(model, config, pairs: int, seq: int):
    """The loss of one preference batch (:func:`_preference_batch`) as
    :meth:`qwenft.train.preference.PreferenceTrainer.preference_outputs` computes it."""
    batch = _preference_batch(model, config, pairs, seq)
    return _preference_trainer(model, config).preference_outputs(model, batch).loss


def _step(model, cuda: bool, config, batch: int, seq: int) -> float:
    """One training step as qwenft's Trainer runs it (a preference objective's: ``batch`` pairs); returns the loss."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if cuda:
        import bitsandbytes as bnb

        optimizer = bnb.optim.PagedAdamW8bit(params, lr=1e-4)
    else:
        optimizer = torch.optim.AdamW(params, lr=1e-4)
    vocab = model.config.vocab_size
    ids = torch.randint(vocab // 10, vocab - vocab // 10, (batch, seq), device=model.device)
    amp = _amp(config)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[-1, -3:] = 0  # a padded row, as the collator makes: the plan assumes a mask reaches attention
    from qwenft.train.loss import supervised_loss_sum
    from qwenft.train.trainer import head_to_autocast_dtype

    if amp:
        head_to_autocast_dtype(model, torch.bfloat16)
    labels = ids.masked_fill(mask == 0, -100)
    if config.train.objective != "sft":
        loss = _preference_loss(model, config, batch, seq)
    else:
        with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=amp):  # as QwenftTrainer.compute_loss
            total, count = supervised_loss_sum(model, {"input_ids": ids, "attention_mask": mask, "labels": labels},
                                               "none")
            loss = total / count
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss)


def predict(overrides, batch: int, seq: int, device: str) -> dict:
    from qwenft.plan import TrainSetup, resolve_architecture
    from qwenft.plan.preference import step_memory
    from tests.conftest import compose_config

    config = compose_config(*overrides)
    arch = resolve_architecture(config.model)
    setup = TrainSetup.from_config(config, device=device)
    mem = step_memory(arch, setup, batch, seq, steady=False)
    return {"static": mem["weights"] + mem["lora_weights"], "peak": mem["peak"], "parts": mem,
            "objective": setup.objective, "reference": setup.reference, "padding_free": setup.padding_free,
            "reference_transient": mem.get("reference")}


def _pair(planned, measured) -> str:
    """``planned / measured`` MiB of the reference forward's transient, ``-`` where there is none."""
    if not planned and measured is None:
        return "-"
    return f"{(planned or 0) / MIB:,.0f} / " + ("-" if measured is None else f"{measured / MIB:,.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a scaled-up tiny-random model only")
    parser.add_argument("--full", action="store_true", help="also gradient checkpointing and the default allocator")
    parser.add_argument("--dpo", action="store_true", help="the preference cases only")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return
    rows, results = [], []
    for name, overrides, batch, seq, malloc in _cases(args):
        spec = {"overrides": overrides, "batch": batch, "seq": seq, "malloc": malloc, "device": args.device}
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1])
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"case {name!r} failed:\n{proc.stderr[-3000:]}")
        measured = json.loads(lines[-1][len("RESULT "):])
        planned = predict(overrides, batch, seq, args.device)
        error = planned["peak"] / measured["peak"] - 1
        preference = planned["objective"] != "sft"
        results.append({"case": name, "overrides": overrides, "batch": batch, "seq": seq, "malloc": malloc,
                        "objective": planned["objective"], "sequences": 2 * batch if preference else batch,
                        "reference_forward": planned["reference"],
                        "padding_free": preference and planned["padding_free"],
                        "reference_transient": {"planned": planned["reference_transient"],
                                                "measured": measured.get("reference_transient")},
                        "measured": measured, "planned": {"static": planned["static"], "peak": planned["peak"]},
                        "plan_parts": planned["parts"], "peak_error": error,
                        "static_error": planned["static"] / measured["static"] - 1})
        rows.append([name, f"{batch}x{seq}" + (" pairs" if preference else ""), malloc,
                     f"{planned['static'] / MIB:,.0f}", f"{measured['static'] / MIB:,.0f}",
                     f"{planned['peak'] / MIB:,.0f}", f"{measured['peak'] / MIB:,.0f}", f"{100 * error:+.1f}%",
                     f"{measured['load_peak'] / MIB:,.0f}",
                     _pair(planned["reference_transient"], measured.get("reference_transient"))])
        print_table("plan vs measured (MiB; memory increase over the process after imports)",
                    ["case", "batch x seq", "malloc", "plan static", "measured static", "plan peak",
                     "measured peak", "peak error", "load peak", "reference fwd plan / measured"], rows)
    what = "torch.cuda.max_memory_allocated" if args.device == "cuda" else "peak RSS increase (VmHWM)"
    name = "plan_accuracy" + ("_cuda" if args.device == "cuda" else "_quick" if args.quick else
                              "_dpo" if args.dpo else "")
    save_json(name, {"environment": environment(), "measured": what, "device": args.device,
                                "target": "plan peak within 15% of the measured CPU peak (10% on a GPU)",
                                "results": results})


if __name__ == "__main__":
    main()
