"""Headless Debian Chromium driven through ChromeDriver (selenium), for the dashboard tests.

Playwright's own browser download cannot run here; Debian's `chromium` and `chromium-driver`
(installed by scripts/install-system-deps.sh) can. The flags keep Chromium from calling home
(component updates, sync, background networking), so every request the page makes is the
page's own, and the performance log lists them."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1800",
)


def start_chromium(profile: Path) -> Any:
    """A fresh headless Chromium with its console and network logs kept; fails (not skips) when
    the Debian packages are missing: `make system-deps` installs them."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for path in (CHROMIUM, CHROMEDRIVER):
        if shutil.which(path) is None:
            pytest.fail(f"{path} is missing: run `make system-deps` (Debian chromium, chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def requested_urls(driver: Any) -> list[str]:
    """Every URL the page asked for since the last call (from the DevTools performance log)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message.get("method") == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def console_errors(driver: Any) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def js(driver: Any, script: str) -> Any:
    return driver.execute_script(script)


def text_of(driver: Any, selector: str) -> str:
    """The element's text, read in one script call: the page re-renders every second, so an
    element handle found first could be replaced before its text is read."""
    text = driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e === null ? null : e.innerText;", selector
    )
    assert text is not None, f"no element {selector!r} on the page"
    return str(text)


def click(driver: Any, selector: str) -> None:
    """Clicks the element, finding it again if a re-render replaced it in between."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    for attempt in range(5):
        try:
            driver.find_element(By.CSS_SELECTOR, selector).click()
            return
        except StaleElementReferenceException:
            if attempt == 4:
                raise


def network_hosts(driver: Any) -> set[str]:
    """Hosts of every network request the browser made since the last call (chrome:// pages of
    the blank start tab are the browser's own, not network)."""
    urls = [urlparse(u) for u in requested_urls(driver)]
    return {u.netloc for u in urls if u.scheme in ("http", "https", "ws", "wss")}


def artifact_dir(tmp_path: Path) -> Path:
    where = Path(os.environ.get("ELASWAVE_ARTIFACT_DIR", tmp_path))
    where.mkdir(parents=True, exist_ok=True)
    return where
