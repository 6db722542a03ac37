"""Imports point down the layers only (docs/ARCHITECTURE.md, "Packages and their direction").

broker (the protocol) <- persistence (the durable path), edge (the network
edge: listeners, WebSocket, logging setup; beside persistence, neither imports
the other) <- app (the composition root, authentication's files, HTTP,
embedded services) <- pipeline, loadtest (tools on top, which may
start the embedded services) <- app.cli (the ``devicemq`` command, whose
``loadtest`` and ``pipeline`` subcommands run the tools). Every import counts:
at module level, inside functions, under ``TYPE_CHECKING``; an upward one, even
deferred, ties the lower part to the upper one again.

And no cycle among the imports a module runs when it is imported (at its top
level, not under ``TYPE_CHECKING`` nor inside a function): every module can be
imported first, and the order of the parts is the order of their imports. A
part that needs another part of the broker takes a small Protocol of what it
uses (``ClusterHost``, ``SysHost``, the handlers' ``ConnectHost`` ...), not
``Broker``.
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


# -- no cycle among runtime imports ------------------------------------------------------


def _is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _run_at_import(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The import statements a module runs when it is imported: at its top level, and
    inside top-level ``if``/``try``/``with`` blocks, but not under ``TYPE_CHECKING``
    nor inside a function or class body (run later, or never, by then the imported
    module is complete)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                found += _run_at_import(node.body)
            found += _run_at_import(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                found += _run_at_import(block)
            for handler in node.handlers:
                found += _run_at_import(handler.body)
        elif isinstance(node, ast.With):
            found += _run_at_import(node.body)
    return found


def runtime_imports(module: str, source: str, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``module`` imports when it is itself imported;
    ``from package import name`` counts as the module package.name when that is one,
    and a module's packages are imported with it. The packages import absolutely only
    (a relative import fails the test)."""
    found: set[str] = set()
    for node in _run_at_import(ast.parse(source).body):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            assert node.level == 0 and node.module, f"{module}: a relative import"
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [n if n in modules else node.module for n in names]
        for name in names:
            # Importing a.b.c runs package a.b first, unless the importer is inside it.
            parts = name.split(".")
            for n in range(1, len(parts) + 1):
                ancestor = ".".join(parts[:n])
                inside = module.startswith(ancestor + ".")
                if ancestor in modules and ancestor != module and not inside:
                    found.add(ancestor)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle of ``graph`` (module -> modules it imports) as one strongly connected
    component of more than one module, or a module importing itself; sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def runtime_import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """module -> the modules of ``sources`` it imports at run time."""
    modules = set(sources)
    return {module: runtime_imports(module, text, modules) for module, text in sources.items()}


def repo_sources() -> dict[str, str]:
    """Every module of the packages by its dotted name (a package by its own name)."""
    sources = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            sources[".".join(parts)] = path.read_text()
    return sources


def test_no_cycle_among_runtime_imports() -> None:
    assert import_cycles(runtime_import_graph(repo_sources())) == []


def test_a_planted_cycle_is_found_and_a_type_only_one_is_not() -> None:
    sources = {
        "broker.a": "import broker.b\n",
        "broker.b": "from broker.c import thing\n",
        "broker.c": "if True:\n    from broker import a\n",
        "broker.d": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import broker.a\n",
        "broker.e": "def later() -> None:\n    import broker.d\n",
    }
    assert import_cycles(runtime_import_graph(sources)) == [["broker.a", "broker.b", "broker.c"]]
    sources["broker.a"] = "from broker import d\n"  # d and e import a for types or later
    sources["broker.b"] = "import broker.e\n"
    assert import_cycles(runtime_import_graph(sources)) == []
    assert import_cycles({"x": {"x"}}) == [["x"]]


def test_importing_a_module_imports_its_packages() -> None:
    sources = {
        "broker.p": "import broker.p.inner\n",
        "broker.p.inner": "x = 1\n",
        "broker.q": "import broker.p.inner\n",
    }
    graph = runtime_import_graph(sources)
    assert graph["broker.q"] == {"broker.p", "broker.p.inner"}
    assert graph["broker.p.inner"] == set()
    sources["broker.p.inner"] = "from broker.q import x\n"  # q -> p -> inner -> q
    assert import_cycles(runtime_import_graph(sources)) == [
        ["broker.p", "broker.p.inner", "broker.q"]
    ]


# -- persistence reads no broker internals -------------------------------------------------

# What the durable path may not reach for: the broker held as an attribute of its own
# (``self._broker.sessions``...), or a session's feeds through its outflow. Stored
# messages reach the live feeds through the feeds the path made itself
# (persistence/feed_bridge.py), which know their outflow by the Feed port.
REACHES = (("_broker",), ("outflow", "feed"), ("outflow", "side"))


def broker_reaches(source: str) -> list[str]:
    """(line: dotted reach) of every attribute chain in ``source`` ending in a REACHES."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        chain = [node.attr]
        inner = node.value
        while isinstance(inner, ast.Attribute) and len(chain) < 2:
            chain.insert(0, inner.attr)
            inner = inner.value
        for reach in REACHES:
            if tuple(chain[-len(reach) :]) == reach:
                found.append(f"line {node.lineno}: .{'.'.join(reach)}")
    return sorted(set(found))


def test_persistence_reads_no_broker_internals() -> None:
    problems = []
    for path in sorted((REPO / "persistence").rglob("*.py")):
        for problem in broker_reaches(path.read_text()):
            problems.append(f"{path.relative_to(REPO)} {problem}")
    assert problems == []


def test_a_reach_into_the_broker_is_found() -> None:
    source = (
        "def f(self, cid):\n"
        "    session = self._broker.sessions.get(cid)\n"
        "    feed = session.outflow.feed\n"
        "    return outflow.side, feed.outflow.connection\n"
    )
    assert broker_reaches(source) == ["line 2: ._broker", "line 3: .outflow.feed"]
