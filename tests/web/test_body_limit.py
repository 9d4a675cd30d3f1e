"""Bodies past a route's bound are answered 413 and read no further (app.web.http_server.BodyLimit), on a
small FastAPI app shaped as Chainlit's routes are: the body is read before the route asks who sent it.
(tests/web/test_sessions.py sends one to the real chat server.)"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import Depends, FastAPI, HTTPException, UploadFile

from app.bounds import MAX_FILE_BYTES
from app.web import http_server
from app.web.http_server import CHAINLIT_BODY_BYTES, UPLOAD_BODY_BYTES

MB = 2**20


def nobody():
    raise HTTPException(401, "Invalid authentication token")


def chainlit_like() -> tuple[FastAPI, list[int]]:
    """Routes that read their body first, then refuse a caller who is not signed in; and how much of each
    body the app received."""
    app, read = FastAPI(), []

    @app.put("/project/thread")
    async def rename(body: dict, user=Depends(nobody)):
        return {}

    @app.post("/project/file")
    async def upload(file: UploadFile, session_id: str):
        data = await file.read()
        read.append(len(data))
        return {"size": len(data)}

    @app.post("/v1/chat/completions")
    async def api(request: dict):
        read.append(len(str(request)))
        return {"ok": True}

    http_server.limit_bodies(app)
    return app, read


def post(app, method: str, path: str, content, headers: dict) -> httpx.Response:
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.request(method, path, content=content, headers=headers)
    return asyncio.run(run())


class Pieces:
    """A body sent in pieces without a Content-Length (as a client may), counting what was taken."""

    def __init__(self, total: int, head: bytes = b"", size: int = MB):
        self.total, self.head, self.size, self.taken = total, head, size, 0

    async def __aiter__(self):
        yield self.head
        while self.taken < self.total:
            piece = b"a" * min(self.size, self.total - self.taken)
            self.taken += len(piece)
            yield piece


FILE_HEAD = (b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.txt\"\r\n"
             b"Content-Type: text/plain\r\n\r\n")


def multipart(size: int) -> bytes:
    return FILE_HEAD + b"a" * size + b"\r\n--b--\r\n"


FORM = {"content-type": "multipart/form-data; boundary=b"}
JSON = {"content-type": "application/json"}


def test_a_declared_length_past_the_bound_is_refused_before_the_body_is_read():
    app, _ = chainlit_like()
    answer = post(app, "PUT", "/project/thread", b"{}", JSON | {"content-length": str(CHAINLIT_BODY_BYTES + 1)})
    assert answer.status_code == 413 and answer.text == "The request body is too large: this route takes at most 1 MB."


def test_a_body_sent_in_pieces_is_counted_and_cut_off_at_the_bound():
    app, _ = chainlit_like()
    body = Pieces(200 * MB)
    answer = post(app, "PUT", "/project/thread", body, JSON)  # no Content-Length
    assert answer.status_code == 413  # not the route's 401, nor its own error for a body it could not read
    assert body.taken < CHAINLIT_BODY_BYTES + 2 * MB  # the other 198 MB were never asked for


def test_a_small_body_reaches_the_route():
    app, _ = chainlit_like()
    assert post(app, "PUT", "/project/thread", b'{"name": "x"}', JSON).status_code == 401  # the route's answer


def test_a_file_up_to_the_largest_taken_is_uploaded_and_one_past_it_is_not():
    app, read = chainlit_like()
    fits = post(app, "POST", "/project/file?session_id=s", multipart(MAX_FILE_BYTES), FORM)
    assert fits.status_code == 200 and read == [MAX_FILE_BYTES]
    body = Pieces(UPLOAD_BODY_BYTES + 100 * MB, head=FILE_HEAD)
    too_big = post(app, "POST", "/project/file?session_id=s", body, FORM)
    assert too_big.status_code == 413 and too_big.text == ("The request body is too large: a file may be at most "
                                                           f"{MAX_FILE_BYTES // MB} MB.")
    assert read == [MAX_FILE_BYTES] and body.taken < UPLOAD_BODY_BYTES + 2 * MB


def test_the_api_keeps_its_own_bound():
    app, read = chainlit_like()
    body = b'{"messages": "' + b"a" * (2 * MB) + b'"}'  # past the Chainlit routes' bound: the API's is its own
    assert post(app, "POST", "/v1/chat/completions", body, JSON).status_code == 200 and read


def test_under_a_path_prefix_the_routes_keep_their_bounds():
    scope = {"type": "http", "path": "/chat/project/file", "root_path": "/chat"}
    assert http_server.BodyLimit.limit(scope) == UPLOAD_BODY_BYTES
    assert http_server.BodyLimit.limit(scope | {"path": "/chat/v1/chat/completions"}) is None
    assert http_server.BodyLimit.limit(scope | {"path": "/chat/project/thread"}) == CHAINLIT_BODY_BYTES
