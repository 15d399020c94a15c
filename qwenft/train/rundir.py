"""The run directory of ``qwenft train`` before anything is written to it: which checkpoint a resume starts from,
a resume refused when its settings differ from the run's or the run already finished, a finished run never
overwritten, and the resolved config as the run records it (config.yaml).

The CLI calls :func:`check_run_dir` before Hydra touches the directory, and :func:`qwenft.train.run.run` again before
it writes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, Optional

from qwenft.config import Config, QwenftError

log = logging.getLogger("qwenft.train")


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
