"""A Llama 3 reply -> its text and its tool calls, as llama_models 0.3.0 reads them
(ChatFormat.decode_assistant_message_from_content with ToolUtils.maybe_extract_custom_tool_call and
maybe_extract_builtin_tool_call), in the same order of tries:

1. `<function=name>{...}</function>` anywhere in the reply;
2. the whole reply one JSON object `{"type": "function", "name": ..., "parameters": {...}}`, or a JSON array of
   them (not llama_models': the reply that tool_choice with parallel calls may be, model/tool_choice.py);
3. the whole reply a Python list of calls with keyword arguments `[f(a=1), g(b="x")]`;
4. `name.call(query="...")` anywhere (Meta's built-in tools);
5. a reply that starts with <|python_tag|> and is none of these: code for code_interpreter.

A reply with a call has content "". Where llama_models raises on a malformed reply (a JSON object with a
name but no "parameters" object, a list whose arguments are not literals or not JSON values, a built-in
tool called with no arguments), here the reply is plain text or the call keeps its arguments.
Two more departures: every call of a Python list is returned (llama_models keeps the first, marked FIXME,
though Meta's 3.2 prompt asks for several), and `<function=...>` arguments are read as JSON before
llama_models' fallback of turning every ' into ".
"""

from __future__ import annotations

import ast
import json
import re
import uuid
import warnings
from collections.abc import Collection

from .tools import BUILTIN_TOOLS, ToolCall

PYTHON_TAG = "<|python_tag|>"
ASSISTANT_HEADER = "<|start_header_id|>assistant<|end_header_id|>\n\n"
END_TOKENS = ("<|eot_id|>", "<|eom_id|>")
FUNCTION_TAG = re.compile(r"<function=(?P<name>[^}]+)>(?P<arguments>{.*?})")  # llama_models' pattern
BUILTIN_CALL = re.compile(r'\b(?P<name>\w+)\.call\(query="(?P<query>[^"]*)"\)')
CALL_OPENINGS = (PYTHON_TAG, "<function=", "{", "[")  # how a reply that is a call begins
FORCED_CALL, PARAMETERS = '{"type": "function", "name": "', '", "parameters": '  # model/tool_choice.py's layout


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """A reply's text, control tokens spelled out (tokenizer.decode of its ids) -> (content, tool calls)."""
    content = text.strip(" ")
    content = content.removeprefix(ASSISTANT_HEADER)
    python_tag = content.startswith(PYTHON_TAG)
    content = content.removeprefix(PYTHON_TAG)
    for end in END_TOKENS:
        if content.endswith(end):
            content = content.removesuffix(end)
            break
    calls = custom_calls(content)
    if calls:  # a built-in tool called in the custom format takes its first argument as the query
        calls = [(name, {"query": next(iter(args.values()))} if name in BUILTIN_TOOLS and args else args)
                 for name, args in calls]
    elif match := BUILTIN_CALL.search(content):
        calls = [(match["name"], {"query": match["query"]})]
    elif python_tag:
        calls = [("code_interpreter", {"code": content})]
    if not calls:
        return content, []
    return "", [ToolCall(f"call_{uuid.uuid4().hex}", name, arguments) for name, arguments in calls]


def custom_calls(text: str) -> list[tuple[str, dict]]:
    """(name, arguments) of a function tag, a JSON call or a Python list of calls; [] for none."""
    if match := FUNCTION_TAG.search(text):
        for arguments in (match["arguments"], match["arguments"].replace("'", '"')):
            try:
                return [(match["name"], json.loads(arguments))]
            except json.JSONDecodeError:
                pass
        return []
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        value = None
    if isinstance(value, dict):
        call = json_call(value)
        return [call] if call else []
    if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        calls = [json_call(item) for item in value]
        return calls if all(calls) else []
    return python_list_calls(text)


def json_call(value: dict) -> tuple[str, dict] | None:
    """`{"type": "function", "name": ..., "parameters": {...}}` -> (name, arguments); None if it is not one."""
    if not (value.get("type") == "function" or "name" in value):
        return None
    name, arguments = value.get("name"), value.get("parameters")
    return (name, arguments) if isinstance(name, str) and isinstance(arguments, dict) else None


def python_list_calls(text: str) -> list[tuple[str, dict]]:
    """`[f(a=1), g(b="x")]` -> [("f", {"a": 1}), ("g", {"b": "x"})]; [] unless the whole text is such a list
    of calls by name with literal keyword arguments only."""
    try:
        with warnings.catch_warnings():  # e.g. "invalid escape sequence" in a string: the reply's business
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: a NUL character
        return []
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Expr) or not isinstance(tree.body[0].value, ast.List):
        return []
    calls = []
    for node in tree.body[0].value.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return []
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None:  # **kwargs
                return []
            try:
                arguments[keyword.arg] = ast.literal_eval(keyword.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return []
        try:
            json.dumps(arguments)
        except (TypeError, ValueError):  # a set, bytes or a complex number: no JSON for them
            return []
        calls.append((node.func.id, arguments))
    return calls


def cut_calls(text: str, names: Collection[str]) -> list[ToolCall]:
    """A reply that tool_choice made a call (model/tool_choice.py: a JSON call, or an array of them, in json.dumps's
    layout) cut short by its token limit, as OpenAI returns one: its whole calls, then the last as far as it
    went, its arguments the JSON text written so far (a str; "" before they began). A name cut short is the one
    name of `names` it can still be, else what was written of it."""
    decoder = json.JSONDecoder()
    text = text.lstrip()
    position, calls = int(text.startswith("[")), []
    while True:
        try:
            value, end = decoder.raw_decode(text, position)
        except (json.JSONDecodeError, RecursionError):
            break
        call = json_call(value) if isinstance(value, dict) else None
        if call is None:
            break
        calls.append(ToolCall(f"call_{uuid.uuid4().hex}", *call))
        position = end + 2 if text.startswith(", ", end) else len(text)  # the next call, or the cut between two
    rest = text[position:]
    if not rest.strip(", "):  # cut after a whole call
        return calls
    if not (rest.startswith(FORCED_CALL) or FORCED_CALL.startswith(rest)):
        return calls
    name, quote, after = rest[len(FORCED_CALL):].partition('"')
    if not quote:  # cut inside the name
        possible = [n for n in names if n.startswith(name)]
        name = possible[0] if len(possible) == 1 else name
    arguments = after.removeprefix(PARAMETERS[1:]) if after.startswith(PARAMETERS[1:]) else ""
    return calls + [ToolCall(f"call_{uuid.uuid4().hex}", name, arguments)]


def may_be_tool_call(text: str) -> bool:
    """Whether a reply that begins with `text` (control tokens spelled out) may still be a tool call from its
    first character: True for "" and while the text, less leading whitespace, is a prefix of or begins with
    <|python_tag|>, "<function=", "{" or "[". A server can hold such a reply back instead of streaming it.

    Once False, the reply is content, except that parse_tool_calls also finds `<function=...>` and
    `name.call(query="...")` further on; run it on the whole reply at the end in every case.
    """
    text = text.lstrip()
    return any(text.startswith(opening) or opening.startswith(text) for opening in CALL_OPENINGS)
