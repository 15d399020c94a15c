"""qwenft: fine-tune Qwen2.5 chat models with LoRA / QLoRA and show, with evidence, what changed."""

from qwenft.logfilter import quiet_known_warnings

__version__ = "0.1.0"

quiet_known_warnings()  # before anything imports bitsandbytes
