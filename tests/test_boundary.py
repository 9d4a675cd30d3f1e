"""Requests that cannot break the server: both API routes against a real engine process on a tiny random
checkpoint, with every field given hostile values (integers past 64 bits, lone surrogates, NaN and
Infinity, deep nesting, 200 kB strings, 5,000-item arrays, wrong types), alone and with n: 4.

Each is answered, or refused with a 4xx in OpenAI's shape; none is a 5xx; the engine process is the
same one throughout (no restart), every place in the queue is free afterwards, and an ordinary
request is answered at the end. The API runs in this process (`app.api.routes.create_app` over an
`EngineClient`), so the test reads the client's places and the engine's pid directly.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.hostile import EDGES, HOSTILE, HOSTILE_SCHEMAS, ROUTES, body_for, schema_body, schema_corpus, with_value

from app.api.routes import create_app
from app.bounds import json_problem, reply_seed
from app.backend.engine_client import EngineClient, InvalidRequest
from app.backend.conversation import Conversation
from app.messages import EngineConfig, ReplySettings

pytestmark = pytest.mark.timeout(600)

MAX_BODY_MB = 1
TEXT = st.text(st.characters() | st.integers(0xD800, 0xDFFF).map(chr), max_size=12)  # lone surrogates too
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4), max_leaves=12)
VALUES = st.sampled_from(sorted(HOSTILE | EDGES)).map((HOSTILE | EDGES).get) | JSON  # the worst cases, and any JSON


@pytest.fixture(scope="module")
def api(tiny):
    """The API over an engine that serves replies of at most ~100 tokens (a small context), fast."""
    from fastapi.testclient import TestClient

    backend = EngineClient(EngineConfig(checkpoint=str(tiny), dtype="fp32", threads=1, max_context=128))
    # `with`: our own FastAPI app (app/api/routes.py, not Chainlit's, whose shutdown ends the process): its
    # lifespan starts the engine process and stops it after the module
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
        assert [error["code"] for error in stream_errors(response.text)] in ([], ["json_schema_failed"]), \
            response.text[-500:]  # the one error a stream may end with: its schema could not be followed


def stream_errors(text: str) -> list[dict]:
    return [json.loads(line.removeprefix("data: "))["error"] for line in text.splitlines()
            if line.startswith('data: {"error"')]


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

@settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(sorted(ROUTES)), data=st.data(), value=VALUES, n=st.sampled_from([None, 4]))
def test_hostile_values_in_any_field_are_answered_without_a_5xx_or_a_restart(api, route, data, value, n):
    """2,000 requests through one server (15 s alone, 31 s beside the suite's two other workers, on a Zen 4): a field of one of the two routes with a hostile
    value, 18 to 40 of them per field, which is what finds a field that takes the server down."""
    field = data.draw(st.sampled_from(ROUTES[route]), label="field")
    body = body_for(route, field, "tiny")
    if n is not None and field != "n":
        body["n"] = n
    text = with_value(body, field, value)
    assert_well_answered(post(api, route, text), text)
    assert api.backend.restarts == 0


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
        {"id": "c", "type": "function", "function": {"name": "f",
                                                    "arguments": '{"a": ' + "[" * 500 + "]" * 500 + "}"}}]},
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


# ---- JSON schemas that compile and then failed in the reply ------------------------------------

@pytest.mark.parametrize("route, field, name, n, text", schema_corpus("tiny"), ids=lambda v: v if isinstance(v, str) and
                         len(v) < 40 else str(v) if isinstance(v, int) else "")
def test_hostile_schemas_are_answered_or_refused_without_a_5xx(api, route, field, name, n, text):
    assert_well_answered(post(api, route, text), text)
    assert api.backend.restarts == 0


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name, message", [
    ("$ref to itself", "response_format: the JSON schema is not supported (at the document's start: NoExtensionBias)"),
    ("499 optional properties", "response_format: the JSON schema's 'properties' has 499 properties; at most 256 "
                                "are taken"),
])
def test_a_schema_that_failed_at_its_first_token_is_a_400_before_the_reply(api, name, message, stream):
    error = refused(api, schema_body("tiny", HOSTILE_SCHEMAS[name], stream=stream))
    assert error == {"message": message, "type": "invalid_request_error", "param": "response_format",
                     "code": "invalid_json_schema"}


def test_a_schema_that_fails_midway_is_a_400_or_a_streams_last_event_then_refused_at_once(api):
    """Before any text, or not streamed, a 400; after some text, a stream ends with the error. A schema whose
    reply failed is refused before the next reply starts (the schemas are new here: a title of their own)."""
    nested = HOSTILE_SCHEMAS["slow pattern, nested"] | {"title": "nested, not seen before"}
    error = refused(api, schema_body("tiny", nested))
    assert (error["param"], error["code"]) == ("response_format", "json_schema_failed")
    assert re.fullmatch(r"response_format: the JSON schema could not be followed after \d+ tokens of the reply "
                        r"\(lexer error: too many expressions constructed\): simplify it .*", error["message"])
    assert refused(api, schema_body("tiny", nested, stream=True)) == {
        "message": "response_format: the JSON schema is not supported (an earlier reply of it failed: lexer error: "
                   "too many expressions constructed)", "type": "invalid_request_error", "param": "response_format",
        "code": "invalid_json_schema"}
    named = HOSTILE_SCHEMAS["slow pattern, after a name"] | {"title": "named, not seen before"}
    streamed = post(api, "/v1/chat/completions", json.dumps(schema_body("tiny", named, n=2, stream=True)))
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    assert '"delta":{"content":"{' in streamed.text, streamed.text[:500]  # the document's start came first
    [error] = stream_errors(streamed.text)
    assert (error["param"], error["code"]) == ("response_format", "json_schema_failed") and "lexer" in error["message"]
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
