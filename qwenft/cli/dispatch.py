"""Command dispatch: ``python -m qwenft COMMAND [hydra overrides]``.

Every command but ``recipes`` (which lists and copies recipe files, :mod:`qwenft.recipes.command`) composes the same Hydra
config (``conf/config.yaml``, ``+recipe=NAME`` or ``+recipe=./my.yaml``, overrides),
validates it against :mod:`qwenft.config` (:mod:`qwenft.cli.compose`) *before* anything heavy is imported or loaded, and only
then hands over to Hydra (run directory, ``.hydra/`` snapshot, log file, ``-m`` multirun).
A user error (bad key, wrong type, impossible value, missing file) ends with exit code 2 and one
line naming the problem; no traceback. A failed gate of the verdict under ``eval.fail_on_gate=true`` ends ``train``
and ``eval`` with exit code 3 (``GatesFailed.exit_code``), an INCONCLUSIVE verdict under
``eval.fail_on_inconclusive=true`` with exit code 4 (``GatesInconclusive.exit_code``), once everything is written, with one line naming the gates and
report.md (with ``-m``: after every grid point ran; a FAIL anywhere exits 3).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from qwenft.cli.compose import register_resolvers, validate
from qwenft.cli.overrides import free_form, parse_hydra_args, shell_split
from qwenft.cli.recipe_files import recipe_overrides
from qwenft.cli.rundir import (RUN_DIR_COMMANDS, discard_untouched_run_dir, hydra_snapshot, log_to_files,
                               restore_hydra_snapshot)
from qwenft.config import COMMANDS, ConfigError, GatesFailed, QwenftError, to_config
from qwenft.files import file_in_the_way
from qwenft.resources import available_recipes, conf_dir
from qwenft.runlock import RunLock, lock_run_dirs, new_run_stamp

log = logging.getLogger("qwenft")

def fail(message: str, code: int = 2) -> "None":
    """Print one error line to stderr and exit with ``code``."""
    print(f"qwenft: error: {message}", file=sys.stderr)
    raise SystemExit(code)


# verb -> (one-line help, room): ``python -m qwenft VERB`` runs ``qwenft.<room>.command.<verb>_command`` with the
# validated Config (tests/test_layout.py checks that each is there)
COMMAND_TABLE: Dict[str, Tuple[str, str]] = {
    "train": ("fine-tune with LoRA/QLoRA on the data mix, then evaluate base vs tuned", "train"),
    "eval": ("evaluate base vs tuned: perplexity, generation metrics, report.md", "evaluate"),
    "generate": ("stream text from the model (+ adapter) with the KV-cached sampler", "generation"),
    "merge": ("merge an adapter into its base and export a standalone 16-bit model", "export"),
    "data": ("validate and preview the training data: counts, lengths, a masked example (a pair for preference data)",
             "data"),
    "inspect": ("per-layer trace of one forward pass (shapes, stats, attention, top-k)", "inspect"),
    "plan": ("memory and parameter plan from the config, before any download", "plan"),
    "serve": ("serve base and tuned behind an OpenAI-compatible API, /metrics and a side-by-side page", "serve"),
    # no Hydra config: `qwenft recipes [cp NAME DEST [--force]]`, run with its own arguments
    "recipes": ("list the built-in recipes; `recipes cp NAME DIR` copies one to edit", "recipes"),
    # no Hydra config either: `qwenft doctor PATH [--json]`; its exit code is 1 when it finds something
    "doctor": ("check an adapter, model directory or GGUF for what breaks a Qwen2.5 fine-tune", "doctor"),
}


def command_function(verb: str) -> Callable:
    """The function ``python -m qwenft VERB`` runs: ``<verb>_command`` of ``qwenft.<room>.command``, imported now."""
    return getattr(importlib.import_module(f"qwenft.{COMMAND_TABLE[verb][1]}.command"), f"{verb}_command")


USAGE = """usage: python -m qwenft COMMAND [overrides]

Fine-tune Qwen2.5 chat models with LoRA / QLoRA and show what the fine-tune changed.

commands:
{table}

overrides are Hydra's: key=value, +recipe=NAME, -m for a multirun grid, --cfg job to print the
resolved config. Example: python -m qwenft train +recipe=quickstart lora.r=8
recipes: {recipes} (+recipe=NAME; a file of your own: +recipe=./my.yaml)
"""


def usage() -> str:
    table = "\n".join(f"  {name:<9} {help_line}" for name, (help_line, _) in COMMAND_TABLE.items())
    return USAGE.format(table=table, recipes=", ".join(available_recipes()) or "(none)")


def _run_hydra(command: str, overrides: Sequence[str], flags: Sequence[str], existing: Sequence[str] = ()) -> None:
    """Hand the command to ``@hydra.main`` (run dir, config snapshot, logging, multirun).

    ``existing``: run directories that existed before this invocation; they are never discarded, and a command
    refused with a user error puts their ``.hydra/`` back as it was.
    """
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig

    snapshots = {path: hydra_snapshot(Path(path)) for path in existing}
    failed_gates: List[GatesFailed] = []  # one per run whose verdict asks for an exit code; reported at the end
    extra = [f"command={command}", f"hydra.job.name={command}"]
    if command not in RUN_DIR_COMMANDS:
        extra += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stderr"]

    @hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")
    def task(cfg: DictConfig):
        run_dir, status, metric_names = None, "failed", list(cfg.eval.metrics)
        try:
            config = to_config(cfg)
            if command in RUN_DIR_COMMANDS:
                config.out_dir = HydraConfig.get().runtime.output_dir
                run_dir = Path(config.out_dir).expanduser().resolve()
            result = command_function(command)(config)
            status = "done"
            return result
        except GatesFailed as exc:  # everything is written: the run directory stays as it is
            status = "gate failed"
            log_to_files(f"verdict: {exc}")
            failed_gates.append(exc)
        except QwenftError as exc:
            status = f"error: {exc}"
            log_to_files(f"error: {exc}")
            if run_dir is not None and os.environ.get("RANK", "0") == "0":
                if str(run_dir) in snapshots:
                    restore_hydra_snapshot(run_dir, snapshots[str(run_dir)])
                else:
                    logging.shutdown()  # close Hydra's log file before removing its folder
                    discard_untouched_run_dir(run_dir, command)
            fail(str(exc))
        except KeyboardInterrupt:
            message = status = "interrupted"
            if command == "train" and run_dir is not None:
                message += (f"; complete checkpoints in {run_dir / 'checkpoints'} are kept: rerun the same command with "
                            "train.resume=auto to continue from the last one")
            log_to_files(message)
            print(file=sys.stderr)  # on a line of its own: a progress bar (or the terminal's ^C) ends without one
            fail(message, code=130)
        finally:  # -m: the point goes into the grid's index however it ended
            _index_grid_point(command, status, metric_names)

    if "--hydra-help" in flags:  # Hydra's own help composes no primary config: an override of it cannot apply
        overrides, extra = [], [f"hydra.job.name={command}"]
    saved = sys.argv
    sys.argv = [f"qwenft {command}", *overrides, *extra, *flags]
    try:
        task()
    finally:
        sys.argv = saved
    if failed_gates:
        for exc in failed_gates:
            print(f"qwenft: {exc.label}: {exc}", file=sys.stderr)
        raise SystemExit(min(exc.exit_code for exc in failed_gates))  # 3 (a FAIL) before 4 (undecided)


def _index_grid_point(command: str, status: str, metric_names: Sequence[str]) -> None:
    """Under ``-m``, in ``train`` and ``eval``: the point that just ended goes into the grid's index at ``out_dir``
    (:mod:`qwenft.cli.grid`: grid.json, grid.md), with the overrides Hydra gave it."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_config = HydraConfig.get()
    if hydra_config.mode != RunMode.MULTIRUN or command not in RUN_DIR_COMMANDS or os.environ.get("RANK", "0") != "0":
        return
    from qwenft.cli.grid import INDEX_MD, record_point

    overrides = [o for o in hydra_config.overrides.task if not o.startswith("command=")]
    root = Path(hydra_config.runtime.output_dir).parent  # point N runs in out_dir/N
    index = record_point(root, int(hydra_config.job.num), overrides, status, metric_names)
    print(f"grid index: {index.parent / INDEX_MD} (the comparison so far; {index.name} beside it)")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of ``python -m qwenft``; exits 0 on success, 2 on a user error, 3 when a gate failed under
    ``eval.fail_on_gate=true``, 130 when interrupted (Ctrl-C)."""
    try:
        _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before Hydra runs the command (its own handler says more), e.g. mid-import
        print(file=sys.stderr)  # on a line of its own, after the terminal's ^C
        fail("interrupted", code=130)
    except BrokenPipeError:  # `qwenft recipes | head -3`: the reader left; no traceback for that
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush of stdout would raise again
        raise SystemExit(0)


def _quiet_wandb_notice(command: str) -> None:
    """With ``WANDB_MODE=offline``, import transformers' W&B integration now with its stdout notice dropped, so a
    redirected result stays clean; called after the config checks, so a refused override stays fast
    (docs/performance.md, "Startup of a command"). ``data`` and ``plan`` never import it."""
    if os.environ.get("WANDB_MODE") == "offline" and command not in ("data", "plan"):
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):
            importlib.import_module("transformers.integrations.integration_utils")




def _main(argv: Optional[Sequence[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        raise SystemExit(0 if args else 2)
    command, rest = args[0], args[1:]
    if command not in COMMAND_TABLE:
        fail(f"unknown command '{command}'; commands: {', '.join(COMMAND_TABLE)}")
    if command not in COMMANDS or (command == "data" and rest[:1] and rest[0].startswith("cache=")):
        try:  # `recipes`, `doctor`, `data cache=list|clear`: no Hydra config
            if command == "data":
                from qwenft.data.command import cache_command

                cache_command(rest)
            else:
                code = command_function(command)(rest)  # `doctor`: 1 when it found something
                if code:
                    raise SystemExit(code)
        except QwenftError as exc:
            fail(str(exc))
        return
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    register_resolvers()
    new_run_stamp()  # this command's default run directory name (validate() and Hydra both compose it)
    try:
        parsed = parse_hydra_args(rest)
    except ConfigError as exc:
        fail(str(exc))
    split = shell_split(parsed.overrides)
    if split:
        fail(split)
    try:  # Hydra's spelling of free text and lists; a recipe file registered for Hydra (+recipe=./my.yaml)
        overrides = recipe_overrides(free_form(parsed.overrides))
    except QwenftError as exc:
        fail(str(exc))
    if parsed.help:  # the keys this command reads; the whole config is `--cfg job`, Hydra's help `--hydra-help`
        from qwenft.cli.usage import command_help

        print(command_help(command, COMMAND_TABLE[command][0], overrides), end="")
        return
    locks: List[RunLock] = []
    try:
        _checked_run(command, rest, parsed, overrides, locks)
    except QwenftError as exc:  # a run directory in use (the other user errors are handled where they arise)
        fail(str(exc))
    finally:  # held until the command ends, however it ends
        for lock in locks:
            lock.release()


def _checked_run(command: str, rest: Sequence[str], parsed, overrides: List[str],
                 locks: List[RunLock]) -> None:  # checks, lock, Hydra
    launch, existing = [], []  # Hydra overrides under a launcher; run directories that existed before
    if not (parsed.help or parsed.cfg or parsed.info):
        from qwenft.train.dist import launch_overrides, preflight

        try:
            configs = validate(command, overrides, multirun=parsed.multirun)
            preflight(configs[0], command)  # a missing package or GPU stops here, before Hydra writes anything
        except QwenftError as exc:
            fail(str(exc))
        _quiet_wandb_notice(command)  # after the config checks: a bad override is refused without this import
        if command in RUN_DIR_COMMANDS:
            for config in configs:
                blocking = file_in_the_way(config.out_dir)
                if blocking is not None:
                    fail(f"out_dir={config.out_dir}: {blocking} is a file, not a directory; choose another out_dir")
        existing = [] if parsed.multirun or command not in RUN_DIR_COMMANDS \
            else [str(Path(c.out_dir).expanduser().resolve()) for c in configs if Path(c.out_dir).expanduser().exists()]
        # before anything is written, and before the resume checks: a run in use is refused as such
        locks.extend(lock_run_dirs(command, configs, RUN_DIR_COMMANDS))
        if command == "train":  # resume / finished-run checks, before Hydra writes .hydra/
            from dataclasses import replace

            from qwenft.train.rundir import check_run_dir

            try:  # -m: grid point N runs in out_dir/N (hydra.sweep.subdir), in the order validate() returns
                for num, config in enumerate(configs):
                    check_run_dir(replace(config, out_dir=str(Path(config.out_dir) / str(num)))
                                  if parsed.multirun else config)
            except QwenftError as exc:
                fail(str(exc))
        command_function(command)  # an unimplemented command stops here, before Hydra writes anything
        if command == "train":  # under torchrun / accelerate launch: one run directory for all ranks
            try:
                launch = launch_overrides(configs[0], parsed.multirun)
            except QwenftError as exc:
                fail(str(exc))
    flags = [a for a in rest if a not in parsed.overrides]
    _quiet_wandb_notice(command)  # --cfg / --info too (imported once)
    _run_hydra(command, [*overrides, *launch], flags, existing)
