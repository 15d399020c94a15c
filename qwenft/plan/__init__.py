"""The memory and parameter planner behind ``python -m qwenft plan`` (no weights are loaded).

- :mod:`qwenft.plan.arch`: architecture numbers from a config.json, parameter and LoRA counts.
- :mod:`qwenft.plan.memory`: weight, KV-cache and training-step byte formulas.
- :mod:`qwenft.plan.evaluation`: the evaluation's peak (weights as evaluation holds them, KV cache, chunked scoring).
- :mod:`qwenft.plan.preference`: a preference step (2 sequences per pair, the reference forward, the chunked
  log-probs); :func:`~qwenft.plan.preference.step_memory` plans either kind of step.
- :mod:`qwenft.plan.command`: the plan as a dict, its tables, the command.

A command room: it may import :mod:`qwenft.kernels`, :mod:`qwenft.runtime`, :mod:`qwenft.model.rope`,
:mod:`qwenft.files` and :mod:`qwenft.config`; it never loads weights (nor imports torch on its own path).
"""

from qwenft.plan.arch import Architecture, lora_parameter_count, parameter_counts, resolve_architecture
from qwenft.plan.command import make_plan, plan_command, write_json
from qwenft.plan.memory import TrainSetup, kv_cache_bytes, nf4_bytes, training_memory, weight_bytes

__all__ = ["Architecture", "TrainSetup", "kv_cache_bytes", "lora_parameter_count", "make_plan", "nf4_bytes",
           "parameter_counts", "plan_command", "resolve_architecture", "training_memory", "weight_bytes",
           "write_json"]
