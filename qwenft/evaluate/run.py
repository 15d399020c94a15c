"""Base vs tuned evaluation: generation metrics per source and perplexity, in one process.

The same loaded base serves both sides: the adapter is disabled (``PeftModel.disable_adapter()``) for
"base" and enabled for "tuned", so nothing is loaded twice. The held-out rows come tokenized in the data
bundle (``DataBundle.eval_rows``): their prompts (``prompt_ids``, token for token the prefix the trainer
supervised after, :func:`qwenft.data.prompt_ids`) and their ``input_ids`` / ``labels`` are used as they are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf

from qwenft.config import Config, ConfigError, GenerateConfig
from qwenft.evaluate.metrics import distinct_n, score
from qwenft.evaluate.perplexity import perplexity_of_ids, perplexity_of_labels

log = logging.getLogger(__name__)

GENERATE_PRESETS = Path(__file__).resolve().parents[2] / "conf" / "generate"


def generate_preset(config: Config) -> GenerateConfig:
    """The sampler settings for evaluation: the ``eval.generate`` preset, then ``eval.max_new_tokens``.

    Raises:
        ConfigError: no preset of that name under conf/generate/.
    """
    path = GENERATE_PRESETS / f"{config.eval.generate}.yaml"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in GENERATE_PRESETS.glob("*.yaml")))
        raise ConfigError(f"eval.generate={config.eval.generate!r} is not accepted; choose one of: {names}")
    merged = OmegaConf.merge(OmegaConf.structured(GenerateConfig), OmegaConf.load(path))
    preset = OmegaConf.to_object(merged)
    if config.eval.max_new_tokens is not None:
        preset = dataclasses.replace(preset, max_new_tokens=config.eval.max_new_tokens)
    return dataclasses.replace(preset, batch_size=config.eval.batch_size)


@contextlib.contextmanager
def adapter_state(model, enabled: bool):
    """Run the block with the LoRA adapter of a PEFT model disabled (``enabled=False``) or as it is."""
    if enabled or not hasattr(model, "disable_adapter"):
        yield
    else:
        with model.disable_adapter():
            yield


def generation_eval(model, tokenizer, config: Config, rows: List[dict], settings: GenerateConfig,
                    label: str) -> List[dict]:
    """Generate an answer for every held-out row (batched) and score it against the reference.

    Args:
        rows: held-out conversations of the bundle (``DataBundle.eval_rows``), each with its ``prompt_ids``.

    Returns:
        One dict per row: ``text``, ``stop_reason``, ``tokens`` (answer length) and the metric values.
    """
    from tqdm.auto import tqdm

    from qwenft.generation import Sampler

    sampler = Sampler(model, tokenizer, settings)
    results: List[dict] = []
    prompts = [row["prompt_ids"] for row in rows]
    batches = range(0, len(prompts), settings.batch_size)
    for start in tqdm(batches, desc=f"generate ({label})", unit="batch", leave=False):
        out = sampler.generate(prompts[start:start + settings.batch_size])
        for row, seq in zip(rows[start:start + settings.batch_size], out.sequences):
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
    summary["answer_tokens"] = sum(r["tokens"] for r in results) / n
    summary["stop_rate"] = sum(r["stop_reason"] != "length" for r in results) / n  # ended by EOS / stop string
    summary["distinct_2"] = distinct_n([r["text"] for r in results], 2)
    summary["rows"] = n
    return summary


def perplexities(model, tokenizer, config: Config, bundle) -> Dict[str, Dict[str, Any]]:
    """Perplexity of each ``eval.ppl_sources`` text file and of each source's held-out answers (the bundle's
    ``input_ids`` / ``labels`` of its held-out rows, as trained on: a ``text`` row counts every token)."""
    from qwenft.data import resolve_path
    from qwenft.data.read import read_text

    out: Dict[str, Dict[str, Any]] = {}
    for source in config.eval.ppl_sources:
        path = resolve_path(source)
        ids = tokenizer(read_text(source), add_special_tokens=False).input_ids  # the data files' reader: BOM removed
        ids = ids[:config.eval.ppl_max_tokens]
        result = perplexity_of_ids(model, [ids], window=config.eval.ppl_window, stride=config.eval.ppl_stride,
                                   batch_size=config.eval.batch_size, pad_id=tokenizer.pad_token_id, progress=True)
        out[f"text:{path.name}"] = result.as_dict()
    for name, rows in (bundle.eval_rows if bundle is not None else {}).items():
        examples = [(row["input_ids"], row["labels"]) for row in rows if row["input_ids"] is not None]
        if not examples:  # every held-out row of the source was skipped as bad (data.on_bad_row=skip)
            continue
        result = perplexity_of_labels(model, examples, batch_size=config.eval.batch_size,
                                      pad_id=tokenizer.pad_token_id, progress=True)
        out[f"answers:{name}"] = result.as_dict()
    return out


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


def evaluate(model, tokenizer, config: Config, bundle, sides: List[str]) -> Dict[str, Any]:
    """Evaluate ``sides`` (``base`` and/or ``tuned``) of ``model`` on the bundle's held-out rows.

    On a CPU a 4-bit base is first dequantized once (:func:`qwenft.model.dequantize_for_inference`), so
    ``model`` is for inference only afterwards.

    Returns:
        ``{"sources": {name: {side: summary}}, "perplexity": {name: {side: {...}}}, "rows": {name: [...]}}``.
    """
    from qwenft.model import dequantize_for_inference

    settings = generate_preset(config)
    model.eval()
    dequantize_for_inference(model, config.quant, str(next(model.parameters()).device.type))
    model.config.use_cache = True  # training switched the cache off
    limit = config.eval.max_eval_prompts
    # Generation needs a conversation; held-out rows of `text` sources only count in perplexity.
    eval_rows = {name: [r for r in rows if r["messages"]][:limit]
                 for name, rows in (bundle.eval_rows if bundle is not None else {}).items()}
    eval_rows = {name: rows for name, rows in eval_rows.items() if rows}
    report: Dict[str, Any] = {"sources": {}, "perplexity": {}, "rows": {}}
    for side in sides:
        with adapter_state(model, enabled=side == "tuned"):
            for name, rows in eval_rows.items():
                results = generation_eval(model, tokenizer, config, rows, settings, f"{side}, {name}")
                report["sources"].setdefault(name, {})[side] = summarise(results, config.eval.metrics)
                report["rows"].setdefault(name, [{} for _ in rows])
                for slot, result in zip(report["rows"][name], results):
                    slot[side] = result
            for name, value in perplexities(model, tokenizer, config, bundle).items():
                report["perplexity"].setdefault(name, {})[side] = value
        log.info("evaluated %s", side)
    for name, by_side in report["sources"].items():
        if "base" in by_side and "tuned" in by_side:
            by_side["delta"] = {k: by_side["tuned"][k] - by_side["base"][k] for k in by_side["base"]
                                if k != "rows" and all(isinstance(by_side[s].get(k), (int, float))
                                                       for s in ("base", "tuned"))}
    for name, by_side in report["perplexity"].items():
        if "base" in by_side and "tuned" in by_side:
            by_side["ratio"] = by_side["tuned"]["perplexity"] / by_side["base"]["perplexity"]
    for name, rows in eval_rows.items():
        for slot, row in zip(report["rows"][name], rows):
            slot.update({"source": name, "row": row.get("row"), "prompt": row["messages"][-2]["content"]
                         if len(row["messages"]) > 1 else "", "reference": row["messages"][-1]["content"]})
    return report


def run_after_train(config: Config, model, tokenizer, bundle) -> Dict[str, Any]:
    """Evaluate base (adapter off) and tuned (adapter on) and write metrics.json, generations.jsonl, report.md."""
    from qwenft.evaluate.report import write_outputs

    report = evaluate(model, tokenizer, config, bundle, ["base", "tuned"])
    return write_outputs(config, Path(config.out_dir), report)


def eval_command(config: Config) -> None:
    """``qwenft eval [adapter=PATH]``: evaluate the base, and the tuned model when an adapter is given."""
    from qwenft import data as data_lib
    from qwenft.evaluate.report import write_outputs
    from qwenft.model import load_tokenizer, resolve_model_dir
    from qwenft.model.inference import load_for_inference, prepare_inference

    generate_preset(config)
    check_ppl_sources(config)
    config = prepare_inference(config)  # the adapter checked, and the base it was trained on (its qwenft.json)
    # The data is read and checked with the tokenizer alone: bad data stops before the weights load.
    tokenizer = load_tokenizer(resolve_model_dir(config.model),
                               config.model.revision if config.model.source == "hub" else None)
    bundle = data_lib.build(config, tokenizer) if config.data.sources else None
    model, tokenizer = load_for_inference(config, tokenizer=tokenizer)
    sides = ["base", "tuned"] if config.adapter else ["base"]
    report = evaluate(model, tokenizer, config, bundle, sides)
    write_outputs(config, Path(config.out_dir), report)
    print(f"report: {Path(config.out_dir) / 'report.md'}")

