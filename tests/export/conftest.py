"""The export room's helpers: adapters made through qwenft's own LoRA path, merge configs, and the one merge of the
real 0.5B that the slow export tests share."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qwenft.model import attach_lora, load_model, save_adapter_meta
from tests.conftest import compose_config


def make_adapter(adapter_dir: Path, *overrides: str, std: float = 0.05, model_args=("model=tiny-random",)):
    """An adapter through attach_lora with seeded random LoRA B (B is zero at init, a no-op adapter)."""
    config = compose_config(*model_args, "lora.lora_dropout=0.0", *overrides)
    model, _ = load_model(config, device="cpu")
    torch.manual_seed(0)  # LoRA A is drawn from the global generator
    peft_model = attach_lora(model, config.lora, gradient_checkpointing=False)
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    peft_model.save_pretrained(adapter_dir)
    save_adapter_meta(adapter_dir, config)
    return config


def merge_config(adapter: Path, out: Path, *overrides: str):
    return compose_config(f"adapter={adapter}", f"out={out}", *overrides, command="merge")


@pytest.fixture(scope="session")
def embedded_merge(tmp_path_factory, embedded_dir) -> Path:
    """One merge of the 0.5B with a seeded random r=8 adapter, shared by the slow export tests of test_export,
    test_gguf_check and test_quantize (one xdist group, so one worker builds it; each merge of the 0.5B is 1-2
    minutes on 2 cores): float32 (the strict check), and where llama-cpp-python is installed also an f16 GGUF run by
    llama.cpp and a Q4_K_M made from it with its cost rows. Returns the merge's directory; its adapter is
    ``<dir>/../run/adapter``."""
    import importlib.util

    from qwenft.export.merge import merge

    root = tmp_path_factory.mktemp("embedded_merge")
    adapter = root / "run" / "adapter"
    make_adapter(adapter, "quant=none", "lora.r=8", "lora.lora_alpha=16", std=0.01, model_args=())
    gguf = ("merge.gguf=f16", "merge.verify_gguf=true", "merge.quantize=[gguf-q4_k_m]",
            "eval.max_new_tokens=8", "eval.max_eval_prompts=3") if importlib.util.find_spec("llama_cpp") else ()
    merge(merge_config(adapter, root / "merged", "merge.dtype=float32", *gguf), device="cpu")
    return root / "merged"
