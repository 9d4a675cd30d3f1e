"""A reply being computed, as the web side sees it: an async iterator of its events, and cancel().

Either backend (the local engine or a remote server) hands events to `deliver()` from any thread;
the caller iterates them on its own event loop. Text pieces that arrive faster than one per
`stream_interval` are joined, so the browser re-renders a message about 20 times a second, not once
per token; the last piece, once the backend has delivered the reply's end, comes at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable

from app.backend.conversation import Conversation
from app.messages import Done, Event, Failed, ReplySettings, Text, join_texts

STREAM_INTERVAL = 0.05  # seconds between two Text events of one reply


class Reply:
    """A request's events; a request for n replies ends after the n-th Done (or a Failed)."""

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
        self._events: asyncio.Queue[Event] = asyncio.Queue()
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
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
            if self.ended:
                self._loop.call_soon_threadsafe(self._all_delivered.set)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more, so it stops
            if not self.ended:
                self.cancel()

    def __aiter__(self):
        return self

    async def __anext__(self) -> Event:
        if self._finished:
            raise StopAsyncIteration
        if self._ahead is not None:
            event, self._ahead = self._ahead, None
        else:
            event = await self._events.get()
        if isinstance(event, Text):
            wait = self._last_text + self.stream_interval - time.monotonic()
            if wait > 0:  # the rest of the interval, unless the reply ends meanwhile: then nothing more to join
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._all_delivered.wait(), wait)
            pieces = [event]
            while not self._events.empty():
                following = self._events.get_nowait()
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
