"""The README's commands run as typed from the root of a fresh clone (issue 27).

Every command in the README's code blocks is read: each file or directory it names must be in the checkout, be
written by an earlier command of the README (``recipes cp``), be output (``out=``, ``out_dir=`` ...) or be marked as
the user's own (a word in capitals, ``<...>``, a line commented ``# your ...``: the README's convention). Every
``python -m qwenft`` command composes and validates as typed (what ``--cfg job`` checks), and the "Use your own
data" examples read, map and hold out their rows (the tiny-random tokenizer stands in for the model's).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import List, Tuple

import pytest

from qwenft.config import ConfigError
from qwenft.hydra_app import free_form, recipe_overrides, register_resolvers, validate
from qwenft.resources import available_recipes
from tests.conftest import ROOT

README = ROOT / "README.md"
PROGRAMS = ("python", "qwenft", "pip", "torchrun", "accelerate", "bash", "vllm", "llama-server", "huggingface-cli",
            "wandb")
INPUT_KEYS = re.compile(r"^(data\.sources\.\d+\.path|prompts_file|adapter|model\.path|eval\.bench_data|"
                        r"eval\.bench_tasks|eval\.ppl_sources)$")
GROUPS = ("model", "quant", "lora", "data", "train", "eval", "generate", "dist")  # conf/GROUP/NAME.yaml presets
HUB_ID = re.compile(r"^Qwen/Qwen2\.5-[\w.-]+$")  # a Hugging Face model id (downloaded, not a path)


def commands(text: str) -> List[Tuple[List[str], str]]:
    """``(tokens, comment)`` of every command line in the README's fenced code blocks (continuation lines joined;
    lines that are not a command, as the run-directory tree, are left out)."""
    found = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.S | re.M):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.strip()
            if not line.split(" ")[0] in PROGRAMS:
                continue
            comment = re.search(r"\s#\s(.*)$", line)
            found.append((shlex.split(line, comments=True), comment.group(1) if comment else ""))
    return found


def is_placeholder(value: str, comment: str) -> bool:
    """The README's marks of a path that is the user's: a word in capitals (RUN, DIR, FILE ...), ``<...>``, or a
    line commented ``# your ...``."""
    return bool(re.search(r"(^|[/=\[])[A-Z]{2,}([/.\]-]|$)", value) or "<" in value
                or re.match(r"your\b", comment))


def path_problems(tokens: List[str], comment: str, created: set) -> List[str]:
    """What is missing among the files and presets one command names (empty: all there)."""
    problems = []

    def check(path: str) -> None:
        if is_placeholder(path, comment) or HUB_ID.match(path) or path.rstrip("/") in created:
            return
        if not (ROOT / path).exists() or not (ROOT / path).resolve().is_relative_to(ROOT.resolve()):
            problems.append(f"{' '.join(tokens)}: {path} is not in the checkout")

    args = [t[1:-1] if t.startswith("[") and t.endswith("]") else t for t in tokens]  # [optional] args
    if args[:2] == ["pip", "install"] or "&&" in args:
        for i, arg in enumerate(args):
            if arg == "-e":
                check(re.sub(r"\[.*\]$", "", args[i + 1]))
        return problems
    if args[0] in ("python", "bash") and len(args) > 1 and not args[1].startswith("-"):
        check(args[1])  # a script
    if args[:3] == ["python", "-m", "benchmarks"]:
        check("benchmarks/__main__.py")
    if args[:2] == ["wandb", "sweep"]:
        check(args[2])
    if "recipes" in args and "cp" in args:  # qwenft recipes cp NAME DEST: DEST/NAME.yaml is written
        name, dest = args[args.index("cp") + 1], args[args.index("cp") + 2]
        assert name in available_recipes() or (ROOT / "recipes" / f"{name}.yaml").is_file(), name
        created.add(str(Path(dest) / f"{Path(name).name}.yaml"))
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or key.startswith("-"):
            continue
        if INPUT_KEYS.match(key):
            for item in value.strip("[]").split(","):
                check(item.strip())
        elif key == "+recipe":
            if value.endswith(".yaml") or "/" in value:
                check(value)
            elif not is_placeholder(value, comment):
                assert value in available_recipes(), f"{' '.join(tokens)}: no recipe {value}"
        elif key in GROUPS and not is_placeholder(value, comment):
            for option in value.split("|"):
                check(f"conf/{key}/{option}.yaml")
    return problems


def qwenft_commands(text: str):
    """``(command, overrides, multirun)`` of each ``python -m qwenft`` (or launcher ``-m qwenft``) line with a
    Hydra config; a synopsis with optional ``[args]`` twice: without them, and with them all and the last of each
    ``a|b`` choice."""
    flags = {"-m", "--cfg", "job"}
    for tokens, _ in commands(text):
        if "qwenft" not in tokens or tokens[tokens.index("qwenft") - 1] != "-m":
            continue
        rest = tokens[tokens.index("qwenft") + 1:]
        if not rest or rest[0] in ("--help", "recipes"):
            continue
        typed = [a for a in rest[1:] if a not in flags and not a.startswith("[")]
        yield rest[0], typed, "-m" in rest
        if any(a.startswith("[") for a in rest[1:]):
            full = [re.sub(r"=[^=]*\|([^|]*)$", r"=\1", a.strip("[]")) for a in rest[1:] if a not in flags]
            yield rest[0], full, "-m" in rest


def test_every_path_in_the_readmes_commands_is_shipped_or_marked():
    text = README.read_text(encoding="utf-8")
    found = commands(text)
    assert len(found) > 30  # the extraction sees the README's commands
    created: set = set()
    problems = [p for tokens, comment in found for p in path_problems(tokens, comment, created)]
    assert not problems, "\n".join(problems)
    assert "../shared" not in text  # a user's clone has no ../shared


def test_the_checks_see_a_missing_file():
    """The check can fail: the issue's example as it was, and a typo'd recipe name."""
    created: set = set()
    line = "python -m qwenft train +recipe=domain data.sources.0.path=../shared/data/domain/gsm8k/train.jsonl"
    assert path_problems(shlex.split(line), "", created)
    assert not path_problems(shlex.split("python -m qwenft train data.sources.0.path=FILE"), "", created)
    assert not path_problems(shlex.split("python -m qwenft eval 'eval.bench_data=[/data/x]'"), "your copies", created)
    with pytest.raises(AssertionError):
        path_problems(shlex.split("python -m qwenft train +recipe=quikstart"), "", created)


def test_every_qwenft_command_in_the_readme_validates():
    """What ``--cfg job`` does for each README command: compose it with its overrides as typed and validate it."""
    register_resolvers()
    seen = 0
    for command, overrides, multirun in qwenft_commands(README.read_text(encoding="utf-8")):
        if any(a.startswith("+recipe=") and a.endswith(".yaml") for a in overrides):
            continue  # a recipe file written by `qwenft recipes cp` (checked above)
        try:
            configs = validate(command, recipe_overrides(free_form(overrides)), multirun=multirun)
        except ConfigError as exc:  # an optional extra (gguf-check, quantize) this environment lacks
            if "not installed" in str(exc):
                continue
            raise
        assert configs, (command, overrides)
        seen += 1
    assert seen >= 15


def _own_data_examples(text: str):
    section = text.split("### Use your own data", 1)[1].split("\n## ", 1)[0]
    return [overrides for command, overrides, _ in qwenft_commands(section) if command == "train"]


def test_own_data_examples_read_their_rows():
    """The "Use your own data" commands, with the tiny-random model in place of the 0.5B one: every source is read
    from the shipped file, its fields mapped, its eval rows held out, and training examples are left."""
    from qwenft.data.pipeline import build
    from qwenft.config import TinyModelConfig
    from qwenft.model import load_tokenizer
    from qwenft.model.tiny import tiny_model_dir

    examples = _own_data_examples(README.read_text(encoding="utf-8"))
    assert len(examples) == 2
    register_resolvers()
    tokenizer = load_tokenizer(str(tiny_model_dir(TinyModelConfig())))
    for overrides in examples:
        overrides = [o for o in overrides if not o.startswith("model=")] + ["model=tiny-random"]
        config = validate("data", recipe_overrides(free_form(overrides)))[0]
        source = config.data.sources[0]
        assert (ROOT / source.path).is_file(), source.path
        stats = build(config, tokenizer).stats["sources"][source.name]
        assert stats["eval"] == source.eval_rows and stats["used"] > 0, stats


def test_every_recipes_data_file_is_shipped():
    """A built-in recipe's data files are the project's (gsm8k_eval read ../shared/data, absent from a clone); a
    path left to the user is ``???`` (Hydra's mandatory value: the run says which key to set)."""
    import yaml

    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        data = (yaml.safe_load(recipe.read_text(encoding="utf-8")) or {}).get("data") or {}
        for source in data.get("sources") or []:
            path = str(source.get("path", "???"))
            if path == "???":
                continue
            assert path.startswith("${qwenft_root:}/"), f"{recipe.name}: {path}"
            file = ROOT / path.removeprefix("${qwenft_root:}/")
            assert file.is_file() and file.resolve().is_relative_to(ROOT.resolve()), f"{recipe.name}: {path}"
