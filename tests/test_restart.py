"""Faults stay with their request, every place in the queue is given back, and a restart loses nothing.

- The engine (app.engine.core.Engine, in this process): a fault injected while building, prefilling, sampling,
  ending or sending one request fails that request alone; the others go on.
- The engine client (app.backend.engine_client.EngineClient, a real engine process): each way a request ends gives its
  place back (refused before sending, a failed step, a cancel, a caller gone, a fault in delivering it);
  requests that come while the engine restarts wait for it, a bounded while.
- The API alone (`python -m app.api`) with its engine killed again and again under several clients:
  every request ends, the next one is answered.
- The chat: a reply cut by a crash is not remembered as an answer, so its question can be sent again.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import msgspec
import psutil
import pytest
import torch
from support.engine import EngineHarness, last, request
from support.servers import ApiServer, server_env

from app.backend import engine_client as client_module
from app.backend.engine_client import EngineClient, InvalidRequest
from app.backend.conversation import Conversation
from app.messages import Done, EngineConfig, Failed, ReplySettings, Restarting, Text
from app.engine.outbox import Outbox
from model.checkpoint import load_checkpoint

pytestmark = pytest.mark.timeout(300)

GREEDY = ReplySettings(max_new_tokens=12, temperature=0.0)
LONG = ReplySettings(max_new_tokens=3000, temperature=1.0, ignore_eos=True)  # (a random model may sample a stop token)


def chat(text: str, **message) -> Conversation:
    conversation = Conversation()
    conversation.add("user", text, **message)
    return conversation


def run(coroutine, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


# ---- the engine: a fault stays with its request -------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tiny):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_checkpoint(tiny, dtype=torch.float32)
    torch.set_num_threads(threads)


@pytest.fixture
def engine(tiny, checkpoint):
    return EngineHarness(tiny, loader=lambda name, path: checkpoint)


def poisoned(monkeypatch, target: str, victim: str):
    """Make `target` (a method, "module.Class.method") raise for the request whose prompt holds `victim`."""
    module, cls, name = target.rsplit(".", 2)
    owner = getattr(__import__(module, fromlist=[cls]), cls)
    original = getattr(owner, name)

    def maybe_raise(self, *args, **kwargs):
        if victim in str(self.request.messages):
            raise RuntimeError(f"injected fault in {name}")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, maybe_raise)


@pytest.mark.parametrize("target", ["app.engine.sequence.Sequence.start", "app.engine.sequence.Sequence.prefill_chunk",
                                    "app.engine.sequence.Sequence.sample", "app.engine.sequence.Sequence.draw",
                                    "app.engine.sequence.Sequence.accept",
                                    "app.engine.sequence.Sequence.done"])
def test_a_fault_in_one_request_fails_it_alone(engine, monkeypatch, target):
    poisoned(monkeypatch, target, "poison")
    bad, good = request("poison", GREEDY, n=2), request("Hello there", GREEDY)
    events = engine.ask(bad, good)
    failed = last(events[bad.id])
    assert isinstance(failed, Failed) and failed.reason == "error" and "injected fault" in failed.message
    assert [e for e in events[bad.id] if isinstance(e, Failed)] == [failed]  # one end, nothing after it
    assert isinstance(last(events[good.id]), Done) and last(events[good.id]).stats.new_tokens == 12
    assert not engine.engine.requests and not engine.engine.scheduler.running  # nothing of it is kept
    after = request("clean", GREEDY)
    assert isinstance(last(engine.ask(after)[after.id]), Done)


def test_a_prompt_the_chat_format_cannot_build_is_a_bad_request(engine, monkeypatch):
    def broken(*args, **kwargs):
        raise TypeError("a tool call argument of an unexpected type")

    monkeypatch.setattr("app.engine.core.fit_prompt", broken)
    r = request("Hi", GREEDY)
    failed = last(engine.ask(r)[r.id])
    assert failed.reason == "bad_request" and "unexpected type" in failed.message


def test_a_seed_at_the_top_of_the_range_serves_n_replies(engine):
    r = request("Hi", ReplySettings(max_new_tokens=4, temperature=1.0, seed=2**63 - 1), n=4)
    dones = [e for e in engine.ask(r)[r.id] if isinstance(e, Done)]
    assert sorted(d.index for d in dones) == [0, 1, 2, 3]


def test_an_event_that_cannot_be_sent_fails_its_request_and_the_others_go():
    outbox = Outbox(interval=0)
    encode = msgspec.msgpack.Encoder().encode
    for event in [Text("a", "fine"), Text("b", "half a pair: \ud800"), Text("b", "later"), Done("a", "fine", "stop"),
                  Done("b", "x", "stop")]:
        outbox.add(event)
    data, failed = outbox.take_encoded(encode)
    sent = msgspec.msgpack.decode(data, type=list[Text | Done | Failed])
    assert failed == ["b"]
    assert [(type(e).__name__, e.id) for e in sent] == [("Text", "a"), ("Failed", "b"), ("Done", "a")]
    assert "could not be sent" in sent[1].message


# ---- the engine client: every way a request ends gives its place back -------------------------

@pytest.fixture(scope="module")
def client(tiny):
    client = EngineClient(EngineConfig(checkpoint=str(tiny), dtype="fp32", threads=1, max_batch=2), max_waiting=2)
    run(client.load())
    yield client
    client.close()


def assert_all_places_free(client, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while client.places_taken and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.places_taken == 0 and client.active == 0


def test_a_request_refused_before_sending_takes_no_place(client):
    async def scenario():
        for settings in (ReplySettings(stop=("\ud800",)), ReplySettings(seed=2**64), ReplySettings(top_p=0.0)):
            with pytest.raises(InvalidRequest, match=r"at `\$\.settings\."):
                client.stream(chat("Hi"), settings, n=4)
        with pytest.raises(InvalidRequest, match=r"\$\.messages\[0\]\.tool_call_id"):
            client.stream(chat("Hi", tool_call_id="\udfff"))

    run(scenario())
    assert_all_places_free(client)


def test_a_failed_step_ends_the_request_and_gives_its_place_back(client):
    pid = client.pid

    async def scenario():
        conversation = chat("Hi")
        conversation.add("assistant", "Hello", ids=[2**31 - 1])  # in range, but past the vocabulary: prefill fails
        conversation.add("user", "Again")
        failed = (await client.stream(conversation, GREEDY, n=2).events())[-1]
        after = (await client.stream(chat("Hi"), GREEDY).events())[-1]
        return failed, after

    failed, after = run(scenario())
    assert isinstance(failed, Failed) and failed.reason == "error" and "Reading the prompt failed" in failed.message
    assert isinstance(after, Done) and client.pid == pid and client.restarts == 0
    assert_all_places_free(client)


def test_cancel_gives_the_place_back(client):
    async def scenario():
        reply = client.stream(chat("Long story"), LONG, n=2)
        async for event in reply:
            if isinstance(event, Text):
                break
        assert client.places_taken == 2
        reply.cancel()
        return [e for e in await reply.events() if isinstance(e, Done)]

    dones = run(scenario())
    assert sorted(d.finish_reason for d in dones) == ["cancelled", "cancelled"]
    assert_all_places_free(client)


def test_a_caller_that_is_gone_gives_the_place_back(client):
    """The event loop that iterated a reply ended (a closed tab, a finished request): the reply is cancelled."""
    async def start_and_leave():
        reply = client.stream(chat("Long story"), LONG)
        async for event in reply:
            if isinstance(event, Text):
                return reply

    reply = run(start_and_leave())  # its loop is closed now; the next event cannot be handed to it
    assert_all_places_free(client, timeout=10)
    assert reply.cancelled


def test_a_fault_delivering_an_event_ends_that_request_and_the_reader_goes_on(client, monkeypatch):
    from app.backend.reply import Reply

    deliver = Reply.deliver

    def broken(reply, event):
        if isinstance(event, Text) and "poison" in str(reply.messages[0].content):
            raise RuntimeError("injected fault in deliver")
        deliver(reply, event)

    monkeypatch.setattr(Reply, "deliver", broken)

    async def scenario():
        bad = await client.stream(chat("poison"), GREEDY).events()
        good = await client.stream(chat("fine"), GREEDY).events()
        return bad, good

    bad, good = run(scenario())
    assert isinstance(bad[-1], Failed) and "could not be delivered" in bad[-1].message
    assert isinstance(good[-1], Done) and client._reader.is_alive()
    assert_all_places_free(client)


# ---- the engine client: a restart ---------------------------------------------------------------

def kill_engine(client: EngineClient) -> None:
    os.kill(client.pid, signal.SIGKILL)
    while client.ready:  # the reader notices within a poll
        time.sleep(0.02)


def test_requests_that_come_during_a_restart_wait_for_the_new_engine(tiny):
    client = EngineClient(EngineConfig(checkpoint=str(tiny), dtype="fp32", threads=1))
    try:
        async def scenario():
            await client.load()
            running = client.stream(chat("Long story"), LONG)
            async for event in running:
                if isinstance(event, Text):
                    break
            await asyncio.to_thread(kill_engine, client)
            cut = (await running.events())[-1]
            waiting = [client.stream(chat(f"Hi {i}"), GREEDY) for i in range(3)]
            cancelled = client.stream(chat("Never mind"), GREEDY)
            assert client.places_taken == 4  # held requests hold their places
            cancelled.cancel()
            return cut, [await r.events() for r in waiting], await cancelled.events()

        cut, answers, cancelled = run(scenario())
        assert isinstance(cut, Failed) and cut.reason == "engine"
        for events in answers:
            assert isinstance(events[0], Restarting) and isinstance(events[-1], Done), events
            assert events[-1].stats.new_tokens == 12
        assert [type(e) for e in cancelled] == [Restarting, Done] and cancelled[-1].finish_reason == "cancelled"
        assert client.restarts == 1 and client.ready
        assert_all_places_free(client)
    finally:
        client.close()


def test_a_restart_that_takes_too_long_ends_the_waiting_requests(tiny, monkeypatch):
    monkeypatch.setattr(client_module, "RESTART_DELAYS_S", (30.0,))  # the next engine starts in 30 s
    monkeypatch.setattr(client_module, "RESTART_WAIT_S", 0.5)
    client = EngineClient(EngineConfig(checkpoint=str(tiny), dtype="fp32", threads=1))
    try:
        async def scenario():
            await client.load()
            await asyncio.to_thread(kill_engine, client)
            started = time.monotonic()
            events = await client.stream(chat("Hi"), GREEDY).events()
            return events, time.monotonic() - started

        events, waited = run(scenario())
        assert isinstance(events[0], Restarting) and isinstance(events[-1], Failed)
        assert events[-1].reason == "restarting" and "not back within" in events[-1].message
        assert waited < 10
        assert_all_places_free(client)
    finally:
        client.close()


def test_the_api_answers_a_restart_with_503_and_retry_after():
    from app.api.pieces import failure_error

    for reason in ("restarting", "engine"):
        response = failure_error(Failed("x", "The model is restarting.", reason)).response()
        assert response.status_code == 503 and response.headers["retry-after"].isdigit()


# ---- the API alone, its engine killed again and again under load -------------------------------

CLIENTS = 6
KILLS = 3
REQUEST_TIMEOUT_S = 120.0  # a request with no end by then counts as one without an answer


def engine_pid(server: ApiServer) -> int | None:
    """The server's engine process, while it runs (a killed one is a zombie until the server notices)."""
    for child in psutil.Process(server.process.pid).children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "app.engine" in " ".join(child.cmdline()):
                return child.pid
        except psutil.Error:  # gone meanwhile
            continue
    return None


def metric(server: ApiServer, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


@pytest.fixture(scope="module")
def api_server(tiny, tmp_path_factory):
    server = ApiServer(server_env(checkpoint=tiny, weights_dir=tiny.parent, dtype="fp32", threads=1),
                       log=tmp_path_factory.mktemp("api") / "api.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_the_engine_killed_under_load_leaves_no_request_without_an_end(api_server):
    """Up to 31 s on a Zen 4 (beside the suite's two other workers): six clients keep asking while the engine is
    killed three times, and each kill waits for a new engine to load its model and answer (its own time, not
    the test's): every request, in flight or sent meanwhile, must end, over restarts one after another."""
    outcomes: list[tuple[int, bool]] = []  # (status, the reply ended: [DONE] or a whole JSON answer)
    stop = threading.Event()

    def client_loop(i: int) -> None:
        with httpx.Client(base_url=api_server.url, timeout=REQUEST_TIMEOUT_S) as http:
            while not stop.is_set():
                response = None
                body = {"messages": [{"role": "user", "content": f"Story {i}"}], "max_tokens": 40, "temperature": 1,
                        "stream": i % 2 == 0}
                try:
                    response = http.post("/v1/chat/completions", json=body)
                    ended = response.text.rstrip().endswith("[DONE]") if body["stream"] else bool(response.json())
                    outcomes.append((response.status_code, ended))
                except httpx.HTTPError:
                    outcomes.append((0, False))  # no answer within REQUEST_TIMEOUT_S, or a dropped connection
                if response is not None and response.status_code in (429, 503):
                    time.sleep(0.2)

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    pids = []
    try:
        for _ in range(KILLS):
            time.sleep(2.0)
            found = time.monotonic() + 90  # (an engine being started again is not there yet)
            while (pid := engine_pid(api_server)) is None and time.monotonic() < found:
                time.sleep(0.1)
            assert pid is not None, (f"no engine process under the server (its exit code: {api_server.process.poll()})"
                                     f": {api_server.log()}")
            pids.append(pid)
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 90
            while (engine_pid(api_server) in (None, pid) or
                   httpx.get(f"{api_server.url}/health").status_code != 200) and time.monotonic() < deadline:
                time.sleep(0.1)
    finally:
        time.sleep(2.0)
        stop.set()
        for thread in threads:
            thread.join(REQUEST_TIMEOUT_S + 10)
    assert len(set(pids)) == KILLS and metric(api_server, "llama_engine_restarts_total") == KILLS
    assert outcomes and all(status != 0 for status, _ in outcomes), outcomes  # every request had an answer
    assert all(ended for status, ended in outcomes if status == 200), outcomes
    assert {status for status, _ in outcomes} <= {200, 503}, outcomes
    assert sum(status == 200 for status, _ in outcomes) > len(outcomes) // 2
    ordinary = httpx.post(f"{api_server.url}/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert ordinary.status_code == 200
    assert metric(api_server, "llama_places_taken") == 0


def test_a_streaming_client_that_goes_away_gives_its_place_back(api_server):
    with httpx.Client(base_url=api_server.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Long story"}], "max_tokens": 5000, "ignore_eos": True,
                "stream": True, "n": 2}) as response:
            lines = response.iter_lines()  # (kept: a dropped iterator closes the connection at once)
            for line in lines:
                if line.startswith("data: {") and any(c["delta"].get("content") for c in json.loads(line[6:])["choices"]):
                    break
            assert metric(api_server, "llama_places_taken") == 2
    deadline = time.monotonic() + 10
    while metric(api_server, "llama_places_taken") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(api_server, "llama_places_taken") == 0


# ---- the chat: a reply cut by a crash ---------------------------------------------------------

@pytest.fixture(scope="module")
def main(tiny):
    from support.app import imported_app

    with imported_app(checkpoint=tiny, weights_dir=tiny.parent, max_context=512, max_new_tokens=8, threads=1,
                      history="off") as main:
        yield main



def test_a_cut_reply_is_stored_as_cut_and_a_resumed_chat_leaves_it_out(main, monkeypatch):
    from support.handlers import Chat, CutOff

    from app.web import history

    chat_ = Chat(main)

    async def scenario():
        await chat_.start()
        with monkeypatch.context() as patch:
            patch.setattr(main.BACKEND, "stream", lambda conversation, settings, **options: CutOff("Paris is ", "the cap"))
            question = await chat_.send("What is the capital of France?")
        return question

    question = run(scenario())
    [cut] = [s for s in chat_.sent() if s["output"] == "Paris is the cap"]
    metadata = json.loads(cut["metadata"]) if isinstance(cut["metadata"], str) else cut["metadata"]
    assert metadata == {"kind": history.CUT}
    assert not history.is_reply(cut)
    stored = [{"id": question.id, "type": "user_message", "output": question.content}] + chat_.sent()
    resumed = history.conversation_from_steps(stored, model="tiny", system_prompt=None)
    assert resumed.messages == []  # as the live chat: the question is to be sent again
    assert chat_.conversation().messages == []

    async def again():
        await chat_.send("What is the capital of France?")

    run(again())
    assert [m.content for m in chat_.conversation().messages if m.role == "user"] == ["What is the capital of France?"]
    assert len(chat_.stats()) == 1


def test_the_settings_panel_values_are_held_to_the_requests_ranges(main):
    """A crafted settings update (the panel's sliders cannot send these) leaves the bad values out, says
    which, and the next message is answered: before, top_k -1 or a seed past 64 bits stopped the engine."""
    settings, note = main.read_settings({"top_k": -1, "temperature": "warm", "top_p": 0.5, "max_new_tokens": 8.0,
                                         "seed": str(2**64), "min_p": float("nan")})
    assert (settings.top_k, settings.temperature, settings.seed, settings.min_p) == (None, None, None, None)
    assert (settings.top_p, settings.max_new_tokens) == (0.5, 8)
    assert all(name in note for name in ("top_k", "temperature", "seed", "min_p")) and "top_p" not in note
    from support.handlers import Chat

    chat_ = Chat(main)

    async def scenario():
        await chat_.start()
        await main.update_settings({"top_k": -1, "seed": str(2**64), "repetition_penalty": 0})
        await chat_.send("Hi")

    run(scenario())
    assert len(chat_.stats()) == 1 and not chat_.errors()
    assert any("top_k" in reply and "seed" in reply for reply in chat_.replies())


def test_an_event_that_cannot_be_read_ends_its_request_and_the_others_are_read(client):
    """The reader reads the engine's messages one by one when a batch of them cannot be read whole."""
    async def scenario():
        reply = client.stream(chat("Long story"), LONG)
        async for event in reply:
            if isinstance(event, Text):
                break
        batch = msgspec.msgpack.encode([Text(reply.id, "fine"), {"type": "Text", "id": reply.id, "text": 5}])
        await asyncio.to_thread(client._messages, batch)
        return await reply.events()

    events = run(scenario())
    assert isinstance(events[-1], Failed) and "could not be read" in events[-1].message
    assert_all_places_free(client)


def test_a_message_sent_while_the_model_restarts_waits_and_is_answered(main):
    from support.handlers import Chat

    chat_ = Chat(main)

    async def scenario():
        await chat_.start()
        await asyncio.to_thread(kill_engine, main.BACKEND)
        await chat_.send("Are you there?")

    run(scenario())
    assert main.RESTARTING_NOTE in [s["output"] for s in chat_.sent()]  # shown while it waited, then removed
    assert len(chat_.stats()) == 1 and not chat_.errors() and main.BACKEND.restarts == 1
    assert [m.role for m in chat_.conversation().messages] == ["user", "assistant"]
