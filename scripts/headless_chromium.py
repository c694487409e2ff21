"""Debian's headless chromium, driven by selenium: what the /kv page's browser test
(tests/test_kv_page_browser.py) and its screenshots (scripts/kv_page_screenshots.py) share.

`find()` locates chromium and chromedriver, `start()` opens a browser with its own profile,
`emulate()` sets the viewport and colour scheme, `full_page_png()` captures the whole page.
selenium is imported only when a browser starts (it is a test extra).
"""

from __future__ import annotations

import base64
import shutil
from pathlib import Path
from typing import Any

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
MISSING = "Debian's chromium and chromium-driver are not installed (apt-get install -y chromium chromium-driver)"


def find() -> tuple[str, str] | None:
    """(chromium, chromedriver) paths, or None where either is not installed."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (chromium, driver) if chromium is not None and driver is not None else None


def start(chromium: str, driver_path: str, profile: Path | str, *extra_flags: str) -> Any:
    """A headless chromium (a selenium driver) using `profile` as its user data directory."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (*FLAGS, f"--user-data-dir={profile}", *extra_flags):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path=driver_path), options=options)


def emulate(driver: Any, width: int, height: int, dark: bool, mobile: bool) -> None:
    """A viewport of width x height (a phone's, twice the pixel density, where `mobile`) and a light
    or dark preferred colour scheme."""
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 2 if mobile else 1, "mobile": mobile},
    )
    scheme = [{"name": "prefers-color-scheme", "value": "dark" if dark else "light"}]
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": scheme})


def full_page_png(driver: Any, width: int) -> bytes:
    """A PNG of the whole page, `width` wide and as tall as the document."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    clip = {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip}
    )
    return base64.b64decode(shot["data"])
