"""The Trainer subclass and callbacks behind ``qwenft train``: atomic checkpoints, NaN guard, progress."""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import time
from typing import Any, Dict, Optional

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import PrinterCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from qwenft.files import publish_tree
from qwenft.train import NonFiniteError

log = logging.getLogger("qwenft.train")


class QwenftTrainer(Trainer):
    """transformers' Trainer with three changes:

    - checkpoints are written under a temporary name and renamed to ``checkpoint-N`` when complete;
    - a non-finite loss or gradient stops the run (:class:`NonFiniteError`, naming the step) before anything
      of that step is saved;
    - every checkpoint carries ``qwenft.json`` (the base, quantization and LoRA settings), so
      ``adapter=.../checkpoint-N`` runs on the right base like the final adapter;
    - ``tokens_seen`` counts the non-padding tokens trained on, and logs carry ``tokens_per_s`` and, for
      eval, ``eval_perplexity = exp(eval_loss)``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.remove_callback(PrinterCallback)
        self.tokens_seen = 0
        self._staging: Optional[str] = None
        self._last_log = (time.perf_counter(), 0)
        self.qwenft_config = None  # set by make_trainer: written into every checkpoint as qwenft.json
        self.kernels = "none"  # resolved train.kernels (qwenft.kernels), set by make_trainer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Causal LM loss over the supervised positions, under mixed precision, without a logits tensor.

        The same value as transformers' ``ForCausalLMLoss`` (sum of token NLLs over labels != -100, divided by
        ``num_items_in_batch`` when the Trainer passes it, else by the count), but:

        - the body and the vocabulary projection run inside ``self.accelerator.autocast()``, the autocast region
          accelerate puts around the top-level model's ``forward`` (bf16 / fp16 under ``train.precision``), since
          they are called directly here: without it the LoRA and vocabulary GEMMs ran in fp32 and SDPA fell back to
          its math path on CUDA;
        - the vocabulary projection and cross-entropy run on the supervised positions only, in chunks, with the
          hidden-state gradient computed as they go (:func:`qwenft.loss.fused_loss`: Liger's fused linear
          cross-entropy with ``train.kernels=liger``, else :func:`qwenft.loss.linear_cross_entropy`), so no
          ``[tokens, vocab]`` logits tensor is ever held (Qwen2.5: 0.6 MB of fp32 per token).
        """
        from qwenft.loss import supervised_loss_sum

        causal = model.get_base_model() if hasattr(model, "get_base_model") else model
        if getattr(causal, "model", None) is None or getattr(causal, "lm_head", None) is None or "labels" not in inputs:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        with self.accelerator.autocast():
            loss, count = supervised_loss_sum(model, inputs, self.kernels)
        denominator = num_items_in_batch if num_items_in_batch is not None else count
        loss = loss / torch.as_tensor(denominator, device=loss.device).clamp(min=1)
        if num_items_in_batch is not None and self.args.average_tokens_across_devices and self.args.world_size > 1:
            # num_items_in_batch counts the labels of all ranks and DDP averages the gradients over the ranks:
            # times world_size, the update is the token-weighted mean over the global batch (as Trainer.compute_loss)
            loss = loss * self.accelerator.num_processes
        return (loss, {"loss": loss}) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        step = self.state.global_step + 1
        if not torch.isfinite(loss).all():
            raise NonFiniteError(f"non-finite loss ({loss.item()}) at step {step}; training stopped, the last good "
                                 f"checkpoint under {self.args.output_dir} is kept (try a lower train.lr or bf16)")
        grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
        if grads and not torch.isfinite(torch.stack([g.detach().float().norm() for g in grads])).all():
            raise NonFiniteError(f"non-finite gradient norm at step {step}; training stopped, the last good "
                                 f"checkpoint under {self.args.output_dir} is kept")
        mask = inputs.get("attention_mask")
        self.tokens_seen += int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())
        return loss

    # Checkpoints: Trainer writes into _get_output_dir(); point that at a staging folder while saving.
    def _get_output_dir(self, trial):
        if self._staging is not None:
            return self._staging
        return super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        from qwenft import dist

        root = super()._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        main = self.args.process_index == 0
        if self.args.world_size > 1:
            # All ranks write into one staging folder (their RNG states; with FSDP / DeepSpeed their shards), which
            # rank 0 renames once every rank is done.
            self._staging = os.path.join(root, f".tmp-{name}")
            if main:
                shutil.rmtree(self._staging, ignore_errors=True)
                os.makedirs(self._staging)
            dist.barrier()
        else:
            os.makedirs(root, exist_ok=True)
            self._staging = tempfile.mkdtemp(prefix=".tmp-", dir=root)
        try:
            super()._save_checkpoint(model, trial)
            dist.barrier()
            if main:
                if self.qwenft_config is not None:  # a checkpoint names its base like the final adapter does
                    from qwenft.model import save_adapter_meta

                    save_adapter_meta(os.path.join(self._staging, name), self.qwenft_config)
                publish_tree(os.path.join(self._staging, name))  # safetensors writes its files 0600
                final = os.path.join(root, name)
                if os.path.exists(final):  # the same step saved again (e.g. after a resume)
                    shutil.rmtree(final)
                os.replace(os.path.join(self._staging, name), final)
        finally:
            if main:
                shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
        if self.args.should_save:
            rotate_checkpoints(output_dir=root, save_total_limit=self.args.save_total_limit, use_mtime=False)
        dist.barrier()  # no rank goes on before checkpoint-N exists

    def log(self, logs: Dict[str, float], start_time: Optional[float] = None) -> None:
        now = time.perf_counter()
        if "loss" in logs:
            then, tokens = self._last_log
            if now > then:
                logs["tokens_per_s"] = round((self.tokens_seen - tokens) / (now - then), 2)
            self._last_log = (now, self.tokens_seen)
        if "eval_loss" in logs:
            logs["eval_perplexity"] = math.exp(min(logs["eval_loss"], 50.0))
        super().log(logs, start_time)


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
