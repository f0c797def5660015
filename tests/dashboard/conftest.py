from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.dashboard.browser import start_chromium


@pytest.fixture(scope="session")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One headless Chromium for the dashboard tests (a fresh profile)."""
    driver = start_chromium(tmp_path_factory.mktemp("chromium-profile"))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """The browser for one test, starting with empty logs; afterwards on a blank page, so the
    dashboard's event stream is closed before the test's Core stops (its errors are not the next
    test's console errors)."""
    browser.get("about:blank")
    browser.get_log("browser")
    browser.get_log("performance")
    yield browser
    browser.get("about:blank")
    browser.get_log("browser")
    browser.get_log("performance")
