"""The Chainlit handlers of app/main.py, called as Chainlit calls them, in a mocked Chainlit context.

A `Chat` sets a ChainlitContext whose session is a plain object and whose emitter is an AsyncMock; the
tests call the handlers, and read what they sent from the emitter's awaited calls.
"""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from pathlib import Path
from unittest.mock import AsyncMock, MagicMock


class Session:
    """What the handlers and cl.user_session read of a Chainlit WebsocketSession."""

    def __init__(self, profile: str | None = None):
        self.id = f"test-{uuid.uuid4()}"
        self.thread_id = str(uuid.uuid4())
        self.user_env, self.chat_settings, self.user = {}, {}, None
        self.chat_profile = profile
        self.client_type = "webapp"
        self.to_clear = False
        self.current_task = None
        self.files: dict[str, dict] = {}  # what elements sent (e.g. an exported chat), by their key

    async def persist_file(self, name: str, mime: str, path=None, content=None) -> dict:
        key = str(uuid.uuid4())
        self.files[key] = {"name": name, "mime": mime, "content": content}
        return {"id": key}


def mock_emitter():
    from chainlit.emitter import BaseChainlitEmitter

    emitter = AsyncMock(spec=BaseChainlitEmitter)
    emitter.set_chat_settings = MagicMock()  # called without await by ChatSettings.send()
    emitter.clear = MagicMock()
    return emitter


class Chat:
    """One browser tab: a session, its emitter, and helpers to read what was sent to it."""

    def __init__(self, main, profile: str | None = None):
        self.main, self.session, self.emitter = main, Session(profile), mock_emitter()
        self._uploads: Path | None = None

    def enter(self):
        from chainlit.context import ChainlitContext, context_var
        context_var.set(ChainlitContext(self.session, self.emitter))

    async def start(self):
        self.enter()
        await self.main.start_chat()

    async def send(self, text: str, id: str | None = None, files: dict[str, bytes] | None = None):
        """The user sends (or, with the id of an earlier message, edits) a message, with files (name -> bytes)
        as Chainlit hands uploads over: an element each, with the path of the uploaded file."""
        import chainlit as cl
        self.enter()
        elements = []
        for name, data in (files or {}).items():
            path = self.uploads() / f"{uuid.uuid4()}"
            path.write_bytes(data)
            elements.append(cl.File(name=name, path=str(path), mime="application/octet-stream"))
        message = cl.Message(content=text, type="user_message", id=id, elements=elements)
        await self.main.on_message(message)
        return message

    def uploads(self) -> Path:
        """The folder of this tab's uploads (Chainlit's is the session's folder in .files/)."""
        if self._uploads is None:
            self._uploads = Path(tempfile.mkdtemp(prefix="uploads-"))
        return self._uploads

    async def long_reply(self, text: str = "Write a long story", pieces: int = 2) -> asyncio.Task:
        """Send text with settings for a long sampled reply; return the on_message task once `pieces`
        pieces of the answer have streamed. Seeded: a random model sampled at temperature 1 picks a stop token
        now and then (a 4-token reply was seen once in a whole run), and an unseeded reply that did so here
        left the test waiting for pieces that never came."""
        await self.main.update_settings({"max_new_tokens": 4000, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                         "seed": "7", "system_prompt": ""})
        task = asyncio.create_task(self.send(text))
        while self.emitter.send_token.await_count < pieces:
            if task.done():
                raise AssertionError(f"the reply to {text!r} ended after {self.emitter.send_token.await_count} "
                                     f"pieces, before the {pieces} this test stops it at")
            await asyncio.sleep(0.01)
        return task

    def sent(self) -> list[dict]:
        """Final state of each message sent (send_step), in order."""
        return [call.args[0] for call in self.emitter.send_step.await_args_list]

    def answers(self) -> list[dict]:
        """The assistant's messages (answers and notes), not statistics lines, errors or steps."""
        return [s for s in self.sent()
                if s["type"] == "assistant_message" and s["name"] not in ("stats",) and not s["isError"]]

    def replies(self) -> list[str]:
        return [s["output"] for s in self.answers()]

    def stats(self) -> list[str]:
        return [s["output"].strip("*") for s in self.sent() if s["name"] == "stats"]  # italic markdown

    def errors(self) -> list[str]:
        return [s["output"] for s in self.sent() if s["isError"]]

    def actions(self, name: str) -> list:
        """The actions (buttons) of this name sent so far, as Chainlit hands them to their callback."""
        import chainlit as cl
        return [cl.Action(**c.args[1]) for c in self.emitter.emit.await_args_list
                if c.args[0] == "action" and c.args[1]["name"] == name]

    def removed(self, event: str = "delete_step") -> list[str]:
        """Ids of the messages (delete_step) or actions (remove_action) taken off the page."""
        if event == "delete_step":
            return [c.args[0]["id"] for c in self.emitter.delete_step.await_args_list]
        return [c.args[1]["id"] for c in self.emitter.emit.await_args_list if c.args[0] == event]

    def conversation(self):
        from chainlit.user_session import user_sessions
        return user_sessions[self.session.id]["conversation"]


class CutOff:
    """A backend's stream that gives some text and then fails, as when the engine process dies mid-answer."""

    def __init__(self, *pieces: str):
        self.pieces = pieces

    def __aiter__(self):
        return self.events()

    async def events(self):
        from app.messages import Failed, Text
        for piece in self.pieces:
            yield Text(id="cut", text=piece)
        yield Failed(id="cut", message="The engine process stopped; starting a new one.", reason="engine")

    def cancel(self) -> None:
        pass
