"""Folding a LoRA adapter into the 16-bit base weights in memory, for fast inference (nothing is written).

Base and tuned are evaluated in one process. Running the tuned side as adapter-on-base costs, per projection and
token, two extra small matmuls and the Python of peft's layer; folding computes ``W + s * B @ A`` once per
projection (peft's own merge arithmetic, the one ``qwenft merge`` exports and verifies) so the tuned side runs
at the base's speed. :func:`unwrap` first turns the ``PeftModel`` into the plain transformers model (the base
side runs on it with no adapter), keeping the LoRA layers aside; :meth:`LoraFold.fold_` then adds each delta in
place, into the same weight storage, so a decode step compiled for the base (``torch.compile`` with CUDA graphs,
which keeps the weights' addresses) serves the tuned side without compiling again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

log = logging.getLogger(__name__)


@dataclass
class LoraFold:
    """The LoRA layers of an unwrapped ``PeftModel``, ready to fold into their (now plain) base layers.

    Attributes:
        layers: peft ``LoraLayer`` modules; each still holds its ``base_layer``, which is now part of the plain model.
        folded: whether :meth:`fold_` ran (the plain model's weights are then the tuned ones).
    """

    layers: List[Any] = field(default_factory=list)
    folded: bool = False

    def fold_(self) -> int:
        """Add every layer's delta ``s * B @ A`` to its base weight, in place: the arithmetic of peft's plain LoRA
        merge (``LoraLayer.merge``, ``weight += get_delta_weight``; ``lora_bias``: ``bias += s * b``), with the
        product taken in fp32 and added into the weight's own storage, so compiled graphs and CUDA graphs stay
        valid. (peft's 4-bit LoRA classes re-quantize in ``merge``; after dequantization the base is a plain
        ``nn.Linear``, so the delta is added here directly.)

        Returns:
            The number of projections changed.

        Raises:
            RuntimeError: called twice (the deltas would be added again).
        """
        import torch

        if self.folded:
            raise RuntimeError("the LoRA adapter is already folded into the base weights")
        with torch.no_grad():
            for layer in self.layers:
                base = layer.get_base_layer()
                for name in layer.active_adapters:
                    if name not in layer.lora_A:
                        continue
                    a, b = layer.lora_A[name].weight.float(), layer.lora_B[name].weight.float()
                    base.weight.add_((b @ a * layer.scaling[name]).to(base.weight.dtype))
                    if layer.lora_bias.get(name):
                        base.bias.add_((layer.lora_B[name].bias.float() * layer.scaling[name]).to(base.bias.dtype))
        self.folded = True
        return len(self.layers)


def fold_blocker(model, dequantizing: bool = False) -> Optional[str]:
    """Why the adapter of ``model`` cannot be folded into a 16-bit base, or None when it can.

    ``dequantizing``: the 4-bit base layers are about to be dequantized, so they count as 16-bit ``nn.Linear``.

    Folding needs every adapted layer to be a plain ``nn.Linear`` under a peft LoRA layer (a 4-bit base must be
    dequantized first), plain LoRA (no variant such as DoRA, whose merge rescales the weight) and nothing else
    trained: ``modules_to_save`` copies and trainable-token layers are not LoRA deltas and would be lost by
    unwrapping.
    """
    import torch
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    if not hasattr(model, "peft_config"):
        return "the model has no adapter"
    for name, module in model.named_modules():
        if type(module).__name__ == "ModulesToSaveWrapper":
            return f"{name} is a modules_to_save copy, not a LoRA delta"
        if isinstance(module, BaseTunerLayer) and not isinstance(module, LoraLayer):
            return f"{name} is a {type(module).__name__}, not a LoRA layer"
        if isinstance(module, LoraLayer):
            if module.lora_variant:
                return f"{name} uses a LoRA variant ({', '.join(type(v).__name__ for v in module.lora_variant.values())})"
            if getattr(module, "fan_in_fan_out", False):
                return f"{name} stores its weight transposed (fan_in_fan_out)"
            base = module.get_base_layer()
            if dequantizing and type(base).__module__.startswith("bitsandbytes"):
                continue
            if type(base) is not torch.nn.Linear:
                return f"{name} wraps a {type(base).__name__} (fold needs a 16-bit nn.Linear: dequantize first)"
    return None


def unwrap(model) -> Tuple[Any, LoraFold]:
    """The plain transformers model under a ``PeftModel``, and its LoRA layers kept for :meth:`LoraFold.fold_`.

    The returned model holds the base weights only (the base side of an evaluation); ``model`` must not be used
    afterwards.

    Raises:
        ValueError: the adapter cannot be folded (:func:`fold_blocker` says why).
    """
    from peft.tuners.lora import LoraLayer

    reason = fold_blocker(model)
    if reason is not None:
        raise ValueError(f"cannot fold the adapter: {reason}")
    layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
    plain = model.unload()  # peft: each LoRA layer replaced by its base layer, nothing merged
    plain.eval()
    return plain, LoraFold(layers=layers)
