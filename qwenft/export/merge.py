"""The merge behind ``qwenft merge``: a standalone 16-bit Qwen2.5 model from base + adapter, verified before it is called done.

``python -m qwenft merge adapter=PATH out=DIR [merge.dtype=bfloat16] [merge.base=dequantized|original]
[merge.max_shard_size=5GB] [merge.overwrite=false] [merge.gguf=none|f16|q8_0] [merge.verify_gguf=null|true|false]
[merge.quantize=[gguf-q4_k_m,gptq,...]] [merge.calibration_rows=128] [merge.calibration_seed=0]``

1. The base comes from the adapter's ``qwenft.json`` (see :func:`qwenft.model.adapter.resolve_base` for when a
   ``model=`` override wins; an adapter made by another tool: its adapter_config.json's base, 16-bit,
   :mod:`qwenft.model.foreign`) and is loaded in ``merge.dtype``; an adapter trained on NF4 is merged into the
   NF4-dequantized weights unless ``merge.base=original`` (trade-off: :mod:`qwenft.export.build`).
2. Reference outputs of the adapter on that base are taken, the delta is merged (NaN/inf checked before it is
   committed), and the model is saved as safetensors shards with its tokenizer (chat template), a
   generation_config stopping on every end token, no quantization_config, and ``tie_word_embeddings`` true
   only when the saved matrices are one.
3. The directory is reloaded by plain transformers in a subprocess and compared (:mod:`qwenft.export.verify`);
   above the tolerance the command exits 1 and writes nothing. With ``merge.gguf`` a GGUF is written and
   loaded back the same way, and in llama.cpp itself (``merge.verify_gguf``: :mod:`qwenft.export.llama_check`).
   The last lines printed (and the model card's "Serve" section) are the commands that serve the result,
   ``vllm serve DIR`` and ``llama-server -m FILE.gguf``, and the adapter unmerged in vLLM, or the warning saying
   why vLLM cannot serve it so (:func:`qwenft.export.card.serve_commands`).
4. Everything is written into ``DIR.tmp-*`` beside ``DIR`` and renamed at the end: an interrupted merge
   (Ctrl-C, SIGTERM, or a kill) never leaves ``DIR``; leftovers of killed runs are removed by the next run.
   A non-empty ``DIR`` is refused unless ``merge.overwrite=true`` (a finished merge's refusal names the recorded
   settings that differ and the overrides that reuse it). A re-run whose ``DIR`` already holds a
   verified merge of the same adapter with the same settings does nothing (``qwenft_merge.json`` records it);
   ``merge.overwrite=true`` redoes it.

5. ``merge.quantize=[...]``: artifacts made from the finished merge and measured against it
   (:mod:`qwenft.export.quantize`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Optional

from qwenft.model.adapter import check_adapter_dir, resolve_base
from qwenft.config import Config, ModelConfig, QuantConfig, QwenftError
from qwenft.config.export import QUANTIZE_KEYS
from qwenft.export.build import (attach_adapter, describe_base, load_base, merge_, nf4_round_trip_,
                                 retie_, save_merged, untie_)
from qwenft.export.card import long_context, model_card, serve_commands
from qwenft.export.gguf_file import rope_scaling_keys
from qwenft.export.llama_check import NEW_TOKENS, verify_with_llama, wanted
from qwenft.export.verify import VerificationError, check_report, compute_reference, run_reload_check
from qwenft.files import publish_mode, staging_dir
from qwenft.model import MERGE_MARKER, read_adapter_meta
from qwenft.runlock import abandoned, write_locked

log = logging.getLogger(__name__)

MARKER = MERGE_MARKER
OWNER = ".qwenft-merge.pid"  # in DIR.tmp-* (then DIR.old-*): the merging process's id, locked while it runs

def _paths(config: Config):
    if not config.adapter:
        raise QwenftError("adapter=PATH is required: the adapter directory written by `python -m qwenft train` "
                          "(<run dir>/adapter)")
    adapter_dir = check_adapter_dir(config.adapter).resolve()
    if not config.out:
        raise QwenftError("out=DIR is required: the directory the merged model is written to")
    out = Path(config.out).expanduser().resolve()
    if out == adapter_dir or out in adapter_dir.parents:
        raise QwenftError(f"out={config.out}: would replace the adapter itself; choose another directory")
    if out.exists() and not out.is_dir():
        raise QwenftError(f"out={config.out}: exists and is not a directory")
    return adapter_dir, out


def _adapter_digest(adapter_dir: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(adapter_dir.glob("adapter_*")):
        if path.is_file():
            digest.update(path.name.encode())
            with open(path, "rb") as handle:
                while chunk := handle.read(16 << 20):
                    digest.update(chunk)
    return digest.hexdigest()


def _request(adapter_dir: Path, model: ModelConfig, quant: QuantConfig, config: Config) -> dict:
    """What identifies a merge: the adapter's bytes, the base, how it was trained and the merge settings."""
    settings = _merge_settings(config)
    # null resolved to what this run does: installing the extra later makes a re-run check the GGUF
    settings["verify_gguf"] = wanted(config.merge.gguf, config.merge.verify_gguf)
    request = {"adapter_sha256": _adapter_digest(adapter_dir), "model": dataclasses.asdict(model),
               "quant": dataclasses.asdict(quant), "merge": settings}
    return json.loads(json.dumps(request))  # the form it has when read back from the marker


def _merge_settings(config: Config) -> dict:
    """The merge's own settings: ``merge.*`` but ``overwrite`` and what is made from the merge (``merge.quantize``
    and its calibration: :data:`~qwenft.config.export.QUANTIZE_KEYS`)."""
    return {k: v for k, v in dataclasses.asdict(config.merge).items() if k != "overwrite" and k not in QUANTIZE_KEYS}


def _already_done(out: Path, request: dict) -> bool:
    marker = out / MARKER
    try:
        record = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if record.get("request") != request or not record.get("verification", {}).get("passed"):
        return False
    files = record.get("files", {})
    return bool(files) and all((out / name).is_file() and (out / name).stat().st_size == size
                               for name, size in files.items())


def _not_this_merge(out: Path, request: dict) -> str:
    """Why the non-empty ``out`` is refused, and what to do: not a merge; a finished merge whose recorded settings
    differ (each named, ``key: recorded there, asked here``, and the overrides that reuse it: the quantize settings
    never differ, :func:`_merge_settings`); or a merge whose files are not as recorded."""
    replace = "choose another out= or pass merge.overwrite=true to replace it"
    try:
        recorded = json.loads((out / MARKER).read_text(encoding="utf-8"))["request"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"exists and is not empty; {replace}"

    def flat(value, key=""):
        if not isinstance(value, dict):
            return {key: value}
        return {k: v for name, item in value.items() for k, v in flat(item, f"{key}.{name}".lstrip(".")).items()}

    def text(value):
        return value if isinstance(value, str) else json.dumps(value)

    there, here = flat(recorded), flat(request)
    keys = [k for k in dict.fromkeys([*there, *here]) if there.get(k) != here.get(k)]
    if "merge.gguf" in keys:  # verify_gguf is recorded resolved, and follows merge.gguf (no GGUF: no check)
        keys = [k for k in keys if k != "merge.verify_gguf"]
    if not keys:
        return f"holds a merge whose files are not as recorded (incomplete or changed since); {replace}"
    if "adapter_sha256" in keys:
        return f"holds a merge of another adapter (or of this one before it changed); {replace}"
    said = "; ".join(f"{k}: {text(there.get(k))} there, {text(here.get(k))} here" for k in keys)
    again = " ".join(f"{k}={text(there[k])}" for k in keys if k in there)
    return (f"holds a finished merge made with other settings ({said}); to reuse it (merge.quantize then adds only "
            f"its artifacts) pass {again}, or {replace}")


def _remove_stale(out: Path) -> None:
    """Remove ``DIR.tmp-*`` / ``DIR.old-*`` left by merges that were killed.

    Each holds the ``OWNER`` file its merge keeps locked while it runs (:func:`qwenft.runlock.write_locked`): a lock
    that can be taken has no live holder (:func:`qwenft.runlock.abandoned`), so that folder's merge is gone, however
    it ended. A folder without that file is left alone.
    """
    for path in list(out.parent.glob(f"{out.name}.tmp-*")) + list(out.parent.glob(f"{out.name}.old-*")):
        if abandoned(path / OWNER):
            log.info("removing %s (left by a merge that was killed)", path)
            shutil.rmtree(path, ignore_errors=True)


def _commit(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` to ``out`` (replacing an empty ``out``, or a full one moved aside first).

    ``tmp/OWNER`` (locked by this merge) never reaches ``out``: it is removed first, or it goes with the previous
    model into ``DIR.old-*``, marking that folder as this live merge's until it is removed.
    """
    owner = tmp / OWNER
    if out.is_dir() and any(out.iterdir()):
        old = out.parent / f"{out.name}.old-{os.getpid()}"
        os.rename(out, old)
        try:
            os.rename(owner, old / OWNER)
            os.rename(tmp, out)
        except BaseException:
            if not owner.exists() and (old / OWNER).exists():
                os.rename(old / OWNER, owner)
            os.rename(old, out)  # put the previous model back
            raise
        shutil.rmtree(old, ignore_errors=True)
        return
    owner.unlink()
    if out.is_dir():
        out.rmdir()
    os.rename(tmp, out)


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM raises KeyboardInterrupt while merging, so the temporary directory is removed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def merge(config: Config, device: Optional[str] = None) -> Path:
    """Merge ``config.adapter`` into its base and write the verified model to ``config.out``.

    Args:
        config: The validated config (``adapter``, ``out``, ``merge.*``; ``model``/``quant`` only when the
            adapter has no ``qwenft.json`` or ``model=`` names other weights).
        device: Where to merge and check (default: :func:`qwenft.runtime.default_device`).

    Returns:
        The output directory.

    Raises:
        QwenftError: missing adapter or out, a non-empty out without ``merge.overwrite=true``, an adapter
            that does not fit its base, non-finite merged weights.
        VerificationError: the reloaded model (or GGUF) is outside the tolerance; nothing is written.

    Example:
        >>> from qwenft.cli.compose import register_resolvers, validate
        >>> register_resolvers()
        >>> config = validate("merge", ["adapter=runs/RUN/adapter", "out=merged", "merge.dtype=float32"])[0]
        >>> merge(config, device="cpu")  # the absolute path of merged/
    """
    from qwenft.runtime import default_device

    adapter_dir, out = _paths(config)
    model_cfg, quant_cfg, why = resolve_base(config.model, config.quant, adapter_dir)
    if config.merge.gguf != "none":  # RoPE scaling llama.cpp cannot take stops here, before any model loads
        rope_scaling_keys({"rope_parameters": model_cfg.rope_scaling.as_dict(), "max_position_embeddings": 1})
    request = _request(adapter_dir, model_cfg, quant_cfg, config)
    done = not config.merge.overwrite and _already_done(out, request)
    if config.merge.quantize:  # bad requests stop here, before the merge (minutes) and before any model loads
        from qwenft.export.quantize import check_before_merge

        check_before_merge(config, out, model_cfg, done)
    if done:
        print(f"{out} already holds a verified merge of this adapter with these settings: nothing to do")
        _print_serving(out)
        _quantize(config, adapter_dir, out, device)
        return out
    if out.is_dir() and any(out.iterdir()) and not config.merge.overwrite:
        raise QwenftError(f"out={config.out}: {_not_this_merge(out, request)}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file where a folder should be, no permission
        blocking = next((p for p in (out.parent, *out.parent.parents) if p.exists() and not p.is_dir()), None)
        why = f"{blocking} is a file, not a folder" if blocking else exc.strerror or str(exc)
        raise QwenftError(f"out={config.out}: cannot create its folder {out.parent}: {why}") from None
    _remove_stale(out)
    log.info("base %s (%s) %s", model_cfg.name, model_cfg.source, why)
    with _terminate_as_interrupt():
        tmp = staging_dir(out.parent, f"{out.name}.tmp-")
        owner = None
        try:
            owner = write_locked(tmp / OWNER, str(os.getpid()))  # held until the end: tmp is a live merge's
            _build(config, adapter_dir, out.name, tmp, model_cfg, quant_cfg, why, device or default_device(),
                   request)
            _commit(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            if owner is not None:
                os.close(owner)
    print(f"merged model written to {out}")
    _print_serving(out)
    _quantize(config, adapter_dir, out, device)
    return out


def _quantize(config: Config, adapter_dir: Path, out: Path, device: Optional[str]) -> None:
    if config.merge.quantize:
        from qwenft.export.quantize import quantize
        from qwenft.runtime import default_device

        with _terminate_as_interrupt():
            quantize(config, adapter_dir, out, device or default_device())


def _print_serving(out: Path) -> None:
    """The closing lines: the serve commands recorded in ``qwenft_merge.json`` (:func:`serve_commands`), and the
    warning when vLLM cannot serve the adapter unmerged."""
    try:
        serve = json.loads((out / MARKER).read_text(encoding="utf-8")).get("serve") or {}
    except (OSError, ValueError):
        return
    if serve.get("merged"):
        print(f"serve it with vLLM: {serve['merged']}")
    if serve.get("gguf"):
        print(f"serve the GGUF with llama.cpp: {serve['gguf']}")
    if serve.get("ollama"):
        print(f"or with Ollama: {serve['ollama']}")
    if serve.get("adapter"):
        print(f"or serve the adapter unmerged with vLLM: {serve['adapter']}")
    if serve.get("adapter_problem"):
        log.warning("%s", serve["adapter_problem"])


def _build(config: Config, adapter_dir: Path, name: str, tmp: Path, model_cfg: ModelConfig,
           quant_cfg: QuantConfig, why: str, device: str, request: dict) -> None:
    """Everything between an empty temporary directory and a verified one."""
    from qwenft.export.gguf_file import write_gguf
    from qwenft.doctor.guard import check_loaded, check_written
    from qwenft.export.gguf_quant import write_modelfile

    merge_cfg = config.merge
    inherited = check_loaded(adapter_dir, "the adapter")  # the adapter and its base: warned about, never refused
    start = time.perf_counter()
    model, tokenizer, model_dir = load_base(model_cfg, merge_cfg, device)
    log.info("loaded the base in %s on %s (%.1f s)", merge_cfg.dtype, device, time.perf_counter() - start)
    if quant_cfg.method == "nf4" and merge_cfg.base == "dequantized":
        count = nf4_round_trip_(model, quant_cfg)
        log.info("NF4 round trip of %d Linear weights, as training saw them (%.1f s)", count,
                 time.perf_counter() - start)
    was_tied = untie_(model)
    peft_model = attach_adapter(model, adapter_dir)
    reference = compute_reference(peft_model, tokenizer)
    log.info("reference outputs of the adapter on the base (%.1f s)", time.perf_counter() - start)
    merged = merge_(peft_model, adapter_dir)
    tied = retie_(merged, was_tied)
    save_merged(merged, tokenizer, tmp, merge_cfg.max_shard_size)
    log.info("merged and saved (%.1f s)", time.perf_counter() - start)
    del merged, peft_model, model  # free the memory before the reload check loads the model again
    gc.collect()

    gguf_record = None
    if merge_cfg.gguf != "none":
        gguf_record = write_gguf(tmp, tmp / f"{name}-{merge_cfg.gguf}.gguf", merge_cfg.gguf, tokenizer, name)
    check_written(tmp, "the merged model", inherited)  # qwenft's own faults (a stop list without <|im_end|>...)
    with_llama = gguf_record is not None and wanted(merge_cfg.gguf, merge_cfg.verify_gguf)
    report = run_reload_check(tmp, reference, merge_cfg.dtype, device, model_cfg.attn_implementation,
                              gguf_record["file"] if gguf_record else None, NEW_TOKENS if with_llama else 0)
    log.info("reloaded and compared without qwenft (%.1f s)", time.perf_counter() - start)
    checks = check_report(reference, report, merge_cfg.dtype, tied, merge_cfg.gguf if gguf_record else None)
    merged_check, gguf_check = checks["merge"], checks["gguf"]
    on = "NF4-dequantized" if quant_cfg.method == "nf4" and merge_cfg.base == "dequantized" else "original 16-bit"
    print(f"merge check (plain transformers reload vs the adapter on the {on} weights, {len(reference.prompts)} "
          f"prompts): max |delta logit| = {merged_check.max_delta:.3g} (tolerance {merged_check.tolerance:g} for "
          f"{merge_cfg.dtype}); greedy: {', '.join(merged_check.greedy)}")
    if gguf_check is not None:
        print(f"gguf check ({merge_cfg.gguf}, loaded back through transformers): max |delta logit| = "
              f"{gguf_check.max_delta:.3g} (tolerance {gguf_check.tolerance:g}); "
              f"greedy: {', '.join(gguf_check.greedy)}")
    llama = verify_with_llama(tmp / gguf_record["file"], reference.prompts, report, tokenizer,
                              merge_cfg.gguf, merge_cfg.dtype) if with_llama else None
    if llama is not None:
        print(f"gguf check ({merge_cfg.gguf}, llama.cpp): {llama.summary()}")
        checks["problems"] += llama.problems
    if checks["problems"]:
        raise VerificationError("; ".join(checks["problems"]))

    base = dict(describe_base(model_cfg, quant_cfg, merge_cfg, model_dir), base_from=why)  # why: the card says it
    verification = {"passed": True, "merge": merged_check.as_dict(),
                    "gguf": gguf_check.as_dict() if gguf_check else None,
                    "llama_cpp": llama.as_dict() if llama else None}
    settings = _merge_settings(config)
    meta = read_adapter_meta(adapter_dir)
    if gguf_record is not None:  # Ollama's Modelfile beside the GGUF (its chat template, stops, sampling)
        gguf_record["modelfile"] = write_modelfile(tmp, gguf_record["file"], (meta or {}).get("system_prompt"),
                                                   tokenizer)
    out = tmp.parent / name  # where _commit renames tmp to: the paths the serve commands name
    rope = long_context(json.loads((tmp / "config.json").read_text(encoding="utf-8")))
    serve = serve_commands(out, gguf_record, adapter_dir, base["path"],
                           (meta or {}).get("run_name") or adapter_dir.parent.name, rope)
    card = model_card(name, base, meta, settings, verification, adapter_dir.parent, gguf_record, out, serve, rope)
    (tmp / "README.md").write_text(card, encoding="utf-8")
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file() and p.name != OWNER}
    for file in files:
        publish_mode(tmp / file)
    record = {"request": request, "adapter": str(adapter_dir), "base": base, "base_from": why,
              "tie_word_embeddings": tied, "verification": verification, "gguf": gguf_record, "serve": serve,
              "files": files}
    (tmp / MARKER).write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
