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
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Dict, Optional

from qwenft.config import Config, QwenftError
from qwenft.files import atomic_write_text, publish_dir, staging_dir
from qwenft.train.trainer import _on_cuda, make_trainer

log = logging.getLogger("qwenft.train")


def _wandb_env(config: Config) -> None:
    """W&B logs offline unless the user is logged in or set WANDB_MODE; files go into the run directory."""
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


def find_resume_checkpoint(config: Config, checkpoint_dir: Path) -> Optional[str]:
    """The checkpoint to resume from: ``none`` -> None, ``auto`` -> newest complete one (or None), else a path.

    Raises:
        QwenftError: ``train.resume=PATH`` that is not a checkpoint directory.
    """
    from transformers.trainer_utils import get_last_checkpoint

    resume = config.train.resume
    if resume == "none":
        return None
    if resume == "auto":
        found = get_last_checkpoint(str(checkpoint_dir)) if checkpoint_dir.is_dir() else None
        log.info("train.resume=auto: %s", f"resuming from {found}" if found else "no checkpoint yet, starting fresh")
        return found
    path = Path(resume).expanduser()
    if not (path / "trainer_state.json").is_file():
        raise QwenftError(f"train.resume={resume!r}: not a checkpoint directory (no trainer_state.json); use "
                          "train.resume=auto with out_dir=<the run directory> or a <run>/checkpoints/checkpoint-N path")
    return str(path)


# Settings a checkpoint's weights and optimizer state depend on: a resume with other values cannot load them.
RESUME_KEYS = ("model.source", "model.path", "model.revision", "model.tiny", "quant.method", "quant.double_quant",
               "lora")


def _flatten(tree: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(tree, dict):
        flat: Dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: tree}


def config_yaml(config: Config) -> str:
    """The run's resolved config as YAML; a literal ``${`` in a text value (a prompt) is written escaped."""
    import dataclasses

    from omegaconf import OmegaConf

    from qwenft.config import escape_interpolations

    return OmegaConf.to_yaml(OmegaConf.create(escape_interpolations(dataclasses.asdict(config))))


def check_run_dir(config: Config) -> Optional[str]:
    """Check ``out_dir`` and ``train.resume`` before anything is written; return the checkpoint to resume from.

    The CLI runs this before Hydra touches the run directory (for ``-m``, on each grid point's ``out_dir/N``),
    ``train`` again before it writes.

    Raises:
        QwenftError: ``out_dir`` already holds a run and ``train.resume=none``; a resume with other model / quant /
            LoRA settings than the run's (:func:`check_resume_config`); a resume from a checkpoint that already
            reached ``train.max_steps`` / ``train.epochs``; a bad ``train.resume`` path.
    """
    out_dir = Path(config.out_dir).expanduser()
    resume_from = find_resume_checkpoint(config, out_dir / "checkpoints")
    if config.train.resume == "none" and _holds_a_run(out_dir):
        raise QwenftError(f"out_dir={config.out_dir} already holds a training run (adapter/ or checkpoints/"
                          "checkpoint-N); continue it with train.resume=auto (with a larger train.max_steps or "
                          "train.epochs if it finished), or choose another out_dir")
    if resume_from:  # <run>/checkpoints/checkpoint-N: that run's config.yaml
        check_resume_config(config, Path(resume_from).parent.parent)
        _check_not_finished(config, Path(resume_from))
    return resume_from


def _check_not_finished(config: Config, checkpoint: Path) -> None:
    """Refuse to resume from a checkpoint that already reached ``train.max_steps`` (or ``train.epochs``)."""
    try:
        state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
        step, epoch = int(state["global_step"]), float(state.get("epoch") or 0.0)
    except (OSError, ValueError, KeyError, TypeError):
        return  # the Trainer reports an unreadable checkpoint itself
    t = config.train
    done = step >= t.max_steps if t.max_steps > 0 else epoch >= t.epochs - 1e-9
    if done:
        limit = f"train.max_steps={t.max_steps}" if t.max_steps > 0 else f"train.epochs={t.epochs}"
        raise QwenftError(f"train.resume: {checkpoint} is already at step {step} (epoch {epoch:.2f}), which reaches "
                          f"{limit}; raise it to train further (the finished run is in {checkpoint.parent.parent})")


def _holds_a_run(out_dir: Path) -> bool:
    checkpoints = out_dir / "checkpoints"
    return (out_dir / "adapter" / "adapter_config.json").is_file() or (
        checkpoints.is_dir() and any(p.name.startswith("checkpoint-") for p in checkpoints.iterdir()))


def check_resume_config(config: Config, out_dir: Path) -> None:
    """Refuse a resume whose model, quantization or LoRA settings differ from ``out_dir/config.yaml``.

    Only the :data:`RESUME_KEYS` are compared (the checkpoint's weights and optimizer state are shaped by them);
    other changes, e.g. a larger ``train.max_steps`` to train further, are allowed.

    Raises:
        QwenftError: names each differing key with both values, or an unreadable ``config.yaml``.
    """
    import dataclasses

    from omegaconf import OmegaConf

    saved_path = out_dir / "config.yaml"
    if not saved_path.is_file():
        return
    try:
        saved = _flatten(OmegaConf.to_container(OmegaConf.load(saved_path), resolve=False))
    except Exception as exc:  # noqa: BLE001 - any YAML / OmegaConf failure is the same user-facing problem
        raise QwenftError(f"{saved_path}: not readable ({exc}); it is written by `python -m qwenft train`") from None
    now = _flatten(dataclasses.asdict(config))
    keys = [key for key in sorted(now) if key in saved and key.startswith(RESUME_KEYS) and saved[key] != now[key]]
    differ = [f"{key}={saved[key]!r} in the run, {now[key]!r} now" for key in keys]
    groups = [("model", "model.name"), ("quant", "quant.method")]  # a preset chosen as model=NAME / quant=NAME
    chosen = []  # named as typed (model=tiny-random), then the model.* keys it sets
    for group, name in groups:
        inside = [key for key in keys if key.startswith(group + ".")]
        if inside and name in saved and saved[name] != now[name]:
            detail = ", ".join(f"{key} {saved[key]!r} -> {now[key]!r}" for key in inside if key != name)
            differ = [d for d in differ if not d.startswith(tuple(f"{key}=" for key in inside))]
            chosen.append(f"{group}={now[name]} now, {group}={saved[name]} in the run"
                          + (f": {detail}" if detail else ""))
    differ = chosen + differ
    if differ:
        raise QwenftError(f"train.resume: {out_dir} was trained with other settings ({'; '.join(differ)}); resume "
                          "with the run's settings, or start a new run in another out_dir")


def save_adapter(model, tokenizer, config: Config, out_dir: Path, state_dict: Optional[dict] = None,
                 data_stats: Optional[dict] = None) -> Path:
    """Write the final adapter (PEFT format) with tokenizer, generation_config and qwenft.json, atomically.

    Call it on rank 0 only. ``state_dict``: the full model state gathered from the ranks when the weights are
    sharded (FSDP, ZeRO-3; ``Accelerator.get_state_dict``); peft picks the adapter weights out of it.
    ``data_stats``: the training data's ``DataBundle.stats`` (the system prompt most training examples carried,
    the rows held out per source), recorded in qwenft.json (:func:`qwenft.model.save_adapter_meta`).
    """
    from qwenft.model import save_adapter_meta

    final = out_dir / "adapter"
    staging = staging_dir(out_dir, ".tmp-adapter-")
    try:
        extra = {"state_dict": state_dict} if state_dict is not None else {}
        model.save_pretrained(str(staging), safe_serialization=True, **extra)
        tokenizer.save_pretrained(str(staging))
        model.generation_config.save_pretrained(str(staging))
        save_adapter_meta(str(staging), config, data_stats)
        publish_dir(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def train_metrics(trainer, seconds: float, tokens: Optional[int] = None) -> Dict[str, Any]:
    """Loss curve and throughput from the Trainer's log history.

    ``tokens``: non-padding tokens trained on by all ranks (default: this process's count).
    """
    history = trainer.state.log_history
    losses = [{"step": h["step"], "loss": h["loss"], "lr": h.get("learning_rate")} for h in history if "loss" in h]
    evals = [{"step": h["step"], "eval_loss": h["eval_loss"], "eval_perplexity": math.exp(min(h["eval_loss"], 50))}
             for h in history if "eval_loss" in h]
    tokens = trainer.tokens_seen if tokens is None else tokens
    return {"global_step": trainer.state.global_step, "epochs": trainer.state.epoch, "loss_curve": losses,
            "eval_curve": evals, "final_loss": losses[-1]["loss"] if losses else None,
            "train_tokens": tokens, "train_seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 2) if seconds > 0 else None}


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
            training examples for the processes' batches (:func:`qwenft.train.dist.check_batch_feed`).
    """
    from transformers import set_seed

    from qwenft import data as data_lib
    import qwenft.train.dist as dist
    from qwenft.kernels import apply_kernels, resolve_kernels
    from qwenft.model import attach_lora, load_model, load_tokenizer, resolve_model_dir
    from qwenft.runtime import default_device, peak_memory, return_freed_memory_promptly

    benchmarks = []
    if config.eval.after_train:  # fail on a bad evaluation setting now, not after training
        from qwenft.evaluate.run import check_ppl_sources, generate_preset

        from qwenft.evaluate.bench_tasks import prepare as prepare_benchmarks

        generate_preset(config)
        check_ppl_sources(config)
        benchmarks = prepare_benchmarks(config)  # the questions, read and checked before any model loads
    dist.check_strategy(config, default_device().startswith("cuda"))  # the CLI checked already; library callers
    dist.init_process_group(config.dist)
    if not default_device().startswith("cuda"):  # freed activations leave the heap: training's do not stay behind
        return_freed_memory_promptly()  # to be re-faulted by the evaluation after it (qwenft.runtime)
    main = dist.is_main_process()
    if not main:  # the other ranks log warnings only (the Trainer does the same for transformers' logs)
        logging.getLogger("qwenft").setLevel(logging.WARNING)
    out_dir = Path(config.out_dir)
    checkpoint_dir = out_dir / "checkpoints"
    # Everything that can refuse the run (resume settings, the model source, the data) is checked before the run
    # directory is written: a refused run leaves nothing behind and never overwrites a resumable run's config.yaml.
    resume_from = check_run_dir(config)
    model_dir = resolve_model_dir(config.model)
    tokenizer = load_tokenizer(model_dir, config.model.revision if config.model.source == "hub" else None)
    with dist.main_process_first():  # rank 0 tokenizes and caches, the others read its cache
        bundle = data_lib.build(config, tokenizer)
    dist.check_batch_feed(len(bundle.train), config)
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out_dir / "config.yaml", config_yaml(config))
        checkpoint_dir.mkdir(exist_ok=True)
        # left by a process killed while saving: the Trainer's staging folder (qwenft.train.callbacks.staging_root),
        # a checkpoint being replaced (qwenft.files.publish_dir)
        for stale in [*checkpoint_dir.glob(".tmp-*"), *checkpoint_dir.glob(".old-*")]:
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    if config.logger == "wandb":
        _wandb_env(config)  # the Trainer's W&B callback starts a run on rank 0 only

    log.info("distributed: %s", dist.describe(config))
    with peak_memory() as train_memory:  # the train phase: load, attach, train (metrics.json "memory")
        model, tokenizer = load_model(config, tokenizer=tokenizer)
        apply_kernels(model, resolve_kernels(config.train.kernels, _on_cuda(model)))
        set_seed(config.train.seed)  # LoRA A is initialised randomly: the same seed gives the same run
        model = attach_lora(model, config.lora, gradient_checkpointing=config.train.gradient_checkpointing,
                            keep_dtype=config.dist.quant_storage != "uint8")
        trainer = make_trainer(config, model, tokenizer, bundle, checkpoint_dir)
        log.info("training: %d examples, run directory %s", len(bundle.train), out_dir)
        start = time.perf_counter()
        trainer.train(resume_from_checkpoint=resume_from)
        seconds = time.perf_counter() - start
    sharded = dist.shards_weights(config.dist)
    # every rank takes part in gathering sharded weights; with DDP (or one process) each already holds them all
    state_dict = trainer.accelerator.get_state_dict(trainer.model_wrapped) if sharded else None
    tokens = dist.sum_over_ranks(trainer.tokens_seen)
    if main:
        adapter_dir = save_adapter(model, tokenizer, config, out_dir, state_dict=state_dict,
                                   data_stats=bundle.stats)
        metrics = {"train": train_metrics(trainer, seconds, tokens), "data": bundle.stats,
                   "memory": {"train": train_memory}}
        atomic_write_text(out_dir / "metrics.json", json.dumps(metrics, indent=2, default=str))
        log.info("adapter saved to %s", adapter_dir)
    # The Trainer, its Accelerator and the DDP wrapper go before the process group they use: freed after
    # destroy() (when run() returned), the wrapper's teardown could wait on the destroyed group and the process
    # hung at exit (seen once in CI on 2 gloo ranks, rank 0 idle after its report was written).
    _release_training_state(trainer, model)
    del trainer, state_dict
    gc.collect()
    dist.barrier()  # the adapter and metrics exist before any rank returns
    dist.destroy()  # nothing collective follows: rank 0 evaluates alone, the others are done
    if not main:
        return out_dir
    if config.eval.after_train and sharded:  # rank 0's model holds its shards only: evaluate the saved adapter
        del model
        gc.collect()
        model, tokenizer = _load_saved_adapter(config, out_dir / "adapter", tokenizer)
    if config.eval.after_train:  # no autocast: the weights are cast to the compute dtype, as `qwenft eval` runs
        _evaluate_after_train(config, model, tokenizer, bundle, benchmarks)
    print(f"run directory: {out_dir}")
    return out_dir


def _release_training_state(trainer, model) -> None:
    """Drop what only training needs, on every rank before the process group goes: the optimizer states, the
    scheduler, the LoRA gradients and the distributed wrapper (referenced by the Trainer, its callback handler and
    the Accelerator), so the evaluation after ``train`` holds what a later ``qwenft eval`` holds."""
    model.zero_grad(set_to_none=True)
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

    from qwenft.model.inference import load_for_inference

    log.info("evaluating the saved adapter %s in one process (the weights were sharded)", adapter_dir)
    if config.dist.strategy == "deepspeed":  # else transformers still sees ZeRO-3 (the TrainingArguments' global
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config  # config) and refuses device_map

        unset_hf_deepspeed_config()
    one = dataclasses.replace(config, adapter=str(adapter_dir),
                              dist=dataclasses.replace(config.dist, quant_storage="uint8"))
    return load_for_inference(one, tokenizer=tokenizer)


def _evaluate_after_train(config: Config, model, tokenizer, bundle, benchmarks) -> None:
    from qwenft.evaluate import run_after_train

    run_after_train(config, model, tokenizer, bundle, benchmarks)
    print(f"report: {Path(config.out_dir) / 'report.md'}")


def main(config: Config) -> None:
    """CLI entry of ``qwenft train``.

    Raises:
        GatesFailed: a gate of the evaluation after training failed with ``eval.fail_on_gate=true``; raised on the
            main process after everything is written (the CLI exits 3).
    """
    out_dir = run(config)
    from qwenft.runtime import is_main_process

    if config.eval.fail_on_gate and is_main_process():
        from qwenft.evaluate.verdict import enforce

        enforce(config, None, out_dir)
