"""The package's structure: no import cycles (function-level imports included), no module over 400 lines, the
rooms' import direction (cli -> commands -> model, data, chat, runtime -> config), and one place for every command
(``qwenft/<room>/command.py`` defines ``<verb>_command``)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Set

from tests.conftest import ROOT

PACKAGE = ROOT / "qwenft"
MAX_LINES = 400
# The lower rooms, which no command room may be imported by: each may import only rooms listed after it here.
LOWER = ["model", "preference", "data", "kernels", "chat", "memory", "runtime", "runlock", "files", "logfilter", "resources",
         "config"]
COMMANDS = ["train", "evaluate", "generation", "export", "plan", "inspect", "recipes", "serve", "doctor"]
ENTRY = ["cli"]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str) -> Set[str]:
    """Every qwenft module ``path`` imports, anywhere in it (function bodies too), as dotted names."""
    found: Set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("qwenft"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.startswith("qwenft"):
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)  # a submodule imported by name
    return found


def graph() -> Dict[str, Set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        targets = set()
        for imported in imports_of(path, name):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        edges[name] = targets
    return edges


def test_no_import_cycles():
    edges = graph()
    state: Dict[str, int] = {}
    stack = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                cycle = stack[stack.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)


def test_no_module_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _room(module: str) -> str:
    """The room of a module: its first level under qwenft; a room's ``command`` module (``qwenft data``'s
    ``qwenft.data.command``) is a command room of its own."""
    if module.endswith(".command"):
        return module
    return module.split(".")[1] if module.count(".") else ""


def test_rooms_import_one_way():
    """cli -> commands -> (model, data, kernels, chat, runtime, ...) -> config: a lower room never imports a command
    room or the CLI, and each lower room imports only the rooms below it in :data:`LOWER`."""
    wrong = []
    for source, targets in graph().items():
        room = _room(source)
        for target in targets:
            other = _room(target)
            if other == room or not other:
                continue
            if room in LOWER and (other in COMMANDS or other in ENTRY or other.endswith(".command")):
                wrong.append(f"{source} -> {target}")
            elif room in LOWER and other in LOWER and LOWER.index(other) < LOWER.index(room):
                wrong.append(f"{source} -> {target}")
    assert not wrong, "imports against the rooms' direction: " + "; ".join(sorted(wrong))


def defined_functions(path: Path) -> Set[str]:
    """The names of the functions defined at the top level of ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


def test_every_command_is_its_rooms_command_module():
    """``python -m qwenft VERB`` runs ``<verb>_command`` defined in ``qwenft/<room>/command.py``, for every verb of
    the CLI's table, and every ``command.py`` of the package is a verb's (no command lives anywhere else)."""
    from qwenft.cli.dispatch import COMMAND_TABLE

    missing = []
    for verb, (_, room) in COMMAND_TABLE.items():
        path = PACKAGE / room / "command.py"
        if not path.is_file() or f"{verb}_command" not in defined_functions(path):
            missing.append(f"{verb}: {verb}_command in {path.relative_to(ROOT)}")
    assert not missing, "commands not where the convention puts them: " + "; ".join(missing)
    rooms = {room for _, room in COMMAND_TABLE.values()}
    assert {p.parent.name for p in PACKAGE.rglob("command.py")} == rooms
    for name in ("cli.py", "hydra_app.py", "trace.py", "recipes.py", "usage.py", "grid.py"):  # gone into rooms
        assert not (PACKAGE / name).exists(), name


def test_the_checks_see_a_cycle_and_function_level_imports(tmp_path):
    """The AST walk finds imports inside functions, so a cycle through a lazy import is not missed."""
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from qwenft.config import Config\n    import qwenft.runtime\n")
    assert imports_of(path, "qwenft.m") >= {"qwenft.config", "qwenft.config.Config", "qwenft.runtime"}
