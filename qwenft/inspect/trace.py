"""The per-layer trace of one forward pass over a prompt (what ``python -m qwenft inspect`` prints).

For each traced decoder layer: statistics of the hidden state after attention (residual added) and after the MLP,
the growth of the residual stream's per-token norm, the entropy of each head's attention for the last token and the
positions it attends most, and the time the layer took. Then the final norm and the next-token distribution at the
last position; :func:`compare` sets the base's trace beside the tuned model's (KL divergence, layers that moved most).

The pass uses eager attention (SDPA does not return attention probabilities) and forward hooks on the decoder layers
(``Qwen2DecoderLayer``), their ``self_attn`` and their ``post_attention_layernorm``, whose input is exactly the
hidden state after attention plus the residual.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from qwenft.config import ConfigError, QwenftError




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
