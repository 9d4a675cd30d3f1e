"""The web side's handle on the engine process (app/backend/engine_client.py), against a real engine process on a tiny
random checkpoint: streaming, text joined per interval, cancel, a full queue, and an engine that dies."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from app.backend.engine_client import EngineClient, EngineError, ServerBusy
from app.backend.conversation import Conversation
from app.messages import Done, EngineConfig, Failed, Loading, ReplySettings, Text

pytestmark = pytest.mark.timeout(180)


def run(coroutine, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


def chat(text: str) -> Conversation:
    conversation = Conversation()
    conversation.add("user", text)
    return conversation


@pytest.fixture(scope="module")
def client(tiny):
    client = EngineClient(EngineConfig(checkpoint=str(tiny), dtype="fp32", threads=1, max_batch=2),
                          max_waiting=1, stream_interval=0.2)
    run(client.load())
    yield client
    client.close()


def test_a_reply_streams_text_then_done(client):
    async def scenario():
        # ignore_eos: a sampled stop token (random weights, temperature 1) would end it before its 150 tokens
        return [(time.monotonic(), e) async for e in client.stream(chat("Hi"), ReplySettings(max_new_tokens=150,
                                                                                              temperature=1.0,
                                                                                              ignore_eos=True))]

    events = run(scenario())
    texts = [(t, e) for t, e in events if isinstance(e, Text)]
    done = events[-1][1]
    assert isinstance(done, Done) and done.stats.new_tokens == 150 and len(done.token_ids) == 150
    assert "".join(e.text for _, e in texts) == done.text
    assert len(texts) < done.stats.new_tokens / 3  # many tokens per UI update
    gaps = [later - earlier for (earlier, _), (later, _) in zip(texts, texts[1:])]
    assert min(gaps[:-1]) >= 0.19  # the last piece comes with the reply's end, not held back (test_reply.py)


def test_models_defaults_and_limits_come_from_the_engine(client, tiny):
    assert client.profiles == {"tiny": str(tiny)} and client.default == "tiny" and client.ready
    assert client.context_limit() == 131072 and client.reply_defaults().top_p == 0.9  # the model's own
    with pytest.raises(EngineError, match="no model named 'nothing'"):
        run(client.load("nothing"))
    with pytest.raises(ValueError, match="no model named"):
        run(_stream_now(client, Conversation(model="nothing", messages=chat("Hi").messages)))


async def _stream_now(client, conversation):
    return client.stream(conversation)


def test_cancel_ends_a_reply_within_a_token_or_two_and_frees_its_place(client):
    async def scenario():
        reply = client.stream(chat("Tell me a long story"), ReplySettings(max_new_tokens=3000, temperature=1.0, ignore_eos=True))
        async for event in reply:
            if isinstance(event, Text):
                break
        cancelled_at = time.monotonic()
        reply.cancel()
        done = (await reply.events())[-1]
        stopped_in = time.monotonic() - cancelled_at
        after = await client.stream(chat("Hi"), ReplySettings(max_new_tokens=3)).events()
        return done, stopped_in, after

    done, stopped_in, after = run(scenario())
    assert done.finish_reason == "cancelled" and done.stats.new_tokens < 3000
    assert stopped_in < 1.0
    assert after[-1].stats.new_tokens == 3 and client.active == 0
    assert not client.cancel("no-such-request")


def test_past_the_batch_and_the_queue_the_server_says_it_is_busy(client):
    async def scenario():
        replies = [client.stream(chat(f"Story {i}"), ReplySettings(max_new_tokens=2000, temperature=1.0, ignore_eos=True))
                   for i in range(3)]  # max_batch=2 running + max_waiting=1
        with pytest.raises(ServerBusy, match="3 replies are running or waiting.*LLAMA_MAX_WAITING=1"):
            client.stream(chat("One more"))
        for reply in replies:
            reply.cancel()
        ends = [(await r.events())[-1] for r in replies]
        again = await client.stream(chat("Now"), ReplySettings(max_new_tokens=2)).events()
        return ends, again

    ends, again = run(scenario())
    assert [e.finish_reason for e in ends] == ["cancelled"] * 3 and isinstance(again[-1], Done)


def test_n_replies_and_a_raw_prompt(client):
    async def scenario():
        many = await client.stream(chat("Hi"), ReplySettings(max_new_tokens=5, temperature=1.0, seed=1), n=2).events()
        raw = await client.complete("Once upon a time", settings=ReplySettings(max_new_tokens=4)).events()
        return many, raw

    many, raw = run(scenario())
    dones = [e for e in many if isinstance(e, Done)]
    assert sorted(d.index for d in dones) == [0, 1] and many[-1] in dones
    for d in dones:
        assert "".join(e.text for e in many if isinstance(e, Text) and e.index == d.index) == d.text
    assert isinstance(raw[-1], Done) and raw[-1].stats.new_tokens == 4
    assert raw[-1].stats.prompt_tokens == 5  # <|begin_of_text|> and the four words, no chat format
    assert client.active == 0


def test_the_engine_is_out_of_reach_of_signals_to_the_web_process_group(client):
    """Ctrl-C or a signal to the web process's process group must not stop the engine on its own: the
    reader would take that for a crash (and start another) while the web process shuts down."""
    assert os.getsid(client.pid) == client.pid != os.getsid(os.getpid())
    assert os.getpgid(client.pid) != os.getpgid(os.getpid())


def test_an_engine_that_dies_fails_its_replies_and_a_new_one_serves(tiny):
    client = EngineClient(EngineConfig(checkpoint=str(tiny), dtype="fp32", threads=1))
    try:
        async def scenario():
            await client.load()
            first_pid = client.pid
            reply = client.stream(chat("Long story"), ReplySettings(max_new_tokens=5000, temperature=1.0, ignore_eos=True))
            async for event in reply:
                if isinstance(event, Text):
                    os.kill(first_pid, signal.SIGKILL)
                    break
            end = (await reply.events())[-1]
            while client.ready:  # the reader notices within a poll
                await asyncio.sleep(0.05)
            await client.load()  # the new engine loads the default model again
            after = await client.stream(chat("Hi"), ReplySettings(max_new_tokens=4)).events()
            return first_pid, end, after

        first_pid, end, after = run(scenario())
        assert isinstance(end, Failed) and end.reason == "engine" and "stopped unexpectedly" in end.message
        assert isinstance(after[-1], Done) and after[-1].stats.new_tokens == 4
        assert client.pid != first_pid and client.restarts == 1
    finally:
        client.close()
    assert client._process.poll() is not None  # close() stopped the engine process


def test_an_engine_that_cannot_start_is_an_error(tmp_path):
    client = EngineClient(EngineConfig(checkpoint=str(tmp_path / "missing"), device="no-such-device"))
    try:
        # the engine starts and lists the model; loading it fails, with the reason
        with pytest.raises(EngineError, match="could not be loaded"):
            run(client.load())
        assert not client.ready
    finally:
        client.close()


def test_an_engine_whose_web_process_is_gone_exits(tiny, tmp_path):
    """The engine watches the pid it was given (its web process may die while it starts): not its
    parent, it leaves at once, with nothing left running."""
    import subprocess
    import sys

    import msgspec
    from support.servers import ROOT

    engine = subprocess.Popen([sys.executable, "-m", "app.engine", f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out",
                               "1"], stdin=subprocess.PIPE, cwd=ROOT)
    engine.communicate(msgspec.json.encode(EngineConfig(checkpoint=str(tiny), threads=1)), timeout=60)
    assert engine.returncode == 0


def test_a_reply_is_off_the_books_before_its_end_is_delivered(client, monkeypatch):
    """`active` counts replies running or waiting: a caller that has seen a reply's Done must not count
    it (the end is handed to the caller's loop, which may run before the client's thread goes on)."""
    from app.backend.reply import Reply

    seen = []
    deliver = Reply.deliver

    def watched(reply, event):
        if isinstance(event, Done | Failed):
            seen.append(reply.id in client._replies)
        deliver(reply, event)

    monkeypatch.setattr(Reply, "deliver", watched)
    async def scenario():
        return await client.stream(chat("Hi"), ReplySettings(max_new_tokens=3)).events()

    events = run(scenario())
    assert isinstance(events[-1], Done) and seen == [False] and client.active == 0


def test_an_unloaded_model_is_known_as_such_and_its_next_request_loads_it_again(tiny):
    """LLAMA_KEEP_ALIVE=2s: the engine unloads the idle model and says so (ModelUnloaded); the client then
    knows it is not loaded, keeps its info (the settings panel, /health), and a reply loads it again."""
    client = EngineClient(EngineConfig(checkpoint=str(tiny), dtype="fp32", threads=1, keep_alive=2.0))
    try:
        async def scenario():
            await client.load()
            assert client.is_loaded() and client.in_memory("tiny") is True
            deadline = time.monotonic() + 60
            while client.is_loaded() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not client.is_loaded() and client.in_memory("tiny") is False
            assert client.ready and client.context_limit() == 131072  # known still: it loads again on demand
            events = await client.stream(chat("Hi"), ReplySettings(max_new_tokens=4)).events()
            return events

        events = run(scenario())
        assert isinstance(events[0], Loading) and events[0].model == "tiny"
        assert isinstance(events[-1], Done) and events[-1].stats.new_tokens == 4
    finally:
        client.close()


def test_an_engine_on_all_cores_gives_its_first_reply_as_on_one_thread():
    """The engine as the app starts it (no thread count: torch's default, every core) runs a decode step's layers as
    one team of threads (csrc/team.h); its first reply, greedy on the default model, is the one an engine of one
    thread gives. (A team whose members counted the threads of a product themselves left half of its rows
    uncomputed in such a process: [504, 0, 0, ...].)"""
    from support.special_checkpoints import default_model

    async def first_reply(threads):
        client = EngineClient(EngineConfig(checkpoint=str(default_model()), threads=threads), max_waiting=1,
                              stream_interval=0.2)
        try:
            await client.load()
            settings = ReplySettings(max_new_tokens=12, temperature=0.0, repetition_penalty=1.0)
            events = [e async for e in client.stream(chat("What is the capital of France?"), settings)]
        finally:
            client.close()
        assert isinstance(events[-1], Done), events[-1]
        return events[-1].token_ids

    alone = run(first_reply(1))
    assert len(set(alone)) > 3  # words, not one token again and again
    assert run(first_reply(None)) == alone
