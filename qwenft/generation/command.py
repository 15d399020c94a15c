"""``python -m qwenft generate``: stream one prompt to the terminal, or run a JSONL file of prompts.

::

    python -m qwenft generate prompt="春天" [adapter=PATH] [generate.temperature=0.3] [chat=false]
    python -m qwenft generate prompts_file=prompts.jsonl [out=results.jsonl] [generate=precise]

A prompts file holds one JSON object per line with a ``prompt`` string (a user turn when ``chat=true``,
the default; raw text otherwise) or a ``messages`` list of ``{"role", "content"}`` turns. Results are
written to ``out`` (default: ``<input stem>.generations.jsonl`` beside the input) under a temporary name,
then renamed: each line is the input object plus ``output``, ``stop_reason``, token counts, ``token_ids``,
``logprobs`` and ``entropies``. Both modes end with prefill and decode tokens/s and the peak memory.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from qwenft.config import Config, QwenftError
from qwenft.files import atomic_write_text

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
LINE_SHAPE = ('one JSON object per line: {"prompt": "your question"} or {"messages": [{"role": "user", '
              '"content": "..."}]}')  # what a prompts file holds, for its errors


def read_prompts(path: str) -> List[Tuple[int, Dict[str, Any]]]:
    """Read and check a JSONL prompts file.

    Returns:
        ``(line number, object)`` of each non-blank line (numbered from 1, blank lines counted), each object
        with a ``prompt`` or ``messages`` field.

    Raises:
        QwenftError: a missing or empty file, a file that is not UTF-8 (file, line and byte offset named, as for
            data files), or a bad line; the message names the file, the line and the field.
    """
    from qwenft.data.read import near_file, read_text, resolve_path

    file = Path(path).expanduser()
    if not file.is_file():
        raise QwenftError(f"prompts_file={path!r}: no such file (resolved to {resolve_path(path)}){near_file(path)}")
    rows = []
    text = read_text(str(file))  # the data files' reader: a byte-order mark removed, UTF-8 checked
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise QwenftError(f"{where}: not valid JSON ({exc.msg}, column {exc.colno}); a prompts file holds "
                              f"{LINE_SHAPE}") from None
        if not isinstance(row, dict):
            raise QwenftError(f"{where}: expected a JSON object with a 'prompt' or 'messages' field; a prompts file "
                              f"holds {LINE_SHAPE}")
        _check_row(row, where)
        rows.append((number, row))
    if not rows:
        raise QwenftError(f"prompts_file={path!r}: the file has no prompts")
    return rows


def _check_row(row: Dict[str, Any], where: str) -> None:
    if "messages" in row and "prompt" in row:
        raise QwenftError(f"{where}: fields 'prompt' and 'messages' both present; keep one")
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise QwenftError(f"{where}: field 'messages' must be a non-empty list of {{role, content}} objects")
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise QwenftError(f"{where}: field 'messages[{i}]' must be an object with 'role' and 'content'")
            if message.get("role") not in ROLES:
                raise QwenftError(f"{where}: field 'messages[{i}].role' is {message.get('role')!r}; "
                                  f"expected one of {', '.join(ROLES)}")
            if not isinstance(message.get("content"), str):
                raise QwenftError(f"{where}: field 'messages[{i}].content' must be a string")
    elif "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise QwenftError(f"{where}: field 'prompt' must be a non-empty string")
    else:
        raise QwenftError(f"{where}: missing field 'prompt' (a string) or 'messages' (a list of turns)")


def chat_input(row: Dict[str, Any], chat: bool, system_prompt: Optional[str]):
    """The sampler input of one row: messages (system prompt prepended if configured) or raw text. ``qwenft serve``
    builds its prompts with it too, so a request and ``qwenft generate`` see the same tokens."""
    if "messages" in row:
        messages = [dict(m) for m in row["messages"]]
    elif chat:
        messages = [{"role": "user", "content": row["prompt"]}]
    else:
        return row["prompt"]
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def output_path(config: Config) -> Path:
    """Where a prompts file's results go: ``out``, or ``<stem>.generations.jsonl`` beside the input.

    Raises:
        QwenftError: ``out`` is a directory, or the prompts file itself.
    """
    source = Path(config.prompts_file).expanduser()
    if not config.out:
        return source.with_name(f"{source.stem}.generations.jsonl")
    path = Path(config.out).expanduser()
    if path.is_dir():
        raise QwenftError(f"out={config.out}: is a directory; name a file, e.g. out={path / 'generations.jsonl'}")
    if path.resolve() == source.resolve():
        raise QwenftError(f"out={config.out}: is the prompts file itself; name another file (it would be replaced)")
    return path


def write_jsonl(path: Path, rows: List[Dict[str, Any]]) -> None:
    """Write ``rows`` as JSONL atomically (temporary file in the same folder, then ``os.replace``)."""
    atomic_write_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def peak_memory_bytes(device: str) -> int:
    """Peak accelerator memory allocated on ``device`` (CUDA), else the process's peak RSS."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _summary(prompt_tokens: int, prefill_s: float, decode_tokens: int, decode_s: float, device: str) -> str:
    prefill = prompt_tokens / prefill_s if prefill_s > 0 else 0.0
    decode = decode_tokens / decode_s if decode_s > 0 else 0.0
    kind = "GPU memory" if device.startswith("cuda") else "RSS"
    return (f"prefill {prefill:,.1f} tokens/s ({prompt_tokens} tokens) | decode {decode:,.1f} tokens/s "
            f"({decode_tokens} tokens) | peak {kind} {peak_memory_bytes(device) / 2**30:.2f} GiB")


def generate_command(config: Config) -> None:
    """Run ``qwenft generate`` for a validated config.

    Raises:
        QwenftError: neither or both of ``prompt`` and ``prompts_file``, a bad prompts file (checked before
            the model is loaded), ``generate.compile=true``, or a missing adapter.
    """
    if (config.prompt is None) == (config.prompts_file is None):
        raise QwenftError('generate needs exactly one of prompt="..." or prompts_file=PATH')
    if config.prompt is not None and config.out:
        raise QwenftError(f"out={config.out}: out= names the results file of prompts_file=...; with prompt= the "
                          "answer streams to the terminal (redirect it: > answer.txt)")
    from qwenft.generation.generate import check_supported

    check_supported(config.generate)  # before any model is loaded
    rows = read_prompts(config.prompts_file) if config.prompts_file else None
    if rows is not None:
        output_path(config)  # a bad out= stops here, before the model is loaded
    if config.prompt is not None and not config.prompt.strip():
        raise QwenftError("prompt: empty prompt")

    from qwenft.generation.engine import prepare_for_decoding
    from qwenft.generation.generate import Sampler, encode_prompts
    from qwenft.model.lora import load_for_inference, prepare_inference
    from qwenft.runtime import default_device

    config = prepare_inference(config)  # the adapter checked, and the base it was trained on (its qwenft.json)
    device = default_device()
    model, tokenizer = load_for_inference(config, device=device)  # 4-bit as loaded: the engine decides
    system_prompt = config.data.system_prompt
    inputs = [chat_input(row, config.chat, system_prompt) for row in ([{"prompt": config.prompt}] if rows is None
                                                                        else [row for _, row in rows])]
    encoded = encode_prompts(tokenizer, inputs)
    prompt_len = max(len(ids) for ids in encoded)
    engine = prepare_for_decoding(model, config, cache_len=prompt_len + config.generate.max_new_tokens,
                                  prompt_len=prompt_len)
    with engine.side("tuned" if config.adapter else "base") as ready:
        sampler = Sampler(ready, tokenizer, engine.settings(config.generate))
        if rows is None:
            _stream_one(sampler, encoded[0], device)
        else:
            _run_file(sampler, rows, encoded, config, device)


def _stream_one(sampler, prompt, device: str) -> None:
    stream = sampler.stream(prompt)
    for delta in stream:
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    stats, result = stream.stats, stream.result
    print(f"[{result.stop_reason}, {len(result.token_ids)} tokens] "
          + _summary(stats.prompt_tokens, stats.prefill_s, stats.decode_tokens, stats.decode_s, device),
          file=sys.stderr)


def _run_file(sampler, numbered: List[Tuple[int, Dict[str, Any]]], encoded: List[List[int]], config: Config,
              device: str) -> None:
    from qwenft.generation.batches import generate_many

    target = output_path(config)
    # Batches of similar length waste less compute on padding; results come back in input order.
    sequences, totals = generate_many(sampler, encoded, config.generate.batch_size, desc="generate",
                                      progress_file=sys.stderr)
    results = [{**row, "input_line": number, "output": seq.text, "stop_reason": seq.stop_reason,
                "prompt_tokens": seq.prompt_tokens, "completion_tokens": len(seq.token_ids),
                "token_ids": seq.token_ids, "logprobs": [round(v, 5) for v in seq.logprobs],
                "entropies": [round(v, 5) for v in seq.entropies]} for (number, row), seq in zip(numbered, sequences)]
    write_jsonl(target, results)
    print(f"wrote {len(results)} generations to {target}", file=sys.stderr)
    print(_summary(totals.prompt_tokens, totals.prefill_s, totals.decode_tokens, totals.decode_s, device),
          file=sys.stderr)
