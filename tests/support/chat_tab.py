"""A chat tab without a browser: drives a running Chainlit server over socket.io as its web page does.

The page first signs in (with header authentication, `POST /auth/header` sets the `access_token`
cookie), then opens the socket at /ws/socket.io with that cookie and an `auth` object naming its
session, and the thread to resume if any; it emits `connection_successful`, and `client_message`
for each message. A reply is over at the `task_end` event that follows.
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import datetime, timezone

import httpx
import socketio


def sign_in(url: str) -> dict[str, str]:
    """The cookies of a header sign-in (what the page does when the server uses header auth)."""
    response = httpx.post(f"{url}/auth/header", timeout=30)
    response.raise_for_status()
    assert "access_token" in response.cookies, f"no access_token cookie: {response.headers}"
    return dict(response.cookies)


class ChatTab:
    def __init__(self, url: str, cookies: dict[str, str] | None = None, thread_id: str | None = None,
                 chat_profile: str | None = None, session_id: str | None = None):
        self.url = url
        self.cookies = cookies or {}
        self.events: list[tuple[str, object]] = []
        self.thread_id = thread_id
        self._changed = threading.Condition()
        self.session_id = session_id or str(uuid.uuid4())
        self.sio = socketio.Client(reconnection=False)
        self.sio.on("*", self._record)
        self.sio.connect(url, socketio_path="/ws/socket.io", transports=["websocket"], wait_timeout=30,
                         headers={"Cookie": self.cookie_header()},
                         auth={"sessionId": self.session_id, "clientType": "webapp", "userEnv": "{}",
                               "chatProfile": chat_profile, "threadId": thread_id})
        self.sio.emit("connection_successful")

    def _record(self, event: str, data=None):
        with self._changed:
            self.events.append((event, data))
            if event == "first_interaction" and isinstance(data, dict):
                self.thread_id = data.get("thread_id")
            self._changed.notify_all()

    def wait_for(self, event: str, after: int = 0, timeout: float = 60.0) -> tuple[int, object]:
        """The index and data of the first `event` at or after index `after` of self.events."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for i in range(after, len(self.events)):
                    if self.events[i][0] == event:
                        return i, self.events[i][1]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {event!r} within {timeout:.0f} s; got {[e for e, _ in self.events]}")
                self._changed.wait(left)

    def cookie_header(self) -> str:
        return "; ".join(f"{k}={v}" for k, v in self.cookies.items())

    def send(self, text: str, timeout: float = 90.0, id: str | None = None, metadata: dict | None = None,
             files: list[dict] | None = None, event: str = "client_message", wait: bool = True) -> int:
        """Send a message (as the page does: its id, metadata and uploaded files' references; or, with
        event="edit_message", an edit of the message `id`) and wait until the server has finished with it
        (task_end), unless not to wait; the index of the events that answer it."""
        start = len(self.events)
        message = {"id": id or str(uuid.uuid4()), "threadId": self.thread_id or "", "type": "user_message",
                   "name": "User", "output": text,
                   "createdAt": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")}
        if metadata is not None:
            message["metadata"] = metadata
        self.sio.emit(event, {"message": message, "fileReferences": files})
        if not wait:
            return start
        started, _ = self.wait_for("task_start", after=start, timeout=timeout)
        self.wait_for("task_end", after=started + 1, timeout=timeout)
        if self.thread_id is None:  # the first message makes the thread; the server says so when it is stored
            self.wait_for("first_interaction", after=start, timeout=timeout)
        return start

    def upload(self, name: str, data: bytes, mime: str = "text/markdown") -> dict:
        """Upload a file as the page does before sending a message with it: its reference for send(files=...)."""
        response = httpx.post(f"{self.url}/project/file", params={"session_id": self.session_id},
                              files={"file": (name, data, mime)}, cookies=self.cookies, timeout=30)
        response.raise_for_status()
        return {"id": response.json()["id"], "name": name, "type": mime}

    def outputs(self, start: int = 0) -> list[str]:
        """The text of every message the server sent or updated since index start."""
        return [data.get("output", "") for event, data in self.events[start:]
                if event in ("new_message", "update_message") and isinstance(data, dict)]

    def close(self) -> None:
        self.sio.disconnect()
