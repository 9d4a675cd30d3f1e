"""Every socket event Chainlit handles, with any payload a client can send (app/web/socket_events.py): what does
not fit the shape Chainlit reads is dropped with one warning line naming the event, never handed to Chainlit's
handler (whose tracebacks filled the log); what fits reaches it unchanged."""

from __future__ import annotations

import asyncio
import logging
import uuid
from types import SimpleNamespace

import pytest

from app.web import socket_events

GOOD_ID = str(uuid.uuid4())
JUNK = [None, "", "x" * 10_000, 0, 2**70, -1.5, float("nan"), True, [], [1, {"a": None}], {}, {"message": None},
        {"message": "hi"}, {"message": {}}, {"message": {"id": "not-a-uuid", "output": "hi"}},
        {"message": {"id": GOOD_ID, "output": 5}}, {"message": {"id": GOOD_ID, "output": "\ud800"}, "fileReferences": 7},
        {"message": {"id": GOOD_ID, "metadata": []}}, {"message": {"id": GOOD_ID}, "fileReferences": [{"name": "x"}]},
        "\ud800", b"\x00\xff"]
for _ in range(3):  # nesting past any depth a payload needs
    JUNK.append({"message": {"id": GOOD_ID, "output": "hi", "metadata": {"a": JUNK[-1]}}, "fileReferences": [None]})


def handlers_of(events):
    """Stand-ins for Chainlit's handlers, taking what Chainlit's take: (sid) or (sid, payload); each call kept."""
    calls = []

    def make(event, takes):
        if takes:
            async def handler(sid, payload):
                calls.append((event, payload))
        else:
            async def handler(sid):
                calls.append((event, None))
        return handler
    return {event: make(event, bool(types)) for event, types in events.items()}, calls


def test_any_payload_of_any_event_that_chainlit_could_not_read_is_dropped_with_a_line(caplog):
    handlers, calls = handlers_of(socket_events.PAYLOADS)
    sio = SimpleNamespace(handlers={"/": dict(handlers)})
    socket_events.guard(sio)
    socket_events.guard(sio)  # twice (a reload): wrapped once
    guarded = sio.handlers["/"]
    assert all(getattr(guarded[e], "payload_checked", False) for e in socket_events.PAYLOADS)

    async def send_all():
        for event, types in socket_events.PAYLOADS.items():
            for junk in JUNK:
                if types == (object,):  # window_message takes any data: Chainlit hands it to the app's own handler
                    continue
                await guarded[event]("sid", junk)  # a payload event with junk; a bare event with an extra argument
            if not types:
                await guarded[event]("sid")

    with caplog.at_level(logging.WARNING, logger="app.web.socket_events"):
        asyncio.run(send_all())
    payload_events = [e for e, types in socket_events.PAYLOADS.items() if types and types != (object,)]
    assert not [c for c in calls if c[0] in payload_events and c[1] is not None and not isinstance(c[1], dict)]
    reached = {(event, repr(payload)) for event, payload in calls if event in payload_events}
    for event in payload_events:  # of all that junk, only what fits the event's shape reached its handler
        for junk in JUNK:
            if (event, repr(junk)) in reached:
                assert event.startswith("chat_settings") and isinstance(junk, dict), (event, junk)
    bare = [e for e, types in socket_events.PAYLOADS.items() if not types]
    assert sorted({e for e, payload in calls if e in bare}) == sorted(bare)  # called, the extra argument dropped
    assert any("dropped a socket event 'client_message'" in r.getMessage() for r in caplog.records)
    assert len(caplog.records) <= socket_events.MAX_LOGGED


def test_a_payload_chainlit_reads_reaches_its_handler_unchanged():
    handlers, calls = handlers_of(socket_events.PAYLOADS)
    sio = SimpleNamespace(handlers={"/": dict(handlers)})
    socket_events.guard(sio)
    message = {"message": {"id": GOOD_ID, "output": "Hello", "createdAt": "2026-12-06", "type": "user_message"},
               "fileReferences": [{"id": "f1"}]}
    asyncio.run(sio.handlers["/"]["client_message"]("sid", message))
    asyncio.run(sio.handlers["/"]["chat_settings_change"]("sid", {"temperature": 0.5}))
    asyncio.run(sio.handlers["/"]["window_message"]("sid", ["any", "data"]))
    assert calls == [("client_message", message), ("chat_settings_change", {"temperature": 0.5}),
                     ("window_message", ["any", "data"])]


@pytest.mark.parametrize("event", sorted(socket_events.PAYLOADS))
def test_each_event_guarded_is_one_chainlit_handles(event):
    from chainlit.server import sio

    assert event in sio.handlers["/"]  # (a Chainlit that renamed one would leave it unchecked)
