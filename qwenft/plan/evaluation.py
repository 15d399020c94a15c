"""Memory of the evaluation (after ``train``, and ``qwenft eval``), in bytes: the planner's figure for the peak that
metrics.json's ``memory.eval`` measures.

What the evaluation holds (:mod:`qwenft.generation.engine`, :mod:`qwenft.evaluate`):

- weights: every floating weight in the compute dtype ``c`` (``quant.compute_dtype`` for a 4-bit base, else
  ``model.dtype``), after training as after a fresh load (``prepare_for_decoding`` casts them); a 4-bit base is
  dequantized to ``c`` on a CPU, and on CUDA when the dense weights fit (else it stays NF4). LoRA weights in ``c``.
- the largest of three phases, one at a time:
  generation (``eval.batch_size`` rows: their KV cache of prompt + ``max_new_tokens`` tokens in ``c``, the
  prefill's forward transient, the last position's logits); perplexity (``eval.batch_size`` windows of
  ``max(eval.ppl_window, data.max_seq_len)`` tokens through the model body, the gathered hidden states of the scored
  positions and one chunk's logits, :func:`qwenft.kernels.target_logprobs`: no ``[batch, seq, vocab]`` tensor);
  benchmarks when ``eval.benchmarks`` is set (``eval.batch_size`` rows of up to :data:`BENCH_TOKENS` tokens on the
  KV cache of a shared few-shot prefix, copied per row, only the last positions projected).
- on a CPU the process itself (:data:`CPU_BASELINE_BYTES`): the measured peak is the resident set, which holds the
  Python interpreter, torch's and the other libraries' code and data, and the tokenizer. On CUDA the measured
  figure is ``torch.cuda.max_memory_allocated`` (tensors only), so no baseline is added.

The prompt length is not known before the data is read: the plan bounds it by ``data.max_seq_len``.
"""

from __future__ import annotations

from typing import Dict

from qwenft.config import Config
from qwenft.plan.arch import Architecture, lora_parameter_count, projection_shapes
from qwenft.plan.memory import kv_cache_bytes, weight_bytes

# Resident set of a `qwenft eval` process on a CPU before its model loads: measured 626 MiB, rounded to 640 MiB
# (docs/performance.md, "Memory on a CPU").
CPU_BASELINE_BYTES = 640 << 20
BENCH_TOKENS = 1024  # a 5-shot benchmark prompt (MMLU, C-Eval, GSM8K) fits in about this many tokens
CPU_BATCH = 8  # eval.batch_size=auto on a CPU (read by qwenft.generation.engine; decode there is compute bound)
MARGIN_BYTES = 1 << 30  # CUDA context, allocator rounding and fragmentation, cuBLAS workspaces: kept free


def forward_bytes(arch: Architecture, batch: int, seq: int, c: int, lora_mlp: bool = False) -> int:
    """Bytes alive at once in one no-grad forward of ``batch x seq`` tokens through the model body (16-bit or fp32
    activations of ``c`` bytes), beside the weights and the KV cache.

    Per token (``H`` hidden, ``I`` intermediate, ``q`` the query width): the residual stream and the normalised
    input, ``2 H c``, plus the largest of a layer's parts: the MLP's gate activation, up output and their product
    ``3 I c`` (``4 I c`` when unfolded LoRA adds its delta to gate or up: base output, delta, scaled delta, sum;
    peft ``tuners/lora/layer.py``); attention's q, k and v repeated to all heads, RoPE's copies and the output,
    ``6 q c``; the RMSNorm's fp32 upcasts, ``H (8 + c)`` (``Qwen2RMSNorm``). Plus the ``[batch, seq, seq]`` bool
    attention mask.
    """
    H, I = arch.hidden_size, arch.intermediate_size
    per_token = 2 * H * c + max((4 if lora_mlp else 3) * I * c, 6 * arch.q_dim * c, H * (8 + c))
    return batch * seq * per_token + batch * seq * seq


def chunk_logits_bytes(arch: Architecture, rows: int, c: int) -> int:
    """One chunk of :func:`qwenft.kernels.target_logprobs`: ``[chunk, vocab]`` fp32 logits (log-softmax in place)
    plus the ``c``-byte product while it is upcast (none when ``c`` is 4)."""
    from qwenft.kernels import chunk_tokens

    return min(rows, chunk_tokens(arch.vocab_size)) * arch.vocab_size * (4 + (c if c != 4 else 0))


def _max_new_tokens(config: Config) -> int:
    """``eval.max_new_tokens``, else the ``eval.generate`` preset's (composed into ``generate_presets``), else 256."""
    if config.eval.max_new_tokens is not None:
        return config.eval.max_new_tokens
    preset = config.generate_presets.get(config.eval.generate)
    return preset.max_new_tokens if preset is not None and preset.max_new_tokens else 256


def evaluation_memory(arch: Architecture, config: Config, device: str, compute_bytes: int, model_bytes: int,
                      budget: int) -> Dict[str, object]:
    """Peak bytes of the evaluation of ``config`` on ``device`` (``cuda`` / ``cpu``), with its parts.

    ``peak = baseline + weights + lora_weights + max(generation, perplexity, benchmarks)`` (module docstring).

    Args:
        compute_bytes: bytes of ``quant.compute_dtype`` resolved; ``model_bytes``: of ``model.dtype``.
        budget: usable GPU bytes (decides whether a 4-bit base is dequantized on CUDA, as the engine decides from
            the free memory); unused on a CPU.

    Returns:
        ``weights`` (as evaluation holds them), ``dequantized`` (bool), ``lora_weights``, ``baseline``,
        ``generation``, ``perplexity``, ``benchmarks`` (0 without ``eval.benchmarks``), ``batch_size``,
        ``tokens`` (``{prompt, new, window}``), ``peak`` and ``baseline_note``.
    """
    nf4 = config.quant.method == "nf4"
    c = compute_bytes if nf4 else model_bytes
    rows = CPU_BATCH if config.eval.batch_size == "auto" else int(config.eval.batch_size)
    prompt, new = config.data.max_seq_len, _max_new_tokens(config)
    window = max(config.eval.ppl_window if config.eval.ppl_sources else 0, config.data.max_seq_len)
    cpu = device != "cuda"
    lora = config.lora
    folded = not cpu  # CUDA folds the LoRA delta into 16-bit weights (when dequantized: settled below)
    lora_mlp = bool({"gate_proj", "up_proj"} & set(lora.target_modules))
    dense = weight_bytes(arch, False, False, c)
    if not nf4:
        dequantize, weights = False, dense
    else:
        want = config.quant.dequantize_for_inference
        packed = weight_bytes(arch, True, config.quant.double_quant, c)
        reserve = forward_bytes(arch, 1, prompt, c) + kv_cache_bytes(arch, prompt + new, c) + MARGIN_BYTES
        projections = dense["attention"] + dense["mlp"]
        dequantize = want if want is not None else (cpu or packed["total"] + projections + reserve <= budget)
        weights = dense if dequantize else packed
        folded = folded and dequantize
    lora_weights = c * lora_parameter_count(arch, lora)
    unfolded = lora_mlp and not folded
    generation = (kv_cache_bytes(arch, rows * (prompt + new), c) + forward_bytes(arch, rows, prompt, c, unfolded)
                  + rows * 3 * 4 * arch.vocab_size)
    perplexity = (forward_bytes(arch, rows, window, c, unfolded) + rows * window * arch.hidden_size * c
                  + chunk_logits_bytes(arch, rows * window, c))
    benchmarks = 0
    if getattr(config.eval, "benchmarks", None):
        benchmarks = (kv_cache_bytes(arch, (rows + 1) * BENCH_TOKENS, c)
                      + forward_bytes(arch, rows, BENCH_TOKENS, c, unfolded) + chunk_logits_bytes(arch, rows, c))
    if not dequantize and nf4:  # bitsandbytes dequantizes one 4-bit weight per projection call
        largest = max(a * b for a, b in projection_shapes(arch).values())
        generation, perplexity = generation + c * largest, perplexity + c * largest
        benchmarks = benchmarks + c * largest if benchmarks else 0
    baseline = CPU_BASELINE_BYTES if cpu else 0
    peak = baseline + weights["total"] + lora_weights + max(generation, perplexity, benchmarks)
    return {"device": "cuda" if not cpu else "cpu", "dtype_bytes": c, "dequantized": bool(dequantize and nf4),
            "weights": weights["total"], "lora_weights": lora_weights, "baseline": baseline,
            "baseline_note": ("a CPU process's resident set before the model loads (measured: Python, torch, "
                              "transformers, peft, bitsandbytes, the tokenizer)" if cpu else
                              "none: CUDA's figure is torch.cuda.max_memory_allocated (tensors only)"),
            "batch_size": rows, "tokens": {"prompt": prompt, "new": new, "window": window},
            "generation": generation, "perplexity": perplexity, "benchmarks": benchmarks, "peak": peak}
