"""Chainlit's socket events, each payload checked before Chainlit's handler reads it.

Chainlit 2.12's handlers (chainlit/socket.py) take a payload on trust: `client_message` with a string, a message
without fields or whose id is not a UUID, `edit_message` or `message_favorite` with null, `chat_settings_change`
with a list, and `stop` or `clear_session` with an argument they do not take each raised inside the handler or
in the task it starts, a traceback in the log ("Task exception was never retrieved") for anyone who can open a
socket. `guard` replaces each registered handler by one that checks the payload's shape (msgspec, the fields
Chainlit reads, with their types) and drops what does not fit with one warning line per event and reason,
naming it; a handler that takes no payload is called without the extra arguments a client sent. Nothing
else changes: the handlers are Chainlit's own, called as before with a payload that fits.
"""

from __future__ import annotations

import functools
import inspect
import logging
import uuid
from typing import Any

import msgspec

log = logging.getLogger(__name__)
MAX_LOGGED = 100  # distinct (event, reason) warnings per process


class Step(msgspec.Struct):
    """What Chainlit reads of a message it is sent (the other fields are its own to read, or not)."""

    id: uuid.UUID
    output: str = ""
    metadata: dict[str, Any] | None = None


class FileReference(msgspec.Struct):
    id: str


class MessagePayload(msgspec.Struct):
    message: Step
    fileReferences: list[FileReference] | None = None  # noqa: N815  (the page's name)


class AudioChunk(msgspec.Struct):
    isStart: bool  # noqa: N815
    mimeType: str  # noqa: N815
    elapsedTime: float  # noqa: N815
    data: bytes | str


# event -> the type of each payload argument its handler takes (a handler taking none: empty)
PAYLOADS: dict[str, tuple[type, ...]] = {
    "client_message": (MessagePayload,),
    "edit_message": (MessagePayload,),
    "message_favorite": (MessagePayload,),
    "chat_settings_change": (dict[str, Any],),
    "chat_settings_edit": (dict[str, Any],),
    "audio_chunk": (AudioChunk,),
    "window_message": (object,),
    "stop": (),
    "clear_session": (),
    "fetch_favorites": (),
    "audio_start": (),
    "audio_end": (),
    "connection_successful": (),
}
_logged: set[tuple[str, str]] = set()


def guard(sio) -> None:
    """Wrap the handlers of the events in PAYLOADS that `sio` (Chainlit's socketio server) has registered."""
    handlers = sio.handlers.get("/", {})
    for event, types in PAYLOADS.items():
        if event in handlers and not getattr(handlers[event], "payload_checked", False):  # (a reload: once)
            handlers[event] = guarded(event, handlers[event], types)


def guarded(event: str, handler, types: tuple[type, ...]):
    """`handler` (async, sid first) called only with payloads of `types`; anything else dropped, said once."""
    takes = len(inspect.signature(handler).parameters) - 1  # payload arguments after sid

    @functools.wraps(handler)
    async def checked(sid, *args):
        payloads = args[:takes]
        if len(payloads) < len(types):
            return refused(event, f"{len(types)} payload(s) expected, {len(payloads)} sent")
        for value, kind in zip(payloads, types):
            try:
                msgspec.convert(value, kind, strict=False)
            except (msgspec.ValidationError, TypeError, ValueError) as e:
                return refused(event, str(e)[:200])
        return await handler(sid, *payloads)

    checked.payload_checked = True
    return checked


def refused(event: str, why: str) -> None:
    if (event, why) not in _logged and len(_logged) < MAX_LOGGED:
        _logged.add((event, why))
        log.warning("dropped a socket event %r whose payload Chainlit could not read: %s", event, why)
