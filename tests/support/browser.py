"""The browser the tests drive: Debian's Chromium, through Playwright (never a downloaded browser)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from model.options import Environment

CHROMIUM = Path("/usr/bin/chromium")
# the chat page's assistant replies and the stats line under each (the stats message has its own avatar)
ANSWERS = '.step[data-step-type="assistant_message"]:not(:has(img[alt="Avatar for stats"])) .message-content'
STATS = '.step:has(img[alt="Avatar for stats"]) .message-content'
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


def browser_or_reason() -> str | None:
    """None when the browser test can run, else why not."""
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing: install Debian's Chromium with `apt-get install -y chromium`"
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is missing: `pip install -r requirements-test.txt`"
    return None


def need_browser() -> None:
    """Go on where the browser tests can run; else skip the test (LLAMA_SKIP_BROWSER=1) or fail it, naming
    what is missing."""
    import pytest

    reason = browser_or_reason()
    if reason and skip_browser():
        pytest.skip(f"LLAMA_SKIP_BROWSER=1: {reason}")
    if reason:
        pytest.fail(f"{reason} (or set LLAMA_SKIP_BROWSER=1 to skip the browser tests)", pytrace=False)


def skip_browser() -> bool:
    """LLAMA_SKIP_BROWSER=on (or 1, yes, true): skip the browser tests where there is no browser, instead of
    failing them."""
    return Environment().switch("LLAMA_SKIP_BROWSER", default=False)


def send_message(page, text: str, tries: int = 3) -> None:
    """Type text in the chat's box and press Enter, once the box takes it (Enter is ignored while a reply
    runs); the page takes a message by emptying the box. An Enter pressed right after the text was filled
    can reach the box before its handler has read the text, and nothing is sent (seen once in a whole run:
    the text still in the box two minutes later): Enter is pressed again then, up to `tries` times in all."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.fill("#chat-input", text)
    page.wait_for_selector("#chat-submit:enabled")
    for _ in range(tries):
        page.press("#chat-input", "Enter")
        try:
            page.wait_for_function("() => document.querySelector('#chat-input').value === ''", timeout=5_000)
            return
        except PlaywrightTimeout:
            pass
    raise AssertionError(f"the chat's box kept {text!r} after {tries} presses of Enter")
