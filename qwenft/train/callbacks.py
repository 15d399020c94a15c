"""Callbacks of ``qwenft train``: atomic checkpoints (:class:`AtomicCheckpoints`), the progress bar (loss, lr,
tokens/s; ETA from tqdm) and the loss logged at the last step (:class:`LogLastStep`)."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from transformers import TrainerCallback

log = logging.getLogger("qwenft.train")


class ProgressBarCallback(TrainerCallback):
    """A tqdm bar over optimizer steps with loss, lr and tokens/s (ETA from tqdm); eval results as lines."""

    def __init__(self) -> None:
        self.bar = None

    def on_train_begin(self, args, state, control, **kwargs):
        from tqdm.auto import tqdm

        if state.is_world_process_zero:
            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="train", unit="step",
                            dynamic_ncols=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" in logs:
            postfix = {"loss": f"{logs['loss']:.4f}", "lr": f"{logs.get('learning_rate', 0):.2e}"}
            if "tokens_per_s" in logs:
                postfix["tok/s"] = f"{logs['tokens_per_s']:.0f}"
            for key, short in (("rewards/accuracies", "acc"), ("rewards/margins", "margin")):  # preference runs
                if key in logs:
                    postfix[short] = f"{logs[key]:.3f}"
            if self.bar is not None:
                self.bar.set_postfix(postfix)
            log.info("step %d: %s", state.global_step, " ".join(f"{k}={v}" for k, v in postfix.items()))
        if "eval_loss" in logs:
            extra = {k: logs[k] for k in ("eval_perplexity", "eval_rewards/accuracies", "eval_rewards/margins")
                     if k in logs}
            log.info("step %d: eval_loss=%.4f%s", state.global_step, logs["eval_loss"],
                     "".join(f" {k}={v:.3f}" for k, v in extra.items()))

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class LogLastStep(TrainerCallback):
    """Log the loss at the last optimizer step too, and say which steps each logged loss averages.

    transformers logs every ``logging_steps`` steps (and step 1 with ``logging_first_step``): a run of 16 steps at
    ``logging_steps=10`` logged steps 1 and 10 only, so its "final" loss was step 10's. The Trainer's
    ``DefaultFlowCallback`` runs first; this one then asks for a log at ``state.max_steps`` too. A logged ``loss``
    (nats per supervised token) is the mean over the steps since the previous log
    (``Trainer._maybe_log_save_evaluate``); each entry of ``state.log_history`` with a loss gets ``loss_from_step``,
    the first of those steps (after a resume, counted from the step resumed at, as the Trainer counts).
    """

    def __init__(self) -> None:
        self.logged_at = 0  # the step of the previous loss log, or the step training (re)started at

    def on_train_begin(self, args, state, control, **kwargs):
        self.logged_at = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            control.should_log = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in (logs or {}):
            entry = state.log_history[-1] if state.log_history else {}  # the Trainer appended it just before
            if entry.get("step") == state.global_step and "loss" in entry:
                entry["loss_from_step"] = self.logged_at + 1
            self.logged_at = state.global_step


STAGING_NAME = ".tmp-staging"  # the Trainer's output_dir inside <run>/checkpoints (a stale one is removed at start)


def staging_root(checkpoint_dir) -> Path:
    """The folder the Trainer writes ``checkpoint-N`` into (its ``TrainingArguments.output_dir``) before
    :class:`AtomicCheckpoints` renames it into ``checkpoint_dir``: on the same filesystem, so the rename is atomic."""
    return Path(checkpoint_dir) / STAGING_NAME


class AtomicCheckpoints(TrainerCallback):
    """Checkpoints that appear in ``checkpoint_dir`` whole or not at all, on transformers' public callback API.

    The Trainer writes ``checkpoint-N`` into :func:`staging_root` (``TrainingArguments.output_dir``). transformers
    (5.24, ``Trainer._maybe_log_save_evaluate``) calls ``on_save`` on every rank right after its
    ``_save_checkpoint`` returned, with no barrier in between: other ranks may still be writing their RNG states (with
    FSDP / DeepSpeed, their shards) into the same folder. So every rank first waits for all the others; then rank 0
    adds ``qwenft.json`` (the base, quantization and LoRA settings, so ``adapter=.../checkpoint-N`` runs on the right
    base), gives the files ordinary permissions, renames the folder to ``checkpoint_dir/checkpoint-N``, removes the
    emptied staging folder and keeps the newest ``save_total_limit`` checkpoints (by step) in ``checkpoint_dir``;
    every rank waits again, so none goes on before ``checkpoint-N`` exists. A process killed at any moment leaves at
    most a stale staging folder, which ``train`` removes at its next start and ``train.resume=auto`` never reads.

    Args:
        checkpoint_dir: Where complete checkpoints live (``<run>/checkpoints``).
        config: The run's config, written into every checkpoint as ``qwenft.json`` (None: not written).
        data_stats: the training data's ``DataBundle.stats``, for ``qwenft.json``
            (:func:`qwenft.model.save_adapter_meta`).
    """

    def __init__(self, checkpoint_dir, config=None, data_stats=None) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        self.config = config
        self.data_stats = data_stats

    def on_train_begin(self, args, state, control, **kwargs):
        if args.process_index == 0:  # made empty by the Trainer when it was built; each save makes it again
            with contextlib.suppress(OSError):
                os.rmdir(args.output_dir)

    def on_save(self, args, state, control, **kwargs):
        from qwenft.train.dist import barrier

        barrier()  # every rank has written its part of checkpoint-N
        if args.process_index == 0:
            self.publish(args.output_dir, state.global_step, args.save_total_limit)
        barrier()  # no rank goes on before checkpoint-N exists

    def publish(self, staging, step: int, save_total_limit=None) -> Path:
        """Move the complete ``staging/checkpoint-<step>`` to ``checkpoint_dir`` (replacing one of the same step,
        e.g. saved again after a resume), then rotate; returns the checkpoint's path."""
        import shutil

        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        from qwenft.files import publish_dir

        name = f"{PREFIX_CHECKPOINT_DIR}-{step}"
        staged = Path(staging) / name
        if self.config is not None:
            from qwenft.model import save_adapter_meta

            save_adapter_meta(str(staged), self.config, self.data_stats)
        final = publish_dir(staged, self.checkpoint_dir / name)  # safetensors writes its files 0600
        shutil.rmtree(staging, ignore_errors=True)  # empty now
        rotate_checkpoints(output_dir=str(self.checkpoint_dir), save_total_limit=save_total_limit, use_mtime=False)
        return final
