"""``merge.quantize``: deployable artifacts made from a finished merge, each with its measured cost.

``python -m qwenft merge adapter=RUN/adapter out=DIR merge.gguf=f16 merge.quantize=[gguf-q4_k_m,gptq,awq]`` merges
(or finds the merge already done) and then, inside ``DIR`` beside the 16-bit model:

- ``gguf-q8_0`` / ``gguf-q6_k`` / ``gguf-q5_k_m`` / ``gguf-q4_k_m``: ``DIR-<type>.gguf`` by llama.cpp's quantizer from
  the merge's f16 GGUF, and ``DIR-<type>.Modelfile`` for Ollama (:mod:`qwenft.export.gguf_quant`);
- ``gptq`` / ``awq``: ``w4a16-gptq/`` / ``w4a16-awq/``, compressed-tensors directories by llm-compressor, calibrated
  on ``merge.calibration_rows`` of the run's training examples (:mod:`qwenft.export.w4a16`).

Each is written under a temporary name and renamed when complete; ``qwenft_merge.json`` records it (``quantized``)
after the rename, so a re-run finds it done (same settings, files of the recorded sizes) and does nothing. Then every
artifact without a measurement (the 16-bit merge and the merge's own GGUF included) is measured on the run's held-out
data (:mod:`qwenft.export.costs`); the table goes into ``qwenft_merge.json`` (``costs``), the model card and the
output. Each row records when it was measured (``measured``, one UTC time per run): a run that adds artifacts
measures the 16-bit merge and the new ones, keeps the other rows, and the table then shows each row's time. The merge
command holds ``DIR``'s lock throughout, so temporary names left in ``DIR`` are a killed run's and are removed.

Bad input stops with one line (exit 2) before anything is loaded: an unknown method, missing or untested packages
(both in :mod:`qwenft.config.export`), GPTQ/AWQ on a model whose widths the group size does not divide, a GGUF
method on a merge without an f16 GGUF, GPTQ/AWQ for an adapter whose run recorded no data.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from qwenft.config import Config, EvalConfig, ModelConfig, QwenftError
from qwenft.config.export import GGUF_METHODS, W4A16_METHODS
from qwenft.export.gguf_quant import GGUF_TYPES, QuantizeError
from qwenft.files import atomic_write_text, publish_dir, publish_mode, staging_dir
from qwenft.model import MERGE_MARKER

log = logging.getLogger(__name__)

__all__ = ["QuantizeError", "artifact_name", "check_before_merge", "check_request", "quantize"]


def artifact_name(out_name: str, method: str) -> str:
    """Where ``method``'s artifact goes in the merge directory ``out_name``: a GGUF file or a directory name."""
    if method in GGUF_METHODS:
        return f"{out_name}-{method[len('gguf-'):]}.gguf"
    return f"w4a16-{method}"


def check_request(config: Config, model_config: dict, gguf: Optional[dict]) -> None:
    """The checks that need the model: GPTQ/AWQ widths (:func:`qwenft.export.w4a16.width_problem`) and, for a GGUF
    method, an f16 GGUF in the merge (``gguf``: its record, None when the merge wrote none; skipped when the merge is
    still to be written with ``merge.gguf=f16``, which the config check guarantees).

    Args:
        model_config: The model's ``config.json`` (the merged directory's, or the base's before merging).

    Raises:
        QwenftError: one line naming the method and what is wrong.
    """
    from qwenft.export.w4a16 import width_problem

    for method in config.merge.quantize:
        problem = width_problem(model_config, method) if method in W4A16_METHODS else None
        if problem:
            raise QwenftError(problem)
        if method in GGUF_METHODS and (gguf is None or gguf.get("type") != "f16"):
            raise QwenftError(f"merge.quantize={method}: {config.out} holds no f16 GGUF to quantize (llama.cpp "
                              "quantizes from 16-bit); merge again with merge.gguf=f16 merge.overwrite=true")


def check_before_merge(config: Config, out: Path, model_cfg: ModelConfig, done: bool) -> None:
    """:func:`check_request` on the finished merge (``done``), or before merging on the base's config (the merge
    writes an f16 GGUF then: the config check requires ``merge.gguf=f16``)."""
    from qwenft.model import resolve_model_dir

    if done:
        record = _read_record(out)
        check_request(config, json.loads((out / "config.json").read_text(encoding="utf-8")), record.get("gguf"))
    else:
        base = Path(resolve_model_dir(model_cfg)) / "config.json"
        if base.is_file():  # a Hub id not yet downloaded: checked on the merged directory instead
            check_request(config, json.loads(base.read_text(encoding="utf-8")), {"type": config.merge.gguf})


def _run_eval_config(adapter_dir: Path, fallback: EvalConfig) -> EvalConfig:
    """The training run's ``eval`` section (``RUN/config.yaml``: its metrics, answer length, prompts per source, ppl
    sources), else ``fallback`` with a warning."""
    from omegaconf import OmegaConf

    path = adapter_dir.parent / "config.yaml"
    if path.is_file():
        try:
            node = OmegaConf.merge(OmegaConf.structured(EvalConfig), OmegaConf.load(path).get("eval") or {})
            return OmegaConf.to_object(node)
        except Exception as exc:  # noqa: BLE001 - an unreadable or invalid file: the fallback, said once
            log.warning("%s: not readable as the run's eval settings (%s); measuring with this command's eval.*",
                        path, str(exc).splitlines()[0][:200])
    else:
        log.warning("%s not found: measuring with this command's eval.* settings", path)
    return fallback


def run_config(config: Config, adapter_dir: Path) -> Config:
    """The config the cost table and the calibration read the run with: the data and system prompt the adapter was
    trained on (its ``qwenft.json``), the run's eval settings with greedy answers and no benchmarks, no packing (one
    training example a row), the model in ``merge.dtype``."""
    from qwenft.model.adapter import inference_config

    cfg = inference_config(dataclasses.replace(config, command="eval", adapter=str(adapter_dir)), typed=[])
    run_eval = _run_eval_config(adapter_dir, config.eval)
    return dataclasses.replace(cfg, eval=dataclasses.replace(run_eval, generate="precise", benchmarks=[], gates={}),
                               data=dataclasses.replace(cfg.data, packing=False),
                               model=dataclasses.replace(cfg.model, dtype=config.merge.dtype))


def run_inputs(cfg: Config, out: Path):
    """The run's data (:func:`run_config`) read with the merged directory's tokenizer: the bundle with the training
    examples and the held-out rows, and the EOS ids of its generation_config.

    Returns:
        :class:`qwenft.export.costs.Inputs`.
    """
    from transformers import GenerationConfig

    from qwenft.preference.pipeline import build_run_data
    from qwenft.chat import stop_token_ids
    from qwenft.export.costs import Inputs
    from qwenft.model import load_tokenizer

    tokenizer = load_tokenizer(str(out))
    bundle = build_run_data(cfg, tokenizer)
    return Inputs(cfg, bundle, tokenizer, stop_token_ids(tokenizer, GenerationConfig.from_pretrained(out)))


def _read_record(out: Path) -> dict:
    return json.loads((out / MERGE_MARKER).read_text(encoding="utf-8"))


def _write_record(out: Path, record: dict) -> None:
    atomic_write_text(out / MERGE_MARKER, json.dumps(record, indent=2, ensure_ascii=False) + "\n")


def _settings(config: Config, method: str) -> dict:
    """What identifies an artifact besides the merge it comes from: the method's recipe and calibration."""
    from qwenft.export.w4a16 import GROUP_SIZE, RECIPES

    if method in GGUF_METHODS:
        return {"type": GGUF_TYPES[method], "from": "f16"}
    return {**RECIPES[method], "group_size": GROUP_SIZE, "calibration_rows": config.merge.calibration_rows,
            "calibration_seed": config.merge.calibration_seed}


def _files(path: Path) -> Dict[str, int]:
    if path.is_file():
        return {path.name: path.stat().st_size}
    return {f"{path.name}/{p.relative_to(path)}": p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}


def _done(out: Path, entry: Optional[dict], settings: dict) -> bool:
    return bool(entry) and entry.get("settings") == settings and all(
        (out / name).is_file() and (out / name).stat().st_size == size for name, size in entry["files"].items())


def _remove_leftovers(out: Path) -> None:
    """Temporary names a killed quantize left in ``out`` (this command holds ``out``'s lock: no one else writes)."""
    for path in list(out.glob(".*.tmp-*")) + list(out.glob(".old-*")):
        log.info("removing %s (left by a run that was killed)", path)
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _check_gguf(cost: dict, method: str, inputs, reference: dict) -> dict:
    """llama.cpp's check of a quantized GGUF, on its measurement before it is published (``cost``,
    :func:`qwenft.export.costs.measure_gguf_file`), by :mod:`qwenft.export.llama_check`'s rules: the chat template
    renders and tokenizes as the HF tokenizer does, the EOS ids end a generation, and fed each held-out prompt and the
    16-bit merge's greedy answer, llama.cpp's argmax is the 16-bit merge's at
    :data:`~qwenft.export.llama_check.MIN_IDENTICAL` of the answer positions for the type.

    Returns:
        The verdict as recorded (identical, compared, required, chat).

    Raises:
        QuantizeError: a rule failed (each one named).
    """
    from qwenft.export.llama_check import check_llama, hf_chat

    got = cost["llama_report"]
    report = {**got, "argmax": got["forced_argmax"], "load_seconds": 0.0, "decode_seconds": cost["seconds"]}
    verdict = check_llama(report, reference["argmax"], hf_chat(inputs.tokenizer), inputs.eos, method[len("gguf-"):])
    if verdict.problems:
        raise QuantizeError(f"{method} failed llama.cpp's check: {'; '.join(verdict.problems)}")
    found = verdict.as_dict()
    return {k: found[k] for k in ("identical", "compared", "required")} | {"chat": "as in HF"}


def _make(config: Config, out: Path, method: str, record: dict, inputs, system: Optional[str],
          reference: dict) -> Tuple[dict, Optional[dict]]:
    """Write one artifact under a temporary name, check it (a GGUF: measured first, :func:`_check_gguf`), rename it
    into place.

    Returns:
        ``(record entry, cost entry)``: the cost entry of a GGUF (measured before publishing), None for GPTQ / AWQ
        (measured afterwards).
    """
    from qwenft.export.costs import measure_gguf_file
    from qwenft.export.gguf_quant import quantize_gguf, staged_gguf, tensor_types, write_modelfile

    name = artifact_name(out.name, method)
    start = time.perf_counter()
    entry: Dict = {"path": name, "settings": _settings(config, method)}
    cost = None
    if method in GGUF_METHODS:
        tmp = staged_gguf(out, name)
        try:
            quantize_gguf(out / record["gguf"]["file"], tmp, method)
            entry["quantize_seconds"] = time.perf_counter() - start
            cost = measure_gguf_file(tmp, inputs, reference, method)
            entry["llama_cpp"] = _check_gguf(cost, method, inputs, reference)
            publish_mode(tmp)
            entry["tensor_types"] = tensor_types(tmp)
            os.replace(tmp, out / name)
        finally:
            tmp.unlink(missing_ok=True)
        entry["modelfile"] = write_modelfile(out, name, system, inputs.tokenizer)
    else:
        from qwenft.export.w4a16 import calibration_rows, quantize_w4a16

        if inputs.bundle is None or len(inputs.bundle.train) == 0:
            raise QwenftError(f"merge.quantize={method}: calibrates on the run's training rows, and the adapter's "
                              "qwenft.json records no data")
        rows, distinct = calibration_rows(inputs.bundle.train, config.merge.calibration_rows,
                                          config.merge.calibration_seed)
        if distinct < config.merge.calibration_rows:
            log.info("%s: the run has %d distinct training examples, fewer than merge.calibration_rows=%d: all "
                     "of them calibrate", method, distinct, config.merge.calibration_rows)
        tmp = staging_dir(out, f".{name}.tmp-")
        try:
            entry["calibration_seconds"] = quantize_w4a16(out, tmp, method, rows, config.merge.dtype,
                                                          config.merge.calibration_seed)
            publish_dir(tmp, out / name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        entry["calibration"] = {"rows": len(rows), "tokens": sum(len(r) for r in rows)}
    entry["seconds"] = time.perf_counter() - start
    entry["files"] = _files(out / name) | ({entry["modelfile"]: (out / entry["modelfile"]).stat().st_size}
                                           if "modelfile" in entry else {})
    log.info("%s written: %s (%.1f s)", method, out / name, entry["seconds"])
    return entry, cost


def quantize(config: Config, adapter_dir: Path, out: Path, device: str) -> None:
    """Make every artifact of ``config.merge.quantize`` not yet done in the finished merge ``out``, measure every
    artifact not yet measured, and print the cost table and the commands that serve each artifact.

    The 16-bit merge is measured first (every artifact is compared with it); then each artifact is made, checked and
    published, and recorded in turn: a GGUF is measured by llama.cpp before it is published, and that measurement is
    also its check (:func:`_check_gguf`); GPTQ / AWQ are measured once all are written.

    Raises:
        QwenftError: bad input (module docstring).
        QuantizeError: a quantizer failed, a GGUF failed llama.cpp's check, or an artifact could not be measured; the
            artifacts finished before stay recorded.
    """
    from qwenft.export.card import cost_table, handoff_lines, quantized_section, replace_section
    from qwenft.export.costs import REFERENCE, measure_hf, public, stamp
    from qwenft.model import read_adapter_meta

    record = _read_record(out)
    check_request(config, json.loads((out / "config.json").read_text(encoding="utf-8")), record.get("gguf"))
    _remove_leftovers(out)
    cfg = run_config(config, adapter_dir)
    made = record.setdefault("quantized", {})
    todo = [m for m in config.merge.quantize if not _done(out, made.get(m), _settings(config, m))]
    for method in config.merge.quantize:
        if method not in todo:
            print(f"{method}: {out / made[method]['path']} already done with these settings")
    key = json.loads(json.dumps({"eval": dataclasses.asdict(cfg.eval), "adapter": record["request"]["adapter_sha256"]},
                                default=str))
    if todo or _unmeasured(record, key):  # else a re-run: nothing is loaded, the table is printed again
        inputs = run_inputs(cfg, out)
        costs = record.get("costs") if (record.get("costs") or {}).get("settings") == key else None
        record["costs"] = costs or {"settings": key, "artifacts": {}}
        log.info("measuring the 16-bit merge on the run's held-out data (the reference)")
        now = stamp()  # every row this run measures says so; rows carried over keep theirs (card.cost_table)
        reference = measure_hf(out, inputs, config.merge.dtype, device, None, REFERENCE)
        record["costs"]["artifacts"][REFERENCE] = public(reference, now)
        system = (read_adapter_meta(adapter_dir) or {}).get("system_prompt")
        for method in todo:
            made[method], cost = _make(config, out, method, record, inputs, system, reference)
            record["costs"]["artifacts"].pop(method, None)  # a new file: measured (again)
            if cost is not None:
                record["costs"]["artifacts"][method] = public(cost, now)
            _write_record(out, record)
        failed = _measure(config, out, record, inputs, device, reference, now)
        measured = record["costs"]["artifacts"]  # in the table's order: the 16-bit merge, its GGUF, merge.quantize's
        record["costs"]["artifacts"] = {label: measured[label] for label, _, _ in _labels(record) if label in measured}
        card = replace_section((out / "README.md").read_text(encoding="utf-8"), quantized_section(record, out))
        atomic_write_text(out / "README.md", card)
        record["files"]["README.md"] = (out / "README.md").stat().st_size  # the merge's own check reads it
        _write_record(out, record)
    else:
        failed = [label for label, entry in record["costs"]["artifacts"].items() if entry.get("error")]
    print(cost_table(record["costs"]["artifacts"], reference=REFERENCE))
    for label, command in handoff_lines(record, out):
        print(f"serve {label}: {command}")
    if failed:
        raise QuantizeError(f"could not measure {', '.join(failed)} (the reason is in the table; the artifacts are "
                            "written and recorded)")


def _labels(record: dict) -> List[tuple]:
    """``(label, path, kind)`` of every artifact to measure: the 16-bit merge, its GGUF, the quantized ones."""
    from qwenft.export.costs import REFERENCE

    labels = [(REFERENCE, "", "hf")]
    if record.get("gguf"):
        labels.append((f"gguf-{record['gguf']['type']}", record["gguf"]["file"], "gguf"))
    labels += [(m, e["path"], "gguf" if m in GGUF_METHODS else "hf") for m, e in record.get("quantized", {}).items()]
    return labels


def _unmeasured(record: dict, key: dict) -> List[tuple]:
    """The artifacts (:func:`_labels`) the cost table lacks (or could not measure); all of them when it was measured
    with other settings (``key``: the eval settings and the adapter)."""
    costs = record.get("costs") or {}
    done = costs.get("artifacts", {}) if costs.get("settings") == key else {}
    return [label for label in _labels(record) if label[0] not in done or done[label[0]].get("error")]


def _measure(config: Config, out: Path, record: dict, inputs, device: str, reference: dict, now: str) -> List[str]:
    """Measure the artifacts ``record["costs"]`` lacks against ``reference`` (the 16-bit merge's measurement), each
    recorded as it is done (``measured``: ``now``); one that cannot be measured is recorded with its ``error``.

    Returns:
        The labels that could not be measured.
    """
    from qwenft.export.costs import REFERENCE, measure_gguf_file, measure_hf, public

    failed = []
    for label, path, kind in _unmeasured(record, record["costs"]["settings"]):
        if label == REFERENCE:
            continue
        try:
            entry = public(measure_gguf_file(out / path, inputs, reference, label) if kind == "gguf"
                           else measure_hf(out / path, inputs, config.merge.dtype, device, reference, label), now)
        except Exception as exc:  # noqa: BLE001 - recorded and reported; the other artifacts are still measured
            log.error("could not measure %s: %s", label, exc)
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            entry = {"error": f"{type(exc).__name__}: {first}", "measured": now}
            failed.append(label)
        record["costs"]["artifacts"][label] = entry
        _write_record(out, record)
    return failed
