"""How uvicorn serves both servers (the chat app, which `chainlit run` starts, and `python -m app.api`):
clients that send too slowly or do not read are cut off, the chat app's routes take bodies up to a
bound, and a client's address comes from X-Forwarded-For only when a trusted proxy sends it.

Slow clients. Uvicorn closes a connection idle between requests (its keep-alive timeout) but waits
for ever on a request that has begun: a client that sends half its headers, or half its body, then
stalls, holds its connection and a task as long as it likes, and a few hundred such clients hold them
all. No setting of uvicorn's bounds this, and an ASGI middleware is called only once the headers are
in, so the deadlines are kept in uvicorn's own HTTP/1.1 protocol (h11, also where httptools is
installed), subclassed: a request's headers must arrive within LLAMA_HEADER_TIMEOUT seconds of the
connection opening (or of the previous answer on it ending), its body within LLAMA_BODY_TIMEOUT
seconds of its headers. Past either, the client is answered 408 (if it sent part of a request) and
the connection closed; the app, if it was reading the body, sees the client gone (`install` has that
answered quietly, as for any client that leaves before its body is read). Websockets, once upgraded,
and answers however long, are not timed by these two.

Clients that do not read. What a server writes waits in the kernel's socket buffers, then in the
transport's; past its high-water mark (64 KB) uvicorn holds the app's next write until the buffer
drains, and nothing else ends the wait: a client that reads nothing (or a socket.io page that stopped
reading: its frames queue in engine.io behind the held write) holds its connection, its task and
what its reply queues, for ever. `WriteDeadline` (in the h11 protocol, and in the wsproto websocket
protocol a chat's socket.io runs on) aborts a connection whose buffer has stayed above the mark
LLAMA_WRITE_TIMEOUT seconds without the client taking a byte of it (the kernel's send buffer, set to
SEND_BUFFER_BYTES, fills first): the app sees the client gone (its request is cancelled), and the
buffers are let go. What an API reply queues meanwhile is bounded too (app.backend.reply).

Large bodies. Chainlit's routes read a request's whole body before they look at who sent it: a JSON
body of 400 MB to one of them, from a client that is not signed in, took the web process from 184 MB
to 1.3 GB, and a fast client sends gigabytes within the body deadline. `BodyLimit` answers 413 past
a route's bound: a file upload's is the largest file taken (app.bounds.MAX_FILE_BYTES) and its form's
framing, every other Chainlit route's CHAINLIT_BODY_BYTES; the API has its own (LLAMA_MAX_BODY_MB), and
socket.io its buffer's. The body is counted as it arrives, so a missing or false Content-Length
changes nothing.

Forwarded addresses. Uvicorn believes X-Forwarded-For (and -Proto) from the addresses in its
`forwarded_allow_ips`, by default loopback: any program on this machine could then claim any address
and sign-in failures would be counted against it. Here only LLAMA_TRUSTED_PROXIES are believed (none
by default), with uvicorn's own middleware: it takes the nearest address that is not a trusted proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import struct
import termios

import h11
import uvicorn.config
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.wsproto_impl import WSProtocol

from app.bounds import MAX_FILE_BYTES
from app.settings import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, DEFAULT_WRITE_TIMEOUT_S, Settings

log = logging.getLogger(__name__)

STATUS_408 = ("HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
              "content-length: {length}\r\n\r\n{text}")


SEND_BUFFER_BYTES = 256 * 1024  # the kernel's send buffer of a connection (Linux doubles it; not grown by autotuning)


class WriteDeadline:
    """A protocol mixin: once the transport has paused writing (its buffer past the high-water mark), the
    connection is aborted when write_timeout_s passes without the client taking a byte: neither the
    transport's buffer nor the kernel's send queue (unsent or unacknowledged bytes) got smaller. The
    kernel hands the transport room again only once a third of its buffer is free, so a client that
    reads slowly but steadily shows in its queue first. That buffer is set to SEND_BUFFER_BYTES: Linux
    grows a loopback socket's up to 4 MB, which a client that reads nothing fills before the transport
    pauses (a minute of a fast stream; kernel memory, a few hundred such clients' worth of a gigabyte).
    Aborted, not closed: close() waits for the buffer to be sent."""

    write_timeout_s = DEFAULT_WRITE_TIMEOUT_S
    stall: asyncio.TimerHandle | None = None
    stalled_at = 0  # the bytes waiting for the client when the deadline was set

    def connection_made(self, transport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        super().connection_made(transport)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.stall is None:
            self._wait_for_reader()

    def resume_writing(self) -> None:
        self._unwait()
        super().resume_writing()

    def connection_lost(self, exc) -> None:
        self._unwait()
        super().connection_lost(exc)

    def _waiting(self) -> int:
        """Bytes written that the client has not taken yet: the transport's buffer and the kernel's send queue."""
        queued = 0
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # (not on Linux, or not a TCP socket: the transport's alone)
                queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        return self.transport.get_write_buffer_size() + queued

    def _wait_for_reader(self) -> None:
        self.stalled_at = self._waiting()
        self.stall = self.loop.call_later(self.write_timeout_s, self._check_reader)

    def _unwait(self) -> None:
        if self.stall is not None:
            self.stall.cancel()
            self.stall = None

    def _check_reader(self) -> None:
        self.stall = None
        waiting = self._waiting()
        if waiting < self.stalled_at:  # it reads, slowly: another period
            self._wait_for_reader()
            return
        log.warning("%s: cut off a client that took nothing of the %d bytes waiting for it in %g s "
                    "(LLAMA_WRITE_TIMEOUT)", _address(self.client), waiting, self.write_timeout_s)
        self.transport.abort()


class Deadlines(WriteDeadline, H11Protocol):
    """uvicorn's h11 protocol, with a deadline for each request's headers, one for its body, and one for the
    client to take what is written to it."""

    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s = DEFAULT_BODY_TIMEOUT_S

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.awaiting: str | None = None  # "headers" or "body": what the deadline is for
        self.deadline: asyncio.TimerHandle | None = None
        self.upgraded = False  # a websocket now: no deadlines

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._follow()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def handle_websocket_upgrade(self, event) -> None:
        self.upgraded = True
        self._await(None)
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc) -> None:
        self._await(None)
        super().connection_lost(exc)

    def _follow(self) -> None:
        """Time what the client is in the middle of sending, as h11 reads it."""
        state = self.conn.their_state
        if self.upgraded or self.transport.is_closing():
            self._await(None)
        else:
            self._await("headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None)

    def _await(self, awaiting: str | None) -> None:
        if awaiting == self.awaiting:
            return
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        self.awaiting = awaiting
        if awaiting is not None:
            self.deadline = self.loop.call_later(self._timeout(awaiting), self._too_slow)

    def _timeout(self, awaiting: str) -> float:
        return self.header_timeout_s if awaiting == "headers" else self.body_timeout_s

    def _too_slow(self) -> None:
        awaiting, self.deadline = self.awaiting, None
        timeout = self._timeout(awaiting)
        begun = awaiting == "body" or bool(self.conn.trailing_data[0])  # not a connection opened ahead of use
        answered = self.cycle is not None and self.cycle.response_started and awaiting == "body"
        if begun:
            variable = "LLAMA_HEADER_TIMEOUT" if awaiting == "headers" else "LLAMA_BODY_TIMEOUT"
            log.warning("%s: closed a connection whose request %s did not arrive within %g s (%s)",
                        _address(self.client), awaiting, timeout, variable)
        if begun and not answered:
            text = f"The request's {awaiting} did not arrive within {timeout:g} s; the connection is closed.\n"
            self.transport.write(STATUS_408.format(length=len(text), text=text).encode())
        if awaiting == "body" and self.cycle is not None:  # the app, reading the body, sees the client gone
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.awaiting = None
        self.transport.close()


class WebSocketDeadline(WriteDeadline, WSProtocol):
    """uvicorn's wsproto websocket protocol, with the deadline for the client to take what is written to it."""


CHAINLIT_BODY_BYTES = 2**20  # sign-in, history, feedback, thread names: small JSON or forms
UPLOAD_BODY_BYTES = MAX_FILE_BYTES + 2**20  # a file and the multipart form around it
OWN_LIMITS = ("/v1/", "/ws/")  # the API (LLAMA_MAX_BODY_MB) and socket.io (its buffer): bounded where they read


class TooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: a request whose body passes its route's bound is answered 413, and read no further."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self.logged: set[str] = set()

    @staticmethod
    def limit(scope: Scope) -> int | None:
        path, root = scope["path"], scope.get("root_path", "")
        path = path[len(root):] if root and path.startswith(root) else path  # (served under a prefix)
        if path.startswith(OWN_LIMITS):
            return None
        return UPLOAD_BODY_BYTES if path.rstrip("/") == "/project/file" else CHAINLIT_BODY_BYTES

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.limit(scope) if scope["type"] == "http" else None
        if limit is None:
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await self._refuse(limit, scope, receive, send)
            return
        received, over, started = 0, False, False

        async def counted() -> Message:
            nonlocal received, over
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                over = True
                raise TooLarge  # (the route may answer this its own way: that answer is not sent)
            return message

        async def sending(message: Message) -> None:
            nonlocal started
            if not over:
                started = True
                await send(message)

        try:
            await self.app(scope, counted, sending)
        except TooLarge:
            pass
        if over and not started:  # (an answer begun before the body was read is left to end as it can)
            await self._refuse(limit, scope, receive, send)

    async def _refuse(self, limit: int, scope: Scope, receive: Receive, send: Send) -> None:
        said = (f"a file may be at most {MAX_FILE_BYTES // 2**20} MB" if limit == UPLOAD_BODY_BYTES
                else f"this route takes at most {limit // 2**20} MB")
        if scope["path"] not in self.logged and len(self.logged) < 64:  # once a path: no flood of the log
            self.logged.add(scope["path"])
            log.warning("refused a request body to %s past %d bytes (logged once a path)", scope["path"], limit)
        await PlainTextResponse(f"The request body is too large: {said}.", status_code=413)(scope, receive, send)


async def client_gone(request, error: ClientDisconnect) -> Response:
    """A client that went away, or was cut off, before its request was read: nobody is left to answer, and
    it is no fault of the app's (uvicorn would log it with a traceback)."""
    return Response(status_code=499)  # nginx's "client closed request"; never sent


def install(app) -> None:
    """Have a Starlette or FastAPI app answer clients gone before their body was read with client_gone."""
    app.add_exception_handler(ClientDisconnect, client_gone)


def limit_bodies(app) -> None:
    """Bound the bodies of a Chainlit app's routes (BodyLimit), before any of them reads one."""
    app.add_middleware(BodyLimit)


def _address(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


def uvicorn_options(settings: Settings) -> dict:
    """What uvicorn.run / uvicorn.Config takes for these rules."""
    protocol = type("Deadlines", (Deadlines,), {"header_timeout_s": settings.header_timeout,
                                                 "body_timeout_s": settings.body_timeout,
                                                 "write_timeout_s": settings.write_timeout})
    websocket = type("WebSocketDeadline", (WebSocketDeadline,), {"write_timeout_s": settings.write_timeout})
    return {"http": protocol, "ws": websocket, "proxy_headers": True,
            "forwarded_allow_ips": ",".join(settings.trusted_proxies)}


def configure_chainlit(settings: Settings) -> None:
    """The same rules for the uvicorn that `chainlit run` starts once it has imported the app: it names no
    HTTP or websocket protocol (so takes uvicorn's "auto" ones, unless UVICORN_WS_PROTOCOL names one) and no forwarded_allow_ips (so reads FORWARDED_ALLOW_IPS)."""
    options = uvicorn_options(settings)
    uvicorn.config.HTTP_PROTOCOLS["auto"] = options["http"]  # uvicorn resolves the name to a class: ours
    uvicorn.config.WS_PROTOCOLS["auto"] = options["ws"]
    os.environ["FORWARDED_ALLOW_IPS"] = options["forwarded_allow_ips"]
