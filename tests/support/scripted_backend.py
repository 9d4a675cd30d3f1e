"""A backend for the API routes without a model: each reply's events are given in advance, and every request
is kept (its conversation, settings and options) for the test to read."""

from __future__ import annotations


class ScriptedReply:
    """What a backend's stream() returns."""

    def __init__(self, events):
        self.id, self.events = "scripted", events

    def cancel(self):
        pass

    async def __aiter__(self):
        for event in self.events:
            yield event


class ScriptedBackend:
    """What the routes need of a backend: one model, "tiny", in memory."""

    profiles, default, ready, observers = {"tiny": "/nowhere/tiny"}, "tiny", True, []

    def __init__(self, events):
        self.events, self.asked, self.kept = events, [], []

    def in_memory(self, name):
        return True

    def keep_alive(self, name, seconds):
        self.kept.append((name, seconds))

    def stream(self, conversation, settings, **options):
        self.asked.append((conversation, settings, options))
        return ScriptedReply(self.events)
