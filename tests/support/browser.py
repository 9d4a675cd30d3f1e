"""The browser the tests drive: Debian's Chromium, through Playwright (never a downloaded browser)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


def browser_or_reason() -> str | None:
    """None when the browser test can run, else why not."""
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing: install Debian's Chromium with `apt-get install -y chromium`"
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is missing: `pip install -r requirements-test.txt`"
    return None
