"""What the engine process sends the web process, and when.

A step of a small model takes a few milliseconds. Sent one message per step, every token of every
stream wakes the web process (a socket read, a decode, a hand-over to its event loop), and on a
machine with as many cores as decode threads that time is taken from the decode step: on two cores
the default model's single stream ran at 0.88x the engine alone. So text pieces and the engine's
statistics wait here up to `TEXT_INTERVAL_S` and go together, each reply's pieces joined into one
Text and only the latest statistics; everything else goes at once: a reply's first piece (its time
to first token), its end, a failure, a place in the queue, a model event. The browser sees no
difference: the web side re-renders a message at most every `app.backend.reply.STREAM_INTERVAL` anyway.
"""

from __future__ import annotations

import time

import logging
from collections.abc import Callable

from app.messages import Done, EngineStats, Failed, FromEngine, Text, join_texts

log = logging.getLogger("app.engine")

# Longest a text piece waits for the next message: the web side's re-render interval. At 25 ms a single
# served stream of the default model decoded at 0.937x the engine alone, at 50 ms 0.947x (docs/benchmarks.md).
TEXT_INTERVAL_S = 0.05


class Outbox:
    """Events in the order the engine emitted them; `due()` says when to `take()` them for sending."""

    def __init__(self, interval: float = TEXT_INTERVAL_S):
        self.interval = interval
        self._events: list[FromEngine] = []
        self._urgent = False
        self._sent_at = time.monotonic()
        self._streaming: set[str] = set()  # requests whose first text piece went already

    def add(self, event: FromEngine) -> None:
        if isinstance(event, Text):
            if event.id not in self._streaming:
                self._streaming.add(event.id)
                self._urgent = True
        elif not isinstance(event, EngineStats):
            self._urgent = True
            if isinstance(event, Done | Failed):
                self._streaming.discard(event.id)
        self._events.append(event)

    def due(self, idle: bool = False) -> bool:
        """Whether to send now: something urgent waits, the interval is over, or the engine is about
        to wait for messages (`idle`) and nothing would come after."""
        return bool(self._events) and (self._urgent or idle or time.monotonic() - self._sent_at >= self.interval)

    def take(self) -> list[FromEngine]:
        """The waiting events, each run of one reply's text pieces joined (up to the next other event
        of that request), the statistics only as their latest value, in place of the last."""
        events: list[FromEngine] = []
        runs: dict[tuple[str, int], list[Text]] = {}  # (request, reply index) -> its open run of pieces
        last_stats = max((i for i, e in enumerate(self._events) if isinstance(e, EngineStats)), default=-1)
        for i, event in enumerate(self._events):
            if isinstance(event, Text):
                run = runs.get((event.id, event.index))
                if run is not None:
                    run.append(event)
                    continue
                runs[event.id, event.index] = run = [event]
                events.append(run)  # joined below
            elif isinstance(event, EngineStats):
                if i == last_stats:
                    events.append(event)
            else:
                for key in [key for key in runs if key[0] == getattr(event, "id", None)]:
                    del runs[key]  # the request's later pieces come after this event
                events.append(event)
        self._events, self._urgent, self._sent_at = [], False, time.monotonic()
        return [join_texts(e) if isinstance(e, list) else e for e in events]

    def take_encoded(self, encode: Callable[[object], bytes]) -> tuple[bytes, list[str]]:
        """take(), encoded as one message; and the requests whose events could not be encoded (a string
        that is not Unicode, a number past 64 bits): each of those ends with a Failed in its place, and
        the events of theirs that followed are left out."""
        events = self.take()
        try:
            return encode(events), []
        except (ValueError, OverflowError, TypeError):
            pass
        kept, failed = [], []
        for event in events:
            request_id = getattr(event, "id", None)
            if request_id in failed:
                continue
            try:
                encode(event)
                kept.append(event)
            except (ValueError, OverflowError, TypeError) as e:
                log.exception("an event of request %s could not be sent", request_id)
                if request_id is not None:
                    failed.append(request_id)
                    kept.append(Failed(request_id, f"The reply could not be sent: {e}", "error"))
        return encode(kept), failed
