"""A real headless browser for the node's page: Debian's chromium and chromium-driver (installed by .ci/run), driven
by selenium. Used by tests/test_dashboard.py, tools/scripts/dashboard_screenshots.py and tools/bench/bench_dashboard.py.
"""

from __future__ import annotations

import base64
import re
import shutil
import tempfile
import time
from pathlib import Path

DESKTOP = (1280, 800)
PHONE = (390, 844)


def available() -> str | None:
    """Why no browser can be driven here, or None when one can."""
    if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
        return "Debian's chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (the test extra)"
    return None


class Browser:
    """One headless chromium, closed with `quit()` (or as a context manager)."""

    def __init__(self, size: tuple[int, int] = DESKTOP):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        self._profile = tempfile.mkdtemp(prefix="provider-browser-")
        opts = webdriver.ChromeOptions()
        opts.binary_location = shutil.which("chromium")
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                    "--no-first-run", "--disable-extensions", "--disable-background-networking",
                    "--disable-component-update", "--disable-default-apps", "--disable-sync", "--mute-audio",
                    f"--user-data-dir={self._profile}", f"--window-size={size[0]},{size[1]}", "--lang=en-US"):
            opts.add_argument(arg)
        opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        self.driver = webdriver.Chrome(options=opts, service=Service(executable_path=shutil.which("chromedriver")))
        self.driver.set_page_load_timeout(30)
        self.resize(*size)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.quit()

    def resize(self, width: int, height: int, mobile: bool = False) -> None:
        """The viewport's size as a device of that size would have it (a phone: touch, mobile layout)."""
        self.driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile})

    def get(self, url: str) -> None:
        self.driver.get(url)

    def field(self, name: str) -> str:
        """The text an element marked data-field=`name` shows."""
        return self.driver.execute_script(
            "const e = document.querySelector(`[data-field=\"${arguments[0]}\"]`); return e ? e.textContent : null;",
            name)

    def value(self, name: str) -> str | None:
        """The raw number behind a figure (its data-value)."""
        return self.driver.execute_script(
            "const e = document.querySelector(`[data-field=\"${arguments[0]}\"]`); return e ? e.dataset.value : null;",
            name)

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def wait(self, predicate, what: str, timeout: float = 10.0, every: float = 0.05):
        deadline = time.monotonic() + timeout
        while True:
            got = predicate()
            if got:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"the page never showed {what} within {timeout} s")
            time.sleep(every)

    def console_errors(self) -> list[str]:
        """What the page logged as errors (a CSP violation is one)."""
        return [e["message"] for e in self.driver.get_log("browser") if e.get("level") == "SEVERE"]

    def screenshot(self, path: Path, full_page: bool = True) -> Path:
        """A PNG of the page: all of it, at the viewport's width, when `full_page`."""
        params = {"format": "png"}
        if full_page:
            metrics = self.driver.execute_cdp_cmd("Page.getLayoutMetrics", {})
            size = metrics.get("cssContentSize") or metrics["contentSize"]
            width = self.js("return window.innerWidth")
            params |= {"captureBeyondViewport": True,
                       "clip": {"x": 0, "y": 0, "width": width, "height": size["height"], "scale": 1}}
        shot = self.driver.execute_cdp_cmd("Page.captureScreenshot", params)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def quit(self) -> None:
        try:
            self.driver.quit()
        finally:
            shutil.rmtree(self._profile, ignore_errors=True)


def login_link(server) -> str:
    """The one-time link `provider start` printed (a LocalServer's stdout, read past its URL line)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = server.proc.stdout.readline()
        if not line:
            break
        m = re.search(r"dashboard: (http://\S+)", line)
        if m:
            return m.group(1)
    raise AssertionError("the node printed no dashboard link")
