"""Seconds per step and tokens/s of qwenft's training path vs a plain transformers Trainer + peft script.

Same model (default: the embedded Qwen2.5 0.5B in NF4, compute dtype as qwenft resolves `auto`), same tokenized rows, batch, steps,
LoRA settings, optimizer and gradient checkpointing; the two arms alternate (A B A B ...) in one process so
that machine noise hits both. The first step of every arm is warm-up and not counted. Target: qwenft/plain
seconds per step <= 1.05.

    python benchmarks/train_step.py            # 2 rounds x 6 steps per arm
    python benchmarks/train_step.py --quick    # tiny-random, for a smoke run
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, plain_lora, print_table, save_json  # noqa: E402


class StepTimer:
    """A TrainerCallback that records the wall time of every optimizer step, and the tokens of every batch.

    ``tokens`` holds the non-padding tokens of each batch the collator built, in order; with grad_accum 1,
    batch i is step i, which lets the two arms be compared step by step on the same rows.
    """

    def __init__(self):
        from transformers import TrainerCallback

        timer = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                timer.steps.append(time.perf_counter() - timer.start)

        self.callback = _Callback()
        self.steps = []
        self.tokens = []
        self.start = 0.0

    def wrap(self, trainer) -> None:
        """Record the tokens of every batch the trainer's collator builds."""
        collate = trainer.data_collator

        def counting(features):
            batch = collate(features)
            self.tokens.append(int(batch["attention_mask"].sum()))
            return batch

        trainer.data_collator = counting


def qwenft_arm(config, steps: int, tmp: Path):
    from qwenft import data as data_lib
    from qwenft.model import attach_lora, load_model
    from qwenft.train.trainer import autocast_dtype, make_trainer

    model, tokenizer = load_model(config)
    bundle = data_lib.build(config, tokenizer)
    model = attach_lora(model, config.lora, gradient_checkpointing=config.train.gradient_checkpointing,
                        autocast_dtype=autocast_dtype(config, str(next(model.parameters()).device)))
    trainer = make_trainer(config, model, tokenizer, bundle, tmp / "qwenft", "none")
    timer = StepTimer()
    timer.wrap(trainer)
    trainer.add_callback(timer.callback)
    trainer.train()
    return timer, bundle


def plain_arm(config, steps: int, tmp: Path, train_rows):
    """What a user would write by hand with transformers + peft + bitsandbytes."""
    import torch
    from transformers import (AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, DataCollatorForSeq2Seq,
                              Trainer, TrainingArguments)

    from qwenft.model import resolve_model_dir
    from qwenft.runtime import native_bf16, torch_dtype

    path = resolve_model_dir(config.model)
    # The same numeric settings as qwenft's `auto` choices, so only the code path differs: bf16 compute and
    # autocast where bf16 is native, fp32 elsewhere (bf16 GEMMs on an AVX2-only CPU are ~20x slower).
    compute = torch_dtype(config.quant.compute_dtype if config.quant.method == "nf4" else config.model.dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    quant = None
    if config.quant.method == "nf4":
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=compute)
    dtype = compute
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=quant, device_map={"": "cpu"})
    if quant is not None:
        for module in model.modules():  # the same bitsandbytes CPU setting qwenft applies
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
    model = plain_lora(model, config.lora, config.train.gradient_checkpointing)
    t = config.train
    args = TrainingArguments(output_dir=str(tmp / "plain"), max_steps=steps, per_device_train_batch_size=t.batch_size,
                             learning_rate=t.lr, lr_scheduler_type=t.lr_scheduler, warmup_steps=t.warmup_ratio,
                             optim="adamw_torch", save_strategy="no", report_to=[], logging_steps=t.logging_steps,
                             remove_unused_columns=False, use_cpu=True, disable_tqdm=True, seed=t.seed,
                             bf16=compute == torch.bfloat16 and native_bf16("cpu"))
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    trainer = Trainer(model=model, args=args, train_dataset=train_rows, data_collator=collator)
    timer = StepTimer()
    timer.wrap(trainer)
    trainer.add_callback(timer.callback)
    trainer.train()
    return timer


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny-random model, for a smoke run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    opts = parser.parse_args()

    from tests.conftest import compose_config

    model = ["model=tiny-random", "quant=none"] if opts.quick else []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        config = compose_config(*model, f"out_dir={tmp}", f"train.max_steps={opts.steps}",
                                f"train.batch_size={opts.batch}", f"data.max_seq_len={opts.seq}",
                                "train.save_steps=100000", "train.eval_steps=100000", "data.packing=false",
                                "lora.lora_dropout=0.0")
        results = {"qwenft": [], "plain": []}
        tokens = {"qwenft": [], "plain": []}
        for round_ in range(opts.rounds):
            timer, bundle = qwenft_arm(config, opts.steps, tmp / f"r{round_}")
            results["qwenft"].extend(timer.steps[1:])
            tokens["qwenft"].extend(timer.tokens[1:len(timer.steps)])
            train_rows = bundle.train
            del bundle, timer
            gc.collect()
            timer = plain_arm(config, opts.steps, tmp / f"r{round_}", train_rows)
            results["plain"].extend(timer.steps[1:])
            tokens["plain"].extend(timer.tokens[1:len(timer.steps)])
            del timer
            gc.collect()
    med = {arm: statistics.median(v) for arm, v in results.items()}
    rate = {arm: sum(tokens[arm]) / sum(results[arm]) for arm in results}
    same_rows = tokens["qwenft"] == tokens["plain"]
    # Both Trainers draw rows with the same seeded sampler, so step i trains on the same row in both arms (checked
    # through the token counts): the per-step ratio cancels the row-length noise that spreads step times 2x.
    paired = [q / p for q, p in zip(results["qwenft"], results["plain"])]
    ratio = statistics.median(paired) if same_rows else med["qwenft"] / med["plain"]
    rows = [(arm, f"{med[arm]:.3f}", f"{rate[arm]:.1f}", len(results[arm])) for arm in med]
    print_table("train step", ["arm", "median s/step", "tokens/s", "steps timed"], rows)
    print(f"same rows in the same order in both arms: {same_rows}")
    print(f"qwenft / plain seconds per step ({'median of paired steps' if same_rows else 'ratio of medians'}): "
          f"{ratio:.3f} (target <= 1.05); tokens/s plain / qwenft: {rate['plain'] / rate['qwenft']:.3f}")
    save_json("train_step_quick" if opts.quick else "train_step", {
        "environment": environment(),
        "settings": {"model": config.model.name, "quant": config.quant.method, "batch": opts.batch,
                     "max_seq_len": opts.seq, "steps_per_arm": opts.steps, "rounds": opts.rounds,
                     "lora_r": config.lora.r, "targets": list(config.lora.target_modules)},
        "seconds_per_step": results, "tokens_per_step": tokens, "same_rows": same_rows,
        "median_seconds_per_step": med, "tokens_per_s": rate, "paired_ratios": paired,
        "ratio_qwenft_over_plain": ratio, "ratio_method": "median of paired steps" if same_rows else "ratio of medians",
        "target": 1.05,
    })


if __name__ == "__main__":
    main()
