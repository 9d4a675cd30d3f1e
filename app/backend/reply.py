"""A reply being computed, as the web side sees it: an async iterator of its events, and cancel().

Either backend (the local engine or a remote server) hands events to `deliver()` from any thread;
the caller iterates them on its own event loop. Text pieces that arrive faster than one per
`stream_interval` are joined, so the browser re-renders a message about 20 times a second, not once
per token; the last piece, once the backend has delivered the reply's end, comes at once.

The events wait in a queue until the caller takes them; a caller that stops taking them (an API client
that reads nothing: its server-sent events wait for the socket) would let it grow for as long as the
reply runs. Past app.bounds.REPLY_BUFFER_BYTES of text waiting, the reply is cut off: what waits is
dropped, the request cancelled (its place given back), and the caller finds a Failed "unread" next.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable

import msgspec

from app.backend.conversation import Conversation
from app.bounds import REPLY_BUFFER_BYTES
from app.messages import Done, Event, Failed, ReplySettings, Text, join_texts

log = logging.getLogger(__name__)
_encode = msgspec.msgpack.Encoder().encode

STREAM_INTERVAL = 0.05  # seconds between two Text events of one reply


class Reply:
    """A request's events; a request for n replies ends after the n-th Done (or a Failed)."""

    buffer_bytes = REPLY_BUFFER_BYTES  # text waiting for the caller, as MessagePack, before it is cut off

    def __init__(self, conversation: Conversation, settings: ReplySettings, model: str,
                 on_cancel: Callable[[Reply], None], stream_interval: float = STREAM_INTERVAL, n: int = 1):
        self.id = uuid.uuid4().hex
        self.n = n
        self._open = n  # replies without their Done yet, as delivered
        self._dones = 0  # as iterated
        self.conversation = conversation
        self.settings = settings
        self.model = model
        self.messages = list(conversation.messages)  # what was asked, whatever the caller adds later
        self.cancelled = False
        self.stream_interval = stream_interval
        self._on_cancel = on_cancel
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[tuple[Event, int]] = asyncio.Queue()  # each with the bytes it counts for
        self._waiting_bytes = 0  # the Text queued, not yet taken
        self.cut_off = False  # the caller left more than buffer_bytes waiting
        self._all_delivered = asyncio.Event()  # set on the caller's loop after the last event is queued
        self._ahead: Event | None = None  # read while joining text pieces, returned next
        self._last_text = 0.0
        self._finished = False
        self.ended = False  # the backend delivered its last event

    def cancel(self) -> None:
        """Stop this reply at its next token; a Done with finish_reason "cancelled" follows.
        Safe from any thread, and twice."""
        if not self.cancelled and not self.ended:
            self.cancelled = True
            self._on_cancel(self)

    def ends_with(self, event: Event) -> bool:
        """Whether delivering `event` ends the request (a Failed, or the last of its n Dones)."""
        return not self.ended and (isinstance(event, Failed) or (isinstance(event, Done) and self._open == 1))

    def deliver(self, event: Event) -> None:
        """Hand an event to the caller's event loop (from any thread)."""
        ends = self.ends_with(event)
        if isinstance(event, Done):
            self._open -= 1
        self.ended = self.ended or ends
        try:
            self._loop.call_soon_threadsafe(self._queue, event)
            if self.ended:
                self._loop.call_soon_threadsafe(self._all_delivered.set)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more, so it stops
            if not self.ended:
                self.cancel()

    def _queue(self, event: Event) -> None:
        """On the caller's loop: queue an event, or cut the reply off when its caller lets too much wait."""
        if self.cut_off:
            return
        size = len(_encode(event)) if isinstance(event, Text) else 0  # (a Done, bounded by the context, is not held)
        self._waiting_bytes += size
        if self._waiting_bytes <= self.buffer_bytes:
            self._events.put_nowait((event, size))
            return
        log.warning("request %s: its reader left more than %d bytes of text untaken "
                    "(app.bounds.REPLY_BUFFER_BYTES); cut off and cancelled", self.id, self.buffer_bytes)
        self.cut_off = True
        while not self._events.empty():  # what nobody took is let go
            self._events.get_nowait()
        self._waiting_bytes = 0
        self._events.put_nowait((Failed(self.id, f"The reply was cut off: its reader left more than "
                                                 f"{self.buffer_bytes} bytes of it untaken.", "unread"), 0))
        self._all_delivered.set()
        self.cancel()

    def _take(self) -> Event:
        event, size = self._events.get_nowait()
        self._waiting_bytes -= size
        return event

    def __aiter__(self):
        return self

    async def __anext__(self) -> Event:
        if self._finished:
            raise StopAsyncIteration
        if self._ahead is not None:
            event, self._ahead = self._ahead, None
        else:
            event, size = await self._events.get()
            self._waiting_bytes -= size
        if isinstance(event, Text):
            wait = self._last_text + self.stream_interval - time.monotonic()
            if wait > 0:  # the rest of the interval, unless the reply ends meanwhile: then nothing more to join
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._all_delivered.wait(), wait)
            pieces = [event]
            while not self._events.empty():
                following = self._take()
                if not isinstance(following, Text) or following.index != event.index:
                    self._ahead = following
                    break
                pieces.append(following)
            self._last_text = time.monotonic()
            event = join_texts(pieces)
        if isinstance(event, Done):
            self._dones += 1
        self._finished = isinstance(event, Failed) or (isinstance(event, Done) and self._dones == self.n)
        return event

    async def events(self) -> list[Event]:
        """Every remaining event, up to and including the last one."""
        return [event async for event in self]
