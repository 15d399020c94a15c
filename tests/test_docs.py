"""The README and the reference in docs/ cannot go stale (issues 27 and 32).

- ``mkdocs build --strict`` builds docs/ (a broken link or anchor, a page missing from the nav fail it).
- Every command line in a fenced block of README.md and docs/*.md is read: each file or directory it names must be in
  the checkout, be written by an earlier command (``recipes cp``), be output (``out=``, ``out_dir=`` ...) or be marked
  as the user's own (a word in capitals, ``<...>``, a line commented ``# your ...``).
- Every ``python -m qwenft`` / ``qwenft`` / launcher ``-m qwenft`` line composes and validates as typed (what
  ``--cfg job`` checks), in this process; a block marked ``<!-- example: run -->`` (``model=`` set to tiny-random) or
  ``<!-- example: run as-typed -->`` also runs end to end, exit 0; ``<!-- example: skip REASON -->`` opts a block out.
  docs/architecture.md ("How the docs are tested") states these rules for writers.
- Every config key the pages name (in backticks or as an override) is a key of the schema (qwenft/config/).
- docs/architecture.md's import-rule table is tests/test_layout.py's rule.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
import shlex
import subprocess
import sys
import typing
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

from qwenft.config import Config, ConfigError
from qwenft.cli.compose import register_resolvers, validate
from qwenft.cli.overrides import free_form
from qwenft.cli.recipe_files import recipe_overrides
from qwenft.resources import available_recipes
from tests.conftest import ROOT
from tests.test_layout import COMMANDS, ENTRY, LOWER

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
PROGRAMS = ("python", "qwenft", "pip", "torchrun", "accelerate", "bash", "vllm", "llama-server", "huggingface-cli",
            "wandb", "ollama")
INPUT_KEYS = re.compile(r"^(data\.sources\.\d+\.path|prompts_file|adapter|model\.path|eval\.bench_data|"
                        r"eval\.bench_tasks|eval\.ppl_sources)$")
GROUPS = ("model", "quant", "lora", "data", "train", "eval", "generate", "dist")  # conf/GROUP/NAME.yaml presets
HUB_ID = re.compile(r"^Qwen/Qwen2\.5-[\w.-]+$")  # a Hugging Face model id (downloaded, not a path)
FENCE = re.compile(r"(?:^<!-- example: (?P<marker>[^>]*?) -->\n)?^```[a-z]*\n(?P<body>.*?)^```", re.S | re.M)
MARKERS = re.compile(r"^(run|run as-typed|skip \(?\S.*)$")


def read(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def blocks(text: str) -> List[Tuple[str, str]]:
    """``(marker, body)`` of every fenced block; the marker is the ``<!-- example: ... -->`` line right above it."""
    return [(m.group("marker") or "", m.group("body")) for m in FENCE.finditer(text)]


def commands(text: str) -> List[Tuple[List[str], str]]:
    """``(tokens, comment)`` of every command line in ``text``'s fenced blocks (continuation lines joined; lines that
    are not a command, as the run-directory tree, are left out)."""
    return [found for _, body in blocks(text) for found in block_commands(body)]


def block_commands(body: str) -> List[Tuple[List[str], str]]:
    found = []
    for line in re.sub(r"\\\n\s*", " ", body).splitlines():
        line = line.strip()
        if line.split(" ")[0] not in PROGRAMS:
            continue
        comment = re.search(r"\s#\s(.*)$", line)
        found.append((shlex.split(line, comments=True), comment.group(1) if comment else ""))
    return found


def is_placeholder(value: str, comment: str) -> bool:
    """The pages' marks of a path that is the user's: a word in capitals (RUN, DIR, FILE ...), ``<...>``, or a line
    commented ``# your ...``."""
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


def qwenft_command(tokens: List[str]) -> Optional[List[str]]:
    """The words after ``qwenft`` of a ``python -m qwenft`` / ``qwenft`` / launcher ``-m qwenft`` line; None for
    another program."""
    if tokens[0] == "qwenft":
        return tokens[1:]
    if "qwenft" in tokens and tokens[tokens.index("qwenft") - 1] == "-m":
        return tokens[tokens.index("qwenft") + 1:]
    return None


def qwenft_commands(text: str, include_skipped: bool = False) -> Iterator[Tuple[str, List[str], bool]]:
    """``(command, overrides, multirun)`` of each qwenft line with a Hydra config (``recipes`` and ``--help`` have
    none); a synopsis with optional ``[args]`` twice: without them, and with them all and the last of each ``a|b``
    choice. Blocks marked ``skip`` are left out."""
    flags = {"-m", "--cfg", "job"}
    for marker, body in blocks(text):
        if marker.startswith("skip") and not include_skipped:
            continue
        for tokens, _ in block_commands(body):
            rest = qwenft_command(tokens)
            if not rest or rest[0] in ("--help", "recipes", "doctor") or rest[1:2] and rest[1].startswith("cache="):
                continue  # no Hydra config: `recipes ...`, `doctor PATH`, `data cache=list|clear`
            typed = [a for a in rest[1:] if a not in flags and not a.startswith("[")]
            yield rest[0], typed, "-m" in rest
            if any(a.startswith("[") for a in rest[1:]):
                full = [re.sub(r"=[^=]*\|([^|]*)$", r"=\1", a.strip("[]")) for a in rest[1:] if a not in flags]
                yield rest[0], full, "-m" in rest


# --- the site ---------------------------------------------------------------------------------------------------


def test_mkdocs_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (the test extra pins mkdocs==1.6.1)")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    built = {p.relative_to(tmp_path / "site").parts[0] for p in (tmp_path / "site").rglob("index.html")}
    assert {page.stem for page in PAGES[1:] if page.stem != "index"} <= built  # every page is in the nav


def anchors(page: Path) -> set:
    """The anchors MkDocs gives the headings of ``page`` (Python-Markdown's toc slugify)."""
    text = re.sub(r"^```.*?^```", "", read(page), flags=re.S | re.M)
    return {re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", title.replace("`", "").encode("ascii", "ignore").decode())
                   .strip().lower()) for title in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_every_page_is_in_the_nav_and_the_readme_links_to_each():
    """The README (outside MkDocs' build) links to every page, to headings that exist, and stays a short tour."""
    nav = re.findall(r":\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(encoding="utf-8"), flags=re.M)
    assert sorted(nav) == sorted(page.name for page in PAGES[1:])
    links = re.findall(r"\]\(docs/([\w-]+\.md)(?:#([\w-]+))?\)", read(README))
    assert {name for name, _ in links} == set(nav), set(nav) ^ {name for name, _ in links}
    broken = [f"{name}#{anchor}" for name, anchor in links if anchor and anchor not in anchors(ROOT / "docs" / name)]
    assert not broken, broken
    assert "evalscore" in anchors(ROOT / "docs" / "eval.md")  # the slug as MkDocs makes it (checked by its build)
    assert len(read(README).splitlines()) <= 150
    first = blocks(read(README))[0][1].splitlines()  # the two commands come first: run the main job; run the tests
    assert [line.rpartition("&& ")[2] for line in first] == ["python -m qwenft train +recipe=quickstart",
                                                             "python -m pytest -q"]


# --- the commands -----------------------------------------------------------------------------------------------


def test_markers_are_known_and_precede_a_qwenft_command():
    """A marker is one of the documented ones, a skip gives its reason, and it stands above a block it affects."""
    seen = 0
    for page in PAGES:
        text = read(page)
        for marker in re.findall(r"^<!-- example: ?(.*?) ?-->", text, flags=re.M):
            assert MARKERS.match(marker), f"{page.name}: unknown marker {marker!r}"
        for marker, body in blocks(text):
            if marker:
                seen += 1
                assert any(qwenft_command(tokens) for tokens, _ in block_commands(body)), (page.name, marker)
        assert len(re.findall("^<!-- example:", text, flags=re.M)) == sum(1 for marker, _ in blocks(text) if marker), \
            f"{page.name}: a marker not on the line right above a fence"
    assert seen >= 3


def test_every_path_in_the_commands_is_shipped_or_marked():
    created: set = set()
    found = 0
    for page in PAGES:
        text = read(page)
        assert "../shared" not in text, page.name  # a user's clone has no ../shared
        for tokens, comment in commands(text):
            found += 1
            problems = path_problems(tokens, comment, created)
            assert not problems, f"{page.name}: " + "\n".join(problems)
    assert found > 40  # the extraction sees the pages' commands


def test_the_checks_see_a_missing_file():
    """The check can fail: the issue's example as it was, and a typo'd recipe name."""
    created: set = set()
    line = "python -m qwenft train +recipe=domain data.sources.0.path=../shared/data/domain/gsm8k/train.jsonl"
    assert path_problems(shlex.split(line), "", created)
    assert not path_problems(shlex.split("python -m qwenft train data.sources.0.path=FILE"), "", created)
    assert not path_problems(shlex.split("python -m qwenft eval 'eval.bench_data=[/data/x]'"), "your copies", created)
    with pytest.raises(AssertionError):
        path_problems(shlex.split("python -m qwenft train +recipe=quikstart"), "", created)


def test_every_qwenft_command_validates():
    """What ``--cfg job`` does for each command of the pages: compose it with its overrides as typed and validate
    it, in this process (no model is loaded)."""
    register_resolvers()
    seen, done = 0, set()
    for page in PAGES:
        for command, overrides, multirun in qwenft_commands(read(page)):
            if any(a.startswith("+recipe=") and a.endswith(".yaml") for a in overrides):
                continue  # a recipe file written by `qwenft recipes cp` (its path is checked above)
            if (command, tuple(overrides), multirun) in done:
                continue  # the same line on another page (a composition costs about a second)
            done.add((command, tuple(overrides), multirun))
            try:
                configs = validate(command, recipe_overrides(free_form(overrides)), multirun=multirun)
            except ConfigError as exc:
                if "not installed" in str(exc):  # an optional extra (gguf-check, quantize) this environment lacks
                    continue
                raise AssertionError(f"{page.name}: {command} {' '.join(overrides)}: {exc}") from exc
            assert configs, (page.name, command, overrides)
            seen += 1
    assert seen >= 30


def test_validation_sees_a_bad_key():
    register_resolvers()
    text = "```\npython -m qwenft train lora.rank=8\n```\n"
    (command, overrides, multirun), = qwenft_commands(text)
    with pytest.raises(ConfigError, match="lora.rank"):
        validate(command, recipe_overrides(free_form(overrides)), multirun=multirun)
    assert not list(qwenft_commands("<!-- example: skip (a reason) -->\n" + text))


def examples_to_run() -> List[Tuple[str, List[str]]]:
    """``(page, argv after qwenft)`` of every line in a block marked ``run`` / ``run as-typed``."""
    found = []
    for page in PAGES:
        for marker, body in blocks(read(page)):
            if not marker.startswith("run"):
                continue
            for tokens, _ in block_commands(body):
                argv = qwenft_command(tokens)
                if marker == "run":
                    argv = [a for a in argv if not a.startswith("model=")] + ["model=tiny-random"]
                found.append((page.name, argv))
    return found


@pytest.mark.slow  # the docs' runnable examples, each a command in a new process
def test_the_examples_marked_run_run(tmp_path):
    """Each example marked ``run`` exits 0 (started together: each is a process of its own, from the checkout root,
    with an empty cache of its own)."""
    examples = examples_to_run()
    assert 3 <= len(examples) <= 8  # a handful: the file's budget is 3 minutes on 2 cores
    procs = []
    for i, (page, argv) in enumerate(examples):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT),
               "QWENFT_CACHE": str(tmp_path / f"cache{i}")}
        procs.append((page, argv, subprocess.Popen([sys.executable, "-m", "qwenft", *argv], cwd=ROOT, env=env,
                                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    for page, argv, proc in procs:
        out, _ = proc.communicate(timeout=170)
        assert proc.returncode == 0, f"{page}: qwenft {' '.join(argv)}\n{out[-3000:]}"


# --- the config keys --------------------------------------------------------------------------------------------


SECTIONS = tuple(name for name, kind in typing.get_type_hints(Config).items() if dataclasses.is_dataclass(kind))
# a dotted name starting with a section, not inside a longer dotted name (qwenft.model.x) or a file's field
# (metrics.json:eval.passed)
# names in backticks that look like keys and are not, on purpose: each is checked to stay out of the schema
NOT_KEYS = {"eval.score": "the score metrics.json and W&B hold (docs/eval.md)",
            "lora.rank": "a bad key, as the error it gets is shown", "lora.alpha": "a near miss qwenft corrects"}
FILE_SUFFIXES = ("json", "jsonl", "yaml", "csv", "md", "py", "log", "png", "txt")
KEY = re.compile(r"(?<![\w.:/$-])(?:%s)\.[A-Za-z_*\[\]0-9N][\w.*\[\]]*" % "|".join(SECTIONS))


def schema_has(key: str) -> bool:
    """Whether the dotted ``key`` is a key of :class:`qwenft.config.Config` (a list of dataclasses is entered through
    an index, ``N`` or ``[*]``; a free-form dict field accepts any key below it)."""
    node: typing.Any = Config
    parts = re.sub(r"\[(\*|\d+)\]", r".\1", key).split(".")
    for part in parts:
        if part.isupper():  # a placeholder: data.sources.N.KEY
            return True
        origin = typing.get_origin(node)
        if origin in (list, List):
            if not (part.isdigit() or part in ("N", "*")):
                return False
            node = typing.get_args(node)[0]
        elif origin in (dict, Dict) or node is typing.Any:
            return True
        elif dataclasses.is_dataclass(node):
            hints = typing.get_type_hints(node)
            if "*" in part:  # eval.bench_*: some key of the section matches
                return any(fnmatch.fnmatchcase(name, part) for name in hints)
            if part not in hints:
                return False
            node = hints[part]
            if typing.get_origin(node) is typing.Union:
                node = next(a for a in typing.get_args(node) if a is not type(None))
        else:
            return False
    return True


def keys_named(text: str) -> List[str]:
    """Config keys in backticks and in the overrides of command lines; ``metrics.json:eval.passed`` (a field of a
    file, not a key) is not one."""
    found = []
    for code in re.findall(r"`([^`\n]+)`", text):
        for m in KEY.finditer(code):
            key = m.group(0).rstrip(".")
            if code[m.end():m.end() + 1] != "(" and key.rpartition(".")[2] not in FILE_SUFFIXES:  # a call, a file
                found.append(key)
    for tokens, _ in commands(text):
        rest = qwenft_command(tokens) or []
        for arg in rest:
            key = arg.strip("[]'\"").lstrip("+").partition("=")[0]
            if KEY.fullmatch(key):
                found.append(key)
    return found


def test_every_config_key_the_pages_name_exists():
    missing, seen = [], set()
    for page in PAGES:
        for key in keys_named(read(page)):
            seen.add(key)
            if key not in NOT_KEYS and not schema_has(key):
                missing.append(f"{page.name}: {key}")
    assert not missing, "keys not in the schema (qwenft/config/): " + "; ".join(sorted(set(missing)))
    assert {"eval.bench_limit", "merge.quantize", "data.sources.0.path", "train.resume"} <= seen
    assert not [key for key in NOT_KEYS if schema_has(key)]  # a name listed as no key became one: say so in the docs


def test_the_key_check_can_fail():
    assert schema_has("eval.bench_limit") and schema_has("data.sources.0.columns") and schema_has("dist.fsdp.x")
    assert not schema_has("eval.bench_limits") and not schema_has("lora.alpha") and not schema_has("data.sources.x")
    text = "`lora.alpha` and `metrics.json:eval.passed`, `model.generate()`, `train.jsonl`"
    assert keys_named(text) == ["lora.alpha"]
    assert schema_has("eval.bench_*") and not schema_has("eval.benchh_*") and schema_has("data.sources[*].name")


# --- the architecture page --------------------------------------------------------------------------------------


def architecture_table() -> Dict[str, Tuple[str, List[str]]]:
    """``{room: (kind, rooms it may import)}`` of docs/architecture.md's import-rule table."""
    section = read(ROOT / "docs" / "architecture.md").split("## The import rule", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        for room in re.findall(r"`([\w.]+)`", cells[0]):
            rows[room] = (cells[1], re.findall(r"`([\w.]+)`", cells[2]))
    return rows


def test_architecture_page_states_test_layouts_rule():
    table = architecture_table()
    lower = [room for room, (kind, _) in table.items() if kind == "lower"]
    assert lower == LOWER  # the same rooms, in the same order
    for i, room in enumerate(LOWER):
        assert table[room][1] == LOWER[i + 1:], room
    commands_ = {room for room, (kind, _) in table.items() if kind == "command"}
    assert commands_ == set(COMMANDS) | {"qwenft.data.command"}
    assert {room for room, (kind, _) in table.items() if kind == "entry"} == set(ENTRY)
    rooms = {p.stem if p.suffix == ".py" else p.name for p in (ROOT / "qwenft").iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").exists()) and not p.name.startswith("_")}
    assert rooms == set(table) - {"qwenft.data.command"}  # every room of the package is in the table


def test_data_and_sources_of_the_own_data_examples():
    """The "Use your own data" commands (docs/data.md), with the tiny-random model in place of the 0.5B one: every
    source is read from the shipped file, its fields mapped, its eval rows held out, training examples are left."""
    from qwenft.config import TinyModelConfig
    from qwenft.data.pipeline import build
    from qwenft.model import load_tokenizer
    from qwenft.model.tiny import tiny_model_dir

    section = read(ROOT / "docs" / "data.md").split("## Use your own data", 1)[1].split("\n## ", 1)[0]
    examples = [overrides for command, overrides, _ in qwenft_commands(section) if command == "train"]
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
