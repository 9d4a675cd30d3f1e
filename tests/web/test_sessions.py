"""Sign-in that means sign-in, on real servers: with sign-in on, the API and /metrics take the key only;
a session ends when its password changes or its user is removed (requests, socket handshakes and
open sockets); X-Forwarded-For counts only from LLAMA_TRUSTED_PROXIES; slow clients are cut off.
And the pieces alone: the session check as middleware, and the rules that settings enforce.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import socketio
from chainlit.auth import create_jwt
from chainlit.user import User
from support.chat_tab import ChatTab
from support.servers import ROOT, ApiServer, ChainlitServer, server_env
from support.special_checkpoints import write_scripted_checkpoint

from app.web import sessions, users
from app.settings import Settings, SettingsError

pytestmark = pytest.mark.timeout(240)

KEY = "sign-in-test-key"
MODEL_SAYS = "Hello there."
THREADS = {"pagination": {"first": 20, "cursor": None}, "filter": {}}
ASK = {"messages": [{"role": "user", "content": "Hi"}]}


# ---- settings -----------------------------------------------------------------------------------

def test_a_users_file_or_a_password_alone_turns_sign_in_on_and_it_needs_an_api_key():
    assert Settings.from_env({"LLAMA_USERS": "users", "LLAMA_API_KEY": KEY}).auth == "password"
    assert Settings.from_env({"LLAMA_PASSWORD": "household", "LLAMA_API_KEY": KEY}).auth == "password"
    assert Settings.from_env({"LLAMA_PASSWORD": "household", "LLAMA_API_KEYS": "keys"}).auth == "password"
    assert Settings.from_env({}).auth == "none" and Settings.from_env({"LLAMA_API_KEY": KEY}).auth == "none"
    for env in ({"LLAMA_USERS": "users"}, {"LLAMA_AUTH": "password", "LLAMA_PASSWORD": "household"},
                {"LLAMA_PASSWORD": "household", "LLAMA_API_KEY": "  "}):
        with pytest.raises(SettingsError, match=r"sign-in is on \(LLAMA_(USERS|PASSWORD) set\): the API and "
                                                r"/metrics then need a key too.*set LLAMA_API_KEYS.*or LLAMA_API_KEY"):
            Settings.from_env(env)
    with pytest.raises(SettingsError, match="LLAMA_AUTH=none with LLAMA_PASSWORD and LLAMA_USERS set: unset"):
        Settings.from_env({"LLAMA_AUTH": "none", "LLAMA_USERS": "users", "LLAMA_PASSWORD": "p"})


def test_trusted_proxies_and_timeouts_are_checked():
    settings = Settings.from_env({"LLAMA_TRUSTED_PROXIES": " 10.0.0.7/8, ::1 ,192.0.2.1",
                                  "LLAMA_HEADER_TIMEOUT": "2.5", "LLAMA_BODY_TIMEOUT": "7"})
    assert settings.trusted_proxies == ("10.0.0.0/8", "::1/128", "192.0.2.1/32")
    assert (settings.header_timeout, settings.body_timeout) == (2.5, 7.0)
    assert Settings.from_env({}).trusted_proxies == ()  # loopback is no proxy unless named
    for value in ("proxy.lan", "10.0.0.0/33", "1" * 40, "::1/129"):
        with pytest.raises(SettingsError, match=r"LLAMA_TRUSTED_PROXIES: .* is not an address or network"):
            Settings.from_env({"LLAMA_TRUSTED_PROXIES": f"127.0.0.1,{value}"})
    for value in ("0", "-1", "nan", "inf", "abc", "1e9"):
        with pytest.raises(SettingsError, match=rf"LLAMA_HEADER_TIMEOUT={re.escape(value)}: expected a number"):
            Settings.from_env({"LLAMA_HEADER_TIMEOUT": value})


# ---- the session check, alone -------------------------------------------------------------------

@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv("CHAINLIT_AUTH_SECRET", "a-test-secret-of-enough-length-for-hs256-0123456789")


def passwords_of(path, **named) -> users.Passwords:
    for name, password in named.items():
        users.add(path, name, password)
    return users.Passwords(users.UsersFile(path), key=b"k" * 32)


def passed_headers(valid: sessions.Valid, headers: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """The headers an app behind the Sessions middleware is given."""
    seen = []

    async def app(scope, receive, send):
        seen.append(dict(scope["headers"]))

    asyncio.run(sessions.Sessions(app, valid)({"type": "http", "headers": headers}, None, None))
    return seen[0]


def test_a_token_whose_stamp_is_no_longer_the_users_is_taken_off_the_request(tmp_path, secret):
    path = tmp_path / "users"
    passwords = passwords_of(path, ada="lovelace", grace="hopper")
    valid = sessions.still_signed_in(passwords)
    ada = create_jwt(sessions.password_user("ada", passwords))
    grace = create_jwt(sessions.password_user("grace", passwords))
    cookie = [(b"cookie", f"access_token={ada}; theme=dark".encode()), (b"host", b"127.0.0.1")]
    assert passed_headers(valid, cookie)[b"cookie"] == cookie[0][1]  # valid: untouched
    chunked = [(b"cookie", f"access_token_0={grace[:40]}; access_token_1={grace[40:]}".encode())]
    assert b"cookie" in passed_headers(valid, chunked)
    bearer = [(b"authorization", f"Bearer {ada}".encode())]
    assert b"authorization" in passed_headers(valid, bearer)

    users.add(path, "ada", "a new password")
    assert passed_headers(valid, cookie) == {b"host": b"127.0.0.1"}  # ada's session ended, not the request
    assert passed_headers(valid, bearer) == {}
    assert b"cookie" in passed_headers(valid, chunked)  # grace's goes on
    users.write_lines(path, [line for line in path.read_text().splitlines() if not line.startswith("grace:")])
    assert b"cookie" not in passed_headers(valid, chunked)

    both = [(b"cookie", f"access_token={ada}".encode()), (b"cookie", f"access_token={grace}".encode())]
    assert passed_headers(valid, both) == {}  # an ended sign-in beside a valid one: Chainlit may read either
    api_key = [(b"authorization", f"Bearer {KEY}".encode())]  # no token of Chainlit's: the API checks it
    assert passed_headers(valid, api_key) == dict(api_key)
    forged = create_jwt(User(identifier="ada", metadata={"provider": "password", "stamp": "0" * 64}))
    assert b"cookie" not in passed_headers(valid, [(b"cookie", f"access_token={forged}".encode())])


def test_who_is_still_signed_in(tmp_path, secret):
    passwords = passwords_of(tmp_path / "users", ada="lovelace")
    valid = sessions.still_signed_in(passwords)
    assert valid(sessions.password_user("ada", passwords))
    for metadata in ({}, {"stamp": None}, {"stamp": 7}, {"stamp": "\ud800"}, {"provider": "local"}):
        assert not valid(User(identifier="ada", metadata=metadata))
    assert not valid(sessions.local_user())  # sign-in turned on: the local user's sessions end
    assert not valid(User(identifier="nobody", metadata={"stamp": passwords.stamp("ada")}))
    local = sessions.still_signed_in(None)
    assert local(sessions.local_user()) and not local(sessions.password_user("ada", passwords))


def test_without_sign_in_the_page_s_first_question_signs_the_local_user_in(secret):
    """GET /user, asked by a new browser before it signs in: the local user (with a cookie of theirs), not a
    401 that the browser writes in its console."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    app.router.routes.insert(0, sessions.local_sign_in())
    client = TestClient(app)  # (not `with`: see CHAINLIT_NOTES)
    response = client.get("/user")
    assert response.status_code == 200 and response.json()["identifier"] == users.LOCAL_USER
    token = response.cookies.get("access_token")
    assert sessions.token_user(token).identifier == users.LOCAL_USER
    assert sessions.still_signed_in(None)(sessions.token_user(token))


# ---- whose API request it is ----------------------------------------------------------------------

class Recording:
    """A backend that answers every request with "Hi" and remembers whose request it was."""
    profiles, default, ready = {"tiny": "/nowhere"}, "tiny", True

    def __init__(self):
        self.observers, self.users = [], []

    def stream(self, conversation, settings, n=1, user="", **options):
        return self.reply(user)

    def complete(self, prompt, model, settings, n=1, user="", **options):
        return self.reply(user)

    def reply(self, user: str):
        from app.messages import Done, Stats, Text

        class Reply:
            id = "recorded"

            def cancel(self):
                pass

            async def __aiter__(self):
                yield Text("recorded", "Hi")
                yield Done("recorded", "Hi", "stop", Stats(prompt_tokens=3, new_tokens=1))

        self.users.append(user)
        return Reply()


def ask_api(backend, key: str | None, auth: str | bytes | None) -> list[int]:
    from fastapi.testclient import TestClient

    from app.api.keys import ApiKeys
    from app.api.routes import create_app

    client = TestClient(create_app(backend, ApiKeys(key)))  # without `with`: see CHAINLIT_NOTES (it exits the process)
    headers = {"Authorization": b"Bearer " + (auth if isinstance(auth, bytes) else auth.encode())} if auth else {}
    return [client.post("/v1/chat/completions", json=ASK, headers=headers).status_code,
            client.post("/v1/completions", json={"prompt": "Once", "stream": True}, headers=headers).status_code]


def test_api_requests_are_the_keys_or_without_a_key_the_local_users():
    from app.api.keys import KEY_USER

    keyed, open_ = Recording(), Recording()
    assert ask_api(keyed, KEY, KEY) == [200, 200]
    assert ask_api(keyed, KEY, "wrong") == [401, 401] and ask_api(keyed, KEY, None) == [401, 401]
    assert ask_api(keyed, KEY, b"\xff\xfe" + KEY.encode()) == [401, 401]  # bytes that are no UTF-8
    assert ask_api(open_, None, None) == [200, 200]
    assert ask_api(Recording(), "cl\u00e9 \U0001f511", "cl\u00e9 \U0001f511".encode()) == [200, 200]  # a UTF-8 key
    assert keyed.users == [KEY_USER] * 2 and open_.users == ["local"] * 2


# ---- a chat server with sign-in -----------------------------------------------------------------

@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    return write_scripted_checkpoint(tmp_path_factory.mktemp("weights") / "scripted", MODEL_SAYS)


@contextlib.contextmanager
def running(server):
    yield from server.running()


@pytest.fixture(scope="module")
def signed(scripted, tmp_path_factory):
    """The chat app with LLAMA_USERS (ada and grace), its key, history, and short deadlines for slow clients."""
    folder = tmp_path_factory.mktemp("signed")
    path = folder / "users"
    users.add(path, "ada", "lovelace")
    users.add(path, "grace", "hopper")
    env = server_env(checkpoint=scripted, weights_dir=scripted.parent, threads=1, users=path, api_key=KEY,
                     history_db=folder / "data" / "history.db", header_timeout=2, body_timeout=2)
    env.pop("CHAINLIT_AUTH_SECRET", None)
    with running(ChainlitServer(env, log=folder / "chainlit.log")) as server:
        server.users = path
        yield server


def login(server, name: str, password: str, **headers) -> httpx.Response:
    return httpx.post(f"{server.url}/login", data={"username": name, "password": password}, headers=headers,
                      timeout=60)


def threads(server, cookies) -> int:
    return httpx.post(f"{server.url}/project/threads", cookies=cookies, json=THREADS, timeout=30).status_code


def set_password(path, name: str, password: str) -> None:
    done = subprocess.run([sys.executable, "-m", "app.web.users", "add", name, "--file", str(path)], cwd=ROOT,
                          input=password + "\n", capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_sign_in_without_an_api_key_stops_the_start_with_what_to_set(scripted, tmp_path):
    path = tmp_path / "users"
    users.add(path, "ada", "lovelace")
    env = server_env(checkpoint=scripted, weights_dir=scripted.parent, threads=1, users=path, history="off")
    server = ChainlitServer(env, log=tmp_path / "chainlit.log")
    try:
        assert server.process.wait(timeout=120) == 2
    finally:
        server.stop()
    assert (f"error: sign-in is on (LLAMA_USERS set): the API and /metrics then need a key too, else anyone who "
            "reaches the port could use them; set LLAMA_API_KEY") in server.log_path.read_text()


def test_with_sign_in_the_api_and_metrics_take_the_key_only(signed):
    config = httpx.get(f"{signed.url}/auth/config", timeout=30).json()
    assert config["passwordAuth"] and not config["headerAuth"]  # LLAMA_USERS alone: a login form
    users.add(signed.users, "kay", "sparck jones")
    for path in ("/v1/models", "/metrics"):
        for key, status in [(None, 401), ("wrong", 401), (KEY, 200)]:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            assert httpx.get(f"{signed.url}{path}", headers=headers, timeout=30).status_code == status, (path, key)
    kay = dict(login(signed, "kay", "sparck jones").cookies)
    assert httpx.get(f"{signed.url}/v1/models", cookies=kay, timeout=30).status_code == 401  # a sign-in is no key
    answer = httpx.post(f"{signed.url}/v1/chat/completions", json=ASK, headers={"Authorization": f"Bearer {KEY}"},
                        timeout=60)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == MODEL_SAYS


def test_a_new_password_ends_the_sessions_signed_in_with_the_old_one(signed):
    old = dict(login(signed, "ada", "lovelace").cookies)
    grace = dict(login(signed, "grace", "hopper").cookies)
    assert threads(signed, old) == 200 and threads(signed, grace) == 200
    set_password(signed.users, "ada", "analytical engine")
    assert threads(signed, old) == 401
    assert httpx.post(f"{signed.url}/auth/jwt", headers={"Authorization": f"Bearer {old['access_token']}"},
                      timeout=30).status_code == 401  # not renewed either
    with pytest.raises(socketio.exceptions.ConnectionError):
        ChatTab(signed.url, old)
    assert login(signed, "ada", "lovelace").status_code == 401
    new = dict(login(signed, "ada", "analytical engine").cookies)
    assert threads(signed, new) == 200 and threads(signed, grace) == 200  # grace's session goes on
    tab = ChatTab(signed.url, new)
    try:
        tab.wait_for("chat_settings")
        tab.send("Hi")
        assert any(event in ("stream_start", "stream_token") for event, _ in tab.events)  # it streamed
    finally:
        tab.close()


def test_a_removed_user_is_signed_out_and_their_open_socket_closed(signed):
    users.add(signed.users, "rosalind", "franklin")
    rosalind = dict(login(signed, "rosalind", "franklin").cookies)
    tab = ChatTab(signed.url, rosalind)
    try:
        tab.wait_for("chat_settings")
        users.write_lines(signed.users, [line for line in signed.users.read_text().splitlines()
                                         if not line.startswith("rosalind:")])
        assert threads(signed, rosalind) == 401
        deadline = time.monotonic() + 5 * sessions.SWEEP_S
        while tab.sio.connected and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not tab.sio.connected
    finally:
        tab.close()
    assert login(signed, "rosalind", "franklin").status_code == 401
    assert "closed a socket signed in as 'rosalind': its sign-in has ended" in signed.log_path.read_text()


def test_x_forwarded_for_from_loopback_is_not_believed_without_trusted_proxies(signed):
    assert login(signed, "ada", "wrong", **{"X-Forwarded-For": "203.0.113.9"}).status_code == 401
    assert "sign-in as 'ada' from 127.0.0.1 failed" in signed.log_path.read_text()
    assert "203.0.113.9" not in signed.log_path.read_text()


def stalled(url: str, data: bytes, wait_s: float = 60) -> bytes:
    """Send data and stall: everything the server answers until it closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait_s) as connection:
        connection.sendall(data)
        answer = b""
        while chunk := connection.recv(4096):
            answer += chunk
    return answer


def test_a_client_that_stalls_in_its_headers_or_its_body_is_cut_off_and_sockets_are_not(signed):
    users.add(signed.users, "hedy", "lamarr")
    tab = ChatTab(signed.url, dict(login(signed, "hedy", "lamarr").cookies))  # open meanwhile, longer than both
    tab.wait_for("chat_settings")
    headers = stalled(signed.url, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bea")
    assert headers.startswith(b"HTTP/1.1 408 ") and b"The request's headers did not arrive within 2 s" in headers
    body = stalled(signed.url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                   + KEY.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mess")
    assert body.startswith(b"HTTP/1.1 408 ") and b"The request's body did not arrive within 2 s" in body
    assert stalled(signed.url, b"") == b""  # a connection opened and never used: closed without a word
    log = signed.log_path.read_text()
    assert "request headers did not arrive within 2 s (LLAMA_HEADER_TIMEOUT)" in log
    assert "request body did not arrive within 2 s (LLAMA_BODY_TIMEOUT)" in log
    assert httpx.get(f"{signed.url}/health", timeout=30).status_code == 200  # and the server goes on
    try:
        assert tab.sio.connected
        tab.send("Still there?")
        assert any(event in ("stream_start", "stream_token") for event, _ in tab.events)  # it streamed
    finally:
        tab.close()


def test_a_large_body_is_refused_before_it_is_read_by_a_route_that_reads_first(signed):
    """Chainlit reads a body before it asks who sent it: 200 MB from nobody must not reach its memory."""
    def resident_mb() -> int:
        status = Path(f"/proc/{signed.process.pid}/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) // 1024

    async def pieces():
        yield b'{"filter": "'
        for _ in range(200):
            yield b"a" * 2**20
        yield b'"}'

    async def send():
        async with httpx.AsyncClient(timeout=60) as client:
            return await client.post(f"{signed.url}/project/threads", content=pieces(),
                                     headers={"content-type": "application/json"})

    before = resident_mb()
    answer = asyncio.run(send())
    assert answer.status_code == 413 and "this route takes at most 1 MB" in answer.text
    assert resident_mb() - before < 64  # (read whole, 200 MB took the process past 1 GB)
    users.add(signed.users, "barbara", "liskov")  # (the tests before change ada's and grace's)
    cookies = dict(login(signed, "barbara", "liskov").cookies)
    assert threads(signed, cookies) == 200  # what the page sends still arrives


def test_history_files_are_private(signed):
    data = signed.users.parent / "data"
    assert data.stat().st_mode & 0o777 == 0o700
    assert (ROOT / ".files").stat().st_mode & 0o777 == 0o700  # where Chainlit keeps the files it sends
    files = {path.name: path.stat().st_mode & 0o777 for path in data.iterdir()}
    assert {"history.db", ".auth_secret"} <= set(files) and set(files.values()) == {0o600}, files


# ---- forwarded addresses from a trusted proxy ---------------------------------------------------

def test_x_forwarded_for_is_believed_from_a_trusted_proxy(scripted, tmp_path):
    env = server_env(checkpoint=scripted, weights_dir=scripted.parent, threads=1, password="household",
                     api_key=KEY, history="off", trusted_proxies="127.0.0.0/8")
    with running(ChainlitServer(env, log=tmp_path / "chainlit.log")) as server:
        assert login(server, "ada", "wrong", **{"X-Forwarded-For": "198.51.100.1, 203.0.113.9"}).status_code == 401
        assert "sign-in as 'ada' from 203.0.113.9 failed" in server.log()  # the address the proxy saw


def test_the_api_alone_believes_x_forwarded_for_only_from_trusted_proxies(scripted, tmp_path):
    for trusted, seen in [("", "127.0.0.1"), ("127.0.0.1", "203.0.113.9")]:
        env = server_env(checkpoint=scripted, weights_dir=scripted.parent, threads=1, trusted_proxies=trusted)
        with running(ApiServer(env, log=tmp_path / f"api-{seen}.log")) as server:
            assert httpx.get(f"{server.url}/v1/models", headers={"X-Forwarded-For": "203.0.113.9"},
                             timeout=30).status_code == 200
            time.sleep(0.2)
            assert re.search(rf'{re.escape(seen)}:\d+ - "GET /v1/models HTTP/1.1" 200', server.log()), server.log()
