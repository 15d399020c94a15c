"""Training on several processes: ranks, the one run directory they share, and the ``dist`` presets' settings.

qwenft writes no distribution code of its own: ``torchrun`` / ``accelerate launch`` start the processes and set
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; transformers' Trainer, through
accelerate, runs DDP, FSDP or DeepSpeed from the TrainingArguments this module fills in
(:func:`training_kwargs`). What is left here is what the Trainer does not know about:

- every rank must write into the same run directory, but the default one is named after the time and the process
  (``${qwenft_run_id:}``, :func:`qwenft.runlock.run_stamp`), which differ between ranks: rank 0's is broadcast
  before Hydra creates anything (:func:`launch_overrides`); rank 0 alone takes the run directory's lock
  (:class:`qwenft.runlock.RunLock`) and keeps Hydra's ``.hydra/`` and ``train.log``;
- only rank 0 writes qwenft's own files (config.yaml, adapter/, metrics.json, the report); checkpoints are
  written by every rank into one staging folder that rank 0 renames
  (:class:`qwenft.train.callbacks.AtomicCheckpoints`);
- environment problems (a missing deepspeed or flash-attn package, nccl without a GPU, no distributed launch)
  stop the run with one line before anything is written (:func:`preflight`); too few training examples for the
  processes' batches stop it after the data build (:func:`qwenft.data.checks.check_batch_feed`).

Process control is accelerate's ``PartialState`` (the process group, barriers, main-process-first, broadcast,
reduce), the object the Trainer itself uses; it is created only under a launch of several processes (in one
process nothing here starts ``torch.distributed``). Before it exists, the rank and world size are read from the
launcher's environment (:mod:`qwenft.runtime`): constructing a ``PartialState`` would start the process group.

Data order stays exact: every rank builds the same mixed dataset (rank 0 first, the others then read its
tokenization cache) and the Trainer's sampler, seeded identically on every rank, deals the batches out:
batch ``i`` of the seeded order goes to rank ``i % world_size``. Two ranks with batch 1 therefore see, step by
step, exactly the rows one process with batch 2 sees, and the loss is token-weighted over the global batch
(``num_items_in_batch`` is summed over ranks), so the updates agree up to float summation order.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
from typing import Any, Dict, Iterator, List

from qwenft.config import Config, ConfigError, DistConfig, QwenftError
from qwenft.model.load import check_attention
from qwenft.runtime import is_main_process, launched, local_rank, rank, world_size

log = logging.getLogger(__name__)


# Commands that load a model (and so need the attention implementation they ask for).
MODEL_COMMANDS = ("train", "eval", "generate", "merge", "inspect")


def resolve_strategy(dcfg: DistConfig) -> str:
    """``dist.strategy`` as run: ``none`` under a launch of several processes is plain ``ddp``."""
    if dcfg.strategy == "none" and world_size() > 1:
        return "ddp"
    return dcfg.strategy


def zero_stage(dcfg: DistConfig) -> int:
    """The DeepSpeed ZeRO stage of ``dcfg`` (-1 when the strategy is not deepspeed)."""
    if dcfg.strategy != "deepspeed":
        return -1
    return int((dcfg.deepspeed.get("zero_optimization") or {}).get("stage", 0))


def shards_weights(dcfg: DistConfig) -> bool:
    """Whether the strategy shards the weights themselves (FSDP, ZeRO-3): a rank then holds only a part."""
    return dcfg.strategy == "fsdp" or zero_stage(dcfg) == 3


def backend(dcfg: DistConfig, cuda: bool) -> str:
    """The process-group backend: ``dist.backend``, or nccl on CUDA and gloo on a CPU for ``auto``."""
    if dcfg.backend != "auto":
        return dcfg.backend
    return "nccl" if cuda else "gloo"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _state():
    """accelerate's ``PartialState`` of a launch of several processes once its process group runs (started by
    :func:`init_process_group`, or by the Trainer's ``TrainingArguments``), else None: one process has nothing to
    coordinate, and nothing here starts a group as a side effect (or uses one :func:`destroy` tore down)."""
    if world_size() <= 1:
        return None
    import torch.distributed

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    from accelerate import PartialState

    return PartialState(cpu=not _cuda())  # already made: the arguments are ignored


def init_process_group(dcfg: DistConfig) -> bool:
    """Start torch.distributed's default group once, when launched with several processes, through accelerate's
    ``PartialState``.

    Uses the backend and timeout the Trainer would use (:func:`backend`, ``dist.timeout_s``), so the Trainer's
    ``TrainingArguments`` find the group ready and reuse it; on CUDA the process uses its GPU, ``cuda:LOCAL_RANK``.

    Returns:
        Whether this is a run of several processes.
    """
    if world_size() <= 1:
        return False
    from datetime import timedelta

    from accelerate import PartialState

    cuda = _cuda()
    PartialState(cpu=not cuda, backend=backend(dcfg, cuda), timeout=timedelta(seconds=dcfg.timeout_s))
    return True


def barrier() -> None:
    """Wait for every rank (no-op in one process)."""
    state = _state()
    if state is not None:
        state.wait_for_everyone()


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """Run the body on rank 0 first, then on the other ranks (e.g. to fill a cache once).

    ``PartialState.main_process_first`` with one difference: when the body raises on rank 0 (bad data), the other
    ranks are still let go (they then meet the same error themselves) instead of waiting at the barrier until the
    process group's timeout.
    """
    state = _state()
    if state is not None and not state.is_main_process:
        state.wait_for_everyone()
    try:
        yield
    finally:
        if state is not None and state.is_main_process:
            state.wait_for_everyone()


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (picklable objects; the object itself in one process)."""
    if _state() is None:
        return obj
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([obj], from_process=0)[0]


def sum_over_ranks(value: int) -> int:
    """The sum of an integer over all ranks (the value itself in one process)."""
    state = _state()
    if state is None:
        return value
    import torch
    from accelerate.utils import reduce

    return int(reduce(torch.tensor([value], dtype=torch.int64, device=state.device), reduction="sum").item())


def destroy() -> None:
    """Tear down the default process group (after the last collective)."""
    state = _state()
    if state is not None:
        state.destroy_process_group()


def _quote(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace("'", "\\'")
    return f"'{escaped}'"


def launch_overrides(config: Config, multirun: bool) -> List[str]:
    """Hydra overrides that give every rank of a distributed launch the same run (none in one process).

    All ranks get rank 0's ``out_dir`` (the default one holds the start time); ranks other than 0 write no
    ``.hydra/`` snapshot and no log file (they log to the console). Initialises the process group.

    Raises:
        ConfigError: ``-m`` (a multirun grid) under a distributed launch.
    """
    if world_size() <= 1:
        return []
    if multirun:
        raise ConfigError("-m (a multirun grid) is not supported under torchrun / accelerate launch; launch one "
                          "training per grid point")
    init_process_group(config.dist)
    extra = [f"out_dir={_quote(broadcast_object(config.out_dir))}"]
    if not is_main_process():
        extra += ["hydra.output_subdir=null", "hydra/job_logging=stdout"]
    return extra


def check_strategy(config: Config, cuda: bool) -> None:
    """Check that ``dist`` can run here: its package, its device and its launcher.

    Raises:
        QwenftError: one line naming the preset and what is missing.
    """
    dcfg = config.dist
    name = f"dist={dcfg.name}"
    if dcfg.strategy == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise QwenftError(f"{name} needs the deepspeed package, which is not installed (pip install deepspeed); "
                          "or train with dist=ddp / dist=fsdp")
    if dcfg.strategy == "deepspeed":
        check_zero_keys(dcfg.deepspeed.get("zero_optimization") or {})
    if dcfg.strategy in ("fsdp", "deepspeed"):  # both also run on CPU processes (gloo; DeepSpeed's CPU accelerator)
        if not launched():
            raise QwenftError(f"{name} needs a distributed launch: torchrun --nproc_per_node=N -m qwenft train ... "
                              "(or accelerate launch --num_processes N -m qwenft train ...)")
    if backend(dcfg, cuda) == "nccl" and not cuda and world_size() > 1:
        raise QwenftError("dist.backend=nccl needs CUDA GPUs; use dist.backend=gloo (or auto) on a CPU")
    if config.quant.method == "nf4" and shards_weights(dcfg) and dcfg.quant_storage == "uint8":
        raise QwenftError(f"{name} with quant=nf4 needs dist.quant_storage=bfloat16: FSDP and ZeRO-3 shard only "
                          "floating-point tensors")


def check_zero_keys(zero: Dict[str, Any]) -> None:
    """Check the keys of ``dist.deepspeed.zero_optimization`` against the installed DeepSpeed's ZeRO config (its
    fields and their aliases), which DeepSpeed itself rejects only when the engine starts, with a traceback on every
    rank after the model has loaded.

    Raises:
        QwenftError: one line naming the unknown key and the closest accepted one.
    """
    import difflib

    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    fields = DeepSpeedZeroConfig.model_fields
    known = sorted(set(fields) | {f.alias for f in fields.values() if f.alias})
    for key in zero:
        if key not in known:
            guess = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f" (did you mean dist.deepspeed.zero_optimization.{guess[0]}?)" if guess else ""
            raise QwenftError(f"unknown key 'dist.deepspeed.zero_optimization.{key}'{hint}: DeepSpeed's ZeRO config "
                              "has no such setting")


def check_batch_feed(examples: int, config: Config) -> None:
    """Check that the training examples fill one global batch: every process needs ``train.batch_size`` of them.

    Args:
        examples: training examples after the data build (packed sequences when packing is on).

    Raises:
        QwenftError: fewer examples than ``world_size x train.batch_size`` under a launch of several processes
            (accelerate would fill the batch by repeating examples, so some would weigh twice in every epoch).
    """
    need = world_size() * config.train.batch_size
    if world_size() > 1 and examples < need:
        raise QwenftError(f"{examples} training example(s) cannot feed {world_size()} processes x train.batch_size="
                          f"{config.train.batch_size} ({need} per step; the rest would be repeats): launch fewer "
                          "processes, lower train.batch_size or add training data")


def preflight(config: Config, command: str) -> None:
    """Environment checks run by the CLI before Hydra writes anything (attention, dist strategy).

    Raises:
        QwenftError: one line (see :func:`check_attention`, :func:`check_strategy`); any command but ``train``
            started by a launcher of several processes.
    """
    if world_size() > 1 and command != "train":
        raise QwenftError(f"qwenft {command} runs in one process: start it with python -m qwenft {command} ... "
                          "(torchrun / accelerate launch are for train)")
    needs_gpu_check = config.model.attn_implementation == "flash_attention_2" or (
        command == "train" and (config.dist.strategy != "none" or world_size() > 1 or config.train.kernels == "liger"))
    if not needs_gpu_check:
        return  # the common case imports no torch
    from qwenft.runtime import default_device

    device = default_device()
    if command in MODEL_COMMANDS:
        check_attention(config.model.attn_implementation, device)
    if command == "train":
        from qwenft.kernels import resolve_kernels

        check_strategy(config, device.startswith("cuda"))
        resolve_kernels(config.train.kernels, device.startswith("cuda"))


def training_kwargs(config: Config, cuda: bool) -> Dict[str, Any]:
    """The TrainingArguments settings of ``config.dist`` (DDP flags, ``fsdp``/``fsdp_config``, ``deepspeed``)."""
    dcfg = config.dist
    strategy = resolve_strategy(dcfg)
    kwargs: Dict[str, Any] = {"ddp_timeout": dcfg.timeout_s, "ddp_find_unused_parameters": dcfg.find_unused_parameters}
    if world_size() > 1:
        kwargs["ddp_backend"] = backend(dcfg, cuda)
    if strategy == "fsdp":
        kwargs["fsdp"] = True
        kwargs["fsdp_config"] = copy.deepcopy(dict(dcfg.fsdp))
    elif strategy == "deepspeed":
        kwargs["deepspeed"] = copy.deepcopy(dict(dcfg.deepspeed))
    return kwargs


def describe(config: Config) -> str:
    """One log line: the strategy, the number of processes and this rank."""
    strategy = resolve_strategy(config.dist)
    if world_size() <= 1 and strategy == "none":
        return "one process"
    how = f"{strategy} (dist={config.dist.name})" if strategy == config.dist.strategy else f"{strategy} (dist=none " \
        "under a launch of several processes)"
    return f"{how}, {world_size()} process(es), this is rank {rank()} (local {local_rank()})"
