"""OpenAI's Responses API (`/v1/responses`), driven by the official `openai` client: the same reply as the
chat route, its stream of events, stored responses continued with previous_response_id, read back and
deleted, function calls out and their outputs back in, JSON formats, cached tokens, and errors that name
the Responses field.

The server is the API alone (`python -m app.api`) on a tiny random checkpoint with an API key.
"""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import openai
import pytest
from support.servers import ApiServer, server_env

from app.api.responses import Store, Stored
from app.api.responses_shapes import Response
from model.kv_cache import PREFILL_CHUNK

pytestmark = pytest.mark.timeout(240)

KEY = "responses-key"
INSTRUCTIONS = "You are a helpful assistant who answers briefly and kindly. " * 40  # more than a prefill chunk


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("responses")
    server = ApiServer(server_env(checkpoint=tiny, weights_dir=tiny.parent, dtype="fp32", threads=1, api_key=KEY),
                       log=folder / "api.log")
    yield from server.running()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_a_response_is_the_chat_routes_reply(client):
    chat = client.chat.completions.create(model="tiny", temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is the capital of France?"}])
    response = client.responses.create(model="tiny", instructions="Be terse.", input="What is the capital of France?",
                                       temperature=0, max_output_tokens=12)
    assert response.output_text == chat.choices[0].message.content
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == chat.usage.prompt_tokens and response.usage.output_tokens == 12
    assert response.usage.total_tokens == chat.usage.prompt_tokens + 12
    assert response.id.startswith("resp_") and response.output[0].type == "message"
    assert response.output[0].role == "assistant" and response.instructions == "Be terse."
    # the same as items, with the easy form of a message (no "type") and the full one
    again = client.responses.create(model="tiny", temperature=0, max_output_tokens=12, input=[
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is the capital of France?"}]}])
    assert again.output_text == response.output_text


def test_a_streamed_response_comes_as_the_responses_events(client):
    whole = client.responses.create(model="tiny", input="Tell me a story.", temperature=0, max_output_tokens=40)
    events = list(client.responses.create(model="tiny", input="Tell me a story.", temperature=0,
                                          max_output_tokens=40, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == 40
    assert {e.item_id for e in events if e.type == "response.output_text.delta"} == {final.output[0].id}
    assert client.responses.retrieve(final.id).output_text == whole.output_text  # stored, as a whole one
    # stream_options: obfuscation asked for pads each delta (random, of random lengths); off, none, as by default
    padded = list(client.responses.create(model="tiny", input="Tell me a story.", temperature=0, max_output_tokens=12,
                                          stream=True, stream_options={"include_obfuscation": True}))
    pads = [e.obfuscation for e in padded if e.type == "response.output_text.delta"]
    assert pads and all(isinstance(p, str) and p for p in pads) and len(set(pads)) == len(pads)
    plain = list(client.responses.create(model="tiny", input="Tell me a story.", temperature=0, max_output_tokens=12,
                                         stream=True, stream_options={"include_obfuscation": False}))
    assert "".join(e.delta for e in plain if e.type == "response.output_text.delta") == \
        "".join(e.delta for e in padded if e.type == "response.output_text.delta")  # (the pieces: as they came)
    assert not any(getattr(e, "obfuscation", None) for e in plain + events)
    assert client.responses.create(model="tiny", input="Hi", max_output_tokens=2,
                                   text={"verbosity": "medium"}).status == "incomplete"  # the default: taken


def test_logprobs_asked_by_include_are_the_chat_routes(client):
    """include: ["message.output_text.logprobs"] (with top_logprobs) gives each output token's logprob and its
    top alternatives, as the chat route gives them, on the whole response, each streamed delta and the stored
    one; include's other values ask for items this server never writes and change nothing."""
    asked = dict(model="tiny", input="Tell me a story.", temperature=0, max_output_tokens=6)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Tell me a story."}],
                                          temperature=0, max_tokens=6, logprobs=True, top_logprobs=2)
    expected = [(t.token, round(t.logprob, 4), [top.token for top in t.top_logprobs]) for t in chat.choices[0].logprobs.content]
    whole = client.responses.create(**asked, include=["message.output_text.logprobs"], top_logprobs=2)
    got = whole.output[0].content[0].logprobs
    assert [(t.token, round(t.logprob, 4), [top.token for top in t.top_logprobs]) for t in got] == expected
    assert "".join(t.token for t in got) == whole.output_text and all(t.bytes for t in got)
    events = list(client.responses.create(**asked, include=["message.output_text.logprobs"], top_logprobs=2, stream=True))
    streamed = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t, p) for t, p, _ in expected]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert len(done.logprobs) == len(expected)
    assert len(client.responses.retrieve(whole.id).output[0].content[0].logprobs) == len(expected)
    plain = client.responses.create(**asked, include=["reasoning.encrypted_content", "file_search_call.results"])
    assert plain.output_text == whole.output_text and plain.output[0].content[0].logprobs == []


def test_a_stored_response_is_continued_read_back_and_deleted(client, server):
    first = client.responses.create(model="tiny", instructions=INSTRUCTIONS, input="Name a color.", temperature=0,
                                    max_output_tokens=8)
    second = client.responses.create(model="tiny", instructions=INSTRUCTIONS, input="And another one?",
                                     previous_response_id=first.id, temperature=0, max_output_tokens=8)
    # the same as sending the whole conversation on the chat route
    chat = client.chat.completions.create(model="tiny", temperature=0, max_tokens=8, messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And another one?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id
    # the earlier turn's keys and values came from the engine's cache, and the client is told
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // PREFILL_CHUNK * PREFILL_CHUNK > 0
    assert client.responses.retrieve(second.id).output_text == second.output_text
    items = client.responses.input_items.list(second.id)
    assert [item.content[0].text for item in items.data] == ["And another one?"]
    said = [{"role": "user", "content": f"Message {i}."} for i in range(5)]  # listed newest first, 2 a page
    several = client.responses.create(model="tiny", input=said, max_output_tokens=2)
    pages = client.responses.input_items.list(several.id, limit=2)
    assert len(pages.data) == 2 and pages.has_more
    assert [item.content[0].text for item in pages] == [m["content"] for m in reversed(said)]  # (the client pages)
    assert client.responses.delete(second.id) is None
    for gone in (lambda: client.responses.retrieve(second.id),
                 lambda: client.responses.create(model="tiny", input="x", previous_response_id=second.id)):
        with pytest.raises(openai.NotFoundError) as error:
            gone()
        assert "No response with id" in error.value.body["message"]
    unstored = client.responses.create(model="tiny", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_input_items_are_paged_as_openai_pages_them():
    from app.api.openai import ApiError
    from app.api.responses import item_page

    items = [{"id": f"msg_{i}"} for i in range(7)]

    def ids(**query) -> tuple[list[str], bool]:
        page = item_page(items, {k: str(v) for k, v in query.items()})
        return [item["id"] for item in page.data], page.has_more

    assert ids() == ([f"msg_{i}" for i in range(6, -1, -1)], False)  # newest first, 20 at most
    assert ids(order="asc", limit=3) == (["msg_0", "msg_1", "msg_2"], True)
    assert ids(order="asc", limit=3, after="msg_2") == (["msg_3", "msg_4", "msg_5"], True)
    assert ids(order="asc", limit=3, after="msg_5") == (["msg_6"], False)
    assert ids(limit=2, after="msg_4") == (["msg_3", "msg_2"], True)  # desc: after means older
    assert ids(order="asc", limit=2, before="msg_5") == (["msg_3", "msg_4"], True)  # the page just before
    assert ids(order="asc", after="msg_1", before="msg_4") == (["msg_2", "msg_3"], False)
    for query, param in [({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"), ({"limit": "1e400"}, "limit"),
                         ({"order": "sideways"}, "order"), ({"after": "msg_x"}, "after"), ({"before": ""}, "before")]:
        with pytest.raises(ApiError) as error:
            item_page(items, query)
        assert error.value.param == param and error.value.status == 400


def reply(i: int) -> Response:
    return Response(id=f"resp_{i}", created_at=0, status="completed", model="tiny")


def test_a_key_holders_responses_are_not_anothers():
    store = Store(per_user=2)
    store.put("alice", Stored.of(reply(1), [], []))
    assert store.get("bob", "resp_1") is None and not store.delete("bob", "resp_1")
    assert store.get("alice", "resp_1") is not None
    for i in range(2, 4):  # bounded: the oldest goes
        store.put("alice", Stored.of(reply(i), [], []))
    assert store.get("alice", "resp_1") is None and store.get("alice", "resp_3") is not None
    size = Stored.of(reply(1), [{"role": "user", "content": "x" * 40}], []).size
    big = Store(bytes_per_user=size + 50)
    big.put("alice", Stored.of(reply(1), [{"role": "user", "content": "x" * 40}], []))
    big.put("alice", Stored.of(reply(2), [{"role": "user", "content": "y" * 40}], []))
    assert big.get("alice", "resp_1") is None and big.get("alice", "resp_2") is not None
    big.put("alice", Stored.of(reply(3), [{"role": "user", "content": "z" * 100}], []))
    assert big.get("alice", "resp_3") is None and big.bytes == 0  # over the bound alone: not kept either
    everyone = Store(total_bytes=2 * size + 10)  # all users together: the one longest unused loses theirs
    for i, user in enumerate(("ann", "bea", "cy", "ann")):
        everyone.put(user, Stored.of(reply(i), [{"role": "user", "content": "x" * 40}], []))
    assert [everyone.get(user, f"resp_{i}") is not None for i, user in enumerate(("ann", "bea", "cy", "ann"))] == [
        False, False, True, True]
    assert everyone.bytes == 2 * size


def test_the_store_counts_the_memory_its_responses_take():
    """What a stored response counts is the memory it takes, measured (tracemalloc): a conversation of many
    short messages, where Python objects took ~5x their JSON's length, and one long message."""
    import tracemalloc

    many = [{"role": "user" if i % 2 else "assistant", "content": f"turn {i}: yes."} for i in range(4_000)]
    one = [{"role": "user", "content": "word " * 100_000}]
    for messages in (many, one):
        store = Store()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            store.put("alice", Stored.of(reply(1), messages, messages[:1]))
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert store.bytes <= held <= store.bytes * 1.05 + 4_096, (held, store.bytes)
        assert store.get("alice", "resp_1").messages == messages  # and it is all there


def test_a_conversation_past_what_a_user_may_store_is_refused_before_it_runs(monkeypatch):
    """A chain of previous_response_ids grows by its input each turn: where the next response could not be
    kept, the request is a 400 naming previous_response_id before the model runs (not a response kept
    past the user's bound, as before, nor one silently forgotten)."""
    from support.scripted_backend import ScriptedBackend

    from app.api import responses
    from app.api.routes import create_app
    from app.messages import Done, Stats, Text

    monkeypatch.setattr(responses, "Store", lambda: Store(bytes_per_user=6_000))
    backend = ScriptedBackend([Text("scripted", "Noted."), Done("scripted", "Noted.", "stop", Stats(new_tokens=2))])

    async def ask():
        transport = httpx.ASGITransport(app=create_app(backend))
        async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", max_retries=0,
                                      http_client=httpx.AsyncClient(transport=transport)) as client:
            first = await client.responses.create(model="tiny", input="x" * 1_500)
            second = await client.responses.create(model="tiny", input="y" * 1_500, previous_response_id=first.id)
            with pytest.raises(openai.BadRequestError) as error:
                await client.responses.create(model="tiny", input="z" * 1_500, previous_response_id=second.id)
            unkept = await client.responses.create(model="tiny", input="z" * 1_500, previous_response_id=second.id,
                                                   store=False)
            return error.value.body, unkept

    error, unkept = asyncio.run(ask())
    assert error["param"] == "previous_response_id" and "store: false" in error["message"]
    assert unkept.output_text == "Noted."


def test_an_empty_reply_is_continued(monkeypatch):
    """A reply with no text (the model's first token a stop token) is stored as an empty assistant message, so
    its previous_response_id continues it (it was stored with content null, which the next turn refused)."""
    from support.scripted_backend import ScriptedBackend

    from app.api.routes import create_app
    from app.messages import Done, Stats

    backend = ScriptedBackend([Done("scripted", "", "stop", Stats(new_tokens=1))])

    async def ask():
        transport = httpx.ASGITransport(app=create_app(backend))
        async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", max_retries=0,
                                      http_client=httpx.AsyncClient(transport=transport)) as client:
            first = await client.responses.create(model="tiny", input="Say nothing.")
            second = await client.responses.create(model="tiny", input="Now?", previous_response_id=first.id)
            return first, second

    first, second = asyncio.run(ask())
    assert first.output_text == "" and second.status == "completed"
    conversation, _, _ = backend.asked[-1]
    assert [(m.role, m.content) for m in conversation.messages][-2:] == [("assistant", ""), ("user", "Now?")]


def test_a_json_schema_format_gives_a_document_of_the_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    response = client.responses.create(model="tiny", input="A person, as JSON.", temperature=1, max_output_tokens=200,
                                       text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
    document = json.loads(response.output_text)
    assert set(document) == {"name", "age"} and isinstance(document["age"], int)
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize("body, param", [
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "include": ["message.output_text.logprob"]}, "include[0]"),  # not one of OpenAI's values
    ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),  # in OpenAI's enum, not supported here
    ({"input": "x", "text": {"verbosity": "loud"}}, "text.verbosity"),
    ({"input": "x", "stream": True, "stream_options": {"include_obfuscation": "yes"}},
     "stream_options.include_obfuscation"),
    ({"input": "x", "stream_options": {"include_usage": True}}, "stream_options.include_usage"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"input": "x", "text": {"format": {"type": "json_object", "schema": {}}}}, "text.format.schema"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}],
      }, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"},
                                             {"type": "input_file", "filename": "a.txt", "file_data": "%%%"}]}]},
     "input[0].content[1].file_data"),
    ({"input": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}, "input"),
    ({"input": "x", "tools": 5}, "tools"),
    ({"input": "x", "previous_response_id": ""}, "previous_response_id"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{not json"},
                {"type": "function_call_output", "call_id": "c1", "output": "x"}],
      "tools": [{"type": "function", "name": "f"}]}, "input[0]"),  # (its message names input[0].arguments)
    ({"input": "x", "tools": True}, "tools"),
    ({"input": "x", "stream": True, "text": {"format": {"type": "json_schema", "name": "p",  # refused by the engine:
                                                       "schema": {"type": "nonsense"}}}}, "text.format"),  # streamed too
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": "\ud800"}, "input"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice"),
    ({"input": "x", "metadata": {"k" * 65: "v"}}, "metadata"),  # kept with the response: OpenAI's bounds
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
])
def test_bad_requests_name_the_responses_field(server, body, param):
    answer = httpx.post(f"{server.url}/v1/responses", content=json.dumps({"model": "tiny"} | body).encode(),
                        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param, error
    assert "messages[" not in error["message"] and "response_format" not in error["message"], error


def test_the_api_alone_answers_at_its_root_as_ollama_does(server):
    """Tools that speak Ollama's API probe its root (no key): the API alone answers as Ollama does."""
    for method in ("GET", "HEAD"):
        answer = httpx.request(method, f"{server.url}/", timeout=30)
        assert answer.status_code == 200 and answer.text == ("Ollama is running" if method == "GET" else "")


def test_the_key_is_needed(server):
    answer = httpx.post(f"{server.url}/v1/responses", json={"model": "tiny", "input": "x"}, timeout=30)
    assert answer.status_code == 401
    assert httpx.get(f"{server.url}/v1/responses/resp_x", timeout=30).status_code == 401


def test_a_file_in_the_input_is_read(client):
    text = "The lighthouse keeper's cat is called Marmalade."
    response = client.responses.create(model="tiny", temperature=0, max_output_tokens=4, input=[{"role": "user", "content": [
        {"type": "input_file", "filename": "notes.txt", "file_data": base64.b64encode(text.encode()).decode()},
        {"type": "input_text", "text": "What is the cat called?"}]}])
    plain = client.responses.create(model="tiny", temperature=0, max_output_tokens=4, input="What is the cat called?")
    assert response.usage.input_tokens > plain.usage.input_tokens + 10  # the file went into the prompt


# ---- function calls (a scripted backend, as tests/api/test_api.py's) ----------------------------

def test_function_calls_go_out_as_items_and_their_outputs_come_back():
    from support.scripted_backend import ScriptedBackend
    from test_api import CALL

    from app.api.routes import create_app
    from app.messages import Done, Stats

    backend = ScriptedBackend([Done("scripted", "", "stop", Stats(prompt_tokens=30, new_tokens=9), tool_calls=[CALL])])
    tools = [{"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}]

    async def ask():
        transport = httpx.ASGITransport(app=create_app(backend))
        async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="x",
                                      http_client=httpx.AsyncClient(transport=transport)) as client:
            whole = await client.responses.create(model="tiny", input="Weather in Paris?", tools=tools,
                                                  tool_choice="required")
            streamed = [e async for e in await client.responses.create(model="tiny", input="Weather in Paris?",
                                                                       tools=tools, stream=True)]
            result = await client.responses.create(model="tiny", previous_response_id=whole.id, tools=tools, input=[
                {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"}])
            return whole, streamed, result

    whole, streamed, _ = asyncio.run(ask())
    [call] = whole.output
    assert (call.type, call.call_id, call.name, json.loads(call.arguments)) == (
        "function_call", "call_1", "get_weather", {"city": "Paris"})
    assert whole.tool_choice == "required" and whole.tools[0].name == "get_weather"
    kinds = [e.type for e in streamed]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert streamed[4].arguments == CALL["function"]["arguments"]
    (first, _, _), _, (then, _, _) = backend.asked  # the call and its output went on as the chat route's messages
    assert [(m.role, m.tool_call_id) for m in then.messages] == [("user", None), ("assistant", None),
                                                                 ("tool", "call_1")]
    assert then.messages[1].tool_calls[0]["function"]["name"] == "get_weather"
