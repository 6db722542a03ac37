"""broker/compiled.py: which hot modules this process runs compiled, as the log
and ``devicemq --version`` say. True both ways: .ci/run runs tests/unit on the
pure tree and again on the copy holding the wheel's compiled modules."""

from __future__ import annotations

import importlib
from importlib.machinery import EXTENSION_SUFFIXES

from broker.compiled import MODULES, compiled, describe, module_name


def test_what_it_reports_is_what_an_import_loads() -> None:
    """The look-up on disk (no import) agrees with the import system."""
    loaded = {
        module_name(path)
        for path in MODULES
        if str(importlib.import_module(module_name(path)).__file__).endswith(
            tuple(EXTENSION_SUFFIXES)
        )
    }
    assert set(compiled()) == loaded


def test_the_line_names_the_count_or_pure_python() -> None:
    count = len(compiled())
    line = describe()
    if count:
        assert line == f"compiled with mypyc: {count} of {len(MODULES)} hot modules"
    else:
        assert line == "pure Python: no hot module compiled with mypyc"


def test_module_names() -> None:
    assert module_name("broker/handlers/acks.py") == "broker.handlers.acks"
    assert "broker.core" in {module_name(p) for p in MODULES}
