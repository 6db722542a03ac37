"""Imports point down the layers only (docs/ARCHITECTURE.md, "Packages and their direction").

broker (the protocol) <- persistence (the durable path), edge (the network
edge: listeners, WebSocket, logging setup; beside persistence, neither imports
the other) <- app (the composition root, authentication's files, HTTP,
embedded services) <- pipeline, loadtest (tools on top, which may
start the embedded services) <- app.cli (the ``devicemq`` command, whose
``loadtest`` and ``pipeline`` subcommands run the tools). Every import counts:
at module level, inside functions, under ``TYPE_CHECKING``; an upward one, even
deferred, ties the lower part to the upper one again.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A part is a package, or a module named apart (the longest name that matches wins).
LAYER = {
    "broker": 0,
    "persistence": 1,
    "edge": 1,
    "app": 2,
    "pipeline": 3,
    "loadtest": 3,
    "app.cli": 4,
}
PACKAGES = ("broker", "persistence", "edge", "app", "pipeline", "loadtest")


def part_of(module: str) -> str | None:
    """The part of LAYER a dotted module name belongs to, None if not ours."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in LAYER:
            return name
    return None


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, dotted module) of every absolute import in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # ``from app import cli`` imports app.cli: name the module when it is one.
            found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
    return found


def upward_imports(module: str, source: str) -> list[str]:
    """The imports of ``module`` that reach a higher part, or a part beside its own."""
    own = part_of(module)
    assert own is not None
    problems = []
    for line, imported in imported_modules(source):
        target = part_of(imported)
        if target is not None and target != own and LAYER[target] >= LAYER[own]:
            problems.append(f"line {line}: imports {imported}")
    return problems


def test_no_module_imports_upward() -> None:
    problems = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            for problem in upward_imports(module, path.read_text()):
                problems.append(f"{path.relative_to(REPO)} {problem}")
    assert problems == []


def test_an_upward_import_inside_a_function_is_found() -> None:
    source = "def f() -> None:\n    from persistence.device_persistence import open_persistence\n"
    assert upward_imports("broker.core", source) == [
        "line 2: imports persistence.device_persistence.open_persistence"
    ]
    assert upward_imports("app.serve", source) == []


def test_tools_sit_between_the_root_and_the_command_line() -> None:
    assert upward_imports("pipeline.cli", "import loadtest.cli\n") == [
        "line 1: imports loadtest.cli"
    ]
    assert upward_imports("loadtest.soak", "from app.embedded_services import HOST\n") == []
    assert upward_imports("loadtest.soak", "from app import cli\n") == ["line 1: imports app.cli"]
    assert upward_imports("app.cli", "from loadtest.cli import run_command\n") == []
    assert upward_imports("app.serve", "from loadtest.cli import run_command\n") == [
        "line 1: imports loadtest.cli.run_command"
    ]
