"""Base vs tuned evaluation: generation metrics per source and perplexity, in one process.

The same loaded base serves both sides, so nothing is loaded twice (:class:`qwenft.generation.engine.Engine`):
the adapter is disabled for "base" and enabled for "tuned", or, on the fast path (CUDA, 16-bit weights), the base
side runs on the plain model and the tuned side after its LoRA delta is folded into the weights. The held-out rows come tokenized in the data
bundle (``DataBundle.eval_rows``): their prompts (``prompt_ids``, token for token the prefix the trainer
supervised after, :func:`qwenft.data.prompt_ids`) and their ``input_ids`` / ``labels`` are used as they are.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional

from qwenft.config import Config, ConfigError, GenerateConfig
from qwenft.evaluate.metrics import distinct_n, score
from qwenft.evaluate.perplexity import label_rows, score_rows, window_rows

log = logging.getLogger(__name__)


def generate_preset(config: Config) -> GenerateConfig:
    """The sampler settings for evaluation: the ``eval.generate`` preset (``config.generate_presets``, every
    conf/generate preset, composed by Hydra), then ``eval.max_new_tokens``; the decoding engine's settings
    (``static_cache``, ``compile``, ``fold_lora``) from the ``generate`` section.

    Raises:
        ConfigError: no preset of that name.
    """
    preset = config.generate_presets.get(config.eval.generate)
    if preset is None:
        names = ", ".join(sorted(config.generate_presets))
        raise ConfigError(f"eval.generate={config.eval.generate!r} is not accepted; choose one of: {names}")
    if config.eval.max_new_tokens is not None:
        preset = dataclasses.replace(preset, max_new_tokens=config.eval.max_new_tokens)
    engine = config.generate
    return dataclasses.replace(preset, static_cache=engine.static_cache, compile=engine.compile,
                               fold_lora=engine.fold_lora)


def generation_eval(sampler, config: Config, rows: List[dict], batch_size: int, label: str,
                    desc: Optional[str] = None) -> List[dict]:
    """Generate an answer for every held-out row and score it against the reference.

    Prompts run in batches of similar length (:func:`qwenft.generation.batches.generate_many`); the results come
    back in the order of ``rows``.

    Args:
        sampler: a :class:`qwenft.generation.Sampler` over the side being evaluated.
        rows: held-out conversations of the bundle (``DataBundle.eval_rows``), each with its ``prompt_ids``.
        batch_size: prompts per batch.
        label: what the progress bar names, ``generate (LABEL)`` (e.g. ``base, domain``), unless ``desc`` is given.

    Returns:
        One dict per row: ``text``, ``stop_reason``, ``tokens`` (answer length) and the metric values.
    """
    from qwenft.generation.batches import generate_many

    sequences, _ = generate_many(sampler, [row["prompt_ids"] for row in rows], batch_size,
                                 desc=desc or f"generate ({label})")
    results: List[dict] = []
    for row, seq in zip(rows, sequences):
        reference = row["messages"][-1]["content"]
        results.append({"text": seq.text, "stop_reason": seq.stop_reason, "tokens": len(seq.token_ids),
                        **score(seq.text, reference, config.eval.metrics, row.get("meta"))})
    return results


def summarise(results: List[dict], metrics: List[str]) -> Dict[str, Optional[float]]:
    """Means of the per-row metrics, mean answer length (tokens), stop rate and distinct-2.

    A row whose metric is None (n/a: no numeric reference answer, no fact) is left out of that metric's mean; a
    metric no row could be scored on is None (null in metrics.json, "n/a" in report.md).
    """
    if not results:
        return {}
    n = len(results)
    summary: Dict[str, Optional[float]] = {}
    for name in metrics:
        values = [r[name] for r in results if r[name] is not None]
        summary[name] = sum(values) / len(values) if values else None
    margins = [r["pref_margin"] for r in results if r.get("pref_margin") is not None]
    if margins:  # held-out preference pairs (qwenft.evaluate.preference)
        summary["pref_margin"] = sum(margins) / len(margins)
    summary["answer_tokens"] = sum(r["tokens"] for r in results) / n
    summary["stop_rate"] = sum(r["stop_reason"] != "length" for r in results) / n  # ended by EOS / stop string
    summary["distinct_2"] = distinct_n([r["text"] for r in results], 2)
    summary["rows"] = n
    return summary


def perplexity_rows(tokenizer, config: Config, bundle) -> Dict[str, list]:
    """What :func:`perplexities` scores, by name: ``text:FILE`` for each ``eval.ppl_sources`` file (its first
    ``eval.ppl_max_tokens`` tokens in ``eval.ppl_window`` windows every ``eval.ppl_stride``,
    :func:`~qwenft.evaluate.perplexity.window_rows`) and ``answers:SOURCE`` for each source's held-out rows (the
    bundle's ``input_ids`` / ``labels``, as trained on: a ``text`` row counts every token,
    :func:`~qwenft.evaluate.perplexity.label_rows`); a source whose every held-out row was skipped has none."""
    from qwenft.data import resolve_path
    from qwenft.data.read import read_text

    out: Dict[str, list] = {}
    for source in config.eval.ppl_sources:
        ids = tokenizer(read_text(source), add_special_tokens=False).input_ids  # the data files' reader: BOM removed
        ids = ids[:config.eval.ppl_max_tokens]
        out[f"text:{resolve_path(source).name}"] = window_rows([ids], config.eval.ppl_window, config.eval.ppl_stride)
    for name, rows in (bundle.eval_rows if bundle is not None else {}).items():
        examples = [(row["input_ids"], row["labels"]) for row in rows if row["input_ids"] is not None]
        if examples:  # else every held-out row of the source was skipped as bad (data.on_bad_row=skip)
            out[f"answers:{name}"] = label_rows(examples)
    return out


def perplexities(model, tokenizer, config: Config, bundle, batch_size: Optional[int] = None) -> Dict[str, Dict[str, Any]]:
    """Perplexity of each ``eval.ppl_sources`` text file and of each source's held-out answers
    (:func:`perplexity_rows`), in batches of ``batch_size`` windows / examples (default: ``eval.batch_size``, or 8
    when it is auto)."""
    if batch_size is None:
        batch_size = 8 if config.eval.batch_size == "auto" else int(config.eval.batch_size)
    return {name: score_rows(model, rows, batch_size, tokenizer.pad_token_id, progress=True).as_dict()
            for name, rows in perplexity_rows(tokenizer, config, bundle).items()}


def check_ppl_sources(config: Config) -> None:
    """Read every ``eval.ppl_sources`` file through the data files' reader, before any model is loaded.

    Raises:
        ConfigError: a missing file, or one that holds no text.
        DataError: a file that is not UTF-8 (naming the file, line and byte offset), or unreadable.
    """
    from qwenft.data import resolve_path
    from qwenft.data.read import read_text

    for i, source in enumerate(config.eval.ppl_sources):
        if not resolve_path(source).is_file():
            raise ConfigError(f"eval.ppl_sources[{i}]={source!r}: no such file")
        if not read_text(source).strip():
            raise ConfigError(f"eval.ppl_sources[{i}]={source!r}: the file holds no text to score")


def evaluate(model, tokenizer, config: Config, bundle, sides: List[str], benchmarks=None,
             progress: Optional[str] = None) -> Dict[str, Any]:
    """Evaluate ``sides`` (``base`` then ``tuned``) of ``model`` on the bundle's held-out rows.

    The model is first made ready along the decode path chosen for its device and memory
    (:func:`qwenft.generation.engine.prepare_for_decoding`: a 4-bit base dequantized on a CPU, or on CUDA when the
    16-bit weights fit, the adapter folded in for the tuned side there), so ``model`` is for inference only
    afterwards. ``eval.batch_size=auto`` is resolved from the free memory (:func:`qwenft.generation.engine.auto_batch_sizes`).
    The generation progress bars read ``generate (SIDE, SOURCE)``, or ``PROGRESS (SOURCE)`` when ``progress`` is given
    (``qwenft merge``'s cost table: ``measure gptq``).

    Returns:
        ``{"sources": {name: {side: summary}}, "perplexity": {name: {side: {...}}}, "rows": {name: [...]},
        "engine": {...}}``.
    """
    from qwenft.evaluate.preference import PAIR_KEYS, is_pair_row, pair_scores, preference_summary
    from qwenft.generation import Sampler
    from qwenft.generation.engine import batch_sizes, prepare_for_decoding

    settings = generate_preset(config)
    limit = config.eval.max_eval_prompts
    # Generation needs a conversation; held-out rows of `text` sources only count in perplexity.
    eval_rows = {name: [r for r in rows if r["messages"]][:limit]
                 for name, rows in (bundle.eval_rows if bundle is not None else {}).items()}
    eval_rows = {name: rows for name, rows in eval_rows.items() if rows}
    prompt_len = max((len(r["prompt_ids"]) for rows in eval_rows.values() for r in rows), default=1)
    cache_len = prompt_len + settings.max_new_tokens
    if "tuned" in sides and _bias_setting(model) != "none":
        log.warning("the adapter trains the base model's biases (lora.bias=%s): peft cannot switch them off, so the "
                    "'base' side includes them; evaluate the base alone with `qwenft eval` without adapter=",
                    _bias_setting(model))
    engine = prepare_for_decoding(model, config, cache_len=cache_len, prompt_len=prompt_len)
    rows_per_batch, windows_per_batch = batch_sizes(config, engine.model, cache_len, prompt_len)
    sampler = Sampler(engine.model, tokenizer, engine.settings(settings))
    runner = None
    if benchmarks:
        from qwenft.evaluate.bench_run import BenchRunner

        runner = BenchRunner(benchmarks, tokenizer, sampler, batch_size=rows_per_batch,
                             chat_template=config.eval.bench_chat_template,
                             max_gen_tokens=config.eval.bench_max_gen_tokens, seed=config.eval.bench_seed)
    report: Dict[str, Any] = {"sources": {}, "perplexity": {}, "rows": {},
                              "engine": {"path": engine.path.reason, "batch_size": rows_per_batch,
                                         "ppl_batch_size": windows_per_batch,
                                         "weights_dtype": _weights_dtype(engine.model)}}
    for side in sides:
        with engine.side(side) as side_model:
            for name, rows in eval_rows.items():
                results = generation_eval(sampler, config, rows, rows_per_batch, f"{side}, {name}",
                                          f"{progress} ({name})" if progress else None)
                if any(is_pair_row(row) for row in rows):  # held-out preference pairs: which answer is preferred
                    scores = pair_scores(side_model, rows, windows_per_batch, tokenizer.pad_token_id,
                                         config.train.objective)
                    for result, extra in zip(results, scores):
                        result.update(extra or dict.fromkeys(PAIR_KEYS))
                report["sources"].setdefault(name, {})[side] = summarise(results, config.eval.metrics)
                report["rows"].setdefault(name, [{} for _ in rows])
                for slot, result in zip(report["rows"][name], results):
                    slot[side] = result
            for name, value in perplexities(side_model, tokenizer, config, bundle, windows_per_batch).items():
                report["perplexity"].setdefault(name, {})[side] = value
            if runner is not None:
                runner.run_side(side, side_model)
        log.info("evaluated %s", side)
    if runner is not None:
        report["benchmarks"], report["bench_rows"] = runner.report()
    from qwenft.evaluate.bench_data import skipped

    report["bench_skipped"] = skipped(config)  # eval.bench_missing=skip and no data found: said in report.md
    for name, by_side in report["sources"].items():
        if "base" in by_side and "tuned" in by_side:
            by_side["delta"] = {k: by_side["tuned"][k] - by_side["base"][k] for k in by_side["base"]
                                if k != "rows" and all(isinstance(by_side[s].get(k), (int, float))
                                                       for s in ("base", "tuned"))}
    for name, by_side in report["perplexity"].items():
        if "base" in by_side and "tuned" in by_side:
            by_side["ratio"] = by_side["tuned"]["perplexity"] / by_side["base"]["perplexity"]
    summaries = {name: preference_summary(report["rows"][name], config.eval.bench_seed) for name in eval_rows}
    report["preference"] = {name: value for name, value in summaries.items() if value is not None}
    for name, rows in eval_rows.items():
        for slot, row in zip(report["rows"][name], rows):
            slot.update({"source": name, "row": row.get("row"), "prompt": row["messages"][-2]["content"]
                         if len(row["messages"]) > 1 else "", "reference": row["messages"][-1]["content"]})
            history = [m for m in row["messages"][:-2] if m["role"] != "system"]
            if history:  # earlier turns of a multi-turn prompt (the judge reads them)
                slot["history"] = history
            if row.get("rejected") is not None:
                slot["rejected"] = row["rejected"]
    return report


def _bias_setting(model) -> str:
    """The adapter's peft ``LoraConfig.bias``: ``all`` / ``lora_only`` train the base model's biases in place."""
    configs = getattr(model, "peft_config", None) or {}
    return next((str(getattr(c, "bias", "none")) for c in configs.values()), "none")


def _weights_dtype(model) -> str:
    """The dtype of the decoder's projection weights as evaluated (e.g. ``torch.bfloat16``)."""
    layer = model.get_decoder().layers[0].mlp.down_proj if hasattr(model, "get_decoder") else None
    weight = getattr(getattr(layer, "base_layer", layer), "weight", None)
    return str(weight.dtype) if weight is not None else "unknown"


def check_settings(config: Config) -> list:
    """Refuse a bad evaluation setting before any model loads (``train`` checks it before training, ``eval`` before
    it loads): the sampler preset, the perplexity sources, the benchmarks' names, files and rows, the judge
    (:func:`qwenft.evaluate.judging.check_judge`: its rubric, preset or endpoint).

    Returns:
        The benchmarks' chosen questions (:func:`qwenft.evaluate.bench_tasks.prepare`), read once.

    Raises:
        ConfigError: see :func:`generate_preset`, :func:`check_ppl_sources` and
            :func:`qwenft.evaluate.bench_tasks.prepare`.
        JudgeUnavailable: the judge endpoint is down or refuses the key or the model.
    """
    from qwenft.evaluate.bench_tasks import prepare as prepare_benchmarks

    from qwenft.evaluate.judging import check_judge

    generate_preset(config)
    check_ppl_sources(config)
    benchmarks = prepare_benchmarks(config)
    check_judge(config)  # last: the other checks cost no request
    return benchmarks


def evaluate_and_report(config: Config, model, tokenizer, bundle, benchmarks=None,
                    sides=("base", "tuned")) -> Dict[str, Any]:
    """Evaluate ``sides`` (base: adapter off; tuned: adapter on) and write metrics.json, generations.jsonl and
    report.md into ``config.out_dir``, then, with ``eval.judge`` and both sides, judge the answers
    (:func:`qwenft.evaluate.judging.run_judge`), write judgments.jsonl and write the three again with the judge; the evaluation's peak memory (:func:`qwenft.memory.peak_memory`) goes into
    metrics.json's ``memory.eval``. Used after ``train`` and by ``qwenft eval``, so both measure the same phase.

    Returns:
        What metrics.json holds.

    Raises:
        JudgeUnavailable: the judge endpoint went down or refused the key (everything but the judge is written).
    """
    from qwenft.evaluate.report import write_outputs
    from qwenft.memory import peak_memory

    with peak_memory(str(next(model.parameters()).device)) as memory:
        report = evaluate(model, tokenizer, config, bundle, list(sides), benchmarks)
    report["memory"] = {"eval": memory}
    judging = config.eval.judge.enabled and "tuned" in sides
    metrics = write_outputs(config, Path(config.out_dir), report, log_wandb=not judging)
    if not judging:
        return metrics
    # the judge comes last, with everything else already written: a judge that goes down loses nothing else
    from qwenft.evaluate.judging import run_judge, write_judgments

    from qwenft.evaluate.judge_client import JudgeUnavailable

    try:
        report["judge"], judgments = run_judge(config, report)
    except JudgeUnavailable as exc:  # report.md and metrics.json say so; W&B gets the evaluation without it
        report["judge"] = {"failed": str(exc)}
        write_outputs(config, Path(config.out_dir), report)
        raise JudgeUnavailable(f"{exc}; the evaluation without the judge is written "
                               f"({Path(config.out_dir) / 'report.md'}); a re-run asks the judge only for what it "
                               "did not answer") from None
    write_judgments(Path(config.out_dir) / "judgments.jsonl", judgments)
    return write_outputs(config, Path(config.out_dir), report)
