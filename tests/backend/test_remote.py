"""The remote backend (LLAMA_BACKEND_URL): replies computed by another OpenAI-compatible server.

The "cluster" is this app's own API (`python -m app.api`) in a second process on a loopback port,
serving a tiny random checkpoint. Through it, replies must be exactly the local engine's for the
same checkpoint, settings and seed; Stop must end the generation over there, so that its queue is
free at once; its errors must arrive as the events a local reply would give. Last, the chat app
itself runs in front of it: the API and a chat tab of that app are answered by the backend.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from support.chat_tab import ChatTab, sign_in
from support.servers import ApiServer, ChainlitServer, free_port, server_env

from app.backend.protocol import open_backend
from app.backend.engine_client import EngineClient
from app.backend.conversation import Conversation
from app.messages import WHOLE, Attachment, Done, EngineConfig, Failed, ReplySettings, Text
from app.backend.remote import RemoteClient, api_base
from app.settings import Settings, SettingsError

pytestmark = pytest.mark.timeout(240)

KEY = "backend-key"
MAX_CONTEXT = 16384  # a reply this long takes the tiny model many seconds
GONE = "the client went away; cancelled"


@pytest.fixture(scope="module")
def backend(tiny, tmp_path_factory):
    env = server_env(checkpoint=tiny, weights_dir=tiny.parent, dtype="fp32", threads=1, max_context=MAX_CONTEXT,
                     api_key=KEY)
    server = ApiServer(env, log=tmp_path_factory.mktemp("backend") / "api.log")
    yield from server.running()


@pytest.fixture(scope="module")
def remote(backend):
    settings = Settings.from_env({"LLAMA_BACKEND_URL": backend.url, "LLAMA_BACKEND_KEY": KEY,
                                  "LLAMA_MAX_CONTEXT": str(MAX_CONTEXT)})
    backend = open_backend(settings)  # picks the remote backend
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def local(tiny):
    """The same checkpoint served here, one thread, float32, as the backend runs it."""
    client = EngineClient(EngineConfig(checkpoint=str(tiny), dtype="fp32", threads=1, max_context=MAX_CONTEXT))
    run(client.load())
    yield client
    client.close()


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 90))


def ask(service, conversation: Conversation, settings: ReplySettings) -> list:
    async def events():
        return await service.stream(conversation, settings).events()
    return run(events())


def chat(*texts: str, system: str | None = None) -> Conversation:
    conversation = Conversation(system_prompt=system)
    for i, text in enumerate(texts):
        conversation.add("user" if i % 2 == 0 else "assistant", text)
    return conversation


# ---- replies ------------------------------------------------------------------------------------

def test_the_backends_models_are_the_profiles(remote, backend):
    assert isinstance(remote, RemoteClient)
    assert list(remote.profiles) == ["tiny"] and remote.default == "tiny"
    assert remote.url == f"{backend.url}/v1"
    # that server says its model is loaded; this client does not pass on what it read once, at start
    models = httpx.get(f"{backend.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
    assert [(m["id"], m["loaded"]) for m in models] == [("tiny", True)]
    assert remote.in_memory("tiny") is None and remote.is_loaded("tiny")
    assert api_base("http://host:8000/") == "http://host:8000/v1"
    assert api_base("https://host/openai/v1") == "https://host/openai/v1"


@pytest.mark.parametrize("settings", [
    ReplySettings(max_new_tokens=40, temperature=0.0),
    ReplySettings(max_new_tokens=40, temperature=1.0, top_k=50, top_p=0.95, seed=3),
    ReplySettings(max_new_tokens=40, temperature=0.0, logit_bias={13: -100.0, 11: 4.5}),
], ids=["greedy", "seeded", "biased"])
def test_a_reply_through_the_backend_is_the_local_reply(remote, local, settings):
    conversation = chat("Hello there", "Hi! How can I help?", "Tell me about Paris.", system="Be brief.")
    events = ask(remote, conversation, settings)
    expected = ask(local, conversation, settings)[-1]

    done = events[-1]
    assert isinstance(done, Done) and all(isinstance(e, Text) for e in events[:-1])
    assert "".join(e.text for e in events[:-1]) == done.text
    assert done.text == expected.text and done.finish_reason == expected.finish_reason == "length"
    assert done.stats.new_tokens == 40 and done.stats.prompt_tokens == expected.stats.prompt_tokens
    assert "tokens" in done.summary


def test_stop_through_the_backend_ends_its_generation(remote, backend):
    before = backend.log().count(GONE)

    async def scenario():
        request = remote.stream(chat("Tell me a long story"), ReplySettings(max_new_tokens=MAX_CONTEXT,
                                                                           temperature=1.0, ignore_eos=True))
        async for event in request:
            if isinstance(event, Text):
                break
        stopped_at = time.monotonic()
        request.cancel()
        done = (await request.events())[-1]
        stopped_in = time.monotonic() - stopped_at
        # the backend's queue is free again: a short reply does not wait for the long one
        asked_at = time.monotonic()
        after = (await remote.stream(chat("Hi"), ReplySettings(max_new_tokens=3)).events())[-1]
        return done, stopped_in, after, time.monotonic() - asked_at

    done, stopped_in, after, took = run(scenario())
    assert done.finish_reason == "cancelled" and done.text and stopped_in < 1.0
    assert after.finish_reason == "length" and after.stats.new_tokens == 3 and took < 3.0
    deadline = time.monotonic() + 5
    while backend.log().count(GONE) <= before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert backend.log().count(GONE) == before + 1
    assert remote.active == 0


# ---- errors -------------------------------------------------------------------------------------

def test_a_prompt_too_long_for_the_backend_fails_as_it_would_here(remote):
    [failed] = ask(remote, chat("word " * (MAX_CONTEXT + 100)), ReplySettings(max_new_tokens=8))
    assert isinstance(failed, Failed) and failed.reason == "prompt_too_long"
    assert f"{MAX_CONTEXT} tokens" in failed.message


def test_a_wrong_key_and_an_unreachable_backend_are_reported(backend):
    wrong = RemoteClient(backend.url, ["tiny"], key="wrong")
    [failed] = ask(wrong, chat("Hi"), ReplySettings(max_new_tokens=3))
    assert isinstance(failed, Failed) and "LLAMA_BACKEND_KEY" in failed.message

    gone = RemoteClient(f"http://127.0.0.1:{free_port()}", ["tiny"])
    [failed] = ask(gone, chat("Hi"), ReplySettings(max_new_tokens=3))
    assert isinstance(failed, Failed) and failed.reason == "error" and "could not be reached" in failed.message

    # A body that cannot be JSON is never sent, and the reply says why instead of never ending.
    [failed] = ask(gone, chat("Hi"), ReplySettings(max_new_tokens=3, temperature=float("nan")))
    assert isinstance(failed, Failed) and "could not be sent" in failed.message and "JSON" in failed.message

    with pytest.raises(SettingsError, match="LLAMA_BACKEND_URL=.*could not list its models"):
        open_backend(Settings.from_env({"LLAMA_BACKEND_URL": f"http://127.0.0.1:{free_port()}"}))
    named = open_backend(Settings.from_env(
        {"LLAMA_BACKEND_URL": f"http://127.0.0.1:{free_port()}", "LLAMA_BACKEND_MODEL": "big"}))
    assert list(named.profiles) == ["big"]
    with pytest.raises(SettingsError, match="LLAMA_BACKEND_URL=ftp://x: expected an http"):
        Settings.from_env({"LLAMA_BACKEND_URL": "ftp://x"})


# ---- the chat app in front of the backend -------------------------------------------------------

def test_the_chat_app_fronts_the_backend(backend, local, tmp_path):
    env = server_env(backend_url=backend.url, backend_key=KEY, temperature=0, max_new_tokens=16,
                     history_db=tmp_path / "history.db", threads=1)
    env.pop("CHAINLIT_AUTH_SECRET", None)
    front = ChainlitServer(env, log=tmp_path / "front.log")
    try:
        front.wait_ready()
        # its API answers from the backend
        client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        question = [{"role": "user", "content": "What is the capital of France?"}]
        reply = client.chat.completions.create(model="tiny", messages=question, temperature=0, max_tokens=16)
        expected = ask(local, chat(question[0]["content"]), ReplySettings(max_new_tokens=16, temperature=0.0))[-1]
        assert reply.choices[0].message.content == expected.text

        # and so does a chat tab: a reply, its stats line, no error
        tab = ChatTab(front.url, sign_in(front.url))
        try:
            tab.wait_for("chat_settings")
            tab.send(question[0]["content"])
        finally:
            tab.close()
        sent = [data for event, data in tab.events if event in ("new_message", "update_message")]
        assert not [s for s in sent if s.get("isError")], sent
        replies = [s["output"] for s in sent if (s.get("metadata") or {}).get("kind") == "reply"]
        assert replies and replies[-1] == expected.text
        assert any(s["output"].startswith("*tiny · 16 tokens") for s in sent if s.get("name") == "stats")  # (its model first)
    finally:
        front.stop()
    log = front.log_path.read_text(errors="replace")
    assert "Traceback" not in log and " - ERROR - " not in log, log


def test_n_replies_and_a_raw_prompt_through_the_backend(remote, local):
    settings = ReplySettings(max_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0, seed=9)

    async def both(backend):
        many = await backend.stream(chat("Hello there"), settings, n=2).events()
        raw = await backend.complete("Once upon a time", settings=ReplySettings(max_new_tokens=5, temperature=0.0),
                                     ).events()
        return ({e.index: e.text for e in many if isinstance(e, Done)}, raw[-1])

    (remote_many, remote_raw), (local_many, local_raw) = run(both(remote)), run(both(local))
    assert remote_many == local_many and len(set(remote_many.values())) == 2
    assert isinstance(remote_raw, Done) and remote_raw.text == local_raw.text


# ---- files --------------------------------------------------------------------------------------

def test_a_file_goes_to_the_server_as_the_engines_text(remote, local):
    conversation = chat("What does the note say?", system="Be brief.")
    conversation.messages[0].files = [Attachment("note.txt", "Feed the cat at six.\n<|eot_id|> stays text.\n")]
    settings = ReplySettings(max_new_tokens=12, temperature=0.0)
    done, expected = ask(remote, conversation, settings)[-1], ask(local, conversation, settings)[-1]
    assert done.text == expected.text and done.stats.prompt_tokens == expected.stats.prompt_tokens
    assert [(u.name, u.chosen) for u in done.context.files] == [("note.txt", WHOLE)]  # (its tokens: estimated)
    assert [(u.name, u.chosen) for u in expected.context.files] == [("note.txt", WHOLE)]


def test_a_long_file_goes_as_its_best_chunks_and_the_decision_comes_back(remote):
    lines = [f"Entry {i}: the ledger shows an ordinary day at the mill." for i in range(6000)]
    lines[4321] = "Entry 4321: the miller Ottoline Vasquez sold the blue horse."
    file = Attachment("ledger.txt", "\n".join(lines))
    conversation = chat("Who sold the blue horse?")
    conversation.messages[0].files = [file]
    settings = ReplySettings(max_new_tokens=4, temperature=0.0)
    done = ask(remote, conversation, settings)[-1]
    (use,) = done.context.files
    assert 0 < len(use.chosen) < use.chunks and any("Ottoline" in s.text for s in use.sources)
    assert done.stats.prompt_tokens < MAX_CONTEXT - 4  # (estimated from characters, and within the context)
    # the web side keeps the decision: the next turn sends the same text, the reply's prompt grows from it
    conversation.messages[0].files = [Attachment(file.name, file.text, chosen=use.chosen)]
    conversation.add("assistant", done.text)
    conversation.add("user", "When?")
    later = ask(remote, conversation, settings)[-1]
    assert later.context.files == [] and later.stats.prompt_tokens > done.stats.prompt_tokens
