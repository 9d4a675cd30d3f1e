"""OpenAI's tool_choice "required" or a named function, kept: the JSON schema a reply must be a document of, so
that it is a call of an allowed tool whose arguments are valid against that tool's `parameters` schema. The
reply is masked to it as a response_format's JSON is (model/structured.py, llguidance):

    schema = call_schema(tools, "required", parallel_tool_calls=True)  # tool_choice as read_tool_choice gives it
    constraint = JsonConstraint(tokenizer, schema, param="tools", ...)

The reply is the JSON call that model/tool_parser.py reads in every tool prompt format, in the key order and
layout (", " and ": ", no other whitespace) of json.dumps, as model/tools.py writes calls into the history:

    {"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}

A named function allows that name only, "required" any of the tools. With parallel_tool_calls (OpenAI's
default) the reply may also be a JSON array of one or more such calls; without, it is exactly one object.
A tool without `parameters` takes any object as arguments; a tool's schema is embedded as it is, with
"type": "object" added where it gives no type and its `$ref`s to its own root ("#", "#/$defs/...") pointed
to where it now lives.

Why JSON for Llama 3.2 too, whose prompt (python_list) shows calls as `[f(a=1), g(b="x")]`: the arguments
must be valid against a JSON schema, which llguidance enforces keyword by keyword; a Lark grammar of Python
calls would need the schema rewritten into Python literals by hand (True and None, keyword arguments with the
required ones present, nested dicts), which no library does and which would cover less (llguidance's `%json`
values write true and null, which Python reads as names). The model chooses only what matters: the first
tokens, `{"type": "function", "name": "`, are the only ones allowed, so what it picks is a name among the
allowed ones and the arguments, and Meta's 3.2 prompt lists the functions and their parameters in JSON. The
call then goes into the history in the checkpoint's own format (model/tools.py encode_tool_call), so later
turns read as Meta's format; vLLM's "required" takes the same route for every model.
"""

from __future__ import annotations

from .structured import SchemaError, inner, schema_text

ANY_ARGUMENTS = {"type": "object"}
# llguidance's options for the calls' JSON: json.dumps's layout, no other whitespace (not structured.WHITESPACE)
JSON_DUMPS = {"whitespace_flexible": False, "whitespace_pattern": None, "item_separator": ", ", "key_separator": ": "}


def call_schema(tools: list[dict], choice: str, parallel_tool_calls: bool = True) -> dict:
    """The JSON schema of the replies that call `choice` ("required": any of the tools), from OpenAI tool
    definitions ([{"type": "function", "function": {"name", "parameters"}}], as model.tools.read_tools takes
    them). SchemaError (a ValueError) names the tool whose parameters cannot be a call's arguments."""
    defs, calls = {}, []
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if choice in ("required", name):
            key = f"tool_{i}"
            defs[key] = arguments_schema(tool["function"].get("parameters"), f"tools[{i}].function.parameters",
                                         f"#/$defs/{key}")
            calls.append({"type": "object", "required": ["type", "name", "parameters"], "additionalProperties": False,
                          "properties": {"type": {"const": "function"}, "name": {"const": name},
                                         "parameters": {"$ref": f"#/$defs/{key}"}}})
    if not calls:
        raise ValueError(f"tool_choice: function {choice!r} is not among the tools")
    defs["call"] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    one = {"$ref": "#/$defs/call"}
    return {"x-guidance": JSON_DUMPS, "$defs": defs, **(
        {"anyOf": [one, {"type": "array", "items": one, "minItems": 1}]} if parallel_tool_calls else one)}


def arguments_schema(parameters: dict | None, param: str, place: str) -> dict:
    """A tool's `parameters` as the schema of its arguments, to live at `place` (a JSON pointer) in the calls'
    schema; checked against model/structured.py's limits first, so that an error names the tool."""
    if parameters is None:
        return ANY_ARGUMENTS
    schema_text(parameters, param)
    kind = parameters.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise SchemaError(f"{param}: expected a JSON schema of type object (a call's arguments), found type {kind!r}")
    return moved({"type": "object", **parameters}, place)


def moved(value, place: str, kind: str = "schema"):
    """A copy of a schema whose `$ref`s to its own root ("#...") point below `place` instead; data (enum,
    const, default, examples) is left as it is."""
    if isinstance(value, list):
        return [moved(item, place, kind) for item in value]
    if not isinstance(value, dict) or kind == "data":
        return value
    return {key: place + item[1:] if kind == "schema" and key == "$ref" and isinstance(item, str)
            and item.startswith("#") else moved(item, place, inner(kind, key)) for key, item in value.items()}
