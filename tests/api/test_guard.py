"""Web defaults: `chainlit run app/main.py` listens on 127.0.0.1 only; HTML in messages is shown as text,
from the user and from the model alike (a scripted checkpoint makes the model write
`<script>window.__pwned=1</script><b>bold</b>`); uploads take only the kinds of files the app reads (text,
code, CSV, JSON, PDF), in the page (its attach button's accept list) and on the server (its upload endpoint
refuses others, an executable named as such or sent as bytes).

Other sites and host names (app.api.guard): a request from a page of another origin is refused with 403 on
every route (the page, socket.io, sign-in, history, the API; the chat server and `python -m app.api`)
and no CORS header names that origin; a request naming a host that is not loopback nor allowed is
refused with 421; the API takes only application/json bodies; the app's own origins, LLAMA_ALLOWED_ORIGINS
and clients that send no Origin still work. In the browser, a page on another loopback origin can read
neither the API nor the history, while the app's own page chats.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import threading
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import websocket
from support.browser import CHROMIUM, CHROMIUM_ARGS, need_browser
from support.chat_tab import ChatTab, sign_in
from support.live_chat import LiveChat
from support.servers import ROOT, ApiServer, ChainlitServer, free_port, server_env
from support.special_checkpoints import write_scripted_checkpoint

from app.api import routes as api, guard
from app.bounds import MAX_FILE_BYTES, MAX_FILES
from app.settings import Settings, SettingsError
from app.web.uploads import server_folder
from app.web import attachments

pytestmark = pytest.mark.timeout(300)

MODEL_SAYS = "<script>window.__pwned=1</script><b>bold</b>"
USER_SAYS = '<img src=x onerror="window.__pwned=2"><b>bold</b> <script>window.__pwned=3</script>'
MESSAGES = '.step[data-step-type="{}"] .message-content'


# ---- configuration ------------------------------------------------------------------------------

def test_configuration_keeps_html_off_and_uploads_to_the_files_the_app_reads():
    features = tomllib.loads((ROOT / ".chainlit" / "config.toml").read_text())["features"]
    assert features["unsafe_allow_html"] is False
    assert features["mcp"]["enabled"] is False and features["mcp"]["user_servers"]["enabled"] is False
    upload = attachments.upload_feature()  # what the app sets at start
    assert upload.enabled and upload.max_size_mb == MAX_FILE_BYTES // 2**20 and upload.max_files == MAX_FILES
    assert all(extensions for pattern, extensions in upload.accept.items() if "*" in pattern)  # no type takes all
    assert ".exe" not in upload.accept["*/*"] and ".pdf" in upload.accept["*/*"]


def test_configuration_allows_no_other_origin():
    project = tomllib.loads((ROOT / ".chainlit" / "config.toml").read_text())["project"]
    assert project["allow_origins"] == []  # the app adds its own origins at start (app.api.guard.install)


def test_binding_elsewhere_is_documented_with_a_warning():
    running = (ROOT / "chainlit.md").read_text().split("## Running it", 1)[1].split("\n## ", 1)[0]
    assert "`127.0.0.1`" in running and "--host 0.0.0.0" in running and "**Warning:**" in running


# ---- a server started as the README says --------------------------------------------------------

@contextlib.contextmanager
def running(server: ChainlitServer):
    """The server once it answers; stopped afterwards, and its log must hold no traceback."""
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
    assert "Traceback" not in server.log_path.read_text()


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    weights = tmp_path_factory.mktemp("weights")
    return write_scripted_checkpoint(weights / "scripted", MODEL_SAYS)


@pytest.fixture(scope="module")
def server(scripted, tmp_path_factory):
    env = server_env(checkpoint=scripted, weights_dir=scripted.parent, threads=1, history="off")
    env.pop("CHAINLIT_HOST", None)  # the default, not a developer's choice
    with running(ChainlitServer(env, log=tmp_path_factory.mktemp("chainlit") / "chainlit.log", host=None)) as server:
        yield server


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


def test_the_upload_endpoint_takes_only_the_files_the_app_reads(server):
    async def upload(*files):
        chat = await LiveChat(server.url).open()
        try:
            async with httpx.AsyncClient() as client:
                return chat.session_id, [await client.post(
                    f"{server.url}/project/file", params={"session_id": chat.session_id},
                    files={"file": file}, timeout=30) for file in files]
        finally:
            await chat.close()

    session_id, (exe, binary, notes) = asyncio.run(asyncio.wait_for(upload(
        ("tool.exe", b"MZ\x90\x00", "application/x-msdownload"), ("tool.exe", b"MZ\x90\x00", "application/octet-stream"),
        ("notes.txt", b"hello", "text/plain")), 60))
    for refused in (exe, binary):
        assert refused.status_code == 400 and "File type not allowed" in refused.text, refused.text
    assert notes.status_code == 200, notes.text
    stored = server_folder(server.process.pid, ROOT / ".files") / session_id  # the session's uploads
    shutil.rmtree(stored, ignore_errors=True)


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
def browser():
    need_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def page(server, browser):
    page = browser.new_page()
    page.set_default_timeout(60_000)
    page.goto(server.url)
    page.wait_for_selector("#chat-input")
    yield page
    page.close()


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


def test_page_has_an_attach_button_for_the_files_the_app_reads(page):
    assert page.locator("#chat-input").count() == 1  # the composer is there
    assert page.locator("#upload-button").count() == 1
    accept = page.locator("#upload-button-input").get_attribute("accept") or ""
    assert ".pdf" in accept and ".exe" not in accept, accept


# ---- other sites and host names: the rules, no server -------------------------------------------

def allowed(listen_host: str = "127.0.0.1", port: int = 8000, **llama) -> guard.Allowed:
    environ = {f"LLAMA_{name.upper()}": value for name, value in llama.items()}
    return guard.Allowed.from_settings(Settings.from_env(environ), listen_host, port)


def refusal(rules: guard.Allowed, **headers) -> int | None:
    from starlette.datastructures import Headers

    refused = rules.refusal(Headers(headers))
    return refused[0] if refused else None


def test_only_loopback_and_allowed_hosts_pass():
    rules = allowed(allowed_hosts="MyBox.lan, [fd00::5]")
    for host in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000", "LOCALHOST", "mybox.lan:8000", "[fd00::5]:8000"):
        assert refusal(rules, host=host) is None, host
    for host in ("evil.example:8000", "127.0.0.1.evil.example", "mybox.lan.evil.example", "[fd00::6]:8000"):
        assert refusal(rules, host=host) == 421, host
    for host in ("", "evil.example@127.0.0.1:8000", "127.0.0.1:port", "127.0.0.1/x"):
        assert refusal(rules, host=host) == 400, host


def test_only_the_apps_own_and_allowed_origins_pass():
    rules = allowed(allowed_origins="http://friend.example:3000/, https://chat.example.org:443")
    own = ("http://127.0.0.1:8000", "http://localhost:8000", "http://[::1]:8000", "http://LocalHost:8000")
    for origin in (*own, "http://friend.example:3000", "https://chat.example.org"):
        assert refusal(rules, host="127.0.0.1:8000", origin=origin) is None, origin
    for origin in ("http://evil.example", "http://localhost:8001", "https://127.0.0.1:8000", "http://friend.example",
                   "https://friend.example:3000", "null", "file://", "http://127.0.0.1:8000.evil.example"):
        assert refusal(rules, host="127.0.0.1:8000", origin=origin) == 403, origin
    assert refusal(rules, host="127.0.0.1:8000") is None  # curl, the openai SDK: no page, no Origin
    assert rules.cors_origins() == [*own[:3], "http://friend.example:3000", "https://chat.example.org"]


def test_the_refusals_say_what_to_set():
    rules = allowed()
    from starlette.datastructures import Headers

    status, message, _ = rules.refusal(Headers({"host": "rebind.example:8000"}))
    assert status == 421 and "LLAMA_ALLOWED_HOSTS=rebind.example" in message and "localhost" in message
    status, message, _ = rules.refusal(Headers({"host": "localhost:8000", "origin": "http://localhost:3000"}))
    assert status == 403 and "LLAMA_ALLOWED_ORIGINS=http://localhost:3000" in message
    assert "http://127.0.0.1:8000" in message


def test_bad_entries_and_listening_on_all_addresses_stop_the_start():
    with pytest.raises(SettingsError, match=r"listening on 0\.0\.0\.0 .*set LLAMA_ALLOWED_HOSTS"):
        allowed("0.0.0.0")
    with pytest.raises(SettingsError, match=r"listening on 192\.168\.1\.20 .*LLAMA_ALLOWED_HOSTS"):
        allowed("192.168.1.20")
    assert allowed("0.0.0.0", allowed_hosts="mybox.lan").hosts == ("mybox.lan",)
    assert allowed("localhost").hosts == () and allowed("::1").hosts == ()
    with pytest.raises(SettingsError, match=r"LLAMA_ALLOWED_HOSTS: 'mybox.lan:8000' is not a host name"):
        allowed(allowed_hosts="mybox.lan:8000")
    with pytest.raises(SettingsError, match=r"LLAMA_ALLOWED_HOSTS: 'http://mybox.lan' is not"):
        allowed(allowed_hosts="http://mybox.lan")
    for entry in ("*", "localhost:3000", "http://x/path", "ftp://x"):
        with pytest.raises(SettingsError, match=rf"LLAMA_ALLOWED_ORIGINS=.*'{entry}' is not an origin"):
            allowed(allowed_origins=entry)


def test_the_api_alone_refuses_to_listen_on_all_addresses_without_allowed_hosts(monkeypatch, capsys):
    for name in [name for name in os.environ if name.startswith("LLAMA_")]:
        monkeypatch.delenv(name)
    assert api.main(["--host", "0.0.0.0", "--port", str(free_port())]) == 2
    assert "error: listening on 0.0.0.0" in capsys.readouterr().err


# ---- other sites and host names: a real chat server with history ---------------------------------

FRIEND = "http://friend.example:3000"  # in LLAMA_ALLOWED_ORIGINS
THREADS = {"pagination": {"first": 20, "cursor": None}, "filter": {}}
ASK = {"messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture(scope="module")
def guarded(scripted, tmp_path_factory):
    """The chat app with history (header sign-in as the local user) and one allowed foreign origin."""
    folder = tmp_path_factory.mktemp("guarded")
    env = server_env(checkpoint=scripted, weights_dir=scripted.parent, threads=1, history_db=folder / "history.db",
                     allowed_origins=FRIEND)
    with running(ChainlitServer(env, log=folder / "chainlit.log")) as server:
        yield server


def routes(server) -> list[tuple[str, str, dict]]:
    """Every kind of route, as (method, path, httpx arguments): with a valid sign-in cookie and a body a
    web page may send to another site without asking it first (text/plain)."""
    cookies = sign_in(server.url)
    return [("GET", "/", {}),
            ("POST", "/auth/header", {}),
            ("POST", "/project/threads", {"cookies": cookies, "content": json.dumps(THREADS),
                                           "headers": {"Content-Type": "text/plain"}}),
            ("GET", "/ws/socket.io/?EIO=4&transport=polling", {"cookies": cookies}),
            ("POST", "/v1/chat/completions", {"content": json.dumps(ASK), "headers": {"Content-Type": "text/plain"}}),
            ("GET", "/v1/models", {})]


def request(server, method: str, path: str, origin: str | None = None, **arguments) -> httpx.Response:
    headers = {**arguments.pop("headers", {}), **({"Origin": origin} if origin else {})}
    cookies = arguments.pop("cookies", None)
    with httpx.Client(cookies=cookies) as client:
        return client.request(method, f"{server.url}{path}", headers=headers, timeout=30, **arguments)


def assert_refused(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, (response.request.url, response.status_code, response.text[:300])
    assert "access-control-allow-origin" not in response.headers
    assert "access-control-allow-credentials" not in response.headers
    assert "set-cookie" not in response.headers


@pytest.mark.parametrize("origin", ["http://evil.example", "http://localhost:{other}", "http://127.0.0.1:{other}",
                                    "null"])
def test_a_page_of_another_origin_is_refused_on_every_route(guarded, origin):
    origin = origin.format(other=free_port())
    for method, path, arguments in routes(guarded):
        assert_refused(request(guarded, method, path, origin, **arguments), 403)
    preflight = request(guarded, "OPTIONS", "/v1/chat/completions", origin, headers={
        "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    assert_refused(preflight, 403)
    assert f"refused a request (logged once per origin {origin!r})" in guarded.log_path.read_text()


def test_a_page_of_another_origin_cannot_open_the_socket(guarded):
    url = f"ws://127.0.0.1:{guarded.port}/ws/socket.io/?EIO=4&transport=websocket"
    with pytest.raises(websocket.WebSocketBadStatusException) as refused:
        websocket.create_connection(url, origin="http://evil.example", timeout=30)
    assert refused.value.status_code == 403
    own = websocket.create_connection(url, origin=guarded.url, timeout=30)  # the handshake passes
    own.close()


def test_the_socket_handshake_gives_a_busy_page_a_minute_to_answer_pings(guarded):
    """engine.io's own 20 s dropped the sockets (and so the replies) of pages that were only busy drawing."""
    handshake = request(guarded, "GET", "/ws/socket.io/?EIO=4&transport=polling", cookies=sign_in(guarded.url))
    assert handshake.status_code == 200 and handshake.text.startswith("0"), handshake.text
    opened = json.loads(handshake.text[1:])
    assert opened["pingTimeout"] == 60_000 and opened["pingInterval"] == 25_000


def test_a_host_name_that_is_not_this_server_is_refused(guarded):
    for method, path, arguments in routes(guarded):
        headers = {**arguments.pop("headers", {}), "Host": f"rebind.example:{guarded.port}"}
        response = request(guarded, method, path, **arguments, headers=headers)
        assert_refused(response, 421)
        assert "LLAMA_ALLOWED_HOSTS=rebind.example" in response.text
    assert request(guarded, "GET", "/", headers={"Host": f"localhost:{guarded.port}"}).status_code == 200


def test_the_api_takes_only_json_bodies(guarded):
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": kind} if kind else {}
        response = request(guarded, "POST", "/v1/chat/completions", content=json.dumps(ASK), headers=headers)
        assert response.status_code == 415, (kind, response.text)
        error = response.json()["error"]
        assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    response = request(guarded, "POST", "/v1/chat/completions", content=json.dumps(ASK),
                       headers={"Content-Type": "application/json; charset=utf-8"})
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == MODEL_SAYS


@pytest.mark.parametrize("origin", ["http://127.0.0.1:{port}", "http://localhost:{port}", FRIEND, None])
def test_the_apps_own_pages_and_allowed_origins_still_work(guarded, origin):
    origin = origin and origin.format(port=guarded.port)
    signed_in = request(guarded, "POST", "/auth/header", origin)
    assert signed_in.status_code == 200 and "access_token" in signed_in.cookies
    threads = request(guarded, "POST", "/project/threads", origin, cookies=dict(signed_in.cookies), json=THREADS)
    answer = request(guarded, "POST", "/v1/chat/completions", origin, json=ASK)
    assert threads.status_code == 200 and "data" in threads.json()
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == MODEL_SAYS
    for response in (signed_in, threads, answer):  # CORS names only an allowed origin, and only when asked
        assert response.headers.get("access-control-allow-origin") == origin


def test_a_chat_over_the_socket_still_works(guarded):
    tab = ChatTab(guarded.url, sign_in(guarded.url))  # its websocket sends the app's own Origin
    try:
        tab.wait_for("chat_settings")
        tab.send("Hello")
        # the answer streams: its first piece opens the message (stream_start), later ones add to it (stream_token);
        # a reply quicker than the page's pacing comes as the first piece alone
        streamed = [event for event, _ in tab.events if event in ("stream_start", "stream_token")]
        assert streamed and streamed[0] == "stream_start", " ".join(event for event, _ in tab.events)
    finally:
        tab.close()


def test_listening_on_all_addresses_without_allowed_hosts_stops_with_what_to_set(scripted, tmp_path):
    env = server_env(checkpoint=scripted, weights_dir=scripted.parent, threads=1, history="off")
    server = ChainlitServer(env, log=tmp_path / "chainlit.log", host="0.0.0.0")
    try:
        assert server.process.wait(timeout=120) == 2
    finally:
        server.stop()
    assert "error: listening on 0.0.0.0 (--host or CHAINLIT_HOST) lets other machines connect: set " \
           "LLAMA_ALLOWED_HOSTS" in server.log_path.read_text()


def test_the_api_alone_has_the_same_guard(scripted, tmp_path):
    env = server_env(checkpoint=scripted, weights_dir=scripted.parent, threads=1)
    with running(ApiServer(env, log=tmp_path / "api.log")) as server:
        ask = {"content": json.dumps(ASK), "headers": {"Content-Type": "text/plain"}}
        assert_refused(request(server, "POST", "/v1/chat/completions", "http://evil.example", **ask), 403)
        assert_refused(request(server, "GET", "/v1/models", headers={"Host": "rebind.example"}), 421)
        assert request(server, "POST", "/v1/chat/completions", **ask).status_code == 415
        answer = request(server, "POST", "/v1/chat/completions", server.url, json=ASK)
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == MODEL_SAYS


# ---- other sites in the browser -----------------------------------------------------------------

ATTACK = """async (app) => {
    const tried = {};
    const attempt = async (name, run) => {
        try { tried[name] = "read: " + await run(); } catch (e) { tried[name] = "failed: " + e; }
    };
    await attempt("api", async () => (await fetch(app + "/v1/chat/completions", {
        method: "POST", headers: {"Content-Type": "text/plain"},
        body: JSON.stringify({messages: [{role: "user", content: "Hi"}]})})).text());
    await attempt("sign-in", async () => (await fetch(app + "/auth/header", {method: "POST", credentials: "include"})).text());
    await attempt("history", async () => (await fetch(app + "/project/threads", {
        method: "POST", credentials: "include", headers: {"Content-Type": "application/json"},
        body: JSON.stringify({pagination: {first: 20, cursor: null}, filter: {}})})).text());
    tried.socket = await new Promise(resolve => {
        const socket = new WebSocket(app.replace("http", "ws") + "/ws/socket.io/?EIO=4&transport=websocket");
        socket.onopen = () => { socket.close(); resolve("read: opened"); };
        socket.onerror = () => resolve("failed: no connection");
    });
    return tried;
}"""


class OtherSite:
    """A page on another loopback origin (http://localhost:<its port>), served by a thread of this process."""

    def __init__(self):
        class Page(BaseHTTPRequestHandler):
            def do_GET(self):
                body = b"<!doctype html><title>another site</title><p>another site</p>"
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Page)
        self.url = f"http://localhost:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self):
        self.http.shutdown()
        self.http.server_close()


def test_in_the_browser_another_site_reads_nothing_and_the_app_still_chats(guarded, browser):
    other = OtherSite()
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(60_000)
        answer = page.goto(guarded.url)  # the app's own page: signed in, with a cookie for 127.0.0.1
        page.wait_for_selector("#chat-input")
        page.wait_for_selector("#starter-capital-of-france")  # its socket connected and its chat started
        assert answer.headers["x-frame-options"] == "DENY"  # no other site shows the app in a frame (and the
        assert answer.headers["content-security-policy"] == "frame-ancestors 'none'"  # page works under them)
        foreign = context.new_page()
        foreign.goto(other.url)
        tried = foreign.evaluate(ATTACK, guarded.url)
        assert set(tried) == {"api", "sign-in", "history", "socket"}
        assert all(result.startswith("failed: ") for result in tried.values()), tried

        page.fill("#chat-input", "Hello")
        page.wait_for_selector("#chat-submit:enabled")
        page.press("#chat-input", "Enter")
        page.wait_for_function("""() => [...document.querySelectorAll('.step[data-step-type="assistant_message"]')]
            .some(e => e.innerText.includes('stop token'))""")
        assert MODEL_SAYS in page.locator(MESSAGES.format("assistant_message")).all_inner_texts()
    finally:
        context.close()
        other.close()
    # refused by the server, not only left unread by the browser
    assert f"refused a request (logged once per origin '{other.url}')" in guarded.log_path.read_text()
