"""The models panel as a user meets it, in headless Chromium: on a first start (one small model) the welcome offers
a better model; the panel lists the model; a pull from a stand-in hub shows a moving progress bar, is cancelled,
pulled again (going on from what it had), and the model it brings answers in the chat. Screenshots go to
test-output/e2e-models/; with LLAMA_UPDATE_SCREENSHOT=1 (or when it is missing) the one of the pull under way
also becomes docs/models-panel.png."""

from __future__ import annotations

import json
import shutil
import sqlite3
import threading
import time

import httpx
import pytest
from support.browser import CHROMIUM, CHROMIUM_ARGS, STATS, need_browser, send_message
from support.checkpoints import write_tiny_checkpoint
from support.fake_hub import FakeHub
from support.servers import ROOT, ChainlitServer, server_env

from model.options import Environment

SHOTS = ROOT / "test-output" / "e2e-models"
SCREENSHOT = ROOT / "docs" / "models-panel.png"
PULLED, OTHER = "acme/Tiny-Pulled", "acme/Tiny-Other"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    hub = FakeHub()
    hub.add_folder(PULLED, write_tiny_checkpoint(tmp_path_factory.mktemp("hub") / "Tiny-Pulled", seed=1))
    hub.add_folder(OTHER, write_tiny_checkpoint(tmp_path_factory.mktemp("other") / "Tiny-Other", seed=2))
    yield hub
    hub.stop()


@pytest.fixture(scope="module")
def server(hub, tmp_path_factory):
    need_browser()
    folder = tmp_path_factory.mktemp("models")
    weights = folder / "weights"
    write_tiny_checkpoint(weights / "tiny")
    env = server_env(checkpoint=weights / "tiny", weights_dir=weights, dtype="fp32", threads=1, max_new_tokens=8,
                     history_db=folder / "history.db")
    env |= {"HF_ENDPOINT": hub.url, "HF_HOME": str(folder / "hf")}
    env.pop("HF_TOKEN", None)
    server = ChainlitServer(env, log=folder / "chainlit.log")
    yield from server.running()


def shot(page, name: str):
    path = SHOTS / f"{name}.png"
    page.screenshot(path=path)
    return path


def said(page) -> str:
    return page.locator(".models-said").last.inner_text() if page.locator(".models-said").count() else ""


def wait_for(check, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.2)
    return found


def test_a_first_chat_pulls_a_better_model_from_the_panel_and_chats_with_it(server, hub):
    from playwright.sync_api import sync_playwright

    shutil.rmtree(SHOTS, ignore_errors=True)
    SHOTS.mkdir(parents=True)
    hub.held, hub.held_files = threading.Event(), {"model.safetensors"}
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1000, "height": 760})
            page.set_default_timeout(60_000)
            page.goto(server.url)
            offer = page.get_by_text("Chatting with tiny: get a better model")
            offer.wait_for()
            shot(page, "01-welcome")
            # A pull asked through Ollama's API (as `ollama pull` would) is the same job the panel shows
            told = []
            ollama = threading.Thread(target=lambda: told.extend(pull_lines(server.url, OTHER)))
            ollama.start()
            wait_for(lambda: hub.gets("model.safetensors"), "the API's pull under way")
            offer.click()
            page.wait_for_selector(".models-panel")
            page.wait_for_selector(f'.models-pull[data-source="{OTHER}"]')
            page.locator(f'.models-pull[data-source="{OTHER}"] button', has_text="Cancel").click()
            ollama.join(60)
            assert told[0] == {"status": "pulling manifest"} and "cancelled" in told[-1]["error"], told
            hub.requests.clear()
            rows = page.locator(".models-row")
            assert rows.count() == 1 and "default" in rows.first.inner_text()
            assert "Llama-3.2-1B-Instruct" in page.locator(".models-panel").inner_text()
            shot(page, "02-panel")

            page.fill(".models-source", PULLED)
            page.locator(".models-panel form button").click()
            progress = page.locator(".models-progress")
            wait_for(lambda: " of " in (progress.inner_text() if progress.count() else ""), "progress")
            width = page.locator(".models-bar").evaluate("e => e.style.width")
            assert 0 < float(width.rstrip("%")) < 100, width
            during = shot(page, "03-pulling")
            if Environment().switch("LLAMA_UPDATE_SCREENSHOT", default=False) or not SCREENSHOT.exists():
                shutil.copy(during, SCREENSHOT)
            wait_for(lambda: hub.gets("model.safetensors"), "request for the weights")
            page.locator(".models-pull button", has_text="Cancel").click()
            wait_for(lambda: said(page).startswith(f"cancelled: pulling {PULLED} again goes on"), "cancel")
            assert page.locator(".models-pull").count() == 0
            shot(page, "04-cancelled")

            hub.held.set()
            page.fill(".models-source", PULLED)
            page.locator(".models-panel form button").click()
            wait_for(lambda: "Tiny-Pulled is here" in said(page), "finished pull", timeout=120)
            assert len(hub.gets("config.json")) == 1  # here before the cancel: not fetched again
            shot(page, "05-pulled")

            page.locator('.models-row[data-model="Tiny-Pulled"] button', has_text="Use").click()
            wait_for(lambda: "This chat now uses Tiny-Pulled" in said(page), "use")
            send_message(page, "Hello")
            wait_for(lambda: page.locator(STATS).count() >= 1, "answer", timeout=120)
            with sqlite3.connect(server.log_path.parent / "history.db") as db:  # named after its first question
                assert db.execute("SELECT name FROM threads").fetchall() == [("Hello",)]
            wait_for(lambda: page.get_by_text("Hello", exact=True).count() == 2, "the chat renamed in the sidebar")
            shot(page, "06-answered")
            browser.close()
    finally:
        hub.held = hub.held_files = None
    assert "loaded Tiny-Pulled" in server.log()


def pull_lines(url: str, model: str) -> list[dict]:
    with httpx.stream("POST", f"{url}/api/pull", json={"model": model}, timeout=120) as response:
        return [json.loads(line) for line in response.iter_lines() if line]
