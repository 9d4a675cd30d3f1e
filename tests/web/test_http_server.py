"""uvicorn as both servers run it (app.web.http_server): the deadlines for a request's headers and body,
and for a client to take what is written to it (a stream, a websocket), on a small app served in this
process, byte by byte over a raw socket; and the forwarded-address rule. (tests/test_sessions.py has the same on the real chat server.)"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket
from support.servers import free_port

from app.web import http_server
from app.settings import Settings, SettingsError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def served():
    """An app that echoes the body it read, and streams without end over HTTP and a websocket, with 1 s
    deadlines; yields (port, what the app saw)."""
    seen: list[str] = []

    async def endless(request: Request) -> StreamingResponse:
        async def chunks():
            try:
                while True:
                    yield b"x" * 16384
                    await asyncio.sleep(0.001)  # (as a reply waits for its next piece)
            finally:
                seen.append("stream ended")
        return StreamingResponse(chunks())

    async def endless_websocket(websocket: WebSocket) -> None:
        await websocket.accept()
        try:
            while True:
                await websocket.send_bytes(b"x" * 16384)
                await asyncio.sleep(0.001)
        except Exception:  # (the client is gone: how it says so differs between protocols)
            pass
        finally:
            seen.append("websocket ended")

    async def echo(request: Request) -> PlainTextResponse:
        try:
            body = await request.body()
        finally:
            seen.append("read")  # the body, or that the client is gone
        return PlainTextResponse(body.decode(), headers={"x-client": request.client.host})

    app = Starlette(routes=[Route("/", echo, methods=["GET", "POST"]), Route("/endless", endless),
                            WebSocketRoute("/ws", endless_websocket)])
    http_server.install(app)
    settings = Settings.from_env({"LLAMA_HEADER_TIMEOUT": "1", "LLAMA_BODY_TIMEOUT": "1", "LLAMA_WRITE_TIMEOUT": "1",
                                  "LLAMA_TRUSTED_PROXIES": "10.9.9.9"})
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None,  # logs reach caplog
                                           **http_server.uvicorn_options(settings)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield port, seen
    server.should_exit = True
    thread.join(timeout=10)


def talk(port: int, *pieces: bytes, pause_s: float = 0.0) -> bytes:
    """Send the pieces (pause_s apart), then read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        for piece in pieces:
            connection.sendall(piece)
            time.sleep(pause_s)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    return answer


POST = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"


def test_a_request_in_time_is_answered_even_in_pieces(served):
    port, _ = served
    answer = talk(port, POST[:10], POST[10:], b"Connection: close\r\n\r\nhel", b"lo", pause_s=0.2)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"hello")


def test_headers_that_stall_are_answered_408_and_cut_off(served, caplog):
    port, _ = served
    with caplog.at_level(logging.WARNING, "app.web.http_server"):
        answer = talk(port, POST)
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n") and b"connection: close" in answer
    assert answer.endswith(b"The request's headers did not arrive within 1 s; the connection is closed.\n")
    assert "request headers did not arrive within 1 s (LLAMA_HEADER_TIMEOUT)" in caplog.text


def test_a_body_that_stalls_is_answered_408_and_the_app_sees_the_client_gone(served, caplog):
    port, seen = served
    before = len(seen)
    with caplog.at_level(logging.INFO):
        answer = talk(port, POST + b"\r\nhel")
    assert answer.startswith(b"HTTP/1.1 408 ") and b"The request's body did not arrive within 1 s" in answer
    time.sleep(0.2)
    assert seen[before:] == ["read"]  # its read of the body ended (with the client gone)
    assert "Traceback" not in caplog.text and "Exception in ASGI application" not in caplog.text


def test_the_next_request_on_a_kept_connection_has_its_own_deadline(served):
    port, _ = served
    first = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    answer = talk(port, first, b"GET / HTTP/1.1\r\nHo", pause_s=0.3)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.count(b"HTTP/1.1 ") == 2
    assert b"HTTP/1.1 408 " in answer and answer.endswith(b"the connection is closed.\n")


def test_a_connection_that_sends_nothing_is_closed_without_a_word(served):
    port, _ = served
    assert talk(port) == b""


def unread(port: int, request: bytes) -> socket.socket:
    """A connection with a 4 KB receive buffer that sends a request and reads nothing."""
    connection = socket.socket()
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    connection.connect(("127.0.0.1", port))
    connection.sendall(request)
    return connection


def wait_for(seen: list[str], what: str, timeout: float) -> float | None:
    started = time.monotonic()
    while what not in seen:
        if time.monotonic() - started > timeout:
            return None
        time.sleep(0.05)
    return time.monotonic() - started


def read_to_the_end(connection: socket.socket, within: float) -> bool:
    """Whether the connection ends (closed or reset) while read for at most `within` seconds."""
    connection.settimeout(within)
    deadline = time.monotonic() + within
    try:
        while connection.recv(65536):
            if time.monotonic() > deadline:
                return False
    except ConnectionResetError:
        pass
    return True


WEBSOCKET = (b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
             b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")


@pytest.mark.parametrize("request_bytes, ended", [(b"GET /endless HTTP/1.1\r\nHost: x\r\n\r\n", "stream ended"),
                                                  (WEBSOCKET, "websocket ended")], ids=["stream", "websocket"])
def test_a_client_that_reads_nothing_is_cut_off(served, caplog, request_bytes, ended):
    port, seen = served
    with caplog.at_level(logging.WARNING, "app.web.http_server"):
        connection = unread(port, request_bytes)
        try:
            waited = wait_for(seen, ended, timeout=20)
            assert waited is not None  # the app's writing ended: the client is gone for it
            seen.remove(ended)
            assert read_to_the_end(connection, within=5)  # the server let go of it
        finally:
            connection.close()
    assert caplog.text.count("cut off a client that took nothing of the") == 1
    assert "(LLAMA_WRITE_TIMEOUT)" in caplog.text and "Traceback" not in caplog.text


def test_a_client_that_reads_slowly_is_not_cut_off(served):
    """Each second (the deadline) it takes a little: never cut off, however long it takes."""
    port, seen = served
    connection = unread(port, b"GET /endless HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        time.sleep(0.5)  # the buffers fill (within the deadline)
        for _ in range(12):
            assert connection.recv(4096)
            time.sleep(0.25)
        assert "stream ended" not in seen
    finally:
        connection.close()
    assert wait_for(seen, "stream ended", timeout=10) is not None
    seen.remove("stream ended")


def test_x_forwarded_for_counts_only_from_a_trusted_proxy(served):
    port, _ = served
    answer = talk(port, b"GET / HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 203.0.113.9\r\nConnection: close\r\n\r\n")
    assert b"x-client: 127.0.0.1" in answer  # loopback is no proxy unless LLAMA_TRUSTED_PROXIES names it
    options = http_server.uvicorn_options(Settings.from_env({"LLAMA_TRUSTED_PROXIES": "127.0.0.1,10.0.0.0/8"}))
    assert options["forwarded_allow_ips"] == "127.0.0.1/32,10.0.0.0/8" and options["proxy_headers"]
    assert http_server.uvicorn_options(Settings.from_env({}))["forwarded_allow_ips"] == ""


def test_the_write_deadline_is_llama_write_timeout_for_http_and_websockets(monkeypatch):
    options = http_server.uvicorn_options(Settings.from_env({"LLAMA_WRITE_TIMEOUT": "7.5"}))
    assert options["http"].write_timeout_s == options["ws"].write_timeout_s == 7.5
    assert http_server.uvicorn_options(Settings.from_env({}))["ws"].write_timeout_s == 30
    with pytest.raises(SettingsError, match="LLAMA_WRITE_TIMEOUT=0"):
        Settings.from_env({"LLAMA_WRITE_TIMEOUT": "0"})
    monkeypatch.setitem(uvicorn.config.WS_PROTOCOLS, "auto", uvicorn.config.WS_PROTOCOLS["auto"])
    monkeypatch.setitem(uvicorn.config.HTTP_PROTOCOLS, "auto", uvicorn.config.HTTP_PROTOCOLS["auto"])
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "")
    http_server.configure_chainlit(Settings.from_env({"LLAMA_WRITE_TIMEOUT": "3"}))  # as `chainlit run` takes them
    assert uvicorn.config.WS_PROTOCOLS["auto"].write_timeout_s == 3


def test_client_gone_is_answered_quietly():
    from starlette.requests import ClientDisconnect

    response = asyncio.run(http_server.client_gone(None, ClientDisconnect()))
    assert response.status_code == 499
