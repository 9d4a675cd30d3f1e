"""A streaming client that reads nothing, on the real API server (`python -m app.api`): it is cut off after
LLAMA_WRITE_TIMEOUT seconds of taking nothing, its request is cancelled and its places are given back,
while the server goes on answering everyone else."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest
from support.servers import ApiServer, server_env

pytestmark = pytest.mark.timeout(900)

WRITE_TIMEOUT_S = 2
PLACES = 4  # LLAMA_MAX_BATCH, with no waiting places: one request for n=4 replies takes them all
# Before the server's writes wait, the reply fills the kernel's buffers (app.web.http_server.SEND_BUFFER_BYTES,
# doubled, and the client's) and the transport's: about 0.6 MB, a second or two of the tiny model's tokens with
# their top logprobs on an idle machine, minutes on a busy one. Its reply alone would run for hours.
CUT_OFF_WITHIN_S = 300


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    server = ApiServer(server_env(checkpoint=tiny, dtype="fp32", threads=1, kernels="off", max_batch=PLACES, max_waiting=0,
                                  write_timeout=WRITE_TIMEOUT_S),
                       log=tmp_path_factory.mktemp("api") / "api.log")
    try:
        server.wait_ready(timeout=300)  # (on a loaded machine the engine takes a while to import torch)
        yield server
    finally:
        server.stop()
    assert "Traceback" not in Path(server.log_path).read_text(errors="replace")


def unread_stream(port: int) -> socket.socket:
    """A connection that asks for a long streamed reply (n=4, top logprobs, no stop) and never reads."""
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me everything."}], "stream": True,
                       "n": PLACES, "logprobs": True, "top_logprobs": 20, "max_tokens": 100_000,
                       "ignore_eos": True, "temperature": 1}).encode()
    connection = socket.socket()
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connecting: the window it offers)
    connection.connect(("127.0.0.1", port))
    connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return connection


def ask(server: ApiServer) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})


def places_taken(server: ApiServer) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("llama_places_taken "):
            return float(line.split()[1])
    raise KeyError("llama_places_taken")


def test_a_client_that_reads_nothing_is_cut_off_and_its_places_given_back(server):
    connection = unread_stream(server.port)
    try:
        time.sleep(1)
        assert ask(server).status_code == 429  # its request holds every place
        started = time.monotonic()
        while (status := ask(server).status_code) == 429 and time.monotonic() - started < CUT_OFF_WITHIN_S:
            time.sleep(0.5)
        assert status == 200
        connection.settimeout(10)
        received = b""
        try:
            while chunk := connection.recv(65536):
                received += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    finally:
        connection.close()
    assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received  # cut off midway
    log = Path(server.log_path).read_text(errors="replace")
    assert log.count("took nothing of the") == 1 and "LLAMA_WRITE_TIMEOUT" in log


def test_everyone_else_is_answered_as_before(server):
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True,
                            "n": PLACES}) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert response.status_code == 200 and events[-1] == "data: [DONE]"
    assert places_taken(server) == 0 and httpx.get(f"{server.url}/health").status_code == 200
