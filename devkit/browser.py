"""Headless Chromium for the /kv page's test and its cost benchmark: Debian's `chromium` and `chromium-driver`,
driven by Selenium (test extra). No browser download is reachable here, so nothing is fetched: the system's
browser is used, or a clear error says how to install it.
"""

from __future__ import annotations

import shutil
import tempfile

# Without the background-networking flags Chromium keeps dialling Google's services, which this closed network
# refuses; a fresh profile per run keeps runs independent.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
INSTALL_HINT = (
    "needs Debian's chromium and chromium-driver: `make test` installs them when run as root, "
    "or run `apt-get install -y chromium chromium-driver`"
)


class BrowserMissing(RuntimeError):
    """chromium or chromedriver is not installed."""


def chromium_driver(width: int = 1400, height: int = 1000):
    """A Selenium Chrome driver on the system's headless Chromium, with browser console logs kept."""
    chromium, driver_bin = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver_bin:
        raise BrowserMissing(f"the /kv page {INSTALL_HINT}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    profile = tempfile.mkdtemp(prefix="pagedllm-chromium-")
    for flag in CHROMIUM_FLAGS + [f"--window-size={width},{height}", f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver_bin), options=options)
