"""The console as an operator meets it, for the tests that drive it: the real ``outboxd ui``
process, a signed-in HTTP client, and Debian's chromium driven by Selenium (never a
downloaded browser). Screenshots are 1400×1000 PNGs, copied to ``$CONSOLE_SHOTS_DIR`` when
that is set.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from outbox.schema import LATENCY_BOUNDS_MS
from tests import procs

TOKEN = "console-token-for-the-test-0123456789"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
needs_chromium = pytest.mark.skipif(not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)),
                                    reason="Debian chromium and chromium-driver are needed (.ci/run installs them)")


@contextmanager
def chromium(*, screen: bool = False) -> Iterator[Any]:
    """Headless Debian chromium; with ``screen``, the page itself is 1400×1000 (no window frame)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--hide-scrollbars"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    browser.implicitly_wait(15)  # a click that submits a form may return before the next page is there
    try:
        if screen:
            browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                                    {"width": 1400, "height": 1000, "deviceScaleFactor": 1, "mobile": False})
        yield browser
    finally:
        browser.quit()


def sign_in(browser: Any, base: str) -> None:
    """Sign the browser in with the token, and wait for the console's first page."""
    from selenium.webdriver.common.by import By

    browser.get(f"{base}/login")
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.ID, "sign-in").click()
    browser.find_element(By.ID, "health")


def submit(browser: Any, by: str, value: str) -> None:
    """Click what loads a new page and wait until it has replaced the old one, so the next
    lookup never reads the previous page (its notice, say) as it goes stale."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    def replaced(driver: Any) -> bool:
        # A new document has a new window object without the mark; asking the old element
        # whether it went stale can race the navigation inside chromedriver itself.
        try:
            return bool(driver.execute_script(
                "return window.__outboxdOldPage === undefined && document.readyState === 'complete'"))
        except WebDriverException:  # the script ran while the documents were swapping
            return False

    browser.execute_script("window.__outboxdOldPage = true")
    browser.find_element(by, value).click()
    WebDriverWait(browser, 30).until(replaced)


def keep_shots(shots: list[Path]) -> None:
    """Each screenshot is a 1400×1000 PNG; copied to ``$CONSOLE_SHOTS_DIR`` when set."""
    target = os.environ.get("CONSOLE_SHOTS_DIR")
    for path in shots:
        header = path.read_bytes()[:24]
        assert header[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", header[16:24]) == (1400, 1000)
        if target:
            Path(target).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, target)


def tile(page: str, name: str) -> str:
    """The ``data-value`` of an endpoint health tile."""
    match = re.search(rf'id="eh-{name}"><div class="k">[^<]*</div><div class="v" data-value="([^"]*)"', page)
    assert match, name
    return match.group(1)


def bucket_bounds(latency: float) -> tuple[float, float]:
    """The latency histogram's bucket (docs/observability.md) that holds ``latency``: its bounds."""
    lower = 0.0
    for bound in LATENCY_BOUNDS_MS:
        if latency <= bound:
            return lower, float(bound)
        lower = float(bound)
    return lower, float("inf")


def console_env(database_url: str) -> dict[str, str]:
    """The daemon's test environment without a signing key: the console signs nothing."""
    return {k: v for k, v in procs.daemon_env(database_url, Path("unused.pem")).items()
            if not k.startswith("OUTBOX_SIGNING")}


@pytest.fixture(scope="module")
def console(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One console process for the module (each test empties the tables it reads)."""
    log = tmp_path_factory.mktemp("console") / "ui.log"
    port = procs.free_port()
    proc = procs.start_ui({**console_env(pg_url), "OUTBOX_UI_TOKEN": TOKEN}, port, log)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        procs.stop(proc)


def signed_in(base: str) -> tuple[httpx.Client, str]:
    """An HTTP client signed in to the console, and its CSRF token."""
    client = httpx.Client(base_url=base)
    assert client.post("/login", data={"token": TOKEN}).status_code == 303
    csrf = re.search(r'name="csrf" value="([^"]+)"', client.get("/").text)
    assert csrf
    return client, csrf.group(1)
