"""Many chats on one server: eight conversations at once against a real `chainlit run` (socket.io clients)
each get the reply they get alone; a tab that disconnects mid-reply frees the model for the next chat
within a second, and its KV cache; Stop during a long prefill ends it between prefill chunks.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from app.service import Conversation, Done, GenerationService, ReplySettings, Text
from app_helpers import imported_app
from checkpoints import hf_model
from e2e_helpers import ChainlitServer, server_env, write_tiny_checkpoint
from live_chat import LiveChat
from model.checkpoint import load_checkpoint
from model.generate import PREFILL_CHUNK
from test_app_handlers import Chat

pytestmark = pytest.mark.timeout(300)

CHATS = 8
SAMPLED = dict(temperature=1.0, top_k=0, top_p=1.0, system_prompt="")


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    folder = tmp_path_factory.mktemp("weights")
    write_tiny_checkpoint(folder / "tiny")
    return folder


@pytest.fixture(scope="module")
def server(weights, tmp_path_factory):
    env = server_env(checkpoint=weights / "tiny", weights_dir=weights, threads=1, history="off")
    server = ChainlitServer(env, log=tmp_path_factory.mktemp("chainlit") / "chainlit.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
    assert "Traceback" not in server.log_path.read_text()


def run(coroutine, timeout: float = 240):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


async def conversation(url: str, seed: int, max_new_tokens: int = 24):
    chat = await LiveChat(url).open()
    await chat.settings(**SAMPLED, max_new_tokens=max_new_tokens, seed=str(seed))
    return chat


def test_eight_conversations_at_once_each_get_the_reply_they_get_alone(server):
    questions = [f"Tell me something about the number {i}." for i in range(CHATS)]

    async def alone():
        replies = []
        for i, question in enumerate(questions):
            chat = await conversation(server.url, seed=i)
            replies.append(await chat.ask(question))
            await chat.close()
        return replies

    async def together():
        chats = await asyncio.gather(*(conversation(server.url, seed=i) for i in range(CHATS)))
        replies = await asyncio.gather(*(chat.ask(q) for chat, q in zip(chats, questions)))
        await asyncio.gather(*(chat.close() for chat in chats))
        return replies

    first, second = run(alone()), run(together())
    for reply in first + second:
        assert reply.text and len(reply.stats) == 1 and not reply.errors, reply
    assert len({reply.text for reply in first}) == CHATS  # each conversation its own answer
    assert [reply.text for reply in second] == [reply.text for reply in first]
    waited = [reply for reply in second if any(note.startswith("Waiting for") for note in reply.notes)]
    assert len(waited) >= CHATS // 2, "the chats did not run at the same time"


def test_a_tab_that_disconnects_mid_reply_frees_the_model_within_a_second(server):
    async def scenario():
        leaving = await conversation(server.url, seed=1, max_new_tokens=8000)
        await leaving.send("Write a very long story.")
        await leaving.wait_for("stream_token")  # it is being answered
        waiting = await conversation(server.url, seed=2, max_new_tokens=8)
        start = await waiting.send("Hi")
        await waiting.wait_for("new_message", after=start, where=lambda m: m["output"].startswith("Waiting for 1"))
        left_at = time.monotonic()
        await leaving.close()
        reply = await waiting.reply(start)
        await waiting.close()
        return reply, left_at

    reply, left_at = run(scenario())
    assert reply.text and len(reply.stats) == 1 and not reply.errors
    assert reply.first_token_at - left_at < 1.0, f"the next chat waited {reply.first_token_at - left_at:.1f} s"


# ---- in the process: the slot, the KV cache, and a stop during prefill --------------------------

def test_chat_end_frees_the_slot_and_the_kv_cache_within_a_second(weights):
    with imported_app(checkpoint=weights / "tiny", weights_dir=weights, history="off") as main:
        chat = Chat(main)

        async def scenario():
            await chat.start()
            await main.update_settings({"max_new_tokens": 8, "temperature": 1.0, "seed": "", "system_prompt": ""})
            await chat.send("Hello")  # a first reply: the conversation now holds a KV cache
            assert chat.conversation().kv_cache is not None
            await main.update_settings({"max_new_tokens": 8000})
            task = asyncio.create_task(chat.send("Write a very long story."))
            while main.SERVICE.active == 0 or chat.emitter.send_token.await_count < 2:
                await asyncio.sleep(0.01)
            ended_at = time.monotonic()
            await main.end_chat()  # what Chainlit calls when the tab disconnects
            while main.SERVICE.active or chat.conversation().kv_cache is not None:
                assert time.monotonic() - ended_at < 1.0, (main.SERVICE.active, chat.conversation().kv_cache)
                await asyncio.sleep(0.01)
            await asyncio.wait_for(task, 5)

        run(scenario(), 60)
        assert chat.conversation().kv_cache is None and main.SERVICE.active == 0
        assert "stopped by user" in chat.stats()[-1]


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    """A random model wide enough that a 7000-token prefill takes a few seconds on one thread."""
    folder = tmp_path_factory.mktemp("weights") / "wide"
    hf_model(hidden_size=256, intermediate_size=768, num_hidden_layers=4).save_pretrained(folder)
    return load_checkpoint(folder)


def test_stop_during_prefill_ends_it_between_chunks(slow):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    service = GenerationService({"wide": slow.path}, loader=lambda name, path: slow)
    service.checkpoint()
    conversation = Conversation()
    conversation.add("user", "word " * 7000)
    prompt_tokens = len(slow.chat_format.encode_dialog(conversation.dialog()))

    async def scenario():
        request = service.stream(conversation, ReplySettings(max_new_tokens=8, temperature=0.0))
        await asyncio.sleep(0.5)  # the worker is prefilling
        cancelled_at = time.monotonic()
        request.cancel()
        events = await request.events()
        return events, time.monotonic() - cancelled_at

    try:
        events, took = run(scenario(), 60)
    finally:
        service.close()
        torch.set_num_threads(threads)
    [done] = events
    assert isinstance(done, Done) and done.finish_reason == "cancelled" and done.stats.new_tokens == 0
    assert not any(isinstance(e, Text) for e in events)
    assert took < 1.0, f"the stop took {took:.1f} s"
    prefilled = len(conversation.kv_cache.tokens)
    assert 0 < prefilled < prompt_tokens - PREFILL_CHUNK and prefilled % PREFILL_CHUNK == 0, (prefilled, prompt_tokens)
