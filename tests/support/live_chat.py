"""A browser tab without a browser, for asyncio tests: a socket.io client of a running Chainlit server.

It connects as the page does (/ws/socket.io, an `auth` object naming a new session and the chat profile),
emits `connection_successful` and waits for the settings panel that ends on_chat_start. `ask` sends a
message and reads the reply that follows, up to its `task_end`. Every event is kept with its time.
(For a server without sign-in: the app with LLAMA_HISTORY=off.)
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone

import socketio


@dataclass
class Reply:
    text: str  # the streamed answer, as finally sent
    stats: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # every other message shown meanwhile, removed or not
    first_token_at: float | None = None  # time.monotonic() of the answer's first piece


class LiveChat:
    def __init__(self, url: str, profile: str | None = None):
        self.url, self.profile = url, profile
        self.session_id = str(uuid.uuid4())
        self.events: list[tuple[float, str, object]] = []
        self._changed = asyncio.Event()
        self.sio = socketio.AsyncClient(reconnection=False)
        self.sio.on("*", self._record)

    async def _record(self, event: str, data=None):
        self.events.append((time.monotonic(), event, data))
        self._changed.set()

    async def open(self, timeout: float = 60.0) -> LiveChat:
        await self.sio.connect(self.url, socketio_path="/ws/socket.io", transports=["websocket"], wait_timeout=30,
                               auth={"sessionId": self.session_id, "clientType": "webapp", "userEnv": "{}",
                                     "chatProfile": self.profile, "threadId": None})
        await self.sio.emit("connection_successful")
        await self.wait_for("chat_settings", timeout=timeout)  # on_chat_start is done
        return self

    async def close(self) -> None:
        await self.sio.disconnect()

    async def settings(self, **values) -> None:
        """Submit the settings panel (and wait until the server has applied it)."""
        await self.sio.call("chat_settings_change", values, timeout=30)

    async def wait_for(self, event: str, after: int = 0, timeout: float = 60.0, where=lambda data: True) -> int:
        """The index of the first `event` at or after index `after` whose data passes `where`."""
        deadline = time.monotonic() + timeout
        while True:
            for i in range(after, len(self.events)):
                if self.events[i][1] == event and where(self.events[i][2]):
                    return i
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {event!r} within {timeout:.0f} s; got {[e for _, e, _ in self.events]}")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                pass

    async def send(self, text: str) -> int:
        """Send a message; returns the index of the events that answer it."""
        start = len(self.events)
        await self.sio.emit("client_message", {"message": {
            "id": str(uuid.uuid4()), "threadId": "", "type": "user_message", "name": "User", "output": text,
            "createdAt": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")}, "fileReferences": None})
        return start

    async def reply(self, start: int, timeout: float = 120.0) -> Reply:
        """The reply to the message sent at index `start`, once the server is done with it."""
        begun = await self.wait_for("task_start", after=start, timeout=timeout)
        end = await self.wait_for("task_end", after=begun + 1, timeout=timeout)
        return self.read(start, end)

    async def ask(self, text: str, timeout: float = 120.0) -> Reply:
        return await self.reply(await self.send(text), timeout)

    def read(self, start: int, end: int | None = None) -> Reply:
        messages: dict[str, dict] = {}
        streamed, first_token_at = set(), None
        for at, event, data in self.events[start:end]:
            if event in ("new_message", "update_message") and data.get("type") == "assistant_message":
                messages[data["id"]] = data
            elif event == "stream_start":
                messages[data["id"]] = data
                streamed.add(data["id"])
                first_token_at = first_token_at or at
            elif event == "stream_token":
                streamed.add(data["id"])
                first_token_at = first_token_at or at
        answers = [m["output"] for i, m in messages.items() if i in streamed]
        others = [m for i, m in messages.items() if i not in streamed]
        return Reply(text=answers[-1] if answers else "",
                     stats=[m["output"].strip("*") for m in others if m.get("name") == "stats"],
                     errors=[m["output"] for m in others if m.get("isError")],
                     notes=[m["output"] for m in others if m.get("name") != "stats" and not m.get("isError")],
                     first_token_at=first_token_at)
