"""The Trainer behind ``qwenft train``: :class:`QwenftTrainer` (NaN guard, the loss under autocast without a logits
tensor) and :func:`make_trainer`, which maps the config onto transformers' ``TrainingArguments`` and adds the
callbacks (atomic checkpoints: :class:`qwenft.train.callbacks.AtomicCheckpoints`)."""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from transformers import Trainer
from transformers.trainer_callback import PrinterCallback

from qwenft.config import Config, ConfigError, QwenftError

log = logging.getLogger("qwenft.train")


class NonFiniteError(QwenftError):
    """The loss or a gradient became NaN/inf; the run stops, the last good checkpoint stays."""


def _precision_and_optim(config: Config, model) -> Tuple[Dict[str, bool], str]:
    """The TrainingArguments' ``bf16`` / ``fp16`` flags (:func:`qwenft.runtime.resolve_precision`) and ``optim``
    (:func:`qwenft.runtime.resolve_optim`) for the device ``model`` is on.

    Raises:
        ConfigError: ``train.precision=fp16`` without a CUDA device.
    """
    import torch

    from qwenft.runtime import native_bf16, resolve_dtype, resolve_optim, resolve_precision

    device = str(next(model.parameters()).device)
    compute = config.quant.compute_dtype if config.quant.method == "nf4" else config.model.dtype
    choice = resolve_precision(config.train.precision, resolve_dtype(compute, device), native_bf16(device))
    optim = resolve_optim(config.train.optim, config.dist.strategy, torch.cuda.is_available())
    if choice == "fp16":
        if not torch.cuda.is_available():
            raise ConfigError("train.precision='fp16' needs a CUDA device; use bf16 or fp32 on a CPU")
        log.warning("fp16 training can overflow on Qwen2 (NaN loss); bf16 is preferred where supported")
    return {"bf16": choice == "bf16", "fp16": choice == "fp16"}, optim


def autocast_dtype(config: Config, device: str):
    """The 16-bit dtype training on ``device`` autocasts to (``train.precision`` resolved as the Trainer's flags
    are, :func:`qwenft.runtime.resolve_precision`): ``torch.bfloat16`` / ``torch.float16``, or None for fp32."""
    import torch

    from qwenft.runtime import native_bf16, resolve_dtype, resolve_precision

    compute = config.quant.compute_dtype if config.quant.method == "nf4" else config.model.dtype
    choice = resolve_precision(config.train.precision, resolve_dtype(compute, device), native_bf16(device))
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(choice)


def wandb_env(config: Config) -> None:
    """W&B logs offline unless the user is logged in or set WANDB_MODE; files go into the run directory (the
    Trainer's W&B callback starts a run on rank 0 only)."""
    os.environ.setdefault("WANDB_PROJECT", config.wandb.project)
    os.environ.setdefault("WANDB_DIR", config.out_dir)
    if config.wandb.entity:
        os.environ.setdefault("WANDB_ENTITY", config.wandb.entity)
    if config.wandb.mode:
        os.environ["WANDB_MODE"] = config.wandb.mode
    elif "WANDB_MODE" not in os.environ and not os.environ.get("WANDB_API_KEY"):
        netrc = Path.home() / ".netrc"
        if not (netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")):
            os.environ["WANDB_MODE"] = "offline"


def training_arguments(config: Config, model, checkpoint_dir: Path, has_eval: bool):
    """Map ``config.train`` and ``config.dist`` onto ``transformers.TrainingArguments``.

    The Trainer's ``output_dir`` is the staging folder inside ``checkpoint_dir``
    (:func:`qwenft.train.callbacks.staging_root`): :class:`~qwenft.train.callbacks.AtomicCheckpoints` renames each
    complete checkpoint from there into ``checkpoint_dir``.
    """
    from transformers import TrainingArguments

    from qwenft.train.callbacks import staging_root
    from qwenft.train.dist import training_kwargs

    distributed = training_kwargs(config, _on_cuda(model))
    precision, optim = _precision_and_optim(config, model)
    t = config.train
    if t.warmup_ratio > 0 and 0 < t.max_steps <= math.ceil(t.warmup_ratio * t.max_steps):
        log.warning("train.max_steps=%d with train.warmup_ratio=%g: every step is warmup, and the learning rate is 0 "
                    "at the first (the warmup starts from 0), so this run leaves the adapter as it began; use "
                    "train.max_steps>=2 or train.warmup_ratio=0", t.max_steps, t.warmup_ratio)
    return TrainingArguments(
        output_dir=str(staging_root(checkpoint_dir)), run_name=Path(config.out_dir).name,
        learning_rate=t.lr, lr_scheduler_type=t.lr_scheduler, warmup_steps=t.warmup_ratio,  # < 1: a ratio
        num_train_epochs=t.epochs, max_steps=t.max_steps, per_device_train_batch_size=t.batch_size,
        per_device_eval_batch_size=t.batch_size, gradient_accumulation_steps=t.grad_accum,
        max_grad_norm=t.max_grad_norm, weight_decay=t.weight_decay, optim=optim,
        seed=t.seed, data_seed=t.seed, save_strategy="steps", save_steps=t.save_steps,
        save_total_limit=t.save_total_limit, eval_strategy="steps" if has_eval else "no", eval_steps=t.eval_steps,
        logging_strategy="steps", logging_steps=t.logging_steps, logging_first_step=True,
        logging_nan_inf_filter=False,  # a NaN must be seen (and stop the run), never averaged away
        neftune_noise_alpha=t.neftune_noise_alpha, report_to=["wandb"] if config.logger == "wandb" else [],
        remove_unused_columns=False, label_names=["labels"], activation_checkpointing=False,  # set up in attach_lora
        dataloader_num_workers=0, use_cpu=not _on_cuda(model), disable_tqdm=True, **precision, **distributed)


def torch_dtype_of(args):
    """The autocast dtype of ``TrainingArguments`` (bf16 or fp16), or None."""
    import torch

    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None


def head_to_autocast_dtype(model, dtype) -> bool:
    """Keep a frozen, untied fp32 ``lm_head`` in the autocast dtype ``dtype``.

    Under autocast the vocabulary projection runs in ``dtype`` anyway; a fp32 head (a 16-bit base under fp32 weights,
    or a k-bit preparation without autocast dtype, :func:`qwenft.model.lora.prepare_kbit`: 2.2 GB for Qwen2.5-7B's
    152064 x 3584) would be cast back on every step (a 1.1 GB copy). The values are unchanged when the checkpoint's
    weight was 16-bit. A tied lm_head (it is the input embedding: casting it would change the residual stream's dtype)
    or a trainable one is left alone.

    Returns:
        Whether the weight was cast.
    """
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    head, embed = causal.get_output_embeddings(), causal.get_input_embeddings()
    if head is None or head.weight is embed.weight or head.weight.requires_grad or head.weight.dtype == dtype:
        return False
    head.to(dtype)
    return True


def _on_cuda(model) -> bool:
    return next(model.parameters()).device.type == "cuda"


def make_trainer(config: Config, model, tokenizer, bundle, checkpoint_dir: Path, kernels: str, *, collator=None,
                 trainer_class=None, trainer_kwargs: Optional[Dict[str, Any]] = None):
    """Build the Trainer (:class:`QwenftTrainer`) with qwenft's collator (as the bundle's packing says) and
    callbacks (atomic checkpoints, the loss logged at the last step too, the progress bar).

    Args:
        kernels: the layer kernels ``model`` was patched with (``train.kernels`` resolved by
            :func:`qwenft.kernels.resolve_kernels`, as :func:`qwenft.model.attach_lora` applied them): ``liger``
            computes the loss with Liger's fused linear cross-entropy, ``none`` with qwenft's chunked loss.
        collator: the batches' collator (default: the SFT one the bundle's packing calls for).
        trainer_class: a :class:`QwenftTrainer` subclass (preference training's), built with ``trainer_kwargs``.
    """
    from qwenft.data import collator as sft_collator
    from qwenft.train.callbacks import AtomicCheckpoints, LogLastStep, ProgressBarCallback
    from qwenft.train.trainer import QwenftTrainer

    if config.logger == "wandb":
        wandb_env(config)
    has_eval = bundle.eval is not None and len(bundle.eval) > 0
    checkpoints = AtomicCheckpoints(checkpoint_dir, config, bundle.stats)
    args = training_arguments(config, model, checkpoint_dir, has_eval)
    if args.bf16 or args.fp16:
        head_to_autocast_dtype(model, torch_dtype_of(args))
    trainer = (trainer_class or QwenftTrainer)(
        model=model, args=args, train_dataset=bundle.train, eval_dataset=bundle.eval if has_eval else None,
        data_collator=collator if collator is not None else sft_collator(bundle, tokenizer), **(trainer_kwargs or {}))
    trainer.add_callback(checkpoints)
    trainer.add_callback(LogLastStep())  # after transformers' DefaultFlowCallback: the last step is logged too
    trainer.add_callback(ProgressBarCallback())
    trainer.checkpoint_dir = str(checkpoint_dir)
    trainer.kernels = kernels
    return trainer


class QwenftTrainer(Trainer):
    """transformers' Trainer with these changes (checkpoints are made atomic by a callback, see :func:`make_trainer`):

    - a non-finite loss or gradient stops the run (:class:`NonFiniteError`, naming the step) before anything
      of that step is saved;
    - the loss runs under autocast without a logits tensor (:meth:`compute_loss`);
    - ``tokens_seen`` counts the non-padding tokens trained on, and logs carry ``tokens_per_s`` and, for
      eval, ``eval_perplexity = exp(eval_loss)``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.remove_callback(PrinterCallback)
        self.tokens_seen = 0
        self._last_log = (time.perf_counter(), 0)
        self.checkpoint_dir = self.args.output_dir  # where complete checkpoints are (make_trainer: <run>/checkpoints)
        self.kernels = "none"  # resolved train.kernels (qwenft.kernels), set by make_trainer
        self.eval_loss_is_nll = True  # the eval loss is a mean token NLL (its exp a perplexity): SFT's, not DPO's

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's Accelerator, with FSDP on CPU processes too (``dist=fsdp`` under gloo).

        accelerate 1.15 takes its FSDP branch only for accelerator devices (``AcceleratorState.__init__`` checks for
        ``MULTI_GPU``, ``MULTI_XPU``, ...): on CPU processes it drops the FSDP plugin without a word and the run is
        plain DDP. The shared process state is shown as ``MULTI_GPU`` while the Accelerator is made (its device,
        the CPU, and the gloo group are already set), so the same FSDP2 path as on GPUs runs (the Accelerator then
        records ``FSDP`` as the shared state's type, as on GPUs).

        Raises:
            QwenftError: accelerate did not take its FSDP branch (a newer accelerate that changed it).
        """
        from accelerate import PartialState
        from accelerate.utils import DistributedType

        state = PartialState() if self.args.fsdp_plugin_args is not None else None  # made by the arguments
        if state is None or state.distributed_type != DistributedType.MULTI_CPU:
            return super().create_accelerator_and_postprocess()
        state.distributed_type = DistributedType.MULTI_GPU
        try:
            super().create_accelerator_and_postprocess()
        finally:
            if state.distributed_type == DistributedType.MULTI_GPU:  # no Accelerator was made
                state.distributed_type = DistributedType.MULTI_CPU
        if not self.is_fsdp_enabled:
            raise QwenftError("dist=fsdp: accelerate did not enable FSDP on CPU processes")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Causal LM loss over the supervised positions, under mixed precision, without a logits tensor.

        The same value as transformers' ``ForCausalLMLoss`` (sum of token NLLs over labels != -100, divided by
        ``num_items_in_batch`` when the Trainer passes it, else by the count), but:

        - the body and the vocabulary projection run inside ``self.accelerator.autocast()``, the autocast region
          accelerate puts around the top-level model's ``forward`` (bf16 / fp16 under ``train.precision``), since
          they are called directly here: without it the LoRA and vocabulary GEMMs ran in fp32 and SDPA fell back to
          its math path on CUDA;
        - the vocabulary projection and cross-entropy run on the supervised positions only, in chunks, with the
          hidden-state gradient computed as they go (:func:`qwenft.train.loss.fused_loss`: Liger's fused linear
          cross-entropy with ``train.kernels=liger``, else :func:`qwenft.train.loss.linear_cross_entropy`), so no
          ``[tokens, vocab]`` logits tensor is ever held (Qwen2.5: 0.6 MB of fp32 per token).
        """
        from qwenft.train.loss import supervised_loss_sum

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
                                 f"checkpoint under {self.checkpoint_dir} is kept (try a lower train.lr or bf16)")
        grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
        if grads and not torch.isfinite(torch.stack([g.detach().float().norm() for g in grads])).all():
            raise NonFiniteError(f"non-finite gradient norm at step {step}; training stopped, the last good "
                                 f"checkpoint under {self.checkpoint_dir} is kept")
        self.tokens_seen += self.batch_tokens(inputs)
        return loss

    def batch_tokens(self, inputs) -> int:
        """The non-padding tokens of a collated batch (``tokens_seen``)."""
        mask = inputs.get("attention_mask")
        return int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())

    def log(self, logs: Dict[str, float], start_time: Optional[float] = None) -> None:
        now = time.perf_counter()
        if "loss" in logs:
            then, tokens = self._last_log
            if now > then:
                logs["tokens_per_s"] = round((self.tokens_seen - tokens) / (now - then), 2)
            self._last_log = (now, self.tokens_seen)
        if "eval_loss" in logs and self.eval_loss_is_nll:
            logs["eval_perplexity"] = math.exp(min(logs["eval_loss"], 50.0))
        super().log(logs, start_time)
