"""app/backend/reply.py: text pieces joined to one event per stream_interval, and a reply's end not held back."""

import asyncio
import threading
import time

from app.backend.conversation import Conversation
from app.messages import Done, Failed, ReplySettings, Stats, Text
from app.backend.reply import Reply

INTERVAL = 0.4


def reply() -> Reply:
    return Reply(Conversation(), ReplySettings(), "tiny", on_cancel=lambda r: None, stream_interval=INTERVAL)


def later(seconds: float, *calls) -> None:
    """Deliver from another thread, as the backends do."""
    def run():
        time.sleep(seconds)
        for call in calls:
            call()
    threading.Thread(target=run).start()


def test_pieces_closer_than_the_interval_are_joined_into_one_event():
    async def scenario():
        r = reply()
        r.deliver(Text(r.id, "a"))
        first = await r.__anext__()
        started = time.monotonic()
        for piece in "bcd":
            r.deliver(Text(r.id, piece))
        second = await r.__anext__()
        return first, second, time.monotonic() - started

    first, second, waited = asyncio.run(scenario())
    assert first.text == "a" and second.text == "bcd"
    assert waited >= INTERVAL * 0.9  # the second event waited for the interval


def test_the_last_piece_comes_as_soon_as_the_reply_ends():
    async def scenario():
        r = reply()
        r.deliver(Text(r.id, "a"))
        await r.__anext__()
        started = time.monotonic()
        # The end comes a moment after the piece: the piece is already waiting out the interval by then.
        later(0.05, lambda: r.deliver(Text(r.id, "b")), lambda: time.sleep(0.05),
              lambda: r.deliver(Done(r.id, "ab", "stop", Stats())))
        events = await r.events()
        return events, time.monotonic() - started

    events, waited = asyncio.run(scenario())
    assert [type(e) for e in events] == [Text, Done] and events[0].text == "b"
    assert waited < INTERVAL / 2  # not held back for the rest of the interval


def test_ends_with_says_which_event_ends_the_request():
    """The backend takes a reply off its books before delivering what ends it (app/backend/engine_client.py): the
    caller may see the end, and count the replies still running, the moment it is delivered."""
    async def scenario():
        r = Reply(Conversation(), ReplySettings(), "tiny", on_cancel=lambda r: None, n=2)
        first, second = Done(r.id, "a", "stop", Stats()), Done(r.id, "b", "stop", Stats(), index=1)
        said = [r.ends_with(Text(r.id, "a")), r.ends_with(first)]
        r.deliver(first)
        said.append(r.ends_with(second))
        r.deliver(second)
        said.append(r.ends_with(Done(r.id, "c", "stop", Stats())))  # nothing ends twice
        return said, await r.events()

    said, events = asyncio.run(scenario())
    assert said == [False, False, True, False] and len(events) == 2


def test_a_failure_ends_the_request_at_once():
    async def scenario():
        r = Reply(Conversation(), ReplySettings(), "tiny", on_cancel=lambda r: None, n=3)
        return r.ends_with(Failed(r.id, "boom", "error"))

    assert asyncio.run(scenario())


def test_a_reader_that_takes_nothing_is_cut_off_past_the_bound(monkeypatch, caplog):
    """Text left untaken past Reply.buffer_bytes (app.bounds.REPLY_BUFFER_BYTES) is let go, the request cancelled
    once, and the reader finds a Failed "unread" next; what arrives after that is not queued."""
    monkeypatch.setattr(Reply, "buffer_bytes", 10_000, raising=False)
    cancelled = []

    async def scenario():
        r = Reply(Conversation(), ReplySettings(), "tiny", on_cancel=cancelled.append, stream_interval=0)
        piece = "x" * 1000
        for _ in range(9):
            r.deliver(Text(r.id, piece))
        await asyncio.sleep(0.01)  # (delivered through the loop)
        kept = (list(cancelled), r._events.qsize())
        for _ in range(100):  # past the bound: cut off at the first
            r.deliver(Text(r.id, piece))
        await asyncio.sleep(0.01)
        was_cancelled = list(cancelled)
        r.deliver(Done(r.id, "", "cancelled", Stats()))  # the backend's answer to the cancel
        await asyncio.sleep(0.01)
        return r, kept, was_cancelled, r._events.qsize(), await r.events()

    r, kept, was_cancelled, queued, events = asyncio.run(scenario())
    assert kept == ([], 9)
    assert was_cancelled == cancelled == [r] and queued == 1
    assert [type(e) for e in events] == [Failed] and events[0].reason == "unread"
    assert "cut off and cancelled" in caplog.text


def test_a_reader_that_keeps_up_is_never_cut_off(monkeypatch):
    monkeypatch.setattr(Reply, "buffer_bytes", 10_000, raising=False)
    cancelled = []

    async def scenario():
        r = Reply(Conversation(), ReplySettings(), "tiny", on_cancel=cancelled.append, stream_interval=0)
        taken = []
        for _ in range(100):  # ten times the bound in all, never more than a piece waiting
            r.deliver(Text(r.id, "x" * 1000))
            taken.append(await r.__anext__())
        r.deliver(Done(r.id, "", "stop", Stats()))
        return r, taken + await r.events()

    _, events = asyncio.run(scenario())
    assert not cancelled and sum(len(e.text) for e in events if isinstance(e, Text)) == 100_000
    assert isinstance(events[-1], Done)
