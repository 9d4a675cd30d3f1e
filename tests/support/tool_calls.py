"""Tool calls asked through the OpenAI API with tool_choice "required" or a named function, and their check:
what tests/api/test_api_tool_choice.py asserts and bench/tool_choice.py counts, on any Llama 3 checkpoint."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai

QUESTION = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]
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


def ask_all(url: str, key: str, bodies: list[dict], stream: bool,
            timeout: float = 120) -> list[tuple[str | None, list[dict], str]]:
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
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=timeout) as client:
            return await asyncio.gather(*(one(client, body, seats) for body in bodies))

    return asyncio.run(run())


def body(i: int, tool_choice, parallel: bool, model: str = "tiny") -> dict:
    return dict(model=model, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=parallel,
                temperature=1.0, top_p=1.0, seed=i, max_tokens=1000,  # room for a long chain of parallel calls
                extra_body={"top_k": 0})  # the whole vocabulary sampled


def problems(replies: list[tuple[str | None, list[dict], str]], tool_choice, parallel: list[bool]) -> list[str]:
    """What is wrong with each reply that is not a valid call (or calls, where parallel) of an allowed tool."""
    allowed = set(SCHEMAS) if tool_choice == "required" else {tool_choice["function"]["name"]}
    found = []
    for i, ((content, calls, finish), several) in enumerate(zip(replies, parallel)):
        if content is not None or finish != "tool_calls" or not calls:
            found.append(f"reply {i}: content {content!r}, calls {calls}, finish {finish!r}")
        elif len(calls) > 1 and not several:
            found.append(f"reply {i}: {len(calls)} calls where parallel_tool_calls is false")
        for call in calls:
            try:
                assert call["name"] in allowed, f"{call['name']!r} is not allowed"
                assert (call["id"] or "").startswith("call_"), f"id {call['id']!r}"
                jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
            except (AssertionError, ValueError, jsonschema.ValidationError) as e:
                found.append(f"reply {i}: {call}: {str(e).splitlines()[0]}")
    return found
