"""Callbacks of ``qwenft train``: the progress bar (loss, lr, tokens/s; ETA from tqdm)."""

from __future__ import annotations

import logging

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
            if self.bar is not None:
                self.bar.set_postfix(postfix)
            log.info("step %d: %s", state.global_step, " ".join(f"{k}={v}" for k, v in postfix.items()))
        if "eval_loss" in logs:
            log.info("step %d: eval_loss=%.4f eval_perplexity=%.3f", state.global_step, logs["eval_loss"],
                     logs["eval_perplexity"])

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
