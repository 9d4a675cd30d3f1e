"""A corpus of hostile requests for both API routes: an ordinary request with one field replaced by a
value no client should send (integers past 64 bits, lone surrogates, NaN and Infinity, deep nesting,
200 kB strings, 5,000-item arrays, wrong types) or by one at the edge of its range; a file part's fields too. Shared by
tests/test_boundary.py and bench/hostile.py.

    text = with_value(chat_body("stop[0]"), "stop[0]", HOSTILE["lone surrogate"])   # the body's JSON text
"""

from __future__ import annotations

import copy
import json

PLACEHOLDER = "@@hostile@@"  # where the value's JSON text goes in the request's JSON text
FILE_PART = {"type": "file", "file": {"filename": "notes.md",
                                      "file_data": "data:text/markdown;base64,VGhlIGhhcmJvciBvcGVucyBhdCBkYXduLg=="}}


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
}
EDGES = {  # in range, at its edges: answered
    "int32 max": 2**31 - 1, "int64 max": 2**63 - 1, "int64 min": -(2**63), "tiny float": 1e-300,
    "NUL text": "\x00\x00", "control tokens": "<|eot_id|><|start_header_id|>assistant", "emoji": "\U0001F600" * 50,
}

def _nested(levels: int, make) -> dict:
    schema = {"type": "integer"}
    for _ in range(levels):
        schema = make(schema)
    return schema


SCHEMA_FIELD = "response_format.json_schema.schema"
SLOW_PATTERN = "^(x{1000}){1000}$"  # 15 characters, a million lexer states
HOSTILE_SCHEMAS = {  # JSON schemas llguidance compiles and then fails on, or that come near its limits
    "$ref to itself": {"$ref": "#"},
    "$refs in a circle": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    "allOf of itself": {"allOf": [{"$ref": "#"}]},
    "recursive, required": {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                                            "required": ["c"]}}, "$ref": "#/$defs/n"},  # no document ends
    "499 optional properties": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(499)}},
    "2 x 250 optional properties": {"anyOf": [{"type": "object", "properties": {
        f"p{j}{i}": {"type": "integer"} for i in range(250)}} for j in range(2)]},
    "2,500 objects in an enum": {"enum": [{"k": i} for i in range(2500)]},
    "5,000 enum values": {"enum": [f"v{i}" for i in range(5000)]},
    "59 nested arrays": _nested(59, lambda inner: {"type": "array", "items": inner}),  # 64 with the body's
    "29 nested anyOf": _nested(29, lambda inner: {"anyOf": [inner, {"type": "null"}]}),  # 63 with the body's
    "5,000-character pattern": {"type": "string", "pattern": "a" * 5000},
    "slow pattern": {"type": "string", "pattern": SLOW_PATTERN},
    "slow pattern, nested": {"type": "object", "properties": {"code": {"type": "string", "pattern": SLOW_PATTERN}},
                             "required": ["code"], "additionalProperties": False},  # fails in the reply
    "slow pattern, after a name": {"type": "object", "properties": {  # fails after the reply wrote a name
        "name": {"type": "string", "maxLength": 8}, "code": {"type": "string", "pattern": SLOW_PATTERN}},
        "required": ["name", "code"], "additionalProperties": False},
    "huge minLength": {"type": "string", "minLength": 10**9},
    "float range": {"type": "number", "exclusiveMinimum": -5.5, "maximum": 1e300},
}
CHAT_FIELDS = [
    "model", "messages", "messages[0]", "messages[0].role", "messages[0].content", "messages[0].content[0].text",
    "messages[0].name", "messages[0].content[1]", "messages[0].content[1].type", "messages[0].content[1].file",
    "messages[0].content[1].file.filename", "messages[0].content[1].file.file_data",
    "messages[0].content[1].file.file_id", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "frequency_penalty", "presence_penalty", "seed", "stop", "stop[0]", "n", "stream",
    "stream_options", "stream_options.include_usage", "ignore_eos", "logprobs", "top_logprobs", "tools",
    "tools[0].function", "tools[0].function.name", "tools[0].function.description", "tools[0].function.parameters",
    "tools[0].function.parameters.properties.city", "tool_choice", "parallel_tool_calls", "response_format",
    "response_format.json_schema.schema", "response_format.json_schema.schema.properties", "user", "metadata",
    "store", "history[1].tool_calls", "history[1].tool_calls[0].id", "history[1].tool_calls[0].function.name",
    "history[1].tool_calls[0].function.arguments", "history[1].tool_calls[0].function.arguments.code",
    "history[2].tool_call_id", "history[2].content", "logit_bias", "audio", "unknown_field",
]
COMPLETION_FIELDS = [
    "model", "prompt", "prompt[0]", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "frequency_penalty", "presence_penalty", "seed", "stop", "stop[0]", "n", "stream", "stream_options", "ignore_eos",
    "logprobs", "echo", "suffix", "best_of", "user", "unknown_field",
]
ROUTES = {"/v1/chat/completions": CHAT_FIELDS, "/v1/completions": COMPLETION_FIELDS}


def body_for(route: str, field: str, model: str, max_tokens: int = 3) -> dict:
    """An ordinary request to the route, shaped so that `field` exists in it."""
    if route == "/v1/completions":
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0}
        if field == "prompt[0]":
            body["prompt"] = ["Once upon a time"]
    else:
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens,
                "temperature": 0}
    if field.startswith("messages[0].content[0]"):
        body["messages"][0]["content"] = [{"type": "text", "text": "Hi"}]
    if field.startswith("messages[0].content[1]"):  # a file sent with the message (OpenAI's file part)
        body["messages"][0]["content"] = [{"type": "text", "text": "When does the harbor open?"}, copy.deepcopy(FILE_PART)]
    if field.startswith("stop"):
        body["stop"] = ["never there"]
    if field.startswith("stream_options"):
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    if field == "top_logprobs":
        body["logprobs"] = True
    if field.startswith(("tools", "tool_choice")):
        body["tools"] = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                                           "parameters": {"type": "object", "required": ["city"],
                                                                          "properties": {"city": {"type": "string"}}}}}]
    if field.startswith("response_format"):
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "integer"}}}}}
    if field.startswith("history"):
        call = {"id": "call_1", "type": "function", "function": {"name": "code_interpreter",
                                                                 "arguments": json.dumps({"code": "print(1)"})}}
        body["messages"] = [{"role": "user", "content": "Run it"},
                            {"role": "assistant", "content": None, "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": "call_1", "content": "1"}]
    return body


def with_value(body: dict, field: str, value) -> str:
    """The body's JSON text with `field` set to `value` (inside a tool call's arguments, which are JSON
    text themselves, for a field under them)."""
    path = field.replace("history", "messages").replace("[", ".").replace("]", "").split(".")
    if "arguments" in path and path[-1] != "arguments":  # e.g. code_interpreter's code
        call = body
        for key in path[:path.index("arguments")]:
            call = call[int(key) if key.isdigit() else key]
        call["arguments"] = "{" + json.dumps(path[-1]) + ": " + to_json(value) + "}"
        return json.dumps(body)
    parent = body
    for key in path[:-1]:
        parent = parent[int(key) if key.isdigit() else key]
    parent[int(path[-1]) if path[-1].isdigit() else path[-1]] = PLACEHOLDER
    return json.dumps(body).replace(json.dumps(PLACEHOLDER), to_json(value), 1)


def to_json(value) -> str:
    return value if isinstance(value, Raw) else json.dumps(value)


def corpus(model: str, values: dict = HOSTILE, max_tokens: int = 3) -> list[tuple[str, str, str, int, str]]:
    """(route, field, value's name, n, JSON text) for every field of both routes and every value, alone
    (n: 1) and with n: 4; then each of HOSTILE_SCHEMAS as a chat's JSON schema, streamed or not, with room
    for the reply to reach where a schema fails."""
    requests = schema_corpus(model)
    for route, fields in ROUTES.items():
        for field in fields:
            for name, value in values.items():
                for n in (1, 4):
                    body = body_for(route, field, model, max_tokens)
                    if n > 1 and field != "n":
                        body["n"] = n
                    requests.append((route, field, name, n, with_value(body, field, value)))
    return requests


def schema_body(model: str, schema: dict, n: int = 1, stream: bool = False, max_tokens: int = 60) -> dict:
    body = body_for("/v1/chat/completions", SCHEMA_FIELD, model, max_tokens)
    body["response_format"]["json_schema"]["schema"] = schema
    return body | ({"n": n} if n > 1 else {}) | ({"stream": True} if stream else {})


def schema_corpus(model: str) -> list[tuple[str, str, str, int, str]]:
    return [("/v1/chat/completions", SCHEMA_FIELD + (" (streamed)" if stream else ""), name, n,
             json.dumps(schema_body(model, schema, n, stream)))
            for name, schema in HOSTILE_SCHEMAS.items() for n in (1, 4) for stream in (False, True)]
