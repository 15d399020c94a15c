"""Memory formulas: weights (16-bit, NF4), KV cache, and one LoRA training step, all in bytes.

The training-step accounting follows the method of Korthikanti et al. 2022 ("Reducing Activation Recomputation
in Large Transformer Models", section 4: count the tensors autograd saves for backward, per layer and token)
applied to what qwenft actually runs: transformers' Qwen2 layers (modeling_qwen2.py), peft LoRA layers
(tuners/lora/layer.py, bnb.py) and the QLoRA preparation in ``qwenft.model.attach_lora``. Three facts of that
stack drive most terms:

- The k-bit preparation (``qwenft.model.lora.prepare_kbit``) casts the norms and biases to fp32, and the embedding
  and lm_head too outside 16-bit autocast: under NF4 the residual stream is fp32 (the embedding's output cast).
- peft keeps LoRA weights in fp32 (``autocast_adapter_dtype=True``) and casts a layer's input to that dtype
  before dropout; bitsandbytes' ``Linear4bit`` casts its output back to its input's dtype and its autograd
  function saves only the packed weight (bitsandbytes/autograd/_functions.py, ``MatMul4Bit``).
- qwenft's loss (``QwenftTrainer.compute_loss``, :mod:`qwenft.train.loss`) projects only the
  supervised positions onto the vocabulary (``rows``: ``plan.supervised_fraction`` of the tokens), a chunk at a
  time, computing the hidden-state gradient as it goes: no ``[rows, vocab]`` logits tensor exists. The loss holds
  one chunk's logits (fp32, plus their 16-bit copy under autocast; Liger: one chunk in the compute dtype), the
  gathered hidden states, a 16-bit copy of an fp32 lm_head under autocast, and keeps the ``[rows, hidden]``
  gradient for backward.

The per-layer formula is checked against the bytes autograd really saves on the tiny model (tests/plan/test_plan.py)
and the whole peak against a measured CPU step (benchmarks/plan_accuracy.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

from qwenft.config import Config, LoraConfig
from qwenft.plan.arch import Architecture, parameter_counts, projection_shapes

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
NF4_BLOCKSIZE = 64  # bitsandbytes quantize_4bit default; QLoRA section 3
NESTED_BLOCKSIZE = 256  # double quantization of the absmax scales (bitsandbytes, compress_statistics=True)
OPTIM_8BIT_BLOCK = 256  # bitsandbytes block-wise 8-bit optimizer states (Dettmers et al. 2022, section 2.1)
OPTIM_8BIT_MIN_SIZE = 4096  # bitsandbytes keeps 32-bit states for tensors with fewer elements


@dataclass(frozen=True)
class TrainSetup:
    """The choices of a training run that change its memory, resolved as ``qwenft.train`` resolves them.

    ``device``: ``cuda`` or ``cpu``. ``amp``: autocast to a 16-bit dtype (``train.precision`` bf16/fp16; ``auto``
    is bf16 when the compute dtype is bfloat16 and bf16 is native on the device). ``model_bytes``: bytes of
    ``model.dtype``; ``compute_bytes``: bytes of ``quant.compute_dtype`` (what NF4 weights are dequantized to);
    a dtype ``auto`` is bfloat16 where bf16 is native, else float32. A CUDA device is assumed to have native
    bf16 (Ampere or newer); for a CPU the machine running the plan is asked (``qwenft.runtime.native_bf16``).
    ``optim``: the optimizer (:func:`qwenft.runtime.resolve_optim`: ``paged_adamw_8bit`` on CUDA, ``adamw_torch`` on
    a CPU and under FSDP / DeepSpeed); ``amp`` follows :func:`qwenft.runtime.resolve_precision`.
    ``supervised``: the share of tokens projected onto the vocabulary by the loss. ``kernels``: ``train.kernels``
    resolved (``auto`` is ``liger`` when planning for CUDA and liger-kernel is installed here, else ``none``).
    ``sharding``: what FSDP / ZeRO shard (:func:`qwenft.plan.sharding.sharding_mode`) over ``processes``
    (``plan.processes``); ``reduce_buffers`` x ``reduce_buffer_elements``: ZeRO-1/2's gradient staging buffers
    (:func:`qwenft.plan.sharding.zero_reduce_buffers`). ``objective``: ``train.objective``; for a preference one
    (:mod:`qwenft.plan.preference`) ``reference``: whether a step runs the reference forward (the objective has a
    reference and ``pref.precompute_ref`` is off), ``padding_free``: ``pref.padding_free`` resolved. ``packed``:
    ``data.packing`` (packed rows reach sdpa / eager with a block-diagonal mask even one row to a batch)."""

    device: str
    nf4: bool
    double_quant: bool
    model_bytes: int
    compute_bytes: int
    amp: bool
    attn: str
    lora: LoraConfig
    gradient_checkpointing: bool
    optim: str
    grad_accum: int = 1
    supervised: float = 1.0
    kernels: str = "none"
    sharding: str = "none"
    processes: int = 1
    reduce_buffers: int = 0
    reduce_buffer_elements: int = 0
    objective: str = "sft"
    reference: bool = False
    padding_free: bool = False
    packed: bool = False

    @classmethod
    def from_config(cls, config: Config, device: str = "cuda") -> "TrainSetup":
        """Resolve ``config`` for ``device`` (``cuda`` or ``cpu``) as ``qwenft.train`` and ``load_model`` do."""
        def native_bf16() -> bool:  # a CUDA device is taken as bf16-native; a CPU is asked
            from qwenft.runtime import native_bf16 as probe

            return device == "cuda" or probe("cpu")

        def resolve(name: str) -> str:
            return name if name != "auto" else ("bfloat16" if native_bf16() else "float32")

        nf4 = config.quant.method == "nf4"
        model_dtype = resolve(config.model.dtype)
        compute = resolve(config.quant.compute_dtype) if nf4 else model_dtype
        from qwenft.kernels import resolve_kernels
        from qwenft.runtime import resolve_optim, resolve_precision

        precision = resolve_precision(config.train.precision, compute, native_bf16())
        optim = resolve_optim(config.train.optim, config.dist.strategy, device == "cuda")
        kernels = config.train.kernels  # an explicit choice is planned as given, whatever this machine has
        kernels = resolve_kernels("auto", device == "cuda") if kernels == "auto" else kernels
        from qwenft.plan.sharding import sharding_mode, zero_reduce_buffers

        dcfg = config.dist
        mode = sharding_mode(dcfg.strategy, dcfg.fsdp, dcfg.deepspeed)
        buffers = zero_reduce_buffers(mode, dcfg.deepspeed) if config.plan.processes > 1 else {"count": 0, "elements": 0}
        from qwenft.config.train import padding_free, uses_reference_forward

        objective = config.train.objective  # as qwenft.train.preference runs it (make_preference_trainer)
        reference = uses_reference_forward(objective, config.pref.precompute_ref)
        return cls(device=device, nf4=nf4, double_quant=config.quant.double_quant,
                   model_bytes=DTYPE_BYTES[model_dtype], compute_bytes=DTYPE_BYTES[compute],
                   amp=precision in ("bf16", "fp16"), attn=config.model.attn_implementation, lora=config.lora,
                   gradient_checkpointing=config.train.gradient_checkpointing, optim=optim,
                   grad_accum=config.train.grad_accum, supervised=config.plan.supervised_fraction, kernels=kernels,
                   sharding=mode, processes=config.plan.processes, reduce_buffers=buffers["count"],
                   reduce_buffer_elements=buffers["elements"], objective=objective, reference=reference,
                   packed=config.data.packing,
                   padding_free=padding_free(objective, config.pref.padding_free, config.model.attn_implementation))


def nf4_bytes(numel: int, double_quant: bool = True, blocksize: int = NF4_BLOCKSIZE) -> int:
    """Bytes of one weight stored in NF4: packed 4-bit values plus the block scales.

    Two 4-bit values per byte, one absmax per ``blocksize`` (64) values. Without double quantization the absmax
    is fp32 (32/64 = 0.5 bit per weight); with it the absmaxes are themselves quantized to 8 bits in blocks of
    256 with one fp32 scale per block: 8/64 + 32/(64*256) = 0.127 bit per weight (Dettmers et al. 2023, "QLoRA",
    section 3, "Double Quantization"; bitsandbytes ``functional.quantize_4bit``). The per-layer code tables
    (< 1.1 KiB) are left out.
    """
    blocks = math.ceil(numel / blocksize)
    scales = blocks + 4 * math.ceil(blocks / NESTED_BLOCKSIZE) if double_quant else 4 * blocks
    return math.ceil(numel / 2) + scales


def weight_bytes(arch: Architecture, nf4: bool, double_quant: bool, dense_bytes: int,
                 head_bytes: Optional[int] = None, embed_bytes: Optional[int] = None) -> Dict[str, int]:
    """Weight bytes by component (the keys of :func:`parameter_counts`), and ``total``.

    With ``nf4`` the seven projections of every layer are NF4 (:func:`nf4_bytes`); embeddings, lm_head, norms
    and biases stay dense at ``dense_bytes`` each (bitsandbytes quantizes only ``nn.Linear`` layers and
    transformers keeps the output embedding out). Pass 2 for the weights as loaded in 16-bit, 4 for the weights
    during QLoRA training (the k-bit preparation casts the dense ones to fp32). ``head_bytes`` / ``embed_bytes``:
    an untied lm_head's / the embedding's bytes when they differ (:func:`training_weight_bytes`).
    """
    counts = parameter_counts(arch)
    L, shapes = arch.num_hidden_layers, projection_shapes(arch)
    out = {}
    for group, names in (("attention", ("q_proj", "k_proj", "v_proj", "o_proj")),
                         ("mlp", ("gate_proj", "up_proj", "down_proj"))):
        if nf4:
            out[group] = L * sum(nf4_bytes(shapes[n][0] * shapes[n][1], double_quant) for n in names)
        else:
            out[group] = dense_bytes * counts[group]
    for name in ("embeddings", "lm_head", "attention_bias", "norms"):
        out[name] = dense_bytes * counts[name]
    for name, size in (("lm_head", head_bytes), ("embeddings", embed_bytes)):
        out[name] = size * counts[name] if size is not None else out[name]
    out["total"] = sum(out.values())
    return out


def embedding_kept_16bit(setup: "TrainSetup") -> bool:
    """Whether QLoRA keeps the embedding 16-bit: NF4 under 16-bit autocast (``qwenft.model.lora.prepare_kbit``)."""
    return setup.nf4 and setup.amp and setup.compute_bytes == 2


def head_bytes_training(arch: Architecture, setup: "TrainSetup") -> int:
    """Bytes per lm_head weight during training: 16-bit under autocast when untied (``make_trainer``) or kept so
    with the embedding (:func:`embedding_kept_16bit`); else fp32 after k-bit preparation, ``model.dtype`` if 16-bit."""
    if (setup.amp and not arch.tie_word_embeddings) or embedding_kept_16bit(setup):
        return 2
    return 4 if setup.nf4 else setup.model_bytes


def training_weight_bytes(arch: Architecture, setup: "TrainSetup") -> Dict[str, int]:
    """Weight bytes by component during training (:func:`weight_bytes` with the training dtypes)."""
    return weight_bytes(arch, setup.nf4, setup.double_quant, 4 if setup.nf4 else setup.model_bytes,
                        head_bytes_training(arch, setup), 2 if embedding_kept_16bit(setup) else None)


def kv_cache_bytes(arch: Architecture, tokens: int, bytes_per_value: int = 2) -> int:
    """KV-cache bytes for ``tokens`` cached tokens: ``2 (K and V) * layers * kv_heads * head_dim * bytes``
    per token. Qwen2.5-7B in bf16: 2 * 28 * 4 * 128 * 2 = 57,344 bytes per token."""
    return 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * bytes_per_value * tokens


def _lora_tensors(arch: Architecture, lcfg: LoraConfig):
    """Element counts of every LoRA weight tensor (A and B of each target of each layer)."""
    shapes = projection_shapes(arch)
    per_layer = [n for name in lcfg.target_modules for n in (lcfg.r * shapes[name][0], shapes[name][1] * lcfg.r)]
    return per_layer * arch.num_hidden_layers


def optimizer_bytes(arch: Architecture, setup: TrainSetup) -> Dict[str, int]:
    """Optimizer state bytes (kept between steps) and the extra bytes of one ``step()``.

    AdamW keeps two fp32 moments per trainable parameter, 8 bytes (Loshchilov & Hutter 2019; torch.optim.AdamW);
    the LoRA weights are already fp32, so there is no master copy. torch's multi-tensor (foreach) step, the
    default on CUDA, makes one fp32 temporary per parameter for the denominator (``_multi_tensor_adamw``); the
    CPU loop makes one per tensor. The 8-bit optimizers (``adamw_8bit``, ``paged_adamw_8bit``) keep two uint8
    states plus an fp32 absmax per 256 values, and 32-bit states for tensors under 4096 elements (Dettmers et al.
    2022, "8-bit Optimizers via Block-wise Quantization"; bitsandbytes ``Optimizer8bit``); paged states live in
    CUDA unified memory. SGD without momentum keeps nothing.
    """
    tensors = _lora_tensors(arch, setup.lora)
    if setup.optim in ("adamw_8bit", "paged_adamw_8bit"):
        states = sum(2 * n + 8 * math.ceil(n / OPTIM_8BIT_BLOCK) if n >= OPTIM_8BIT_MIN_SIZE else 8 * n
                     for n in tensors)
        step = 4 * max(tensors)  # one dequantized fp32 state at a time
    elif setup.optim == "adamw_torch":
        states = 8 * sum(tensors)
        step = 4 * sum(tensors) if setup.device == "cuda" else 4 * max(tensors)
    else:  # sgd
        states, step = 0, 0
    return {"states": states, "step": step}


def activation_terms(arch: Architecture, setup: TrainSetup, batch: int, seq: int,
                     masked: Optional[bool] = None) -> Dict[str, int]:
    """Bytes autograd saves in one forward of ``batch x seq`` tokens, by term (no gradient checkpointing).

    Per token and layer (``H`` hidden, ``I`` intermediate, ``q``/``kv`` projection widths, ``r`` the LoRA rank):
    each RMSNorm saves its fp32 input and the rsqrt, ``4H + 4`` (Qwen2RMSNorm upcasts); the MLP saves the gate
    output, its SiLU and the up output, ``3 * I * p`` (``p`` the projection output bytes); SDPA saves q, k, v, its
    output and an fp32 log-sum-exp per head, with k/v expanded to all heads when a padding mask is passed
    (transformers ``use_gqa_in_sdpa``); eager attention also saves the ``[heads, seq, seq]`` probabilities. Each
    LoRA target with input width ``d`` saves the dropout mask (bool on CUDA, fp32 on a CPU), the input of A
    (bf16 under autocast, else fp32) and the input of B (``r`` values). Under autocast the bf16 copies of the fp32
    LoRA weights are saved too. The first layer saves less when the embedding output does not require grad (NF4
    with non-reentrant checkpointing, or no checkpointing). With ``kernels=liger`` the MLP saves the gate and up
    outputs only (``LigerSiLUMulFunction`` recomputes the SiLU), ``2 * I * p``.

    The loss (``rows`` = ``plan.supervised_fraction`` of the ``batch * (seq - 1)`` predicted positions) saves the
    supervised-position mask (bool) and the ``[rows, H]`` hidden-state gradient in the projection dtype ``c``
    (bf16 under autocast); while it runs it also holds the gathered hidden states and their ``c`` copy, a ``c``
    copy of an fp32 lm_head, and one chunk's logits: ``chunk * V * (4 + c)`` bytes (fp32 logits, softmax in place,
    plus the 16-bit product or gradient when ``c`` is 2; ``chunk`` from :func:`qwenft.kernels.chunk_tokens`), or
    with Liger ``chunk * V * c`` (``qwenft.kernels.liger_chunk_tokens``). ``masked``: whether a mask reaches
    attention (default ``batch > 1`` or ``setup.packed``: right padding, or packed rows' block-diagonal mask).

    Returns:
        ``per_token_layer`` (bytes per token per layer), ``layers`` (all layers, batch x seq),
        ``layer_constants`` (bytes per layer independent of tokens), ``final`` (final norm, RoPE tables, the
        loss's position mask), ``loss_saved`` (the hidden-state gradient), ``loss_transient`` (alive only while the
        loss runs: gathered hidden states, one chunk's logits, the lm_head copy), ``checkpoints`` (layer inputs kept
        with gradient checkpointing), ``backward_transient`` and ``dequant_transient``.
    """
    H, I, L, V = arch.hidden_size, arch.intermediate_size, arch.num_hidden_layers, arch.vocab_size
    n = batch * seq
    lcfg = setup.lora
    targets, r = set(lcfg.target_modules), lcfg.r
    res_b = 4 if setup.nf4 else setup.model_bytes  # residual stream (fp32 embeddings, or their output cast, under NF4)
    proj_b = 2 if (setup.amp and not setup.nf4) else res_b  # Linear4bit casts back to its input dtype
    attn_b = 2 if setup.amp else proj_b
    mask_b = 1 if setup.device == "cuda" else 4
    lora_in_b = 2 if setup.amp else 4
    dropout = lcfg.lora_dropout > 0

    def lora(group, width, x_bytes, shared_elsewhere=False):
        chosen = [name for name in group if name in targets]
        if not chosen:
            return 0
        if dropout:
            per = (mask_b + lora_in_b) * width
        elif setup.amp or x_bytes != 4:
            per = lora_in_b * width  # each module casts the input itself
        else:  # one fp32 input shared by the group (o_proj's is the attention output SDPA saved already)
            return (0 if shared_elsewhere else 4 * width) + lora_in_b * r * len(chosen)
        return len(chosen) * (per + lora_in_b * r)

    padded = (batch > 1 or setup.packed) if masked is None else masked  # a mask: padding, or packed sequences
    if setup.attn == "eager":  # q, repeated k and v, fp32 probabilities (+ their 16-bit copy for the matmul)
        attention = attn_b * 3 * arch.q_dim + arch.num_attention_heads * seq * (4 + (attn_b if attn_b != 4 else 0))
    else:  # a padding mask turns GQA off (k/v repeated) and is converted to a float mask per call, then saved
        kv_saved = arch.q_dim if padded and setup.attn == "sdpa" else arch.kv_dim
        attention = attn_b * (2 * arch.q_dim + 2 * kv_saved) + 4 * arch.num_attention_heads
        attention += attn_b * seq if padded and setup.attn == "sdpa" else 0
    mlp_saved = (2 if setup.kernels == "liger" else 3) * I * proj_b
    per_token = (2 * (4 * H + 4) + attention + mlp_saved
                 + lora(("q_proj", "k_proj", "v_proj"), H, res_b)
                 + lora(("o_proj",), arch.q_dim, attn_b, shared_elsewhere=setup.attn != "eager")
                 + lora(("gate_proj", "up_proj"), H, res_b) + lora(("down_proj",), I, proj_b))
    shapes = projection_shapes(arch)
    constants = 0
    if setup.amp:
        constants += 2 * sum(r * (a + b) for name, (a, b) in shapes.items() if name in targets)
        if not setup.nf4 and setup.model_bytes != 2:
            constants += 2 * sum(a * b for a, b in shapes.values())  # bf16 copies of fp32 base weights
    # The first layer saves nothing for its input's gradient when the embedding output does not require grad
    # (attach_lora enables input grads only for a 16-bit base with checkpointing).
    first_saving = 0
    if setup.nf4 or not setup.gradient_checkpointing:
        qkv = [name for name in ("q_proj", "k_proj", "v_proj") if name in targets]
        first_saving = n * ((4 * H + 4) + (mask_b * H * len(qkv) if dropout else 0))
        if setup.amp:
            first_saving += sum(2 * r * H + (2 * H * shapes[name][1] if not setup.nf4 and setup.model_bytes != 2
                                             else 0) for name in qkv)
    head_b = head_bytes_training(arch, setup)
    rows = math.ceil(setup.supervised * batch * (seq - 1))
    loss_b = 2 if setup.amp else res_b  # the projection's dtype: autocast's, else the final norm's output dtype
    if setup.kernels == "liger":
        from qwenft.kernels import liger_chunk_tokens

        chunk_logits = liger_chunk_tokens(rows, V, H) * V * loss_b
    else:
        from qwenft.kernels import chunk_tokens

        chunk_logits = min(rows, chunk_tokens(V)) * V * (4 + (loss_b if loss_b != 4 else 0))
    gathered = rows * H * (res_b + (loss_b if loss_b != res_b else 0))
    return {
        "per_token_layer": per_token,
        "layers": n * L * per_token - first_saving,
        "layer_constants": constants,
        # final norm, RoPE cos/sin (shared by the layers) and the loss's bool mask of supervised positions
        "final": n * (4 * H + 4) + 2 * seq * arch.head_dim * res_b + batch * (seq - 1),
        "loss_saved": rows * H * loss_b,
        "loss_transient": gathered + chunk_logits + (2 * V * H if setup.amp and head_b != 2 else 0),
        "checkpoints": n * L * res_b * H,
        "backward_transient": n * (2 * res_b * H + 3 * proj_b * I),
        "dequant_transient": setup.compute_bytes * max(a * b for a, b in shapes.values()) if setup.nf4 else 0,
    }


def training_memory(arch: Architecture, setup: TrainSetup, batch: int, seq: int,
                    steady: bool = True, terms: Optional[Dict[str, int]] = None) -> Dict[str, int]:
    """Peak bytes of one LoRA training step of ``batch x seq`` tokens, with its parts.

    ``peak = static + max(loss phase, layer-backward phase, optimizer step)``, where static is the weights during
    training plus the fp32 LoRA weights (plus the optimizer states from the second step on, ``steady=True``, and
    the gradients when ``grad_accum > 1``). The loss phase holds every saved activation (or, with gradient
    checkpointing, every layer input) plus the loss's own bytes (``loss_saved + loss_transient`` of
    :func:`activation_terms`: no logits tensor, one chunk at a time); the layer phase holds one layer's activations
    being recomputed (checkpointing), the gradient temporaries, a dequantized NF4 weight and the LoRA gradients so
    far; the step holds gradients, states and the step's temporaries.

    Per process: under FSDP / ZeRO (``setup.sharding`` over ``setup.processes``) the static rows are one process's
    shards (:func:`qwenft.plan.sharding.shard`) and the loss and layer phases add the weights gathered at that
    moment (:func:`qwenft.plan.sharding.gathered`); activations are never divided (each process has its own
    micro-batch of ``batch`` rows). ``terms``: :func:`activation_terms`' terms computed by the caller (a preference
    step's, :func:`qwenft.plan.preference.preference_terms`).

    Returns:
        ``weights``, ``lora_weights``, ``gradients``, ``optimizer_states`` (this process's shards),
        ``gathered_weights`` (the most unsharded weight bytes held besides the shards), ``reduce_buffers`` (ZeRO-1/2
        gradient staging), ``saved_activations`` (everything
        autograd saves without checkpointing), ``held_at_loss`` (activations alive when the loss runs: all of
        them, or the layer checkpoints), ``loss`` (the loss's own bytes), ``loss_phase``, ``layer_phase``,
        ``step_phase``, ``peak``.
    """
    from qwenft.plan.arch import lora_parameter_count
    from qwenft.plan.sharding import gathered, shard

    terms = terms or activation_terms(arch, setup, batch, seq)
    L = arch.num_hidden_layers
    by_part = training_weight_bytes(arch, setup)
    n_lora = lora_parameter_count(arch, setup.lora)
    optim = optimizer_bytes(arch, setup)
    own = shard(setup.sharding, setup.processes, by_part["total"], 4 * n_lora, 4 * n_lora, optim["states"],
                optim["step"])
    weights, lora_w, grads = own["weights"], own["lora_weights"], own["gradients"]
    layer_grads = 4 * n_lora // L  # one layer's LoRA gradients, whole until FSDP / ZeRO reduce-scatters them
    # outside the decoder layers: embeddings, lm_head and the final norm (one of the 2L + 1 norms)
    final_norm = by_part["norms"] // (2 * L + 1)
    outside = by_part["embeddings"] + by_part["lm_head"] + final_norm
    head = (by_part["lm_head"] if by_part["lm_head"] else by_part["embeddings"]) + final_norm  # FSDP's tail group
    layer = (by_part["total"] - outside + 4 * n_lora) // L
    gather = gathered(setup.sharding, setup.processes, layer, head, by_part["total"] + 4 * n_lora,
                      gloo=setup.device == "cpu")
    consts = L * terms["layer_constants"]
    shared = terms["final"]
    loss = terms["loss_saved"] + terms["loss_transient"]
    transient = terms["backward_transient"] + terms["dequant_transient"]
    one_layer = batch * seq * terms["per_token_layer"] + terms["layer_constants"]
    if setup.gradient_checkpointing:
        held_at_loss = terms["checkpoints"] + shared
        loss_phase = terms["checkpoints"] + shared + loss
        ckpt, per_ckpt = terms["checkpoints"], terms["checkpoints"] // L
        layer_phase = shared + one_layer + transient + max(ckpt + layer_grads, per_ckpt + grads)
    else:
        held_at_loss = terms["layers"] + consts + shared
        loss_phase = terms["layers"] + consts + shared + loss
        layer_phase = terms["layers"] + consts + shared + transient + layer_grads
    loss_phase = max(loss_phase + gather["loss"], loss_phase - loss + gather["at_gather"])
    layer_phase += gather["layers"]
    held = (own["optimizer_states"] if steady else 0) + (grads if setup.grad_accum > 1 else 0)
    step_phase = grads + own["optimizer_states"] + own["step"]
    # ZeRO-1/2 staging buffers: allocated whole on CUDA; on a CPU only the pages written (the LoRA gradients) count
    elements = setup.reduce_buffer_elements
    buffers = 4 * setup.reduce_buffers * (min(elements, n_lora) if setup.device == "cpu" else elements)
    static = weights + lora_w + buffers
    peak = static + max(held + max(loss_phase, layer_phase), step_phase)
    return {"weights": weights, "lora_weights": lora_w, "gradients": grads, "optimizer_states": own["optimizer_states"],
            "gathered_weights": max(gather.values()), "reduce_buffers": buffers,
            "saved_activations": terms["layers"] + consts + terms["final"] + terms["loss_saved"],
            "held_at_loss": held_at_loss, "loss": loss,
            "loss_phase": loss_phase, "layer_phase": layer_phase, "step_phase": step_phase, "peak": peak}
