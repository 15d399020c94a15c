"""The training run: LoRA / QLoRA through transformers' Trainer, atomic checkpoints, exact resume.

Run directory (``out_dir``)::

    config.yaml                 the resolved config (Hydra's .hydra/ holds the composed one and overrides)
    checkpoints/checkpoint-N/   adapter + optimizer + scheduler + RNG + trainer state, renamed into place whole
    adapter/                    the final adapter (PEFT format) + tokenizer + generation_config + qwenft.json
    metrics.json                train metrics: loss curve, eval loss, steps, tokens, tokens/s, seconds
    train.log                   the log (Hydra's job log)

The Trainer writes a checkpoint under ``checkpoints/.tmp-staging`` and a callback renames it to ``checkpoint-N``
only when complete (:class:`qwenft.train.callbacks.AtomicCheckpoints`), so a process killed at any moment never
leaves a checkpoint that ``train.resume=auto`` would pick up half-written.
"""

from __future__ import annotations

import gc
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Dict, Optional

from qwenft.config import Config
from qwenft.files import atomic_write_text, publish_dir, staging_dir
from qwenft.train.rundir import check_run_dir, config_yaml
from qwenft.train.trainer import autocast_dtype, make_trainer

log = logging.getLogger("qwenft.train")


def save_adapter(model, tokenizer, config: Config, out_dir: Path, state_dict: Optional[dict] = None,
                 data_stats: Optional[dict] = None, inherited: Optional[set] = None) -> Path:
    """Write the final adapter (PEFT format) with tokenizer, generation_config and qwenft.json, atomically.

    Call it on rank 0 only. ``state_dict``: the full model state gathered from the ranks when the weights are
    sharded (FSDP, ZeRO-3; ``Accelerator.get_state_dict``); peft picks the adapter weights out of it.
    ``data_stats``: the training data's ``DataBundle.stats`` (the system prompt most training examples carried,
    the rows held out per source), recorded in qwenft.json (:func:`qwenft.model.save_adapter_meta`). The doctor
    checks the adapter before it is published (:func:`qwenft.doctor.guard.check_written`; ``inherited``: the codes
    found on the base and the init adapter at load).

    Raises:
        DoctorRefused: the adapter has a fault qwenft must never write (nothing is published; the checkpoints stay).
    """
    from qwenft.doctor.guard import check_written
    from qwenft.model import save_adapter_meta

    final = out_dir / "adapter"
    staging = staging_dir(out_dir, ".tmp-adapter-")
    try:
        extra = {"state_dict": state_dict} if state_dict is not None else {}
        if len(getattr(model, "peft_config", {})) > 1:  # a preference run's frozen reference copy is not saved
            extra["selected_adapters"] = ["default"]
        model.save_pretrained(str(staging), safe_serialization=True, **extra)
        tokenizer.save_pretrained(str(staging))
        model.generation_config.save_pretrained(str(staging))
        save_adapter_meta(str(staging), config, data_stats)
        check_written(staging, "the adapter", inherited)
        publish_dir(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _preference_key(key: str) -> bool:
    """A preference objective's logged metric (TRL's names: ``rewards/*``, ``logps/*``, ``kl``, ``nll_loss``,
    ``log_odds_*``; qwenft's ``sft_nll``: mixed-in SFT rows' NLL)."""
    return key.startswith(("rewards/", "logps/", "log_odds")) or key in ("kl", "nll_loss", "sft_nll")


def train_metrics(trainer, seconds: float, tokens: Optional[int] = None) -> Dict[str, Any]:
    """Loss curve and throughput from the Trainer's log history.

    The loss curve's points: ``step``, ``loss`` (nats per supervised token, or the preference objective's loss: the
    mean over the steps since the previous log, from ``from_step``; :class:`qwenft.train.callbacks.LogLastStep`),
    ``lr`` and a preference objective's metrics under TRL's names. ``final_loss`` is the loss logged at the last
    step (``final_loss_step``, over steps ``final_loss_from_step`` to it): the trainer logs the last step too,
    whatever ``train.logging_steps`` is.

    Args:
        seconds: wall time of ``trainer.train`` (s).
        tokens: non-padding tokens trained on by all ranks (default: this process's count).
    """
    history = trainer.state.log_history
    losses = [{"step": h["step"], "loss": h["loss"], "lr": h.get("learning_rate"),
               "from_step": h.get("loss_from_step"), **{k: v for k, v in h.items() if _preference_key(k)}}
              for h in history if "loss" in h]
    evals = [{"step": h["step"], "eval_loss": h["eval_loss"],
              **({"eval_perplexity": h["eval_perplexity"]} if "eval_perplexity" in h else {}),
              **{k: v for k, v in h.items() if _preference_key(k[len("eval_"):])}}
             for h in history if "eval_loss" in h]
    tokens = trainer.tokens_seen if tokens is None else tokens
    return {"global_step": trainer.state.global_step, "epochs": trainer.state.epoch, "loss_curve": losses,
            "eval_curve": evals, "final_loss": losses[-1]["loss"] if losses else None,
            "final_loss_step": losses[-1]["step"] if losses else None,
            "final_loss_from_step": losses[-1]["from_step"] if losses else None,
            "train_tokens": tokens, "train_seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 2) if seconds > 0 else None}


def with_init_adapter(config: Config) -> Config:
    """``config`` with the LoRA settings of ``init_adapter`` (its ``adapter_config.json``: r, lora_alpha, dropout,
    target modules, rsLoRA, DoRA), which the run continues; a setting the user gave differently is named in a
    warning. Without ``init_adapter``, ``config`` as it is.

    Raises:
        QwenftError: ``init_adapter`` holds no adapter (:func:`qwenft.model.adapter.check_adapter_dir`).
    """
    import dataclasses

    from qwenft.config import ALL_TARGETS, QwenftError
    from qwenft.model.adapter import check_adapter_dir, recorded_lora

    if not config.init_adapter:
        return config
    try:
        path = check_adapter_dir(config.init_adapter)
    except QwenftError as exc:  # it names adapter=: the key typed was init_adapter=
        raise QwenftError(str(exc).replace("adapter=", "init_adapter=", 1)) from None
    saved = recorded_lora(path)
    lora = config.lora
    values = {"r": saved.get("r", lora.r), "lora_alpha": saved.get("lora_alpha", lora.lora_alpha),
              "lora_dropout": saved.get("lora_dropout", lora.lora_dropout),
              "target_modules": [m for m in ALL_TARGETS
                                 if m in set(saved.get("target_modules") or lora.target_modules)],
              "use_rslora": bool(saved.get("use_rslora", lora.use_rslora)),
              "use_dora": bool(saved.get("use_dora", lora.use_dora))}
    differ = [f"{k}: {getattr(lora, k)} -> {v}" for k, v in values.items()
              if (set(getattr(lora, k)) != set(v) if k == "target_modules" else getattr(lora, k) != v)]
    if differ:
        log.warning("init_adapter=%s: the run continues that adapter, so its LoRA settings hold (%s)",
                    config.init_adapter, "; ".join(differ))
    return dataclasses.replace(config, init_adapter=str(path), lora=dataclasses.replace(lora, **values))


def run(config: Config) -> Path:
    """``qwenft train``: load, attach LoRA, build data, train, save the adapter, then evaluate.

    Under a distributed launch (``torchrun`` / ``accelerate launch``, see :mod:`qwenft.train.dist`) every rank runs this
    function: each loads its model copy on its own device and builds the same data (rank 0 first), the Trainer
    runs DDP / FSDP / DeepSpeed, and only rank 0 writes config.yaml, adapter/, metrics.json and the report. The
    evaluation after training runs on rank 0 alone, after the other ranks have left (with FSDP / ZeRO-3, whose
    ranks hold only part of the weights, rank 0 evaluates the saved adapter on a freshly loaded base).

    Returns:
        The run directory.

    Raises:
        NonFiniteError: the loss or gradient norm became NaN/inf (names the step).
        QwenftError: bad data, a bad resume path, a missing model source, a run already in ``out_dir`` with
            ``train.resume=none``, a resume whose model / quant / LoRA settings differ from the run's, too few
            training examples for the processes' batches (:func:`qwenft.data.checks.check_batch_feed`).
    """
    from transformers import set_seed

    import qwenft.train.dist as dist
    from qwenft.preference.pipeline import build_run_data
    from qwenft.data.checks import check_batch_feed
    from qwenft.kernels import resolve_kernels
    from qwenft.model import attach_lora, load_model, load_tokenizer, resolve_model_dir
    from qwenft.runtime import default_device
    from qwenft.memory import peak_memory, return_freed_memory_promptly
    from qwenft.preference.loss import needs_reference

    dist.check_strategy(config, default_device().startswith("cuda"))  # the CLI checked already; library callers
    dist.init_process_group(config.dist)
    if not default_device().startswith("cuda"):  # freed activations leave the heap: training's do not stay behind
        return_freed_memory_promptly()  # to be re-faulted by the evaluation after it (qwenft.memory)
    main = dist.is_main_process()
    if not main:  # the other ranks log warnings only (the Trainer does the same for transformers' logs)
        logging.getLogger("qwenft").setLevel(logging.WARNING)
    out_dir = Path(config.out_dir)
    checkpoint_dir = out_dir / "checkpoints"
    # Everything that can refuse the run (resume settings, evaluation settings, the model source, the data) is
    # checked before the run directory is written: a refused run leaves nothing behind and never overwrites a
    # resumable run's config.yaml.
    config = with_init_adapter(config)
    resume_from = check_run_dir(config)
    log.info("distributed: %s", dist.describe(config))
    recorded = config_yaml(config)
    benchmarks = []
    if config.eval.after_train:  # fail on a bad evaluation setting now, not after training
        from qwenft.evaluate.run import check_settings

        benchmarks = check_settings(config)  # the questions, read and checked before any model loads
    model_dir = resolve_model_dir(config.model)
    inherited = set()
    if main:  # what the base (and an init adapter) bring along: warned about now, not refused in the adapter later
        from qwenft.doctor.guard import check_loaded

        inherited = check_loaded(model_dir, "the base") | (check_loaded(config.init_adapter, "the init adapter")
                                                             if config.init_adapter else set())
    tokenizer = load_tokenizer(model_dir, config.model.revision if config.model.source == "hub" else None)
    with dist.main_process_first():  # rank 0 tokenizes and caches, the others read its cache
        bundle = build_run_data(config, tokenizer)
    check_batch_feed(len(bundle.train), config.train.batch_size)
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out_dir / "config.yaml", recorded)
        checkpoint_dir.mkdir(exist_ok=True)
        # left by a process killed while saving: the Trainer's staging folder (qwenft.train.callbacks.staging_root),
        # a checkpoint being replaced (qwenft.files.publish_dir)
        for stale in [*checkpoint_dir.glob(".tmp-*"), *checkpoint_dir.glob(".old-*")]:
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()

    preference = config.train.objective != "sft"
    with peak_memory(default_device()) as train_memory:  # the train phase: load, attach, train (metrics.json "memory")
        model, tokenizer = load_model(config, tokenizer=tokenizer)
        set_seed(config.train.seed)  # LoRA A is initialised randomly: the same seed gives the same run
        model = attach_lora(model, config.lora, gradient_checkpointing=config.train.gradient_checkpointing,
                            keep_dtype=config.dist.quant_storage != "uint8", kernels=config.train.kernels,
                            init_adapter=config.init_adapter, reference=bool(config.init_adapter) and preference
                            and needs_reference(config.train.objective),
                            autocast_dtype=autocast_dtype(config, str(next(model.parameters()).device)))
        kernels = resolve_kernels(config.train.kernels, next(model.parameters()).device.type == "cuda")  # as applied
        if preference:
            from qwenft.train.preference import make_preference_trainer

            trainer = make_preference_trainer(config, model, tokenizer, bundle, checkpoint_dir, kernels)
        else:
            trainer = make_trainer(config, model, tokenizer, bundle, checkpoint_dir, kernels)
        log.info("training: %d examples, run directory %s", len(bundle.train), out_dir)
        start = time.perf_counter()
        trainer.train(resume_from_checkpoint=resume_from)
        seconds = time.perf_counter() - start
    sharded = dist.shards_weights(config.dist)
    # every rank takes part in gathering sharded weights; with DDP (or one process) each already holds them all
    state_dict = trainer.accelerator.get_state_dict(trainer.model_wrapped) if sharded else None
    tokens = dist.sum_over_ranks(trainer.tokens_seen)
    metrics = None
    if main:
        adapter_dir = save_adapter(model, tokenizer, config, out_dir, state_dict=state_dict,
                                   data_stats=bundle.stats, inherited=inherited)
        metrics = {"train": train_metrics(trainer, seconds, tokens), "data": bundle.stats,
                   "memory": {"train": train_memory}}
        log.info("adapter saved to %s", adapter_dir)
    # The Trainer, its Accelerator and the DDP wrapper go before the process group they use: freed after
    # destroy() (when run() returned), the wrapper's teardown could wait on the destroyed group and the process
    # hung at exit (seen once in CI on 2 gloo ranks, rank 0 idle after its report was written).
    _release_training_state(trainer, model)
    if "reference" in getattr(model, "peft_config", {}):  # evaluation compares the base with the trained adapter
        model.delete_adapter("reference")
        model.set_adapter("default")
    del trainer, state_dict
    gc.collect()
    if metrics is not None:
        atomic_write_text(out_dir / "metrics.json", json.dumps(metrics, indent=2, default=str))
    dist.barrier()  # the adapter and metrics exist before any rank returns
    dist.destroy()  # nothing collective follows: rank 0 evaluates alone, the others are done
    if not main:
        return out_dir
    if config.eval.after_train:  # no autocast: the weights are cast to the compute dtype, as `qwenft eval` runs
        if sharded:  # rank 0's model holds its shards only: dropped before the saved adapter is loaded
            model = None
        _evaluate_after_train(config, model, tokenizer, bundle, benchmarks)
    print(f"run directory: {out_dir}")
    return out_dir


def _release_training_state(trainer, model) -> None:
    """Drop what only training needs, on every rank before the process group goes: the optimizer states, the
    scheduler, the LoRA gradients and the distributed wrapper (referenced by the Trainer, its callback handler and
    the Accelerator), so the evaluation after ``train`` holds what a later ``qwenft eval`` holds."""
    from qwenft.model import end_training

    model.zero_grad(set_to_none=True)
    end_training(model)  # the k-bit preparation's embedding cast (qwenft.model.lora.prepare_kbit)
    trainer.accelerator.free_memory()
    trainer.model_wrapped = trainer.model
    trainer.optimizer = trainer.lr_scheduler = None
    handler = getattr(trainer, "callback_handler", None)
    if handler is not None:
        handler.optimizer = handler.lr_scheduler = None


def _load_saved_adapter(config: Config, adapter_dir: Path, tokenizer):
    """The base and the adapter just saved, loaded in this one process as ``qwenft eval adapter=...`` loads them
    (a 4-bit base in its usual uint8 storage, not the float storage sharding needed): the evaluation after a
    sharded run (FSDP, ZeRO-3), whose ranks each held a part of the weights."""
    import dataclasses

    from qwenft.model.lora import load_for_inference

    log.info("evaluating the saved adapter %s in one process (the weights were sharded)", adapter_dir)
    if config.dist.strategy == "deepspeed":  # else transformers still sees ZeRO-3 (the TrainingArguments' global
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config  # config) and refuses device_map

        unset_hf_deepspeed_config()
    one = dataclasses.replace(config, adapter=str(adapter_dir),
                              dist=dataclasses.replace(config.dist, quant_storage="uint8"))
    return load_for_inference(one, tokenizer=tokenizer)


def _evaluate_after_train(config: Config, model, tokenizer, bundle, benchmarks) -> None:
    """Evaluate base vs tuned into the run directory; ``model`` None: the weights were sharded (FSDP, ZeRO-3), so
    rank 0's model holds its shards only and the saved adapter is evaluated on a freshly loaded base."""
    from qwenft.evaluate import evaluate_and_report

    if model is None:
        gc.collect()
        model, tokenizer = _load_saved_adapter(config, Path(config.out_dir) / "adapter", tokenizer)
    from qwenft.evaluate.verdict_text import summary_line

    metrics = evaluate_and_report(config, model, tokenizer, bundle, benchmarks)
    print(summary_line(metrics.get("eval") or {}))
    print(f"report: {Path(config.out_dir) / 'report.md'}")
