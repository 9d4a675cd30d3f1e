"""The engine (app.engine.core.Engine) driven in this process, step by step, without its sockets."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

from app.backend.conversation import Conversation
from app.engine.core import Engine
from app.messages import Done, EngineConfig, Failed, Generate, ReplySettings
from app.engine.prompt import dialog
from model.generation import Generation
from model.sampling import SamplingParams

_ids = itertools.count()


class EngineHarness:
    """An Engine whose events land in `events`; `run()` steps it until it has nothing left to do. As the
    engine's loop does, it computes kept caches again while nothing else runs (Engine.refine), unless
    refine=False. clock: the seconds that keep-alive counts. It keeps no KV caches on disk unless given
    kv_disk_mb (and kv_disk_dir)."""

    def __init__(self, checkpoint: Path, loader=None, refine: bool = True, clock=time.monotonic, **config):
        self.events: list = []
        self.refine = refine
        config.setdefault("kv_disk_mb", 0)
        self.engine = Engine(EngineConfig(checkpoint=str(checkpoint), **config), self.events.append, loader, clock)
        self.engine.start()
        self.run()

    def run(self, *messages, max_steps: int | None = None) -> list:
        """Handle the messages, then step until idle (or max_steps); the events that came out."""
        first = len(self.events)
        for message in messages:
            self.engine.handle(message)
        for _ in itertools.count() if max_steps is None else range(max_steps):
            if not (self.engine.busy or self.engine.preparing) and self.refine and self.engine.idle_work:
                self.engine.refine()
                continue
            if not (self.engine.busy or self.engine.models.loading or self.engine.preparing):
                break
            if not self.engine.busy:
                time.sleep(0.002)  # the loader thread needs the interpreter more than this loop
            self.step()
        return self.events[first:]

    def step(self) -> None:
        """One step of the engine, once the prompts submitted before it are built (the loop's steps take them
        whenever they are: here a step starts every request submitted before it, so tests count steps)."""
        self.engine.wait_for_prompts()
        self.engine.step()

    def ask(self, *requests: Generate) -> dict[str, list]:
        """Run requests together to their end: each one's events, by id."""
        events = self.run(*requests)
        return {r.id: [e for e in events if getattr(e, "id", None) == r.id] for r in requests}


def request(conversation: Conversation | str, settings: ReplySettings = ReplySettings(), model: str = "tiny",
            **fields) -> Generate:
    """A Generate for a conversation (or one user message), with a fresh id."""
    if isinstance(conversation, str):
        text, conversation = conversation, Conversation()
        conversation.add("user", text)
    return Generate(f"r{next(_ids)}", model, settings, conversation.chat_messages(),
                    left_out=conversation.left_out, **fields)


def last(events: list) -> Done | Failed:
    assert events and isinstance(events[-1], Done | Failed), events
    return events[-1]


def reference(checkpoint, generate: Generate, settings: ReplySettings) -> Generation:
    """The reply the engine gives alone, with no engine, batch or cache in between (run to the end).
    Settings left unset are off (not the model's defaults)."""
    prompt = checkpoint.chat_format.encode_dialog(dialog(generate.messages))
    given = {name: value for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                                      "frequency_penalty", "presence_penalty", "seed")
             if (value := getattr(settings, name)) is not None}
    generation = Generation(checkpoint, prompt, max_new_tokens=settings.max_new_tokens, sampling=SamplingParams(**given))
    list(generation)
    return generation
