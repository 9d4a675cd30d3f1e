"""tool_choice "required" and a named function through the API (`python -m app.api` on a tiny random Llama 3.2
checkpoint, driven by the official `openai` client): sampled at temperature 1, a random model writes garbage,
so only the constraint (model/tool_choice.py) makes every reply a valid call; streamed, none of it comes as
content. "none" gives no calls, and what cannot be honoured is a 400 that names it."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from support.servers import ApiServer, server_env

from app.api.pieces import failure_error
from app.messages import Failed

pytestmark = pytest.mark.timeout(300)

KEY = "tool-choice-key"
QUESTION = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]
REPLIES = 50  # per case
# Every call of these is short whatever a random model picks: strings and numbers bounded, no other keys.
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone", "parameters": {
        "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14},
                                         "dst": {"type": "boolean"}},
        "required": ["zone", "dst"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "send_letter", "parameters": {
        "$defs": {"Address": {"type": "object", "properties": {
            "zip": {"type": "integer", "minimum": 0, "maximum": 99}, "country": {"enum": ["FR", "NO"]}},
            "required": ["zip", "country"], "additionalProperties": False}},
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}}, "required": ["to"],
        "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tool-choice")
    server = ApiServer(server_env(checkpoint=tiny, weights_dir=tiny.parent, dtype="fp32", threads=1, api_key=KEY,
                                  max_batch=16), log=folder / "api.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
    assert "Traceback" not in server.log_path.read_text(errors="replace")


def ask_all(server, bodies: list[dict], stream: bool) -> list[tuple[str | None, list[dict], str]]:
    """Each body's reply, asked 16 at a time: (content, calls as {"id", "name", "arguments"}, finish_reason).
    Streamed, the content is every content delta joined (None if there was none but the first, empty one)."""
    async def one(client, body, seats):
        async with seats:
            if not stream:
                choice = (await client.chat.completions.create(**body)).choices[0]
                calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                         for c in choice.message.tool_calls or []]
                return choice.message.content, calls, choice.finish_reason
            content, calls, finish = None, {}, None
            async for chunk in await client.chat.completions.create(**body, stream=True):
                for choice in chunk.choices:
                    if choice.delta.content:
                        content = (content or "") + choice.delta.content
                    for piece in choice.delta.tool_calls or []:
                        call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
                        call["id"] = piece.id or call["id"]
                        call["name"] += piece.function.name or ""
                        call["arguments"] += piece.function.arguments or ""
                    finish = choice.finish_reason or finish
            return content, [calls[k] for k in sorted(calls)], finish

    async def run():
        seats = asyncio.Semaphore(16)
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, body, seats) for body in bodies))

    return asyncio.run(run())


def body(i: int, tool_choice, parallel: bool) -> dict:
    return dict(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=parallel,
                temperature=1.0, top_p=1.0, seed=i, max_tokens=400,
                extra_body={"top_k": 0})  # the whole vocabulary sampled


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "send_letter"}}],
                         ids=["required", "named"])
def test_every_reply_is_a_valid_call_of_an_allowed_tool(server, tool_choice, stream):
    allowed = set(SCHEMAS) if tool_choice == "required" else {tool_choice["function"]["name"]}
    parallel = [i % 2 == 1 for i in range(REPLIES)]  # half of them one call only
    replies = ask_all(server, [body(i, tool_choice, parallel[i]) for i in range(REPLIES)], stream)
    counts = []
    for (content, calls, finish), several in zip(replies, parallel):
        assert content is None and finish == "tool_calls" and calls, (content, calls, finish)
        assert len(calls) == 1 or several
        for call in calls:
            assert call["name"] in allowed and call["id"].startswith("call_")
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        counts.append(len(calls))
    assert len({call["id"] for _, calls, _ in replies for call in calls}) == sum(counts)
    if tool_choice == "required":  # the model chose: more than one tool among the replies
        assert len({call["name"] for _, calls, _ in replies for call in calls}) > 1


def test_none_gives_no_calls(server):
    for content, calls, finish in ask_all(server, [body(i, "none", True) | {"max_tokens": 12} for i in range(10)],
                                          stream=False):
        assert calls == [] and finish in ("stop", "length") and isinstance(content, str)


def test_tools_that_cannot_be_called_are_400s_that_name_them(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    bad = [*TOOLS, {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=QUESTION, tools=bad, tool_choice="required")
    assert error.value.body["param"] == "tools[3].function.parameters"
    assert error.value.body["code"] == "invalid_function_parameters" and "type object" in error.value.body["message"]
    unknown = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "foo"}}}}}]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=QUESTION, tools=unknown, tool_choice="required")
    assert error.value.body["param"] == "tools" and "Invalid type: foo" in error.value.body["message"]
    # "auto" compiles nothing: the same tools are offered in the prompt
    reply = client.chat.completions.create(model="tiny", messages=QUESTION, tools=bad, tool_choice="auto", max_tokens=3)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_model_without_tool_calling_refuses_tools_by_name():
    failed = Failed("r", "tools: the model chatml has no tool calling (its chat template is given no tools; Llama 3 "
                         "checkpoints are), so it takes neither tools nor tool_choice: send the request without them",
                    "bad_request")
    error = failure_error(failed)
    assert (error.status, error.param) == (400, "tools") and "tool_choice" in error.message
    assert failure_error(Failed("r", "The request cannot be answered: messages", "bad_request")).param is None
