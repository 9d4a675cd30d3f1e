"""The Chainlit handlers of app/main.py, called as Chainlit calls them, in a mocked Chainlit context.

Each test sets a ChainlitContext whose session is a plain object and whose emitter is an AsyncMock,
calls the handlers, and reads what they sent from the emitter's awaited calls. The model is a tiny
random Llama checkpoint, so replies are gibberish but real: streamed by the real service.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from unittest.mock import AsyncMock, MagicMock

import pytest
import torch

from e2e_helpers import write_tiny_checkpoint

pytestmark = pytest.mark.timeout(120)

SYSTEM_PROMPT = "You are terse."


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def main(tmp_path_factory):
    """app.main imported with LLAMA_* pointing at a weights folder holding `tiny` and a broken `broken`."""
    weights = tmp_path_factory.mktemp("weights")
    write_tiny_checkpoint(weights / "tiny")
    broken = weights / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    (broken / "model.safetensors").write_bytes(b"this is not a safetensors file")
    env = {name: "" for name in os.environ if name.startswith("LLAMA_")}  # e.g. from a developer's .env
    env |= {"LLAMA_CHECKPOINT": str(weights / "tiny"), "LLAMA_WEIGHTS_DIR": str(weights),
            "LLAMA_MAX_CONTEXT": "512", "LLAMA_MAX_NEW_TOKENS": "24", "LLAMA_SYSTEM_PROMPT": SYSTEM_PROMPT,
            "LLAMA_HISTORY": "off"}  # no database: these sessions are mocks (tests/test_history.py has the real thing)
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    sys.modules.pop("app.main", None)
    try:
        import app.main as main
        yield main
    finally:
        sys.modules.pop("app.main", None)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    main.SERVICE.close()


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

    def enter(self):
        from chainlit.context import ChainlitContext, context_var
        context_var.set(ChainlitContext(self.session, self.emitter))

    async def start(self):
        self.enter()
        await self.main.start_chat()

    async def send(self, text: str, id: str | None = None):
        """The user sends (or, with the id of an earlier message, edits) a message."""
        import chainlit as cl
        self.enter()
        message = cl.Message(content=text, type="user_message", id=id)
        await self.main.on_message(message)
        return message

    def sent(self) -> list[dict]:
        """Final state of each message sent (send_step), in order."""
        return [call.args[0] for call in self.emitter.send_step.await_args_list]

    def replies(self) -> list[str]:
        return [s["output"] for s in self.sent() if s["name"] not in ("stats",) and not s["isError"]]

    def stats(self) -> list[str]:
        return [s["output"].strip("*") for s in self.sent() if s["name"] == "stats"]  # italic markdown

    def errors(self) -> list[str]:
        return [s["output"] for s in self.sent() if s["isError"]]

    def conversation(self):
        from chainlit.user_session import user_sessions
        return user_sessions[self.session.id]["conversation"]


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 90))


# ---- start --------------------------------------------------------------------------------------

def test_chat_start_offers_settings_with_the_checkpoints_defaults(main):
    chat = Chat(main)
    run(chat.start())

    [call] = [c for c in chat.emitter.emit.await_args_list if c.args[0] == "chat_settings"]
    widgets = {w["id"]: w for w in call.args[1]}
    assert list(widgets) == ["temperature", "top_k", "top_p", "max_new_tokens", "seed", "system_prompt"]
    # tiny's generation_config.json sets nothing: Llama 3's defaults; LLAMA_MAX_NEW_TOKENS=24
    assert widgets["temperature"]["initial"] == 0.6 and widgets["top_p"]["initial"] == 0.9
    assert widgets["top_k"]["initial"] == 0 and widgets["max_new_tokens"]["initial"] == 24
    assert widgets["max_new_tokens"]["max"] == 512  # LLAMA_MAX_CONTEXT
    assert widgets["seed"]["initial"] == "" and widgets["system_prompt"]["multiline"]
    assert widgets["system_prompt"]["initial"] == SYSTEM_PROMPT
    assert chat.conversation().model == "tiny" and chat.conversation().system_prompt == SYSTEM_PROMPT


def test_profiles_are_the_checkpoints_in_the_weights_folder_and_starters_exist(main):
    profiles = run(main.chat_profiles(None))
    assert [(p.name, p.default) for p in profiles] == [("tiny", True), ("broken", False)]
    starters = run(main.starters(None))
    assert "What is the capital of France?" in [s.message for s in starters]


# ---- replies ------------------------------------------------------------------------------------

def test_message_streams_a_reply_then_a_stats_line_and_keeps_the_history(main):
    chat = Chat(main)

    async def scenario():
        await chat.start()
        first = await chat.send("Hello")
        second = await chat.send("And then?")
        return first, second

    first, second = run(scenario())
    replies = chat.replies()
    assert len(replies) == 2 and all(replies)
    # streamed: the first piece opened the message, later pieces followed as tokens
    assert chat.emitter.stream_start.await_count == 2
    assert chat.emitter.send_token.await_count >= 1
    streamed = chat.emitter.stream_start.await_args_list[0].args[0]["output"] + "".join(
        c.kwargs["token"] for c in chat.emitter.send_token.await_args_list
        if c.kwargs["id"] == chat.sent()[0]["id"])
    assert streamed == replies[0]

    stats = chat.stats()
    assert len(stats) == 2
    for line in stats:
        assert "tokens" in line and "first token" in line and "tokens/s" in line
        assert any(reason in line for reason in ("stop token", "length limit"))

    history = [(m.role, m.content, m.id) for m in chat.conversation().messages]
    assert history == [("user", "Hello", first.id), ("assistant", replies[0], chat.sent()[0]["id"]),
                       ("user", "And then?", second.id), ("assistant", replies[1], chat.sent()[2]["id"])]
    assert chat.conversation().kv_cache is not None  # the next turn prefills only what is new


def test_stop_ends_the_reply_at_once_keeps_it_and_frees_the_model(main):
    chat = Chat(main)

    async def scenario():
        await chat.start()
        await main.update_settings({"max_new_tokens": 4000, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                    "seed": "", "system_prompt": ""})
        task = asyncio.create_task(chat.send("Write a long story"))
        while chat.emitter.send_token.await_count < 2:
            await asyncio.sleep(0.01)
        # what Chainlit does on Stop: cancel the on_message task, then call on_stop
        stopped_at = time.monotonic()
        task.cancel()
        await main.stop_reply()
        with pytest.raises(asyncio.CancelledError):
            await task
        took = time.monotonic() - stopped_at
        await main.update_settings({"max_new_tokens": 8, "seed": "", "system_prompt": ""})
        await chat.send("Short one")
        return took

    took = run(scenario())
    assert took < 1.0
    partial = chat.replies()[0]
    assert partial and chat.conversation().messages[1].content == partial
    assert "stopped by user" in chat.stats()[0]
    tokens = int(chat.stats()[0].split()[0])
    assert tokens < 4000
    assert len(chat.replies()) == 2 and "stopped by user" not in chat.stats()[1]
    assert chat.conversation().messages[-2].content == "Short one"


def test_stop_without_a_task_to_cancel_still_stops_the_worker(main):
    """An edited message runs on_message with no task the Stop button could cancel: on_stop must do it."""
    chat = Chat(main)

    async def scenario():
        await chat.start()
        await main.update_settings({"max_new_tokens": 4000, "temperature": 1.0, "seed": "", "system_prompt": ""})
        task = asyncio.create_task(chat.send("Write a long story"))
        while chat.emitter.send_token.await_count < 2:
            await asyncio.sleep(0.01)
        stopped_at = time.monotonic()
        await main.stop_reply()
        await task
        return time.monotonic() - stopped_at

    assert run(scenario()) < 1.0
    assert "stopped by user" in chat.stats()[0]
    assert chat.conversation().messages[-1].content == chat.replies()[0]


def test_editing_a_message_answers_again_from_there(main):
    chat = Chat(main)

    async def scenario():
        await chat.start()
        first = await chat.send("First question")
        await chat.send("Second question")
        await chat.send("First question, edited", id=first.id)
        return first

    first = run(scenario())
    messages = chat.conversation().messages
    assert [(m.role, m.content) for m in messages] == [("user", "First question, edited"),
                                                      ("assistant", chat.replies()[-1])]
    assert messages[0].id == first.id


def test_settings_apply_to_the_next_reply(main):
    chat = Chat(main)

    async def scenario():
        await chat.start()
        chat.enter()
        await main.update_settings({"temperature": 0, "top_k": 0, "top_p": 1, "max_new_tokens": 16,
                                    "seed": "42", "system_prompt": "Be a pirate."})
        await chat.send("Hi")
        await chat.send("Hi")

    run(scenario())
    from chainlit.user_session import user_sessions
    settings = user_sessions[chat.session.id]["reply_settings"]
    assert settings == main.ReplySettings(max_new_tokens=16, temperature=0.0, top_k=0, top_p=1.0, seed=42)
    assert chat.conversation().system_prompt == "Be a pirate."
    assert chat.stats()[0].startswith("16 tokens") and "length limit" in chat.stats()[0]


def test_a_seed_that_is_not_a_number_is_explained(main):
    chat = Chat(main)

    async def scenario():
        await chat.start()
        chat.enter()
        await main.update_settings({"temperature": 0.5, "seed": "forty-two", "system_prompt": ""})

    run(scenario())
    [note] = chat.replies()
    assert "whole number" in note and "forty-two" in note
    assert chat.conversation().system_prompt is None


# ---- errors and limits --------------------------------------------------------------------------

def test_a_message_longer_than_the_context_is_a_clear_error_and_the_chat_goes_on(main):
    chat = Chat(main)

    async def scenario():
        await chat.start()
        await chat.send("word " * 2000)
        await chat.send("Hi")

    run(scenario())
    [error] = chat.errors()
    assert "too long" in error and "512 tokens" in error
    assert [m.content for m in chat.conversation().messages if m.role == "user"] == ["Hi"]
    assert len(chat.replies()) == 1 and len(chat.stats()) == 1


def test_older_messages_are_left_out_with_one_note(main):
    chat = Chat(main)

    async def scenario():
        await chat.start()
        await main.update_settings({"max_new_tokens": 16, "temperature": 0, "seed": "", "system_prompt": "Pirate."})
        for i in range(8):
            await chat.send(f"Message {i}: " + "more words here " * 25)

    run(scenario())
    notes = [r for r in chat.replies() if r == main.TRIMMED_NOTE]
    assert len(notes) == 1
    assert chat.conversation().left_out > 0
    assert len(chat.stats()) == 8 and not chat.errors()


def test_a_model_that_fails_to_load_is_reported_and_other_chats_go_on(main):
    broken = Chat(main, profile="broken")

    async def scenario():
        await broken.start()
        await broken.send("Hi")
        working = Chat(main)
        await working.start()
        await working.send("Hi")
        return working

    working = run(scenario())
    assert len(broken.errors()) == 2 and all("could not be loaded" in e for e in broken.errors())
    assert broken.conversation().messages == []
    assert len(working.replies()) == 1 and not working.errors()


def test_a_second_chat_waits_its_turn_and_is_told(main):
    first, second = Chat(main), Chat(main)

    async def scenario():
        await first.start()
        await second.start()
        first.enter()
        await main.update_settings({"max_new_tokens": 100, "temperature": 1.0, "seed": "1", "system_prompt": ""})
        one = asyncio.create_task(first.send("Long answer please"))
        while first.emitter.send_token.await_count < 1:
            await asyncio.sleep(0.01)
        two = asyncio.create_task(second.send("Hi"))
        await asyncio.gather(one, two)

    run(scenario())
    notes = [s for s in second.sent() if s["output"].startswith("Waiting for 1 other reply")]
    assert len(notes) == 1
    removed = [c.args[0]["id"] for c in second.emitter.delete_step.await_args_list]
    assert notes[0]["id"] in removed  # gone once the answer started
    assert len(first.replies()) == 1 and len(second.replies()) == 2  # the note, then the answer
    assert len(first.stats()) == len(second.stats()) == 1


def test_chat_end_cancels_a_reply_nobody_reads(main):
    chat = Chat(main)

    async def scenario():
        await chat.start()
        await main.update_settings({"max_new_tokens": 4000, "temperature": 1.0, "seed": "", "system_prompt": ""})
        task = asyncio.create_task(chat.send("Long story"))
        while chat.emitter.send_token.await_count < 1:
            await asyncio.sleep(0.01)
        chat.session.to_clear = True
        await main.end_chat()
        await asyncio.wait_for(task, 5)

    run(scenario())
    assert "stopped by user" in chat.stats()[0]
