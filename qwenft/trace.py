"""``python -m qwenft inspect``: a per-layer trace of one forward pass over a prompt.

For each traced decoder layer: statistics of the hidden state after attention (residual added) and after the MLP,
the growth of the residual stream's per-token norm, the entropy of each head's attention for the last token and the
positions it attends most, and the time the layer took. Then the final norm and the next-token distribution at the
last position. With ``adapter=PATH`` the same pass runs for the base (adapter disabled with peft's
``disable_adapter``) and the tuned model, and the two are compared (KL divergence, layers that moved most).

The pass uses eager attention (SDPA does not return attention probabilities) and forward hooks on the decoder layers
(``Qwen2DecoderLayer``), their ``self_attn`` and their ``post_attention_layernorm``, whose input is exactly the
hidden state after attention plus the residual.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from qwenft.config import Config, ConfigError, QwenftError
from qwenft.logfilter import result_console

log = logging.getLogger(__name__)


def _byte_decoder() -> Dict[str, int]:
    """The inverse of the byte-level BPE alphabet (GPT-2's byte-to-unicode map): printable Latin-1 bytes map
    to themselves, the other 68 bytes to the code points from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            table[chr(byte)] = byte
        else:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


_BYTE_DECODER = _byte_decoder()


def token_table(tokenizer, ids: Sequence[int]) -> List[Dict[str, Any]]:
    """One row per token: ``id``, ``piece`` (the vocabulary string), ``text`` (its decoded text), ``bytes``
    (hex of the raw UTF-8 bytes for a byte-level piece; None for special tokens) and ``special``.

    A byte-level piece may hold part of a UTF-8 character (Chinese often splits across tokens); its text is then
    shown as ``�`` by the tokenizer and the bytes say what it really holds.
    """
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    rows = []
    for token_id, piece in zip(ids, tokenizer.convert_ids_to_tokens(list(ids))):
        is_special = token_id in special or token_id in added
        raw = None
        if not is_special and piece and all(ch in _BYTE_DECODER for ch in piece):
            raw = bytes(_BYTE_DECODER[ch] for ch in piece).hex(" ")
        rows.append({"id": int(token_id), "piece": piece, "text": tokenizer.decode([token_id]), "bytes": raw,
                     "special": is_special})
    return rows


def tensor_stats(x) -> Dict[str, float]:
    """Statistics of one sequence's hidden states ``x: [seq, hidden]`` (any float dtype; computed in float64).

    ``rms`` sqrt(mean(x^2)), ``mean``, ``std`` (population, over all elements), ``max_abs``, and ``token_norm``:
    the mean over positions of the per-token L2 norm.
    """
    x = x.detach().double()
    return {"rms": float(x.pow(2).mean().sqrt()), "mean": float(x.mean()), "std": float(x.std(unbiased=False)),
            "max_abs": float(x.abs().max()), "token_norm": float(x.norm(dim=-1).mean())}


def _entropy(p) -> Any:
    """Entropy in nats along the last dimension of probabilities ``p`` (0 log 0 = 0)."""
    import torch

    return -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)


def resolve_layers(requested: Optional[Sequence[int]], num_layers: int) -> List[int]:
    """Layer indices to trace (negative ones count from the end), sorted and unique; None means all.

    Raises:
        ConfigError: an index outside ``[-num_layers, num_layers)``, naming ``inspect.layers``.
    """
    if requested is None:
        return list(range(num_layers))
    out = set()
    for index in requested:
        if not -num_layers <= index < num_layers:
            raise ConfigError(f"inspect.layers={list(requested)!r} is not accepted; layer {index} is out of range, "
                              f"the model has {num_layers} layers (0..{num_layers - 1})")
        out.add(index % num_layers)
    return sorted(out)


def _decoder(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model


def trace_forward(model, input_ids, layers: Sequence[int], top_k: int = 10, top_positions: int = 3,
                  pieces: Optional[Sequence[str]] = None) -> Tuple[Dict[str, Any], Dict[int, Any]]:
    """Run one forward pass of ``input_ids: [1, seq]`` and trace ``layers``.

    The model must use eager attention so the attention modules return their probabilities
    ``[batch, heads, seq, seq]``. The pass runs under ``torch.no_grad`` with the KV cache on, so the cache size
    is measured too.

    Returns:
        ``(trace, hidden)``: ``trace`` is JSON-ready (``embeddings`` and ``final_norm`` statistics, ``layers``,
        ``next_token``, ``kv_cache_bytes``, ``total_ms``); ``hidden`` maps each traced layer to its output
        hidden state ``[seq, hidden]`` (float32, on the CPU) for comparisons.

    Raises:
        QwenftError: the attention modules return no probabilities (the model does not use eager attention).
    """
    import torch

    decoder = _decoder(model)
    sync = torch.cuda.synchronize if input_ids.device.type == "cuda" else (lambda: None)
    seen: Dict[int, Dict[str, Any]] = {i: {} for i in layers}
    extra: Dict[str, Any] = {}
    handles = []

    # The hooks keep references (no copies) inside the timed window; statistics are computed afterwards.
    def layer_pre(index):
        def hook(module, args, kwargs):
            seen[index]["input"] = args[0] if args else kwargs["hidden_states"]
            sync()
            seen[index]["t0"] = time.perf_counter()
        return hook

    def layer_post(index):
        def hook(module, args, output):
            sync()
            seen[index]["t1"] = time.perf_counter()
            seen[index]["output"] = output[0] if isinstance(output, tuple) else output
        return hook

    def after_attention(index):
        def hook(module, args, kwargs):
            seen[index]["attention"] = args[0] if args else kwargs["hidden_states"]
        return hook

    def attention_probs(index):
        def hook(module, args, output):  # [batch, heads, q, k] -> the last query's rows, [heads, k]
            seen[index]["probs"] = None if output[1] is None else output[1][0, :, -1, :].clone()
        return hook

    for i in layers:
        layer = decoder.layers[i]
        handles += [layer.register_forward_pre_hook(layer_pre(i), with_kwargs=True),
                    layer.register_forward_hook(layer_post(i)),
                    layer.post_attention_layernorm.register_forward_pre_hook(after_attention(i), with_kwargs=True),
                    layer.self_attn.register_forward_hook(attention_probs(i))]
    handles.append(decoder.embed_tokens.register_forward_hook(lambda m, a, o: extra.__setitem__("embeddings", o)))
    handles.append(decoder.norm.register_forward_hook(lambda m, a, o: extra.__setitem__("final", o)))
    try:
        with torch.no_grad():
            sync()
            start = time.perf_counter()
            out = model(input_ids=input_ids, use_cache=True)
            sync()
            total = time.perf_counter() - start
    finally:
        for handle in handles:
            handle.remove()
    records, hidden = [], {}
    for i in layers:
        rec = {k: (v[0].float().cpu() if k in ("input", "attention", "output") else v) for k, v in seen[i].items()}
        if rec.get("probs") is None:
            raise QwenftError("inspect needs attention probabilities: load the model with "
                              "model.attn_implementation=eager")
        probs = rec["probs"].float().cpu()  # [heads, seq] for the last position
        mean_probs = probs.mean(0)
        top = torch.topk(mean_probs, min(top_positions, mean_probs.numel()))
        entropy = _entropy(probs)
        norm_in = float(rec["input"].double().norm(dim=-1).mean())
        stats_attn, stats_mlp = tensor_stats(rec["attention"]), tensor_stats(rec["output"])
        records.append({
            "layer": i, "time_ms": 1000.0 * (rec["t1"] - rec["t0"]),
            "input_token_norm": norm_in, "attention": stats_attn, "mlp": stats_mlp,
            "growth_attention": stats_attn["token_norm"] / norm_in, "growth": stats_mlp["token_norm"] / norm_in,
            "attention_entropy": [float(e) for e in entropy], "attention_entropy_mean": float(entropy.mean()),
            "top_positions": [{"position": int(p), "weight": float(w),
                               "piece": pieces[int(p)] if pieces is not None else None}
                              for w, p in zip(top.values, top.indices)],
            "head_top_position": [int(p) for p in probs.argmax(-1)],
        })
        hidden[i] = rec["output"]
    logits = out.logits[0, -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    probs = logprobs.exp()
    top = torch.topk(probs, min(top_k, probs.numel()))
    from qwenft.generation.kv_cache import cache_bytes

    kv_bytes = cache_bytes(getattr(out, "cache", None))
    trace = {
        "n_tokens": int(input_ids.shape[1]), "total_ms": 1000.0 * total,
        "embeddings": tensor_stats(extra["embeddings"][0].float()), "layers": records,
        "final_norm": tensor_stats(extra["final"][0].float()),
        "next_token": {"entropy_nats": float(_entropy(probs)), "top": [
            {"id": int(t), "prob": float(p), "logit": float(logits[t])} for p, t in zip(top.values, top.indices)]},
        "kv_cache_bytes": kv_bytes,
    }
    trace["_logprobs"] = logprobs.cpu()  # removed before writing JSON; used for the KL divergence
    return trace, hidden


def compare(base: Dict[str, Any], tuned: Dict[str, Any], base_hidden, tuned_hidden, top_moved: int = 5):
    """Base vs tuned: ``kl_tuned_base`` = KL(tuned || base) of the next-token distributions in nats,
    ``kl_base_tuned`` the reverse, and per traced layer the relative change ``||h_t - h_b|| / ||h_b||`` of the
    hidden state after the layer (Frobenius norm over ``[seq, hidden]``) and the cosine similarity of the last
    position; ``moved_most`` lists the ``top_moved`` layers with the largest relative change."""
    import torch

    lp_b, lp_t = base["_logprobs"], tuned["_logprobs"]
    kl_tb = float((lp_t.exp() * (lp_t - lp_b)).sum())
    kl_bt = float((lp_b.exp() * (lp_b - lp_t)).sum())
    layers = []
    for i in base_hidden:
        hb, ht = base_hidden[i].double(), tuned_hidden[i].double()
        layers.append({"layer": i, "relative_change": float((ht - hb).norm() / hb.norm().clamp_min(1e-30)),
                       "last_cosine": float(torch.nn.functional.cosine_similarity(ht[-1], hb[-1], dim=0))})
    moved = sorted(layers, key=lambda r: -r["relative_change"])[:top_moved]
    return {"kl_tuned_base": kl_tb, "kl_base_tuned": kl_bt, "layers": layers,
            "moved_most": [r["layer"] for r in moved]}


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

    from qwenft.model.inference import load_for_inference, prepare_inference
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
