"""Requests that cannot break the server: both API routes against a real engine process on a tiny random
checkpoint, with every field given hostile values (integers past 64 bits, lone surrogates, NaN and
Infinity, deep nesting, 200 kB strings, 5,000-item arrays, wrong types), alone and with n: 4.

Each is answered, or refused with a 4xx in OpenAI's shape; none is a 5xx; the engine process is the
same one throughout (no restart), every place in the queue is free afterwards, and an ordinary
request is answered at the end. The API runs in this process (`app.api.create_app` over an
`EngineClient`), so the test reads the client's places and the engine's pid directly.
"""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.checkpoints import write_tiny_checkpoint

from app.api import create_app
from app.bounds import json_problem, reply_seed
from app.client import EngineClient, InvalidRequest
from app.conversation import Conversation
from app.messages import EngineConfig, ReplySettings

pytestmark = pytest.mark.timeout(600)

MAX_BODY_MB = 1
HOSTILE_TEXT = "@@hostile@@"  # where the hostile value's JSON text goes in a request's JSON text


class Raw(str):
    """JSON text to put in a request as it is (what json.dumps cannot write: 1e400, 100,000-deep nesting)."""


HOSTILE = {
    "past 64 bits": 2**64, "past 64 bits, negative": -(2**63) - 1, "past 100 bits": 2**100,
    "lone surrogate": "\ud800", "lone low surrogate in text": "a\udfffb", "NaN": float("nan"),
    "Infinity": float("inf"), "-Infinity": float("-inf"), "1e400": Raw("1e400"),
    "100k deep": Raw("[" * 100_000 + "]" * 100_000), "65 deep": Raw("[" * 65 + "]" * 65),
    "200 kB string": "x" * 200_000, "5000 items": list(range(5000)), "5000 strings": ["a"] * 5000,
    "true": True, "false": False, "null": None, "zero": 0, "negative": -1, "fraction": 1.5, "big float": 1e300,
    "text": "text", "empty text": "", "object": {"a": 1}, "empty object": {}, "list": [1, "a"], "empty list": [],
    "hostile object": {"\ud800": 1}, "deep object": json.loads('{"a":' * 40 + "1" + "}" * 40),
    # in range, at its edges: these are answered
    "int32 max": 2**31 - 1, "int64 max": 2**63 - 1, "int64 min": -(2**63), "tiny float": 1e-300,
    "NUL text": "\x00\x00", "control tokens": "<|eot_id|><|start_header_id|>assistant", "emoji": "\U0001F600" * 50,
}
CHAT_FIELDS = [
    "model", "messages", "messages[0]", "messages[0].role", "messages[0].content", "messages[0].content[0].text",
    "messages[0].name", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "frequency_penalty", "presence_penalty", "seed", "stop", "stop[0]", "n", "stream",
    "stream_options", "stream_options.include_usage", "ignore_eos", "logprobs", "top_logprobs", "tools",
    "tools[0].function", "tools[0].function.name", "tools[0].function.description", "tools[0].function.parameters",
    "tools[0].function.parameters.properties.city", "tool_choice", "parallel_tool_calls", "response_format",
    "response_format.json_schema.schema", "response_format.json_schema.schema.properties", "user", "metadata",
    "store", "history[1].tool_calls", "history[1].tool_calls[0].id", "history[1].tool_calls[0].function.name",
    "history[1].tool_calls[0].function.arguments", "history[1].tool_calls[0].function.arguments.code",
    "history[2].tool_call_id", "history[2].content", "logit_bias", "audio", "unknown_field",
]
TEXT = st.text(st.characters() | st.integers(0xD800, 0xDFFF).map(chr), max_size=12)  # lone surrogates too
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4), max_leaves=12)
VALUES = st.sampled_from(sorted(HOSTILE)).map(HOSTILE.get) | JSON  # the named worst cases, and any JSON at all
COMPLETION_FIELDS = [
    "model", "prompt", "prompt[0]", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "frequency_penalty", "presence_penalty", "seed", "stop", "stop[0]", "n", "stream", "stream_options", "ignore_eos",
    "logprobs", "echo", "suffix", "best_of", "user", "unknown_field",
]


def chat_body(field: str) -> dict:
    """An ordinary chat request, shaped so that `field` exists in it."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    if field.startswith("messages[0].content[0]"):
        body["messages"][0]["content"] = [{"type": "text", "text": "Hi"}]
    if field.startswith("stop"):
        body["stop"] = ["never there"]
    if field.startswith("stream_options"):
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    if field == "top_logprobs":
        body["logprobs"] = True
    if field.startswith(("tools", "tool_choice")):
        body["tools"] = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    if field.startswith("response_format"):
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "integer"}}}}}
    if field.startswith("history"):
        call = {"id": "call_1", "type": "function", "function": {"name": "code_interpreter",
                                                                 "arguments": json.dumps({"code": "print(1)"})}}
        body["messages"] = [{"role": "user", "content": "Run it"}, {"role": "assistant", "content": None,
                                                                     "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": "call_1", "content": "1"}]
    return body


def completion_body(field: str) -> dict:
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}
    if field == "prompt[0]":
        body["prompt"] = ["Once upon a time"]
    if field.startswith("stop"):
        body["stop"] = ["never there"]
    return body


def with_value(body: dict, field: str, value) -> str:
    """The body's JSON text with `field` set to `value` (in a tool call's arguments, which are JSON text
    themselves, the value is set inside them)."""
    path = field.replace("history", "messages").replace("[", ".").replace("]", "").split(".")
    if "arguments" in path and path[-1] != "arguments":  # e.g. code_interpreter's code
        call = body
        for key in path[:path.index("arguments")]:
            call = call[int(key) if key.isdigit() else key]
        call["arguments"] = "{" + json.dumps("code") + ": " + to_json(value) + "}"
        return json.dumps(body)
    parent = body
    for key in path[:-1]:
        parent = parent[int(key) if key.isdigit() else key]
    last = path[-1]
    parent[int(last) if last.isdigit() else last] = HOSTILE_TEXT
    return json.dumps(body).replace(json.dumps(HOSTILE_TEXT), to_json(value), 1)


def to_json(value) -> str:
    return value if isinstance(value, Raw) else json.dumps(value)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("weights") / "tiny")


@pytest.fixture(scope="module")
def api(tiny):
    """The API over an engine that serves replies of at most ~100 tokens (a small context), fast."""
    from fastapi.testclient import TestClient

    backend = EngineClient(EngineConfig(checkpoint=str(tiny), dtype="fp32", threads=1, max_context=128))
    with TestClient(create_app(backend, max_body_mb=MAX_BODY_MB), raise_server_exceptions=False) as http:
        http.backend = backend
        http.engine_pid = backend.pid
        yield http


def post(api, route: str, text: str):
    return api.post(route, content=text.encode("utf-8", "surrogatepass"),
                    headers={"Content-Type": "application/json"})


def assert_well_answered(response, text: str) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500], text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]"), response.text[-300:]
        assert '"error"' not in response.text, response.text[-500:]


def wait_for_free_places(backend, timeout: float = 10.0) -> int:
    """Places still taken once the requests ended (a refused reply's cancel comes back within a step)."""
    deadline = time.monotonic() + timeout
    while backend.places_taken and time.monotonic() < deadline:
        time.sleep(0.05)
    return backend.places_taken


def assert_engine_untouched(api) -> None:
    assert wait_for_free_places(api.backend) == 0
    assert api.backend.pid == api.engine_pid and api.backend.restarts == 0
    ordinary = api.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert ordinary.status_code == 200 and ordinary.json()["usage"]["completion_tokens"] >= 1


# ---- the fuzz test ------------------------------------------------------------------------------

@settings(max_examples=5000, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(["chat", "completion"]), data=st.data(), value=VALUES, n=st.sampled_from([None, 4]))
def test_hostile_values_in_any_field_are_answered_without_a_5xx_or_a_restart(api, route, data, value, n):
    field = data.draw(st.sampled_from(CHAT_FIELDS if route == "chat" else COMPLETION_FIELDS), label="field")
    body = chat_body(field) if route == "chat" else completion_body(field)
    if n is not None and field != "n":
        body["n"] = n
    text = with_value(body, field, value)
    response = post(api, "/v1/chat/completions" if route == "chat" else "/v1/completions", text)
    assert_well_answered(response, text)


def test_after_the_fuzz_the_engine_is_the_same_and_every_place_is_free(api):
    assert_engine_untouched(api)


# ---- what was seen to break the server ----------------------------------------------------------

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def refused(api, body: dict | str, route: str = "/v1/chat/completions", status: int = 400) -> dict:
    text = body if isinstance(body, str) else json.dumps(body)
    response = post(api, route, text)
    assert response.status_code == status, (response.status_code, response.text[:300])
    return response.json()["error"]


def test_a_seed_past_64_bits_is_refused_and_the_largest_seed_serves_n_replies(api):
    error = refused(api, CHAT | {"seed": 18446744073709551615, "n": 2})
    assert error["param"] == "seed" and "between" in error["message"]
    largest = api.post("/v1/chat/completions", json=CHAT | {"seed": 2**63 - 1, "n": 4, "temperature": 1})
    assert largest.status_code == 200 and len(largest.json()["choices"]) == 4
    assert_engine_untouched(api)


def test_replies_of_one_request_take_seed_seed_plus_1_wrapped_into_range():
    assert [reply_seed(5, i) for i in range(3)] == [5, 6, 7]
    assert reply_seed(2**63 - 1, 1) == -(2**63)  # torch takes it as 2**63: the seed after 2**63 - 1
    assert reply_seed(-1, 1) == 0


def test_ten_requests_with_a_lone_surrogate_stop_give_every_place_back(api):
    for _ in range(10):
        error = refused(api, json.dumps(CHAT | {"n": 4, "stop": ["\ud800"]}))
        assert error["param"] == "stop[0]" and "surrogate" in error["message"]
    assert api.backend.places_taken == 0
    assert_engine_untouched(api)


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "Run"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "code_interpreter", "arguments": '{"code": 5}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "5"}]}, "messages[1].tool_calls"),
    ({"messages": [{"role": "user", "content": "Run"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": ' + "[" * 500 + "]" * 500 + "}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "5"}]}, "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "Run"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "\ud800", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "5"}]}, "messages[1].tool_calls[0].id"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": float("nan")}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_k": 2**70}, "top_k"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["x" * 300]}, "stop[0]"),
    ({"messages": [{"role": "user", "content": "x"}] * 2049}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "description": "x" * 100_001}}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "metadata": {"k": 1}}, "metadata"),
])
def test_what_crashed_the_engine_is_a_400_naming_the_field(api, body, param):
    error = refused(api, json.dumps(CHAT | body))
    assert error["param"] == param, error


def test_bodies_too_large_too_deep_or_not_json_are_refused_cleanly(api):
    assert refused(api, json.dumps(CHAT | {"padding": "x" * (MAX_BODY_MB * 2**20)}), status=413)["code"] == \
        "request_too_large"
    assert "nests" in refused(api, "[" * 100_000 + "]" * 100_000)["message"]
    assert "not valid JSON" in refused(api, '{"messages": [}')["message"]
    assert refused(api, '{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}')["param"] == \
        "temperature"
    assert refused(api, '{"messages": [{"role": "user", "content": "x"}], "seed": 1e400}')["param"] == "seed"
    assert refused(api, '{"prompt": "x", "max_tokens": 123456789012345678901234567890}', "/v1/completions")[
        "param"] == "max_tokens"
    assert_engine_untouched(api)


# ---- the engine client's own check ---------------------------------------------------------------

def test_a_request_the_engine_cannot_take_is_refused_before_it_takes_a_place(api):
    """Whatever the caller (the chat, a test, a future route): the client checks the Generate itself."""
    backend = api.backend
    conversation = Conversation()
    conversation.add("user", "Hi")

    async def ask(settings: ReplySettings, n: int = 1):
        return backend.stream(conversation, settings, n=n)

    import asyncio
    for settings, n, where in [(ReplySettings(stop=("\ud800",)), 1, "$.settings.stop[0]"),
                               (ReplySettings(top_k=-1), 1, "$.settings.top_k"),
                               (ReplySettings(seed=2**64), 1, "$.settings.seed"),
                               (ReplySettings(max_new_tokens=2**80), 1, "$.settings.max_new_tokens"),
                               (ReplySettings(), 5, "$.n")]:
        with pytest.raises(InvalidRequest, match=where.replace("$", r"\$").replace("[", r"\[")):
            asyncio.run(ask(settings, n))
        assert backend.places_taken == 0


def test_json_problem_names_the_place():
    assert json_problem({"a": [1, {"b": "\udfff"}]}) == ("a[1].b", json_problem("\udfff")[1])
    assert json_problem({"a": float("nan")})[0] == "a"
    assert json_problem([[[1]]], max_depth=2) == ("[0][0]", "nests deeper than 2 levels")
    assert json_problem({"k": -(2**63), "m": 2**64 - 1}) is None
    assert json_problem({"k": 2**64})[0] == "k"
