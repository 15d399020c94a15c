"""The config composed and validated before anything loads: Hydra's composition (each grid point of ``-m``), its
errors turned into one line naming the key (and the recipe file that set it), and the resolvers and schema node
the config tree uses."""

from __future__ import annotations

from typing import List, Sequence

from qwenft.config import Config, ConfigError, omegaconf_message, to_config
from qwenft.config.load import sources_override_message
from qwenft.resources import conf_dir, project_root
from qwenft.cli.overrides import lexer_refused, sweep_grid, sweep_message
from qwenft.cli.recipe_files import recipe_overrides, recipe_problem, where_in_recipe_file
from qwenft.cli.rundir import RUN_DIR_COMMANDS


def compose_message(exc: BaseException) -> str:
    """Turn a Hydra / OmegaConf composition error into one line naming the key."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    text = str(exc).strip()
    first = text.splitlines()[0].strip() if text else type(exc).__name__
    if isinstance(exc, MissingConfigException):  # e.g. quant=nf3: missing_cfg_file 'quant/nf3', options of 'quant'
        group, _, option = (exc.missing_cfg_file or "").partition("/")
        if option and exc.options:
            return f"{group}={option} is not accepted; choose one of: {', '.join(exc.options)}"
        return first
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, OmegaConfBaseException):
        return omegaconf_message(cause)
    if isinstance(exc, OverrideParseException) and lexer_refused(exc):
        override = exc.override.strip()
        key, _, value = override.partition("=")
        if value.startswith(("[", "{")):
            return (f"{override}: Hydra cannot read this value; quote each text item inside it, e.g. "
                    f"\"{key}=['text']\"")
        if value:  # Hydra's grammar takes unquoted values of letters, digits and a few symbols only
            return (f"{override}: Hydra cannot read this value unquoted; quote it for Hydra inside the shell's "
                    f"quotes: \"{key}='{value}'\"")
    return first.replace("Error merging override ", "")


def validate(command: str, overrides: Sequence[str], multirun: bool = False) -> list:
    """Compose and validate the config for ``command`` with ``overrides`` (each grid point if ``multirun``).

    Returns:
        The validated :class:`qwenft.config.Config` objects (one per grid point).

    Raises:
        ConfigError: one line naming the offending key.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra  # clear(): what Hydra's own "already initialized" error asks for
    from hydra.core.override_parser.overrides_parser import OverridesParser  # Hydra's plugin API
    from hydra.core.override_parser.types import ValueType

    overrides = recipe_overrides(overrides)
    problem = recipe_problem(overrides)
    if problem:
        raise ConfigError(problem)
    for item in overrides:
        key = item.partition("=")[0].lstrip("+~")
        if key in ("hydra.run.dir", "hydra.sweep.dir") and command in RUN_DIR_COMMANDS:
            raise ConfigError(f"{key} is set from out_dir; use out_dir=PATH instead (with -m, runs go to "
                              "out_dir/0, out_dir/1, ...)")
    user = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    try:
        parsed = OverridesParser.create().parse_overrides(list(user))
    except Exception as exc:  # a malformed override or sweep expression
        raise ConfigError(compose_message(exc)) from None
    grid: List[List[str]] = [list(user)]
    if multirun:
        try:
            grid = sweep_grid(parsed)
        except ConfigError:
            raise
        except Exception as exc:  # a sweep whose values cannot be listed
            raise ConfigError(compose_message(exc)) from None
    for override in parsed if not multirun else ():  # Hydra refuses these as ambiguous when it composes
        if override.is_sweep_override() and override.value_type == ValueType.SIMPLE_CHOICE_SWEEP:
            raise ConfigError(sweep_message(override))
    configs = []
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        for point in grid:
            try:
                cfg = compose(config_name="config", overrides=[*point, f"command={command}"])
            except Exception as exc:
                message = sources_override_message(point) or compose_message(exc)
                raise ConfigError(f"{message}{where_in_recipe_file(message, point)}") from None
            try:
                configs.append(to_config(cfg))
            except ConfigError as exc:
                raise ConfigError(f"{exc}{where_in_recipe_file(str(exc), point)}") from None
    GlobalHydra.instance().clear()
    return configs


def register_resolvers() -> None:
    """Register the ``qwenft_schema`` node in Hydra's ConfigStore and the ``${qwenft_root:}``,
    ``${qwenft_run_id:}`` (the default run directory's name, :func:`qwenft.runlock.run_stamp`) and
    ``${qwenft_run_group:COMMAND}`` (``eval/`` for eval, :func:`qwenft.runlock.run_group`) resolvers.

    Idempotent; called by the CLI and by tests that compose the config themselves.
    """
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from qwenft.runlock import run_group, run_stamp

    ConfigStore.instance().store(name="qwenft_schema", node=Config)
    OmegaConf.register_new_resolver("qwenft_root", lambda: str(project_root()), replace=True)
    OmegaConf.register_new_resolver("qwenft_run_id", run_stamp, replace=True)
    OmegaConf.register_new_resolver("qwenft_run_group", run_group, replace=True)
