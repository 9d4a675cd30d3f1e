"""Many chats on one server: eight conversations at once against a real `chainlit run` (socket.io clients)
are answered together, each with the reply it gets alone; past LLAMA_MAX_BATCH a chat waits and is told
its place, and a tab that disconnects mid-reply frees its place within a second; Stop during a long
prefill ends it between prefill chunks.
"""

from __future__ import annotations

import asyncio
import re
import time

import pytest
import torch
from support.app import imported_app
from support.checkpoints import hf_model, write_tiny_checkpoint
from support.engine import EngineHarness, request
from support.handlers import Chat
from support.live_chat import LiveChat
from support.servers import ChainlitServer, server_env

from app.messages import Cancel, Done, ReplySettings, Text
from model.checkpoint import load_checkpoint
from model.generation import PREFILL_CHUNK

pytestmark = pytest.mark.timeout(300)

CHATS = 8
SAMPLED = dict(temperature=1.0, top_k=0, top_p=1.0, system_prompt="")


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    folder = tmp_path_factory.mktemp("weights")
    write_tiny_checkpoint(folder / "tiny")
    return folder


def start_server(weights, tmp_path_factory, **llama) -> ChainlitServer:
    env = server_env(checkpoint=weights / "tiny", weights_dir=weights, threads=1, history="off", dtype="fp32",
                     **llama)
    server = ChainlitServer(env, log=tmp_path_factory.mktemp("chainlit") / "chainlit.log")
    server.wait_ready()
    return server


@pytest.fixture(scope="module")
def server(weights, tmp_path_factory):
    server = start_server(weights, tmp_path_factory)
    yield server
    server.stop()
    assert "Traceback" not in server.log_path.read_text()


@pytest.fixture(scope="module")
def one_at_a_time(weights, tmp_path_factory):
    server = start_server(weights, tmp_path_factory, max_batch=1)
    yield server
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
    assert not any(reply.notes for reply in second)  # nobody waited
    batches = [int(b) for b in re.findall(r"reply: .*, batch (\d+)", server.log())[-CHATS:]]
    assert max(batches) >= CHATS // 2, f"the chats did not run in one batch: {batches}"


def test_a_tab_that_disconnects_mid_reply_frees_its_place_within_a_second(one_at_a_time):
    server = one_at_a_time

    async def scenario():
        leaving = await conversation(server.url, seed=1, max_new_tokens=8000)
        await leaving.send("Write a very long story.")
        await leaving.wait_for("stream_token")  # it is being answered
        waiting = await conversation(server.url, seed=2, max_new_tokens=8)
        start = await waiting.send("Hi")
        await waiting.wait_for("new_message", after=start, where=lambda m: "yours is next in line" in m["output"])
        left_at = time.monotonic()
        await leaving.close()
        reply = await waiting.reply(start)
        await waiting.close()
        return reply, left_at

    reply, left_at = run(scenario())
    assert reply.text and len(reply.stats) == 1 and not reply.errors
    assert reply.first_token_at - left_at < 1.0, f"the next chat waited {reply.first_token_at - left_at:.1f} s"


# ---- in the process: the place in the batch, and a stop during prefill -------------------------

def test_chat_end_frees_its_place_within_a_second(weights):
    with imported_app(checkpoint=weights / "tiny", weights_dir=weights, threads=1, history="off") as main:
        chat = Chat(main)

        async def scenario():
            await chat.start()
            await main.update_settings({"max_new_tokens": 8000, "temperature": 1.0, "seed": "", "system_prompt": ""})
            task = asyncio.create_task(chat.send("Write a very long story."))
            while main.BACKEND.active == 0 or chat.emitter.send_token.await_count < 2:
                await asyncio.sleep(0.01)
            ended_at = time.monotonic()
            await main.end_chat()  # what Chainlit calls when the tab disconnects
            while main.BACKEND.active:
                assert time.monotonic() - ended_at < 1.0, main.BACKEND.active
                await asyncio.sleep(0.01)
            await asyncio.wait_for(task, 5)

        run(scenario(), 60)
        assert main.BACKEND.active == 0
        assert "cut off: the page was closed" in chat.stats()[-1]  # (it said "stopped by user": nobody pressed Stop)


def test_stop_during_prefill_ends_it_between_chunks(tmp_path):
    """A 7000-token prompt is prefilled a chunk per step; a cancel ends it at the next step, and the
    chunks already prefilled stay in the prefix cache."""
    folder = tmp_path / "wide"
    hf_model(hidden_size=256, intermediate_size=768, num_hidden_layers=4).save_pretrained(folder)
    checkpoint = load_checkpoint(folder)
    engine = EngineHarness(folder, loader=lambda name, path: checkpoint)
    long = request("word " * 7000, ReplySettings(max_new_tokens=8, temperature=0.0), model="wide")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine.run(long, max_steps=2)
        sequence = engine.engine.requests[long.id][0]
        assert sequence.cache.length == 2 * PREFILL_CHUNK < len(sequence.prompt) - PREFILL_CHUNK
        events = engine.run(Cancel(long.id), max_steps=1)
    finally:
        torch.set_num_threads(threads)
    [done] = [e for e in events if isinstance(e, Done | Text)]
    assert isinstance(done, Done)
    assert done.finish_reason == "cancelled" and done.stats.new_tokens == 0
    assert not engine.engine.sequences and len(engine.engine.prefix_cache) == 1
