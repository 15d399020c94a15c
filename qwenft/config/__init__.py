"""The typed schema every qwenft config is validated against.

Hydra composes ``conf/config.yaml`` (plus ``+recipe=NAME`` and overrides) on top of :class:`Config`,
registered in Hydra's ConfigStore as ``qwenft_schema``; the composed config is then turned into
these dataclasses once, at the entry point, with :func:`to_config`. Library code only ever sees the
dataclasses. Value checks live in ``__post_init__`` and raise :class:`ConfigError` naming the key.

The defaults below are the single place a default is written; the YAML presets under ``conf/``
only hold what makes a preset different.

Modules: :mod:`~qwenft.config.base` (errors, checks), :mod:`~qwenft.config.model` (model, quant, lora),
:mod:`~qwenft.config.data` (data), :mod:`~qwenft.config.train` (train, wandb), :mod:`~qwenft.config.dist` (dist),
:mod:`~qwenft.config.generate` (generate), :mod:`~qwenft.config.evaluate` (eval; :mod:`~qwenft.config.gates` its
gates), :mod:`~qwenft.config.export` (merge), :mod:`~qwenft.config.inspect` (inspect), :mod:`~qwenft.config.plan`
(plan), :mod:`~qwenft.config.serve` (serve), :mod:`~qwenft.config.schema` (:class:`Config`, the root),
:mod:`~qwenft.config.load` (:func:`to_config`). This room imports nothing of qwenft but itself; every other room
may import it.
"""

from qwenft.config.base import ALL_TARGETS, COMMANDS, ConfigError, GatesFailed, GatesInconclusive, QwenftError
from qwenft.config.data import FORMAT_FIELDS, DataConfig, DataSource
from qwenft.config.dist import DIST_STRATEGIES, QUANT_STORAGE, DistConfig
from qwenft.config.evaluate import EvalConfig
from qwenft.config.export import MergeConfig
from qwenft.config.generate import GenerateConfig
from qwenft.config.inspect import InspectConfig
from qwenft.config.judge import JudgeConfig
from qwenft.config.load import escape_interpolations, omegaconf_message, to_config, unknown_key_message
from qwenft.config.model import ROPE_TYPES, LoraConfig, ModelConfig, QuantConfig, RopeScalingConfig, TinyModelConfig
from qwenft.config.plan import PlanConfig
from qwenft.config.schema import Config
from qwenft.config.serve import LOCAL_HOSTS, ServeConfig, is_local_host
from qwenft.config.train import TrainConfig, WandbConfig

__all__ = ["ALL_TARGETS", "COMMANDS", "Config", "ConfigError", "DIST_STRATEGIES", "DataConfig", "DataSource",
           "DistConfig", "EvalConfig", "FORMAT_FIELDS", "GatesFailed", "GatesInconclusive", "GenerateConfig",
           "InspectConfig", "JudgeConfig", "LoraConfig",
           "MergeConfig", "ModelConfig", "PlanConfig", "QUANT_STORAGE", "QuantConfig", "QwenftError", "ROPE_TYPES",
           "RopeScalingConfig", "ServeConfig", "TinyModelConfig", "LOCAL_HOSTS", "is_local_host", "TrainConfig",
           "WandbConfig", "escape_interpolations", "omegaconf_message", "to_config", "unknown_key_message"]
