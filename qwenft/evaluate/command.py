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

    Raises:
        ConfigError: a bad evaluation setting or adapter directory, before any model loads.
        DataError: bad held-out data, before the weights load (the data is read with the tokenizer alone).
        GatesFailed: a gate failed under ``eval.fail_on_gate=true``, once everything is written (the CLI exits 3).
    """
    from qwenft import data as data_lib
    from qwenft.model import load_tokenizer, resolve_model_dir
    from qwenft.model.lora import load_for_inference, prepare_inference

    benchmarks = check_settings(config)  # unknown names, missing files, bad rows: refused before any load
    config = prepare_inference(config)  # the adapter checked, and the base it was trained on (its qwenft.json)
    tokenizer = load_tokenizer(resolve_model_dir(config.model),
                               config.model.revision if config.model.source == "hub" else None)
    bundle = data_lib.build(config, tokenizer) if config.data.sources else None
    model, tokenizer = load_for_inference(config, tokenizer=tokenizer)  # evaluate() decides the decoding path
    metrics = evaluate_and_report(config, model, tokenizer, bundle, benchmarks,
                              sides=("base", "tuned") if config.adapter else ("base",))
    print(f"report: {Path(config.out_dir) / 'report.md'}")
    enforce(config, metrics, Path(config.out_dir))
