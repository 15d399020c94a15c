"""``qwenft doctor PATH [--json]``: check an adapter directory, a model directory or a GGUF file, made by qwenft or
any other tool (LLaMA-Factory, unsloth, axolotl, a peft script), for the faults that make a Qwen2.5 fine-tune behave
wrongly without an error: a stop list without ``<|im_end|>``, a missing or foreign chat template, a lost tie or
lm_head, a leftover quantization_config, shrunk embeddings, inconsistent RoPE scaling, GGUF special tokens, and
adapters vLLM cannot serve.

Prints one line per finding (``SEVERITY CODE: what; fix: what to do``) after info lines saying what PATH is and
which checks were skipped, then a summary; ``--json`` prints the same as one JSON object (for an unreadable PATH:
``{"path", "kind": null, "exit_code": 2, "error"}``, the error line on stderr as well). Exit 0 clean, 1 findings,
2 unreadable (raised as :class:`~qwenft.config.QwenftError`; the CLI prints one line and exits 2). Only metadata is
read: JSON files, safetensors headers, GGUF key-values.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional, Sequence

from qwenft.config import QwenftError
from qwenft.doctor.findings import Report
from qwenft.doctor.read import kind_of, read_json, read_model_dir


def _max_seq_len(meta: Optional[dict]) -> Optional[int]:
    value = ((meta or {}).get("data") or {}).get("max_seq_len")
    return value if isinstance(value, int) else None


def _rope_recorded(meta: Optional[dict]) -> dict:
    rope = ((meta or {}).get("model") or {}).get("rope_scaling")
    return {k: v for k, v in rope.items() if v is not None} if isinstance(rope, dict) and rope.get("rope_type") \
        else {}


def check_adapter(path: Path, report: Report) -> None:
    """An adapter: its base's checks with the adapter's own generation_config and tokenizer on top, what it trains
    on a tied base, its embedding copies, and vLLM's rules (:func:`qwenft.model.vllm_lora.vllm_support`)."""
    from qwenft.doctor.base import read_adapter
    from qwenft.doctor.checks import View, check_model, declared_theta
    from qwenft.model.vllm_lora import vllm_max_lora_rank, vllm_support

    adapter = read_adapter(path)
    report.note(adapter.base_note)
    config = adapter.adapter_config
    if not any(path.glob("adapter_model*.safetensors")):
        pickled = sorted(p.name for p in path.glob("adapter_model*.bin"))
        if not pickled:
            raise QwenftError(f"{path}: no adapter_model.safetensors (nor .bin): the adapter's weights are missing "
                              "(an interrupted copy or save?)")
        report.note(f"skipped: the checks of the LoRA weights ({', '.join(pickled)} is a pickle, never read; save "
                    "with safetensors, peft's default)")
    from qwenft.doctor.base import weight_problems

    for code, message, fix in weight_problems(config, adapter.tensors):
        report.add(code, message, fix)
    base = adapter.base
    if base is not None:
        recorded = _rope_recorded(adapter.meta)
        base_config = dict(base.config)
        if recorded:  # the base as the adapter was trained on it: qwenft applies model.rope_scaling at load
            positions = base_config.get("max_position_embeddings")
            theta = declared_theta(base_config)[0]  # qwenft keeps the base's RoPE base under the scaling
            base_config["rope_parameters"] = dict(recorded, original_max_position_embeddings=recorded.get(
                "original_max_position_embeddings") or positions)
            base_config.pop("rope_scaling", None)
            if theta:  # in one place, as transformers 5 saves it
                base_config["rope_parameters"]["rope_theta"] = theta
                base_config.pop("rope_theta", None)
            if recorded.get("rope_type") in ("yarn", "linear") and isinstance(positions, int):
                base_config["max_position_embeddings"] = int(base_config["rope_parameters"][
                    "original_max_position_embeddings"] * recorded.get("factor", 1))
        own_tokenizer = adapter.tokenizer is not None and adapter.tokenizer.template is not None
        view = View(base_config, adapter.generation if adapter.generation is not None else base.generation,
                    adapter.tokenizer if own_tokenizer else (base.tokenizer or adapter.tokenizer), base.tensors,
                    base.names + [str(config.get("base_model_name_or_path") or "")],
                    "the adapter" if adapter.generation is not None else "the base",
                    "the adapter" if own_tokenizer else "the base")
        identity = check_model(view, report, need_generation=False, max_seq_len=_max_seq_len(adapter.meta),
                               template_known=view.tokenizer is not None)
        _trained_embeddings(adapter, base, report, identity)
        _base_shapes(adapter, base, report)
    else:
        report.note("skipped: every check of the base (family, template, stops, tie, vocabulary, RoPE)")
    reasons = vllm_support(config)
    if reasons:
        report.add("vllm-lora-unsupported", f"vLLM cannot serve this adapter unmerged: {'; '.join(reasons)}",
                   "merge it (python -m qwenft merge adapter=PATH out=DIR) and serve the merged model, or train "
                   "again with settings vLLM accepts (LoRA on the 7 projections, r <= 512, no DoRA or "
                   "modules_to_save)")
    elif isinstance(config.get("r"), int) and not any(c.startswith("adapter-") for c in report.codes()):
        report.note(f"vLLM can serve it unmerged: --enable-lora --max-lora-rank {vllm_max_lora_rank(config['r'])}")


def _trained_embeddings(adapter, base, report: Report, identity) -> None:
    """``adapter-lm-head-on-tied-base``, and ``embedding-rows-shrunk`` for embedding copies saved in the adapter."""
    config = adapter.adapter_config
    trained = [str(m) for m in (config.get("modules_to_save") or []) if m in ("lm_head", "embed_tokens")]
    targets = config.get("target_modules") or []
    trained += [m for m in ("lm_head", "embed_tokens") if (m in targets if not isinstance(targets, str)
                                                            else m in targets) and m not in trained]
    if trained and base.config.get("tie_word_embeddings"):
        report.add("adapter-lm-head-on-tied-base", f"the adapter trains {', '.join(trained)} of a base with "
                   "tie_word_embeddings=true: the trained copy and the tied matrix drift apart, and a merged model "
                   "saved still tied loses one of them on reload", "merge with `qwenft merge` (it unties the base "
                   "and saves tie_word_embeddings=false when the matrices differ), or train without them")
    member = identity.member
    want = member.config.get("vocab_size") if member is not None else base.config.get("vocab_size")
    for name, tensor in adapter.tensors.items():
        if ("embed_tokens" in name or "lm_head" in name) and "lora_" not in name and tensor.shape:
            if isinstance(want, int) and tensor.shape[0] < want:
                report.add("embedding-rows-shrunk", f"the adapter saves {name} with {tensor.shape[0]} rows; the "
                           f"base has {want}", f"train again without resizing the embeddings below {want} rows "
                           "(never resize to len(tokenizer))")
                return


def _base_shapes(adapter, base, report: Report) -> None:
    """``adapter-base-mismatch``: LoRA matrices whose shapes do not fit the base's projections."""
    from qwenft.doctor.base import shape_mismatches

    wrong = shape_mismatches(adapter.tensors, base.config)
    if wrong:
        name, shape, need = wrong[0]
        named = base.names[-1] if base.names else "the base"
        report.add("adapter-base-mismatch", f"{name} has shape {shape} but on the base ({named}, hidden_size "
                   f"{base.config.get('hidden_size')}) it must be {need}" + (f"; {len(wrong) - 1} more LoRA matrices "
                   "do not fit either" if len(wrong) > 1 else "") + ": peft refuses to load it, or a tool that "
                   "skips it serves the bare base", "use the base the adapter was trained on: set "
                   "base_model_name_or_path in adapter_config.json to it")


def _merge_record(path: Path) -> Optional[dict]:
    """qwenft.json of the adapter a ``qwenft merge`` directory was made from (its qwenft_merge.json names it)."""
    try:
        record = read_json(path / "qwenft_merge.json", required=False)
        adapter = (record or {}).get("adapter")
        return read_json(Path(adapter) / "qwenft.json", required=False) if isinstance(adapter, str) else None
    except QwenftError:
        return None


def check_model_dir(path: Path, report: Report) -> None:
    """A model directory, and any GGUF in it against its config.json."""
    from qwenft.doctor.checks import View, check_model
    from qwenft.doctor.gguf import check_gguf, compare_rope, read_gguf

    files = read_model_dir(path)
    if files.tensors is None:
        report.note("skipped: the tie, lm_head, quantization and embedding-row checks (no .safetensors files)")
    view = View(files.config, files.generation, files.tokenizer, files.tensors, files.names)
    check_model(view, report, need_generation=True, max_seq_len=_max_seq_len(_merge_record(path)))
    for gguf_path in sorted(path.glob("*.gguf")):
        facts = read_gguf(gguf_path)
        sub = Report(str(gguf_path), "gguf")
        check_gguf(facts, sub)
        compare_rope(files.config, facts, sub)
        report.note(f"{gguf_path.name}: checked too ({len(sub.findings)} finding(s))")
        report.extend(sub, gguf_path.name)


def diagnose(path) -> Report:
    """The report on ``path``: an adapter directory (or a run directory holding ``adapter/``), a model directory
    or a GGUF file.

    Raises:
        QwenftError: PATH missing, none of the three, or a file it must read is corrupt (one line naming it).
    """
    path = Path(path).expanduser()
    if path.is_dir() and not (path / "adapter_config.json").is_file() and not (path / "config.json").is_file() \
            and (path / "adapter" / "adapter_config.json").is_file():
        path = path / "adapter"  # a qwenft run directory stands for its adapter
    kind = kind_of(path)
    report = Report(str(path), kind)
    if kind == "adapter":
        check_adapter(path, report)
        if (path / "config.json").is_file():  # a model saved beside its adapter (a trainer's output directory)
            model = Report(str(path), "model")
            check_model_dir(path, model)
            seen = set(report.codes())  # the same files (generation_config, tokenizer) read twice: said once
            model.findings = [f for f in model.findings if f.code not in seen]
            report.note(f"this directory holds a model too (config.json, its weights): checked as one as well, "
                        f"its findings marked \"as a model\" ({len(model.findings)} more finding(s))")
            report.info += [f"as a model: {line}" for line in model.info]
            report.extend(model, "as a model", file=None)
    elif kind == "model":
        check_model_dir(path, report)
    else:
        from qwenft.doctor.gguf import check_gguf, read_gguf

        check_gguf(read_gguf(path), report)
    return report


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, through the CLI's error path
        raise QwenftError(f"doctor: {message} (usage: qwenft doctor PATH [--json])")


def doctor_command(argv: Optional[Sequence[str]] = None) -> int:
    """``qwenft doctor PATH [--json]``: print the report; returns the exit code (0 clean, 1 findings).

    Raises:
        QwenftError: bad arguments, or PATH unreadable (:func:`diagnose`); the CLI exits 2.
    """
    parser = _Parser(prog="qwenft doctor", description="Check a Qwen2.5 adapter, model directory or GGUF file.")
    parser.add_argument("path", help="an adapter directory, a model directory or a .gguf file")
    parser.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    args = parser.parse_args(list(argv or []))
    try:
        report = diagnose(args.path)
    except QwenftError as exc:  # --json readers get an object too; the one line still goes to stderr (exit 2)
        if args.json:
            print(json.dumps({"path": str(args.path), "kind": None, "exit_code": 2, "error": str(exc)}, indent=2,
                             ensure_ascii=False))
        raise
    print(json.dumps(report.as_dict(), indent=2, ensure_ascii=False) if args.json else report.text())
    return report.exit_code
