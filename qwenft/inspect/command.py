"""``python -m qwenft inspect``: trace one forward pass over a prompt (:mod:`qwenft.inspect.trace`), print its
tables and write it as JSON. With ``adapter=PATH`` the same pass runs for the base (adapter disabled with peft's
``disable_adapter``) and the tuned model, and the two are compared.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict

from qwenft.config import Config, QwenftError
from qwenft.inspect.trace import compare, resolve_layers, token_table, trace_forward
from qwenft.logfilter import result_console

log = logging.getLogger(__name__)


def _with_pieces(trace, tokenizer) -> None:
    for row in trace["next_token"]["top"]:
        row["text"] = tokenizer.decode([row["id"]])
    trace.pop("_logprobs", None)


def inspect_command(config: Config) -> Dict[str, Any]:
    """Entry point of ``python -m qwenft inspect prompt=TEXT [chat=true] [adapter=PATH] [inspect.layers=[0,12]]``.

    Loads the model with eager attention (``qwenft.model.load_model``), the adapter when given, traces the prompt,
    prints the tables and writes the whole trace to ``inspect.out`` (JSON, atomically) when set.

    Returns:
        What is written as JSON: ``prompt``, ``chat``, ``model``, ``adapter``, ``layers`` (traced indices),
        ``tokens`` (:func:`token_table`), ``kv_cache`` (measured and formula bytes), ``base`` (the trace of
        :func:`trace_forward` of the model, with the adapter disabled when one is given), ``tuned`` and
        ``comparison`` (:func:`compare`; both None without an adapter).

    Raises:
        QwenftError: no ``prompt``; a bad ``inspect.layers``; an adapter directory without adapter_config.json;
            model loading errors. All are raised before the model is loaded except the last.
    """

    import torch

    from qwenft.model.lora import load_for_inference, prepare_inference
    from qwenft.plan import Architecture, kv_cache_bytes, resolve_architecture, write_json

    if not config.prompt:
        raise QwenftError('prompt: inspect needs a prompt, e.g. python -m qwenft inspect prompt="春天"')
    config = prepare_inference(config)  # the adapter checked, and the base it was trained on (its qwenft.json)
    layers = resolve_layers(config.inspect.layers, resolve_architecture(config.model).num_hidden_layers)
    eager = dataclasses.replace(config, model=dataclasses.replace(config.model, attn_implementation="eager"))
    model, tokenizer = load_for_inference(eager)  # 4-bit as loaded: the 4-bit computation itself is traced
    if config.chat:
        from qwenft.data.template import with_system

        # the system prompt trained with (the adapter's qwenft.json) or data.system_prompt, as generate and eval
        messages = with_system([{"role": "user", "content": config.prompt}], config.data.system_prompt)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    else:
        ids = tokenizer(config.prompt, add_special_tokens=False)["input_ids"]
    device = next(p for p in model.parameters()).device
    input_ids = torch.tensor([list(ids)], device=device)
    tokens = token_table(tokenizer, input_ids[0].tolist())
    pieces = [row["piece"] for row in tokens]
    kw = {"layers": layers, "top_k": config.inspect.top_k, "top_positions": config.inspect.top_positions,
          "pieces": pieces}
    comparison, tuned = None, None
    if config.adapter:
        with model.disable_adapter():
            base, base_hidden = trace_forward(model, input_ids, **kw)
        tuned, tuned_hidden = trace_forward(model, input_ids, **kw)
        comparison = compare(base, tuned, base_hidden, tuned_hidden, config.inspect.top_moved)
    else:
        base, _ = trace_forward(model, input_ids, **kw)
    for trace in (base, tuned):
        if trace is not None:
            _with_pieces(trace, tokenizer)
    arch = Architecture.from_config_dict(model.config.to_dict(), "model.config")
    element = model.get_input_embeddings().weight.element_size()  # the cache has the hidden states' dtype
    result = {"prompt": config.prompt, "chat": config.chat, "model": config.model.name, "adapter": config.adapter,
              "layers": layers, "tokens": tokens,
              "kv_cache": {"measured_bytes": base["kv_cache_bytes"], "tokens": len(tokens),
                           "formula_bytes": kv_cache_bytes(arch, len(tokens), element)},
              "base": base, "tuned": tuned, "comparison": comparison}
    render(result)
    if config.inspect.out:
        path = write_json(config.inspect.out, result)
        print(f"trace written to {path}")
    return result



def _layer_table(title: str, trace: Dict[str, Any]):
    from rich.table import Table

    table = Table(title=title)
    for col in ("layer", "ms", "attn rms", "mlp rms", "std", "max|x|", "growth", "H(attn)", "attends"):
        table.add_column(col, justify="left" if col == "attends" else "right", overflow="fold")
    for r in trace["layers"]:
        ent, m = r["attention_entropy"], r["mlp"]
        tops = " ".join(f"{p['position']}({p['weight']:.2f})" for p in r["top_positions"])
        table.add_row(str(r["layer"]), f"{r['time_ms']:.1f}", f"{r['attention']['rms']:.3g}", f"{m['rms']:.3g}",
                      f"{m['std']:.3g}", f"{m['max_abs']:.3g}", f"x{r['growth']:.2f}",
                      f"{r['attention_entropy_mean']:.2f} ({min(ent):.1f}-{max(ent):.1f})", tops)
    return table


def _next_table(title: str, traces: Dict[str, Dict[str, Any]]):
    from rich.table import Table

    table = Table(title=title)
    table.add_column("rank", justify="right", overflow="fold")
    for name, trace in traces.items():
        table.add_column(f"{name} token", overflow="fold")
        table.add_column(f"{name} p", justify="right", overflow="fold")
    rows = max(len(t["next_token"]["top"]) for t in traces.values())
    for k in range(rows):
        cells = [str(k + 1)]
        for trace in traces.values():
            top = trace["next_token"]["top"]
            cells += [f"{top[k]['id']} {top[k]['text']!r}", f"{top[k]['prob']:.4f}"] if k < len(top) else ["", ""]
        table.add_row(*cells)
    return table


def render(result: Dict[str, Any], console=None) -> None:
    """Print the trace of :func:`inspect_command` as rich tables: tokens, layers (base, tuned), final norm,
    next-token candidates, KV-cache bytes and, with an adapter, the base-vs-tuned comparison."""
    from rich.table import Table

    console = console or result_console()
    table = Table(title=f"Tokens of the prompt ({len(result['tokens'])}, chat={result['chat']})")
    for col in ("#", "id", "piece", "text", "bytes"):
        table.add_column(col, justify="right" if col in ("#", "id") else "left", overflow="fold")
    for pos, row in enumerate(result["tokens"]):
        table.add_row(str(pos), str(row["id"]), repr(row["piece"]), repr(row["text"]),
                      "special" if row["special"] else (row["bytes"] or ""))
    console.print(table)
    traces = {"base": result["base"], "tuned": result["tuned"]}
    if result["tuned"] is None:
        traces = {"model": result["base"]}
    for label, trace in traces.items():
        console.print(_layer_table(f"Layers ({label}): hidden state after attention / after the MLP; growth = "
                                   "per-token norm out/in; H(attn) = last token's attention entropy in nats, "
                                   "mean (min-max) over heads; attends = position(weight)", trace))
        f = trace["final_norm"]
        console.print(f"final norm ({label}): rms {f['rms']:.4g}, mean {f['mean']:.4g}, std {f['std']:.4g}, "
                      f"max|x| {f['max_abs']:.4g}; forward {trace['total_ms']:.0f} ms")
    console.print(_next_table("Next token at the last position", traces))
    console.print("next-token entropy: " + ", ".join(f"{n} {t['next_token']['entropy_nats']:.3f} nats"
                                                     for n, t in traces.items()))
    kv = result["kv_cache"]
    console.print(f"KV cache for the prompt: {kv['measured_bytes']:,} bytes measured, {kv['formula_bytes']:,} by "
                  f"the formula ({kv['tokens']} tokens)")
    comparison = result["comparison"]
    if comparison:
        console.print(f"KL(tuned || base) = {comparison['kl_tuned_base']:.4g} nats, "
                      f"KL(base || tuned) = {comparison['kl_base_tuned']:.4g} nats")
        table = Table(title="Layers whose hidden state moved most (||h_tuned - h_base|| / ||h_base||)")
        for col in ("layer", "relative change", "cosine (last token)"):
            table.add_column(col, justify="right", overflow="fold")
        by_layer = {r["layer"]: r for r in comparison["layers"]}
        for i in comparison["moved_most"]:
            table.add_row(str(i), f"{by_layer[i]['relative_change']:.4g}", f"{by_layer[i]['last_cosine']:.4f}")
        console.print(table)
