"""Which LoRA adapters vLLM can serve unmerged (``vllm serve BASE --enable-lora --lora-modules NAME=ADAPTER``), and
the ``--max-lora-rank`` that needs.

One rule, :func:`vllm_support`, read by ``qwenft merge`` (its closing lines and the model card), by ``qwenft eval
adapter=...`` (one warning, :func:`vllm_warning`) and by ``tests/serve/test_serving.py``, which checks it against the
table in docs/serve.md ("vLLM, llama.cpp and Ollama"). Each fact names where in vLLM it was read (vLLM source and
docs, releases 0.10-0.22).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import List, Optional

# vllm/config/lora.py: ``MaxLoRARanks = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]`` is the type of
# ``LoRAConfig.max_lora_rank`` (default 16; docs.vllm.ai/en/v0.14.0/api/vllm/config/lora/), so ``--max-lora-rank``
# takes only these; an adapter whose r exceeds it is refused (vllm/lora/peft_helper.py ``validate_legal``:
# "LoRA rank {r} is greater than max_lora_rank").
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# vllm/model_executor/models/qwen2.py: ``Qwen2ForCausalLM.packed_modules_mapping`` packs q/k/v_proj into qkv_proj and
# gate/up_proj into gate_up_proj; with o_proj and down_proj these are its LoRA modules (older releases list them as
# ``supported_lora_modules``, ``embedding_modules = {}``). embed_tokens / lm_head are not registered for Qwen2: such an
# adapter fails with "expected target modules in [...]" (vllm-project/vllm PR #33234, open, would add them).
VLLM_QWEN2_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# The adapter_config.json keys the rule reads; docs/serve.md's table lists exactly these (tests/serve/test_serving.py).
VLLM_CHECKED_KEYS = ("peft_type", "r", "target_modules", "use_dora", "modules_to_save", "bias", "lora_bias",
                     "rank_pattern", "alpha_pattern", "trainable_token_indices")


def vllm_max_lora_rank(r: int) -> Optional[int]:
    """The smallest value vLLM accepts for ``--max-lora-rank`` that is >= ``r`` (e.g. 16 -> 16, 24 -> 32, 257 ->
    320); None above 512, which vLLM cannot serve."""
    return next((rank for rank in VLLM_MAX_LORA_RANKS if rank >= r), None)


def vllm_support(adapter_config: dict) -> List[str]:
    """Why vLLM cannot serve this adapter unmerged on a Qwen2.5 base: one short reason per setting, naming the key;
    empty when it can.

    Args:
        adapter_config: The adapter's ``adapter_config.json`` as written by peft's ``save_pretrained``.
    """
    reasons = []
    peft_type = adapter_config.get("peft_type", "LORA")
    if peft_type != "LORA":  # vllm/lora/peft_helper.py: PEFTHelper reads LoRA configs only
        reasons.append(f"peft_type={peft_type}: vLLM loads LoRA adapters only")
    r = adapter_config.get("r")
    if isinstance(r, int) and vllm_max_lora_rank(r) is None:
        reasons.append(f"r={r}: vLLM's --max-lora-rank is at most {VLLM_MAX_LORA_RANKS[-1]}")
    targets = adapter_config.get("target_modules") or []
    if isinstance(targets, str):  # a regex (peft): only the modules vLLM never has are detectable
        other = [name for name in ("embed_tokens", "lm_head") if name in targets]
    else:
        other = sorted(set(targets) - set(VLLM_QWEN2_TARGETS))
    if other:
        reasons.append(f"target_modules {', '.join(other)}: vLLM's Qwen2 takes LoRA on "
                       f"{', '.join(VLLM_QWEN2_TARGETS)} only")
    # vllm/lora/peft_helper.py ``_validate_features``: "vLLM does not yet support DoRA." (vllm-project/vllm#10849 open)
    if adapter_config.get("use_dora"):
        reasons.append("use_dora=true: vLLM does not support DoRA")
    # Same function: "vLLM only supports modules_to_save being None."
    if adapter_config.get("modules_to_save"):
        reasons.append(f"modules_to_save={adapter_config['modules_to_save']}: vLLM loads no fully trained modules")
    # PEFTHelper declares ``bias: Literal["none"]`` since LoRA bias support was removed (vllm-project/vllm PR #25807).
    if adapter_config.get("bias", "none") != "none":
        reasons.append(f"bias={adapter_config['bias']!r}: vLLM serves bias='none' only")
    # peft's lora_bias saves ``lora_B.bias``; vllm/lora/utils.py ``parse_fine_tuned_lora_name`` accepts only
    # ``lora_A/lora_B.weight`` and ``lora_embedding_A/B`` ("... is unsupported LoRA weight"). The same for
    # trainable_token_indices, saved as ``trainable_tokens_delta``.
    if adapter_config.get("lora_bias"):
        reasons.append("lora_bias=true: vLLM loads no LoRA bias weights")
    if adapter_config.get("trainable_token_indices"):
        reasons.append("trainable_token_indices set: vLLM loads no trainable-token weights")
    # PEFTHelper.from_dict keeps only its own fields (r, lora_alpha, use_rslora, ...): every module is scaled by
    # lora_alpha / r, so per-module ranks or alphas would be served with the wrong scale.
    for key in ("rank_pattern", "alpha_pattern"):
        if adapter_config.get(key):
            reasons.append(f"{key} set: vLLM applies one r and lora_alpha to every module")
    return reasons


def read_adapter_config(adapter_dir) -> dict:
    """The adapter's ``adapter_config.json`` as a dict; {} when it is missing or unreadable (the loaders say so)."""
    try:
        config = json.loads((Path(adapter_dir).expanduser() / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def vllm_warning(adapter_dir, reasons: List[str], merged_dir=None) -> str:
    """The one line that names an adapter vLLM cannot serve unmerged, why, and what to do instead.

    Args:
        adapter_dir: The adapter directory, as the user gave it.
        reasons: :func:`vllm_support` of its config (non-empty).
        merged_dir: The directory ``qwenft merge`` just wrote, if any (then: serve that).
    """
    adapter = shlex.quote(str(adapter_dir))
    if merged_dir is not None:
        todo = f"serve the merged model instead: vllm serve {shlex.quote(str(merged_dir))}"
    else:
        todo = f"merge it (python -m qwenft merge adapter={adapter} out=DIR) and serve that: vllm serve DIR"
    return f"vLLM cannot serve adapter {adapter} unmerged ({'; '.join(reasons)}): {todo}"
