"""The chat page as a newcomer meets it: `chainlit run app/main.py` driven by headless Chromium.

A page load leaves the browser's console and the server's log clean; a preset chosen in the settings shows
its text in the system prompt's box before Confirm; an edit of a chat's first message renames the chat in
the sidebar; Stop leaves one trace, the stopped answer and its line. The default model (SmolLM2-135M-Instruct)
answers greedily. Screenshots go to test-output/e2e-page/. Needs Debian's Chromium, as
tests/test_e2e_browser.py.
"""

from __future__ import annotations

import re
import shutil
import sqlite3
import time

import pytest
from support.browser import ANSWERS, CHROMIUM, CHROMIUM_ARGS, STATS, need_browser
from support.browser import send_message as send
from support.servers import DEFAULT_MODEL, ROOT, ChainlitServer, server_env
from support.special_checkpoints import default_model

SHOTS = ROOT / "test-output" / "e2e-page"
USER_MESSAGES = '.step[data-step-type="user_message"]'
SIDEBAR_CHATS = '#thread-history a[href^="/thread/"]'

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    need_browser()
    default_model()
    folder = tmp_path_factory.mktemp("chainlit")
    # the page is under test, not the decode kernel: none to build first
    env = server_env(checkpoint=DEFAULT_MODEL, temperature=0, repetition_penalty=1, dtype="fp32", threads=1,
                     kernels="off", max_new_tokens=200, history_db=folder / "history.db")
    server = ChainlitServer(env, log=folder / "chainlit.log")
    try:
        server.wait_ready(timeout=300)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def chromium(server):
    from playwright.sync_api import sync_playwright

    shutil.rmtree(SHOTS, ignore_errors=True)
    SHOTS.mkdir(parents=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def open_page(chromium, server, problems: list[str] | None = None):
    """A new browser (no cookies: a newcomer) on the chat; what goes wrong on the page is added to problems."""
    page = chromium.new_context(viewport={"width": 1100, "height": 800}).new_page()
    page.set_default_timeout(60_000)
    if problems is not None:
        page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} ({r.failure})"))
        page.on("response", lambda r: problems.append(f"{r.status}: {r.url}") if r.status >= 400 else None)
    page.goto(server.url)
    page.wait_for_selector("#chat-settings-open-modal")  # the chat has started
    return page


def shot(page, name: str) -> None:
    page.screenshot(path=SHOTS / f"{name}.png")


def ask(page, text: str) -> str:
    stats = page.locator(STATS).count()
    send(page, text)
    page.wait_for_function(f"() => document.querySelectorAll('{STATS}').length > {stats}", timeout=120_000)
    page.wait_for_selector("#stop-button", state="detached")
    return page.locator(ANSWERS).last.inner_text()


def warnings(log: str) -> list[str]:
    return [line for line in log.splitlines() if re.search(r" - (WARNING|ERROR) - ", line)]


def test_a_page_load_leaves_the_console_and_the_log_clean(chromium, server):
    before = warnings(server.log_path.read_text(errors="replace"))
    problems: list[str] = []
    page = open_page(chromium, server, problems)
    try:
        page.wait_for_selector("#starter-capital-of-france")
        page.reload()  # and again, signed in
        page.wait_for_selector("#starter-capital-of-france")
        page.wait_for_timeout(2_000)  # late requests (fonts, stylesheets) fail by now
        shot(page, "01-loaded")
    finally:
        page.context.close()
    assert not problems, problems  # no 401 before sign-in, nothing asked of other sites
    logged = warnings(server.log_path.read_text(errors="replace"))[len(before):]
    assert not logged, logged  # e.g. no "Translated markdown file for en-US not found", three times a load


def test_a_preset_fills_the_system_prompt_box_before_confirm(chromium, server):
    concise = (ROOT / "presets" / "Concise.md").read_text().strip()
    teacher = (ROOT / "presets" / "Teacher.md").read_text().strip()
    page = open_page(chromium, server)
    try:
        page.click("#chat-settings-open-modal")
        page.wait_for_selector("#chat-settings")
        assert page.input_value("#system_prompt") == ""
        page.click("#preset")
        page.get_by_role("option", name="Concise").click()
        page.wait_for_function(f"() => document.querySelector('#system_prompt').value === {concise!r}",
                               timeout=5_000)
        shot(page, "02-preset-chosen")
        page.fill("#system_prompt", concise + " Answer in English.")  # edited: stays as typed
        page.wait_for_timeout(1_000)
        assert page.input_value("#system_prompt") == concise + " Answer in English."
        page.click("#confirm")
        page.wait_for_selector("#chat-settings", state="detached")
        page.click("#chat-settings-open-modal")
        assert page.input_value("#system_prompt") == concise + " Answer in English."
        # another preset, then Cancel: the panel is as it was confirmed
        page.click("#preset")
        page.get_by_role("option", name="Teacher").click()
        page.wait_for_function(f"() => document.querySelector('#system_prompt').value === {teacher!r}",
                               timeout=5_000)
        page.get_by_role("button", name="Cancel").click()
        page.wait_for_selector("#chat-settings", state="detached")
        page.click("#chat-settings-open-modal")
        assert page.input_value("#system_prompt") == concise + " Answer in English."
        page.get_by_role("button", name="Cancel").click()
    finally:
        page.context.close()
    assert "Traceback" not in server.log()


def test_an_edit_of_the_first_message_renames_the_chat(chromium, server):
    page = open_page(chromium, server)
    try:
        assert ask(page, "What is the capital of Spain?").strip()
        page.locator(SIDEBAR_CHATS, has_text="What is the capital of Spain?").wait_for()
        first = page.locator(USER_MESSAGES).first
        first.hover()
        first.locator("button").first.click()  # the pencil
        first.locator("textarea").fill("What is the capital of Italy?")
        first.locator("button", has_text="Confirm").click()
        page.locator(SIDEBAR_CHATS, has_text="What is the capital of Italy?").wait_for(timeout=10_000)
        assert page.locator(SIDEBAR_CHATS, has_text="What is the capital of Spain?").count() == 0
        page.wait_for_selector("#stop-button", state="detached")
        shot(page, "03-renamed")
        thread_id = page.url.rsplit("/", 1)[-1]
    finally:
        page.context.close()
    with sqlite3.connect(server.log_path.parent / "history.db") as db:
        [(name,)] = db.execute("SELECT name FROM threads WHERE id = ?", (thread_id,)).fetchall()
    assert name == "What is the capital of Italy?"  # also when the page loads the list again
    assert "Traceback" not in server.log()


def test_stop_leaves_the_stopped_answer_and_its_line_only(chromium, server):
    page = open_page(chromium, server)
    try:
        send(page, "Write a 2000 word story about a dragon.")
        page.wait_for_function(f"""() => {{
            const answers = document.querySelectorAll('{ANSWERS}');
            return answers.length === 1 && answers[0].innerText.length > 40; }}""")
        page.click("#stop-button")
        page.wait_for_function(f"() => [...document.querySelectorAll('{STATS}')].some("
                               "e => e.innerText.includes('stopped by user'))", timeout=10_000)
        page.wait_for_timeout(1_500)  # anything else Stop sends has come by now
        shot(page, "04-stopped")
        replies = page.locator('.step[data-step-type="assistant_message"] .message-content').all_inner_texts()
        assert len(replies) == 2, replies  # the answer as far as it came, and its line
        assert "dragon" in replies[0].lower() and "stopped by user" in replies[1]
        assert "Task manually stopped" not in page.inner_text("body")
    finally:
        page.context.close()
    assert "Traceback" not in server.log()


def test_a_reloaded_chat_keeps_regenerate_and_export_and_new_chat_says_it_stays(chromium, server):
    """A chat opened again (a reload, or from the sidebar) has Regenerate and Export under its last answer, as
    before the reload, and Regenerate works there; New chat's dialog says the chat stays in the sidebar (not
    Chainlit's "This will clear your current chat history")."""
    page = open_page(chromium, server)
    try:
        first = ask(page, "Name a fruit.")
        page.wait_for_url(re.compile(r"/thread/"))
        page.reload()
        page.locator(ANSWERS, has_text=first.strip()[:20]).wait_for()
        buttons = page.locator(STATS).last.locator("..").locator("button")
        buttons.filter(has_text="Export").wait_for(timeout=15_000)
        buttons.filter(has_text="Regenerate").click()
        page.wait_for_function(f"() => document.querySelectorAll('{STATS}').length === 1", timeout=120_000)
        page.wait_for_selector("#stop-button", state="detached")
        page.locator(STATS).last.locator("..").locator("button", has_text="Regenerate").wait_for()
        assert page.locator(ANSWERS).count() == 1 and page.locator(ANSWERS).last.inner_text().strip()
        assert "Only the last answer" not in page.inner_text("body")
        shot(page, "05-regenerated-after-reload")
        page.locator("#new-chat-button").click()
        dialog = page.get_by_role("dialog")
        dialog.wait_for()
        assert "stays in the sidebar" in dialog.inner_text() and "clear your current" not in dialog.inner_text()
    finally:
        page.context.close()
    assert "Traceback" not in server.log()


def test_models_chosen_in_the_tools_menu_opens_the_panel_at_once(chromium, server):
    """Tools > Models opens the models panel without an empty message to send (public/page.js); words typed
    before choosing it wait for Enter."""
    page = open_page(chromium, server)
    try:
        page.locator("#command-button").click()
        page.get_by_role("option", name=re.compile("^Models")).click()
        page.wait_for_selector(".models-panel", timeout=20_000)
        assert page.locator("#command-Models").count() == 0 and page.input_value("#chat-input") == ""
        panels = page.locator(".models-panel").count()
        page.fill("#chat-input", "What is a model?")
        page.locator("#command-button").click()
        page.get_by_role("option", name=re.compile("^Models")).click()
        page.wait_for_timeout(1_000)
        assert page.locator(".models-panel").count() == panels and page.input_value("#chat-input") == "What is a model?"
        shot(page, "06-models-from-tools")
    finally:
        page.context.close()
