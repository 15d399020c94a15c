"""qwenft: fine-tune Qwen2.5 chat models with LoRA / QLoRA and show, with evidence, what changed."""

__version__ = "0.1.0"
