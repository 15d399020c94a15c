"""``python -m qwenft eval [adapter=PATH]``: the base, and the tuned model when an adapter is given, evaluated as
after ``train`` (:func:`qwenft.evaluate.run.evaluate_and_report`), then the verdict enforced."""

from __future__ import annotations

from pathlib import Path

from qwenft.config import Config
from qwenft.evaluate.run import check_settings, evaluate_and_report
from qwenft.evaluate.verdict import enforce


def eval_command(config: Config) -> None:
    """Evaluate the base, and the tuned model when ``adapter`` is set; write the run directory's metrics.json,
    generations.jsonl and report.md.

    With an adapter, the evaluation starts from the eval settings its run recorded (gates, metrics, sampler preset
    and its values, ...), then the keys typed on top (:func:`qwenft.model.eval_record.restore_eval`), so a later
    eval without overrides reproduces the run's own after-train numbers; report.md and metrics.json
    (``eval.settings_from``) say where the settings came from.

    Raises:
        QwenftError: an unreadable ``qwenft.json``, or recorded eval settings that do not fit this evaluation.
        ConfigError: a bad evaluation setting or adapter directory, before any model loads.
        DataError: bad held-out data, before the weights load (the data is read with the tokenizer alone).
        GatesFailed: a gate failed under ``eval.fail_on_gate=true``, once everything is written (the CLI exits 3).
    """
    from qwenft.preference.pipeline import build_run_data
    from qwenft.model import load_tokenizer, resolve_model_dir
    from qwenft.model.lora import load_for_inference, prepare_inference

    # the adapter checked; the base, data and eval settings its run recorded (its qwenft.json), typed keys on top
    config = prepare_inference(config)
    benchmarks = check_settings(config)  # unknown names, missing files, bad rows: refused before any load
    tokenizer = load_tokenizer(resolve_model_dir(config.model),
                               config.model.revision if config.model.source == "hub" else None)
    bundle = build_run_data(config, tokenizer)
    model, tokenizer = load_for_inference(config, tokenizer=tokenizer)  # evaluate() decides the decoding path
    metrics = evaluate_and_report(config, model, tokenizer, bundle, benchmarks,
                                  sides=("base", "tuned") if config.adapter else ("base",))
    from qwenft.evaluate.verdict_text import summary_line

    print(summary_line(metrics.get("eval") or {}))
    print(f"report: {Path(config.out_dir) / 'report.md'}")
    enforce(config, metrics, Path(config.out_dir))
