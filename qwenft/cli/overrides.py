"""The command line's overrides as Hydra reads them: its flags parsed, an override the shell split rejoined in the
error, the few spellings Hydra's grammar refuses rewritten (free-form mappings, free text, comma lists), and a
``-m`` grid listed job by job in Hydra's order."""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence

from qwenft.config import ConfigError


def parse_hydra_args(args: Sequence[str]):
    """Hydra's own reading of the command line: ``overrides``, ``multirun``, ``cfg``, ``info``, ``help`` ...

    Raises:
        ConfigError: an unrecognised option; ``-m`` with ``--cfg`` / ``--info``.
    """
    # Hydra has no public API for its command line: its own parser (hydra._internal.utils in Hydra 1.3) is the only
    # way to read its flags exactly as @hydra.main will; private, so used here alone.
    from hydra._internal.utils import get_args_parser

    # intermixed: Hydra's flags may come anywhere among the overrides (`train +recipe=x -m lora.r=8,16`)
    parsed, unknown = get_args_parser().parse_known_intermixed_args(list(args))
    if unknown:
        raise ConfigError(f"unrecognised option(s): {' '.join(unknown)}; overrides are key=value")
    if parsed.multirun and (parsed.cfg or parsed.info):
        raise ConfigError("--cfg / --info print one config: drop -m (or give one value per key)")
    return parsed


def shell_split(words: Sequence[str]) -> Optional[str]:
    """The one-line error for an override the shell split at its spaces, else None.

    Unquoted, ``data.sources.0.columns={instruction: q, output: a}`` reaches qwenft as four words, the first
    ``data.sources.0.columns={instruction:`` (Hydra: "no viable alternative at input '{instruction:'"); so do
    ``eval.metrics=[char_f1, rouge_l]`` and ``prompt=Hello world``. Every override is ``key=value`` (or ``~key``),
    so the words without ``=`` after an override are the rest of it: the error names the key and the whole
    override, quoted for the shell.
    """
    for i, word in enumerate(words):
        if "=" not in word:
            continue
        end = i + 1
        while end < len(words) and "=" not in words[end] and not words[end].startswith("~"):
            end += 1
        if end > i + 1:
            whole = " ".join(words[i:end])
            quote = "'" if "'" not in whole else '"'
            return (f"{word.partition('=')[0]}: the shell split this override at its spaces into {end - i} words "
                    f"(the first: {word}); quote it whole: {quote}{whole}{quote}")
    return None


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
