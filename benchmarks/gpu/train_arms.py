"""The training arms of the one-GPU check, timed in alternating blocks (see qlora_7b.py).

Each arm is a real ``Trainer.train()`` (the plain Trainer + peft baseline, qwenft's ``make_trainer``, and qwenft with
``train.kernels=liger`` where CUDA and liger-kernel are there), running in its own thread on its own copy of the same
random NF4 model. A callback hands the device to the next arm after every block of optimizer steps, so the arms run
``A B C A B C ...`` on one device, one at a time: a machine that warms up, throttles or is disturbed during the run
affects every arm alike. The first block of each arm (optimizer creation, kernel selection, allocator warm-up) is not
timed; each arm's peak memory is measured during that first block, while the arms built before it sit idle, as the
peak above the memory in use before it was built.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional


def _quantiles(values: List[float]) -> Dict[str, float]:
    values = sorted(values)
    if len(values) < 2:
        return {"p25": values[0], "p75": values[0]} if values else {"p25": None, "p75": None}
    q = statistics.quantiles(values, n=4, method="inclusive")
    return {"p25": q[0], "p75": q[2]}


class _Arm:
    """One arm's thread, its step timer and its hand-off points."""

    def __init__(self, name: str, trainer, cuda: bool, block: int, handoff: threading.Semaphore):
        from transformers import TrainerCallback

        self.name, self.trainer, self.block = name, trainer, block
        self.go, self.handoff = threading.Semaphore(0), handoff
        self.steps: List[float] = []
        self.error: Optional[BaseException] = None
        self.finished = False
        arm = self

        def now() -> float:
            if cuda:
                import torch

                torch.cuda.synchronize()
            return time.perf_counter()

        class Blocks(TrainerCallback):
            start = 0.0

            def on_step_begin(self, args, state, control, **kwargs):
                Blocks.start = now()

            def on_step_end(self, args, state, control, **kwargs):
                arm.steps.append(now() - Blocks.start)
                if len(arm.steps) % arm.block == 0 and state.global_step < state.max_steps:
                    arm.handoff.release()  # this block is done: the next arm's turn
                    arm.go.acquire()

        trainer.add_callback(Blocks())
        self.thread = threading.Thread(target=self._run, name=f"train-{name}", daemon=True)

    def _run(self) -> None:
        try:
            self.trainer.train()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc
        finally:
            self.finished = True
            self.handoff.release()

    def wait(self) -> None:
        """Wait for this arm's block to end; re-raise its error."""
        self.handoff.acquire()
        if self.error is not None:
            raise RuntimeError(f"training arm {self.name!r} failed: {self.error!r}") from self.error


def run_arms(builders: Dict[str, Callable[[], object]], memory, block: int, blocks: int, tokens_per_step: int,
             cuda: bool) -> Dict[str, dict]:
    """Build and train every arm of ``builders`` (name -> a function returning a ready ``Trainer`` on a fresh model),
    ``blocks`` blocks of ``block`` steps each, alternated; the first block of each arm is untimed.

    Returns:
        Per arm: ``seconds_per_step`` (all), ``block_of_step``, ``timed_steps``, ``median_s_per_step`` with
        ``min/p25/p75/max``, ``tokens_per_s`` (``tokens_per_step / median``), ``peak_memory_bytes`` (first block,
        above the memory in use before the arm was built), ``losses`` (every logged loss) and ``final_loss``.
    """
    handoff = threading.Semaphore(0)
    arms: Dict[str, _Arm] = {}
    peaks: Dict[str, int] = {}
    for name, build in builders.items():
        before = memory.current()
        memory.reset()
        arm = _Arm(name, build(), cuda, block, handoff)
        arms[name] = arm
        arm.thread.start()
        arm.wait()  # its first block, with the arms before it idle
        peaks[name] = max(0, memory.peak() - before)  # a CPU's RSS can dip below the "before" reading
        print(f"  {name}: first block done, peak {peaks[name] / 2**30:.2f} GiB above the {before / 2**30:.2f} GiB "
              "before it", flush=True)
    for _ in range(1, blocks):
        for arm in arms.values():
            if arm.finished:
                continue
            arm.go.release()
            arm.wait()
    results = {}
    for name, arm in arms.items():
        arm.thread.join()
        timed = arm.steps[block:]
        median = statistics.median(timed) if timed else None
        losses = [h["loss"] for h in arm.trainer.state.log_history if "loss" in h]
        results[name] = {
            "seconds_per_step": arm.steps, "block_of_step": [i // block for i in range(len(arm.steps))],
            "timed_steps": len(timed), "median_s_per_step": median,
            "min_s_per_step": min(timed) if timed else None, "max_s_per_step": max(timed) if timed else None,
            **{f"{k}_s_per_step": v for k, v in _quantiles(timed).items()},
            "tokens_per_s": tokens_per_step / median if median else None, "steps": len(arm.steps),
            "peak_memory_bytes": peaks[name], "losses": losses, "final_loss": losses[-1] if losses else None,
        }
    return results


def round_ratios(results: Dict[str, dict], arm: str, baseline: str, block: int) -> List[float]:
    """Per alternation round (block index >= 1): median step of ``arm`` / median step of ``baseline``."""
    out = []
    a, b = results[arm]["seconds_per_step"], results[baseline]["seconds_per_step"]
    for start in range(block, min(len(a), len(b)), block):
        out.append(statistics.median(a[start:start + block]) / statistics.median(b[start:start + block]))
    return out


def qwenft_builder(build_model: Callable[[], object], tokenizer, config, rows, tmp: Path, kernels: str):
    """A function building qwenft's arm: ``train.kernels`` applied, ``attach_lora``, ``make_trainer`` on ``rows``."""

    def build():
        import dataclasses

        from transformers import set_seed

        from qwenft.data import DataBundle
        from qwenft.model import attach_lora
        from qwenft.train.trainer import autocast_dtype, make_trainer

        cfg = dataclasses.replace(config, train=dataclasses.replace(config.train, kernels=kernels))
        model = build_model()
        set_seed(cfg.train.seed)
        model = attach_lora(model, cfg.lora, gradient_checkpointing=cfg.train.gradient_checkpointing, kernels=kernels,
                            autocast_dtype=autocast_dtype(cfg, "cuda"))
        bundle = DataBundle(train=rows, eval=None, eval_rows={}, stats={})
        return make_trainer(cfg, model, tokenizer, bundle, tmp / f"qwenft-{kernels}", kernels)

    return build


def plain_builder(build_model: Callable[[], object], tokenizer, config, rows, tmp: Path, cuda: bool):
    """A function building the baseline a user writes with transformers + peft + bitsandbytes."""

    def build():
        import torch
        from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments, set_seed

        from benchmarks.common import plain_lora

        set_seed(config.train.seed)
        model = plain_lora(build_model(), config.lora, gradient_checkpointing=True)
        t = config.train
        args = TrainingArguments(output_dir=str(tmp / "plain"), max_steps=t.max_steps,
                                 per_device_train_batch_size=t.batch_size, learning_rate=t.lr,
                                 lr_scheduler_type=t.lr_scheduler, warmup_steps=t.warmup_ratio,
                                 optim="paged_adamw_8bit" if cuda else "adamw_torch", save_strategy="no", report_to=[],
                                 logging_steps=1, remove_unused_columns=False, use_cpu=not cuda, disable_tqdm=True,
                                 seed=t.seed, bf16=cuda and torch.cuda.is_bf16_supported())
        collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
        return Trainer(model=model, args=args, train_dataset=rows, data_collator=collator)

    return build
