"""What the wheel ships imports nothing it does not ship.

pyproject.toml's package list is what ``pip install`` puts on a machine; the
tests and benchmarks/ stay in the clone. A shipped module importing them
works in a checkout and fails once installed (loadtest's benchmarks did, until
they moved to benchmarks/). Every import counts, as in test_import_direction.py:
at module level, inside functions, under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

from tests.unit.test_import_direction import imported_modules

REPO = Path(__file__).resolve().parents[2]


def shipped_packages() -> list[str]:
    """The top-level packages pyproject.toml's package discovery includes."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted(
        path.name
        for path in REPO.iterdir()
        if (path / "__init__.py").is_file()
        and any(fnmatch.fnmatch(path.name, pattern) for pattern in patterns)
    )


def unshipped_imports(source: str, shipped: list[str]) -> list[str]:
    """The imports of ``source`` that reach one of our packages the wheel leaves out."""
    ours = {path.name for path in REPO.iterdir() if (path / "__init__.py").is_file()}
    return [
        f"line {line}: imports {module}"
        for line, module in imported_modules(source)
        if module.split(".")[0] in ours - set(shipped)
    ]


def test_the_wheel_ships_the_tools_and_not_the_tests() -> None:
    shipped = shipped_packages()
    assert {"app", "broker", "edge", "persistence", "pipeline", "loadtest"} <= set(shipped)
    assert "tests" not in shipped and "benchmarks" not in shipped


def test_no_shipped_module_imports_the_tests_or_the_benchmarks() -> None:
    shipped = shipped_packages()
    problems = []
    for package in shipped:
        for path in sorted((REPO / package).rglob("*.py")):
            for problem in unshipped_imports(path.read_text(encoding="utf-8"), shipped):
                problems.append(f"{path.relative_to(REPO)} {problem}")
    assert problems == []


def test_an_import_of_the_tests_is_found() -> None:
    shipped = shipped_packages()
    source = "def f() -> None:\n    from tests.kafka_fixtures import start_tansu\n"
    assert unshipped_imports(source, shipped) == [
        "line 2: imports tests.kafka_fixtures.start_tansu"
    ]
    assert unshipped_imports("import benchmarks.codec_bench\n", shipped) == [
        "line 1: imports benchmarks.codec_bench"
    ]
    assert unshipped_imports("from loadtest.client import Stats\n", shipped) == []
