"""Helpers shared by every test package (unit, integration, e2e)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from app.embedded_services import free_port

__all__ = ["admin_env", "free_port"]


def admin_env() -> dict[str, str]:
    """The admin API of a test broker on a free port: the default (18083) would be
    taken by the first of several brokers a test runs."""
    return {"DEVICEMQ_ADMIN_PORT": str(free_port("127.0.0.1"))}


@pytest.fixture(scope="module")
def chromium(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A headless Chromium for a test module (tests/e2e/browser.py), quit after it."""
    from tests.e2e.browser import start_chromium

    driver = start_chromium(tmp_path_factory.mktemp("chromium"))
    try:
        yield driver
    finally:
        driver.quit()


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` hands out the heaviest files first (tests/scheduling.py)."""
    if config.getoption("dist") != "loadfile":
        return None
    from tests.scheduling import HeaviestFirst

    return HeaviestFirst(config, log)
