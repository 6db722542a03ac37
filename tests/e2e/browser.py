"""A real headless browser for the admin web console's tests: Debian's Chromium,
driven by its own chromedriver through Selenium.

The driver's path is given to Selenium (``Service``), so Selenium Manager is
never run: nothing is downloaded, and no network is needed. ``bash .ci/run``
installs the ``chromium`` and ``chromium-driver`` packages.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Literal, TypeVar

import pytest
from selenium import webdriver
from selenium.common.exceptions import (
    NoSuchElementException,
    StaleElementReferenceException,
    TimeoutException,
    WebDriverException,
)
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.wait import WebDriverWait

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WAIT = 20.0

T = TypeVar("T")


def start_chromium(
    workdir: Path | None = None, size: tuple[int, int] = (1280, 800)
) -> webdriver.Chrome:
    """A headless Chromium with a fresh profile in ``workdir`` (a temporary
    directory when None); the test fails, never skips, when it is not installed."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.is_file()]
    if missing:
        pytest.fail(
            f"{' and '.join(missing)} not installed (bash .ci/run installs chromium "
            "and chromium-driver)"
        )
    workdir = workdir or Path(tempfile.mkdtemp(prefix="devicemq-chromium-"))
    workdir.mkdir(parents=True, exist_ok=True)
    options = Options()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={workdir / 'profile'}",
        f"--window-size={size[0]},{size[1]}",
    ):
        options.add_argument(arg)
    # An explicit driver path: Selenium Manager (which would download one) never runs.
    service = Service(str(CHROMEDRIVER), log_output=str(workdir / "chromedriver.log"))
    try:
        return webdriver.Chrome(service=service, options=options)
    except WebDriverException as e:
        log = workdir / "chromedriver.log"
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        pytest.fail(f"chromium did not start: {e.msg}\n{tail}")


def page_text(driver: WebDriver) -> str:
    try:
        return str(driver.find_element(By.TAG_NAME, "body").text)
    except WebDriverException as e:
        return f"(no page text: {e.msg})"


def wait_for(
    driver: WebDriver,
    condition: Callable[[WebDriver], Literal[False] | T],
    what: str,
    timeout: float = WAIT,
) -> T:
    """``condition``'s first truthy value; on a timeout the test fails naming
    ``what``, with the page's text (its error line included) to see why. An
    element missing or replaced while the page renders is tried again."""
    try:
        return WebDriverWait(
            driver,
            timeout,
            poll_frequency=0.05,
            ignored_exceptions=(NoSuchElementException, StaleElementReferenceException),
        ).until(condition)
    except TimeoutException:
        pytest.fail(f"timed out waiting for {what}; the page says:\n{page_text(driver)[:3000]}")
