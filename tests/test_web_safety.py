"""Web defaults: `chainlit run app/main.py` listens on 127.0.0.1 only; HTML in messages is shown as text,
from the user and from the model alike (a scripted checkpoint makes the model write
`<script>window.__pwned=1</script><b>bold</b>`); file uploads are off, in the configuration, in the page
(no attach button) and on the server (its upload endpoint refuses).
"""

from __future__ import annotations

import asyncio
import os
import tomllib

import httpx
import pytest

from e2e_helpers import ROOT, ChainlitServer, server_env
from live_chat import LiveChat
from special_checkpoints import write_scripted_checkpoint
from test_e2e_browser import CHROMIUM, CHROMIUM_ARGS, browser_or_reason

pytestmark = pytest.mark.timeout(300)

MODEL_SAYS = "<script>window.__pwned=1</script><b>bold</b>"
USER_SAYS = '<img src=x onerror="window.__pwned=2"><b>bold</b> <script>window.__pwned=3</script>'
MESSAGES = '.step[data-step-type="{}"] .message-content'


# ---- configuration ------------------------------------------------------------------------------

def test_configuration_keeps_html_and_uploads_off():
    features = tomllib.loads((ROOT / ".chainlit" / "config.toml").read_text())["features"]
    assert features["unsafe_allow_html"] is False
    assert features["spontaneous_file_upload"]["enabled"] is False
    assert features["mcp"]["enabled"] is False and features["mcp"]["user_servers"]["enabled"] is False


def test_binding_elsewhere_is_documented_with_a_warning():
    running = (ROOT / "chainlit.md").read_text().split("## Running it", 1)[1].split("\n## ", 1)[0]
    assert "`127.0.0.1`" in running and "--host 0.0.0.0" in running and "**Warning:**" in running


# ---- a server started as the README says --------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    weights = tmp_path_factory.mktemp("weights")
    write_scripted_checkpoint(weights / "scripted", MODEL_SAYS)
    env = server_env(checkpoint=weights / "scripted", weights_dir=weights, threads=1, history="off")
    env.pop("CHAINLIT_HOST", None)  # the default, not a developer's choice
    server = ChainlitServer(env, log=tmp_path_factory.mktemp("chainlit") / "chainlit.log", host=None)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
    assert "Traceback" not in server.log_path.read_text()


def listening_addresses(port: int) -> set[str]:
    """Local addresses of the sockets listening on `port`, from /proc/net/tcp and tcp6 (hex as the kernel
    writes them: 0100007F is 127.0.0.1, 00000000 is 0.0.0.0)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.add(address)
    return found


def test_server_listens_on_localhost_only(server):
    addresses = listening_addresses(server.port)
    assert addresses == {"0100007F"}, f"listening on {addresses}, expected 127.0.0.1 only"


def test_the_upload_endpoint_refuses_files(server):
    async def upload():
        chat = await LiveChat(server.url).open()
        try:
            async with httpx.AsyncClient() as client:
                return chat.session_id, await client.post(
                    f"{server.url}/project/file", params={"session_id": chat.session_id},
                    files={"file": ("notes.txt", b"hello", "text/plain")}, timeout=30)
        finally:
            await chat.close()

    session_id, response = asyncio.run(asyncio.wait_for(upload(), 60))
    assert response.status_code == 400 and "not enabled" in response.text, response.text
    stored = ROOT / ".files" / session_id
    assert not stored.exists() or not any(stored.iterdir())
    if stored.exists():  # Chainlit makes the session's folder before it checks
        stored.rmdir()


def test_model_output_with_html_reaches_the_page_as_text(server):
    async def ask():
        chat = await LiveChat(server.url).open()
        try:
            return await chat.ask("Say something")
        finally:
            await chat.close()

    reply = asyncio.run(asyncio.wait_for(ask(), 60))
    assert reply.text == MODEL_SAYS and "stop token" in reply.stats[0]


# ---- in the browser -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def page(server):
    reason = browser_or_reason()
    if reason and os.environ.get("LLAMA_SKIP_BROWSER") == "1":
        pytest.skip(f"LLAMA_SKIP_BROWSER=1: {reason}")
    if reason:
        pytest.fail(f"{reason} (or set LLAMA_SKIP_BROWSER=1 to skip the browser test)", pytrace=False)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(60_000)
            page.goto(server.url)
            page.wait_for_selector("#chat-input")
            yield page
        finally:
            browser.close()


def test_page_shows_html_as_text_and_runs_none_of_it(page):
    page.fill("#chat-input", USER_SAYS)
    page.wait_for_selector("#chat-submit:enabled")
    page.press("#chat-input", "Enter")
    page.wait_for_function("""() => [...document.querySelectorAll('.step[data-step-type="assistant_message"]')]
        .some(e => e.innerText.includes('stop token'))""")  # the answer and its stats line are there
    page.wait_for_timeout(500)  # an image's onerror would have fired by now
    assert page.locator(MESSAGES.format("user_message")).first.inner_text().strip() == USER_SAYS
    assert MODEL_SAYS in page.locator(MESSAGES.format("assistant_message")).all_inner_texts()
    for tag in ("script", "img", "b"):
        assert page.locator(f".message-content {tag}").count() == 0, f"a <{tag}> element was made from a message"
    assert page.evaluate("window.__pwned") is None


def test_page_has_no_attach_button(page):
    assert page.locator("#chat-input").count() == 1  # the composer is there
    assert page.locator("#upload-button").count() == 0 and page.locator("#upload-button-input").count() == 0
