"""The Hydra glue of the CLI: overrides read and rewritten, the config composed and validated before anything
loads, the resolvers, recipes found, and a refused run's directory left as it was."""

from __future__ import annotations

import logging
import re
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from qwenft.config import Config, ConfigError, omegaconf_message, to_config
from qwenft.config.load import sources_override_message
from qwenft.files import atomic_write_bytes
from qwenft.resources import available_recipes, conf_dir, project_root
from qwenft.runlock import LOCK_FILES

log = logging.getLogger("qwenft")


# Commands that write a run directory (out_dir); the others print and write only what they are told to.
RUN_DIR_COMMANDS = ("train", "eval")


def fail(message: str, code: int = 2) -> "None":
    """Print one error line to stderr and exit with ``code``."""
    print(f"qwenft: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def _parse_hydra_args(args: Sequence[str]):
    # Hydra has no public API for its command line: its own parser (hydra._internal.utils in Hydra 1.3) is the only
    # way to read its flags exactly as @hydra.main will; private, so used here alone.
    from hydra._internal.utils import get_args_parser

    # intermixed: Hydra's flags may come anywhere among the overrides (`train +recipe=x -m lora.r=8,16`)
    parsed, unknown = get_args_parser().parse_known_intermixed_args(list(args))
    if unknown:
        fail(f"unrecognised option(s): {' '.join(unknown)}; overrides are key=value")
    if parsed.multirun and (parsed.cfg or parsed.info):
        fail("--cfg / --info print one config: drop -m (or give one value per key)")
    return parsed


def _recipe_problem(overrides: Sequence[str]) -> Optional[str]:
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "recipe":
            return f"{item}: a recipe is added with a leading +: +recipe={value}"
        if key.lstrip("+~") == "recipe" and value and value not in available_recipes() and value not in _FILE_RECIPES:
            return (f"unknown recipe '{value}' (+recipe={value}); available recipes: {', '.join(available_recipes())}"
                    "; or a recipe file: +recipe=./FILE.yaml")
    return None


_FILE_RECIPES: Dict[str, Path] = {}  # a recipe file's option name in Hydra's ConfigStore -> the file
_FILE_GROUP = "file"  # ./my.yaml is composed as +recipe=file/my: a name no built-in recipe (recipes/*.yaml) has
_NOTED: set = set()  # built-in recipes whose same-named file in the current directory was pointed out


def recipe_overrides(overrides: Sequence[str]) -> List[str]:
    """Rewrite ``+recipe=`` so that a recipe file outside the package composes like a built-in one.

    ``+recipe=NAME`` is the built-in ``recipes/NAME.yaml`` or, when there is none, ``NAME.yaml`` in the current
    directory; ``+recipe=PATH`` (a value ending in ``.yaml`` / ``.yml`` or holding a ``/``, relative to the current
    directory or absolute) is that file. A file is registered in Hydra's ConfigStore as the ``recipe`` option
    ``file/<stem>`` (package ``_global_`` unless its ``# @package`` header says otherwise) and the override
    rewritten to it; anything else (a built-in, an unknown name, a sweep ``a,b``) is returned as it was.
    Idempotent.

    Raises:
        ConfigError: the file is missing, not YAML, or not a mapping; one line naming it.
    """
    out = []
    for item in overrides:
        key, _, value = item.partition("=")
        path = _recipe_file(value) if key.startswith("+") and key.lstrip("+") == "recipe" else None
        out.append(f"{key}={_register_recipe_file(path, value)}" if path is not None else item)
    return out


def _recipe_file(value: str) -> Optional[Path]:
    """The file ``+recipe=value`` names, or None for a built-in recipe, an unknown name or a sweep."""
    if not value or "," in value or value in _FILE_RECIPES:
        return None
    if value in available_recipes():
        if Path(f"{value}.yaml").is_file() and value not in _NOTED:  # a copy from `qwenft recipes cp`?
            _NOTED.add(value)
            log.warning(f"+recipe={value} is the built-in recipe; ./{value}.yaml here is not used "
                        f"(+recipe=./{value}.yaml uses it)")
        return None
    if value.endswith((".yaml", ".yml")) or "/" in value or "\\" in value:
        return Path(value).expanduser()
    return next((p for p in (Path(f"{value}.yaml"), Path(f"{value}.yml")) if p.is_file()), None)


def _register_recipe_file(path: Path, value: str) -> str:
    """Load the recipe file ``path`` into Hydra's ConfigStore; returns its option name in the ``recipe`` group."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import DictConfig, OmegaConf

    if path.is_dir():
        raise ConfigError(f"recipe file {value} is a directory (+recipe={value}); name a YAML file in it")
    if not path.is_file():
        hint = next((f"; did you mean +recipe={value}{ext}?" for ext in (".yaml", ".yml")
                     if Path(f"{path}{ext}").is_file()), "")
        raise ConfigError(f"recipe file {value} not found (+recipe={value}, resolved to {path.resolve()}){hint}; "
                          f"built-in recipes: {', '.join(available_recipes())}")
    try:
        text = path.read_text(encoding="utf-8")
        node = OmegaConf.create(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"recipe file {path}: cannot be read ({exc})") from None
    except Exception as exc:  # PyYAML's MarkedYAMLError says where; OmegaConf's own errors are one line
        mark = getattr(exc, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
        raise ConfigError(f"recipe file {path}{where}: not valid YAML ({problem})") from None
    if not isinstance(node, DictConfig) or not len(node):  # an empty file would silently run the defaults
        raise ConfigError(f"recipe file {path}: expected a mapping of config keys, as recipes/*.yaml hold")
    leading = re.match(r"(\s*#[^\n]*\n)*", text).group(0)  # Hydra reads the header in the leading comments only
    header = re.search(r"^\s*#\s*@package\s+(\S+)", leading, re.MULTILINE)
    option = re.sub(r"[^A-Za-z0-9_-]", "_", path.stem)  # a plain name for Hydra's override grammar
    ConfigStore.instance().store(group=f"recipe/{_FILE_GROUP}", name=option, node=node,
                                 package=header.group(1) if header else "_global_")
    _FILE_RECIPES[f"{_FILE_GROUP}/{option}"] = path.resolve()
    return f"{_FILE_GROUP}/{option}"


def _compose_message(exc: BaseException) -> str:
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


def lexer_refused(exc) -> bool:
    """Whether Hydra's override parser refused ``exc.override`` in its lexer (a character its grammar has no token
    for: non-ASCII text, most punctuation unquoted), not in its parser (a misplaced bracket, ...).

    Only the message tells: Hydra 1.3's ``OverridesParser.parse_overrides`` words a lexer failure
    ``LexerNoViableAltException: <override>`` and drops the antlr exception it came from.
    """
    return str(getattr(exc, "message", "")).startswith("LexerNoViableAltException:")


def sweep_message(override) -> str:
    """The one line for a comma sweep (``key=a,b``, a parsed Hydra ``Override``) given without ``-m``, which Hydra
    refuses as ambiguous (a list, a text or a sweep)."""
    key, _, value = override.input_line.partition("=")
    return (f"{override.input_line}: a comma makes this a sweep; quote a value holding a comma (\"{key}='{value}'\"), "
            f"write a list as {key}=[{value}], or add -m to run one job per value")


def sweep_grid(overrides) -> List[List[str]]:
    """The jobs of a multirun over the parsed Hydra ``Override`` objects, in Hydra's order (its basic sweeper's:
    the cartesian product of each key's values, keys in first-seen order, a repeated key's last value winning), so
    job N is the one Hydra runs in ``out_dir/N``.

    Raises:
        ConfigError: a sweep the basic sweeper cannot run (an ``interval(...)``), with Hydra's wording.
    """
    import itertools

    values: Dict[str, List[str]] = {}
    for override in overrides:
        key = override.get_key_element()
        if not override.is_sweep_override():
            values[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():
            values[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            raise ConfigError(f"BasicSweeper does not support sweep type : {override.value_type.name}")
    return [list(point) for point in itertools.product(*values.values())]


_FREE_FORM = re.compile(r"^(data\.sources\.\d+\.(columns|replace)|dist\.fsdp|dist\.deepspeed|eval\.gates)(\.[^=]+)?=")


_TEXT_KEYS = ("prompt", "data.system_prompt")  # free text: taken literally, whatever characters it has


def quote_text(value: str) -> str:
    """``value`` as a single-quoted Hydra override value that composes back to exactly ``value``.

    Hydra's quoted strings keep backslashes except runs before a quote (and before the closing quote), which
    escape in pairs; ``${`` is escaped so a prompt about ``${HOME}`` is not an interpolation.
    """
    out = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
    out = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, out)
    out = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", out)  # OmegaConf: \\ then \${ stay literal
    return f"'{out}'"


_LIST_KEYS = ("inspect.layers", "lora.target_modules", "eval.benchmarks", "eval.bench_data", "eval.metrics",
              "eval.ppl_sources", "merge.quantize", "wandb.tags")  # comma lists (or one item): a list, not a sweep


def free_form(overrides: Sequence[str]) -> List[str]:
    """Rewrite the few overrides whose natural spelling Hydra's grammar refuses.

    - ``data.sources.N.columns`` is a free-form mapping (format field -> file field; ``data.sources.N.replace``:
      placeholder -> text, checked by :class:`qwenft.config.DataSource`): Hydra refuses new keys in
      a struct config unless the override starts with ``++``; the keys are checked against the format later
      (:class:`qwenft.config.DataSource`). So are ``dist.fsdp`` and ``dist.deepspeed`` (passed through to
      transformers' ``fsdp_config`` / ``deepspeed``), and ``eval.gates`` (``eval.gates={domain: {min_delta: 0.2}}``
      or ``eval.gates.domain.min_delta=0.2``; checked by :mod:`qwenft.config.gates`).
    - ``prompt=春天`` and ``data.system_prompt=...``: free text is quoted for Hydra (unquoted non-ASCII or ``,``
      would be refused) and taken literally (``${...}`` stays text, see :func:`quote_text`); ``null`` stays null.
      A sweep over them needs the user's own Hydra quoting.
    - ``inspect.layers=0,12,23`` is a list, not a multirun sweep; ``inspect.layers=5`` is the list ``[5]``; the
      same for ``lora.target_modules=q_proj,v_proj`` and the other lists of names or paths (``eval.bench_data=DIR``
      is ``[DIR]``).
    """
    out = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if _FREE_FORM.match(item):
            item = f"++{item}"
        elif sep and key in _TEXT_KEYS and value != "null" and not (len(value) >= 2 and value[0] == value[-1] and value[0] in "'\""):
            item = f"{key}={quote_text(value)}"
        elif sep and key in _LIST_KEYS and value not in ("", "null") and not value.startswith("["):
            item = f"{key}=[{value}]"  # 0,12,23 or a single 5
        out.append(item)
    return out


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
    problem = _recipe_problem(overrides)
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
        raise ConfigError(_compose_message(exc)) from None
    grid: List[List[str]] = [list(user)]
    if multirun:
        try:
            grid = sweep_grid(parsed)
        except ConfigError:
            raise
        except Exception as exc:  # a sweep whose values cannot be listed
            raise ConfigError(_compose_message(exc)) from None
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
                message = sources_override_message(point) or _compose_message(exc)
                raise ConfigError(f"{message}{_where_in_recipe_file(message, point)}") from None
            try:
                configs.append(to_config(cfg))
            except ConfigError as exc:
                raise ConfigError(f"{exc}{_where_in_recipe_file(str(exc), point)}") from None
    GlobalHydra.instance().clear()
    return configs


def _where_in_recipe_file(message: str, overrides: Sequence[str]) -> str:
    """`` (in recipe file PATH)`` when the key a validation message names is set by a recipe file in use, else ''."""
    from omegaconf import OmegaConf

    found = re.match(r"([A-Za-z0-9_.]+)[:=]", message) or re.search(r"key '([A-Za-z0-9_.\[\]]+)'", message)
    if not found:
        return ""
    key = found.group(1)
    for item in overrides:
        option = item.partition("=")[2]
        path = _FILE_RECIPES.get(option)
        if path is None:
            continue
        try:
            node = OmegaConf.load(path)
        except Exception:  # read when registered; a file changed since is not worth a second error
            continue
        top = key.split(".")[0]
        if top in node and (OmegaConf.select(node, key, default=None) is not None or "." not in key):
            return f" (in recipe file {path})"
    return ""


def register_resolvers() -> None:
    """Register the ``qwenft_schema`` node in Hydra's ConfigStore and the ``${qwenft_root:}``,
    ``${qwenft_run_id:}`` (the default run directory's name, :func:`qwenft.runlock.run_stamp`) and
    ``${qwenft_run_group:COMMAND}`` (``eval/`` for eval, :func:`qwenft.runlock.run_group`) resolvers.

    Idempotent; called by the CLI and by tests that compose the config themselves.
    """
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from qwenft.runlock import run_group, run_stamp  # here, not at the top: runlock imports this module

    ConfigStore.instance().store(name="qwenft_schema", node=Config)
    OmegaConf.register_new_resolver("qwenft_root", lambda: str(project_root()), replace=True)
    OmegaConf.register_new_resolver("qwenft_run_id", run_stamp, replace=True)
    OmegaConf.register_new_resolver("qwenft_run_group", run_group, replace=True)


def discard_untouched_run_dir(run_dir: Path, command: str) -> bool:
    """Remove ``run_dir`` when it holds nothing but what Hydra wrote before the command ran.

    A run refused with a user error before it wrote anything (bad data, a missing adapter or model) then leaves
    no empty run directory behind. Anything else in it (config.yaml, checkpoints, an adapter) keeps it.

    Returns:
        Whether the directory was removed.
    """
    hydra_only = {".hydra", f"{command}.log", *LOCK_FILES}  # and the lock this command holds
    if not run_dir.is_dir() or not {p.name for p in run_dir.iterdir()} <= hydra_only:
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    return True


def hydra_snapshot(run_dir: Path) -> Dict[str, bytes]:
    """The files of ``run_dir/.hydra`` (Hydra's config snapshot of the run), by name; empty when there are none."""
    folder = run_dir / ".hydra"
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} if folder.is_dir() else {}


def restore_hydra_snapshot(run_dir: Path, snapshot: Dict[str, bytes]) -> None:
    """Put back ``run_dir/.hydra`` as :func:`hydra_snapshot` found it (each file written atomically), so that a
    refused command in an existing run directory leaves that run's record of how it was run unchanged."""
    folder = run_dir / ".hydra"
    if not snapshot:  # the directory had no .hydra/ before this command
        shutil.rmtree(folder, ignore_errors=True)
        return
    for path in folder.iterdir() if folder.is_dir() else ():
        if path.is_file() and path.name not in snapshot:
            path.unlink()
    for name, data in snapshot.items():
        atomic_write_bytes(folder / name, data)


def _log_to_files(message: str) -> None:
    """Write ``message`` to the run's log file(s) only (the terminal gets it once, from :func:`fail`), so a
    run's log ends with why it stopped."""
    record = logging.LogRecord("qwenft", logging.ERROR, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            try:
                handler.handle(record)
            except OSError:  # the log's folder is gone: nothing to complete
                pass
