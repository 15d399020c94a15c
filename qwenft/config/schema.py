"""The schema's root: :class:`Config`, the whole validated run, one field per section (registered in Hydra's
ConfigStore as ``qwenft_schema``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

from qwenft.config.base import COMMANDS, _check, _check_choice
from qwenft.config.data import UNPAIRED_FORMATS, DataConfig, is_preference
from qwenft.config.dist import DistConfig
from qwenft.config.evaluate import EvalConfig
from qwenft.config.export import MergeConfig
from qwenft.config.gates import check_gate_names
from qwenft.config.generate import GenerateConfig
from qwenft.config.inspect import InspectConfig
from qwenft.config.model import LoraConfig, ModelConfig, QuantConfig
from qwenft.config.plan import PlanConfig
from qwenft.config.serve import ServeConfig
from qwenft.config.train import PrefConfig, TrainConfig, WandbConfig


@dataclass
class Config:
    """The whole run. ``command`` is set by the CLI; ``out_dir`` is the run directory.

    ``init_adapter``: ``train`` starts from this saved adapter (an SFT run's ``adapter/`` or run directory) instead of
    a fresh one, with its LoRA settings; for a preference objective that adapter, frozen, is also the reference.

    ``generate_presets``: every ``conf/generate`` preset by name, composed by Hydra (``conf/config.yaml``'s defaults
    list); ``eval.generate`` names the one evaluation samples with (:func:`qwenft.evaluate.run.generate_preset`).
    """

    command: str = "train"
    run_name: str = "run"
    out_dir: str = "outputs"
    logger: str = "none"
    adapter: Optional[str] = None
    init_adapter: Optional[str] = None
    prompt: Optional[str] = None
    prompts_file: Optional[str] = None
    chat: bool = True
    out: Optional[str] = None
    model: ModelConfig = field(default_factory=ModelConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    pref: PrefConfig = field(default_factory=PrefConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    merge: MergeConfig = field(default_factory=MergeConfig)
    inspect: InspectConfig = field(default_factory=InspectConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    generate_presets: Dict[str, GenerateConfig] = field(default_factory=dict)

    def check_gates(self) -> None:
        """The names in ``eval.gates`` and ``eval.targets`` against this config's data and benchmarks
        (:func:`qwenft.config.gates.check_gate_names`).

        Raises:
            ConfigError: naming the gate or target.
        """
        check_gate_names(self.eval.gates, self.data.sources, self.eval.benchmarks, self.eval.metrics,
                         self.eval.targets, self.eval.judge)

    def __post_init__(self) -> None:
        _check_choice("command", self.command, COMMANDS)
        _check_choice("logger", self.logger, ("none", "wandb"))
        # a gate or target names a held-out source or benchmark of this run; `eval` of an adapter reads the data
        # its run recorded first (qwenft.model.adapter.inference_config checks them then, before any model loads)
        if self.command == "train" or (self.command == "eval" and not self.adapter):
            self.check_gates()
        if self.command == "train" and self.data.sources:  # eval may use evaluation-only (weight 0) sources
            _check(sum(s.weight for s in self.data.sources) > 0, "data.sources.weight",
                   [s.weight for s in self.data.sources], "at least one weight must be > 0 to train")
        if self.command in ("train", "data") and self.data.sources:  # `data` previews what `train` would train on
            self.check_objective()

    def check_objective(self) -> None:
        """The training sources fit ``train.objective``: SFT trains on SFT formats, a preference objective on
        preference formats (pairs; KTO also on ``kto`` / ``kto_trl`` labelled answers, and on pairs, each answer
        then one labelled example), with SFT sources mixed in beside a preference one; a weight-0 preference source
        may still be held out for evaluation in an SFT run.

        Raises:
            ConfigError: naming the source and the setting to change.
        """
        objective = self.train.objective
        if objective != "sft":
            _check(self.dist.strategy in ("none", "ddp"), "dist", self.dist.strategy,
                   f"train.objective={objective} runs on one process or DDP (dist=none, dist=ddp); sharded "
                   "preference training (FSDP, DeepSpeed) is not supported yet")
            _check(objective not in ("orpo", "kto") or self.pref.rpo_alpha == 0, "pref.rpo_alpha", self.pref.rpo_alpha,
                   f"must be 0 with train.objective={objective}: "
                   + ("ORPO carries its own NLL term (weight 1)" if objective == "orpo" else
                      "KTO's answers are unpaired, with no chosen answer to add an NLL term for")
                   + "; set pref.rpo_alpha=0 (the dpo recipe sets 1.0)")
            trained = [s for s in self.data.sources if s.weight > 0]
            _check(not trained or any(is_preference(s.format) for s in trained), "data.sources",
                   ", ".join(f"{s.name} ({s.format})" for s in trained),
                   f"train.objective={objective} needs a preference source of weight > 0 (a preference format: "
                   "pairs_alpaca, pairs_sharegpt, pairs_trl, hh_rlhf, kto, kto_trl, or preference to detect it); "
                   "SFT sources are mixed in beside one; or set train.objective=sft")
            _check(objective != "kto" or self.train.batch_size >= 2, "train.batch_size", self.train.batch_size,
                   "must be >= 2 for train.objective=kto: its KL estimate pairs each prompt with another example's "
                   "answer in the same batch")
        for i, src in enumerate(self.data.sources):
            if src.weight <= 0:
                continue
            key = f"data.sources[{src.name}].format"
            if objective == "sft":
                _check(not is_preference(src.format), key, src.format,
                       "is a preference format: train on it with train.objective=dpo (or ipo, simpo, orpo, kto), "
                       "or give it weight 0 to evaluate on it")
            else:  # an SFT source of weight > 0 is mixed in: its rows' NLL joins the objective's loss
                _check(objective == "kto" or src.format not in UNPAIRED_FORMATS, key, src.format,
                       f"holds unpaired labelled answers: train.objective={objective} needs pairs (chosen and "
                       "rejected); use train.objective=kto")
