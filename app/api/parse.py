"""OpenAI request bodies -> what the backend takes; every parameter is either done or refused by name.

`parse_chat` reads a /v1/chat/completions body, `parse_completion` a /v1/completions body: each is
converted by msgspec into a declared type (`ChatBody`, `CompletionBody`, in `app.api.openai`) whose fields carry their
types and ranges (`app.bounds`, the same as the engine's messages), so a wrong type, a number out of
range or too many of something is a 400 that names the parameter. A parameter this server does is in
those types; one it cannot do (audio, logit_bias, ...) is a 400 naming it, unless its value asks for
nothing; one that only labels the request (user, metadata, ...) is accepted and has no effect; and one
OpenAI does not know either is a 400 too ("Unrecognized request argument"), as OpenAI answers. Before
that, `app.bounds.json_problem` finds what no JSON in a request may hold (a string that is not
Unicode, a number that is not finite or is past 64 bits, nesting past 64 levels), wherever it is.
Errors are `ApiError`s in OpenAI's shape.

A user message's content parts of type "file" (OpenAI's shape: {"type": "file", "file": {"file_data":
"data:application/pdf;base64,...", "filename": "x.pdf"}}; bare base64 is taken too) are decoded and read
into text here (app.files.read), each a 400 naming the message, the part and the file when it cannot be:
bad base64, too large, a kind not taken, bytes that are not what the name says. A file_id (OpenAI's files
API, which this server does not have) is refused by name. The engine decides how much of each goes into the
prompt (app.files.prompt), the same way for the same message on every request.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import threading
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec

from model.tools import read_tool_calls, read_tool_choice, read_tools

from app.bounds import MAX_FILE_BYTES, MAX_FILES, MAX_INT32, MAX_JSON_CHARS, Bias, json_problem
from app.backend.conversation import Conversation
from app.files.read import FileRefused, check_together, read_deadline, read_file
from app.messages import Attachment, ReplySettings
from app.api.openai import (
    HARMLESS,
    REFUSED,
    ApiError,
    AssistantMessage,
    Body,
    ChatBody,
    CompletionBody,
    Content,
    FilePart,
    JsonObjectFormat,
    JsonSchemaFormat,
    Message,
    SystemMessage,
    ToolMessage,
    UserContent,
)


# ---- what the backend takes ---------------------------------------------------------------------

@dataclass
class ApiRequest:
    """What both endpoints ask for, read and checked."""

    model: str
    settings: ReplySettings
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # alternatives per token to report (0: the chosen token's only); None: off

    def options(self) -> dict:
        """What the backend's stream() or complete() takes besides the conversation and settings."""
        return {"n": self.n, "logprobs": self.logprobs}


@dataclass
class ChatRequest(ApiRequest):
    conversation: Conversation = field(default_factory=Conversation)
    tools: list[dict] | None = None  # checked by model.tools; the engine says whether the model takes them
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    json_schema: dict | None = None  # response_format json_schema: the engine compiles it (400 if it cannot)
    json_object: bool = False  # response_format json_object
    # False: messages that do not fit are an error (400 context_length_exceeded), as OpenAI's clients expect,
    # which the engine gives before it computes anything; never a silently shortened conversation. True (the
    # Responses API's truncation "auto"): the oldest messages are left out, as in the chat.
    trim: bool = False

    def options(self) -> dict:
        return super().options() | {"trim": self.trim, "tools": self.tools, "tool_choice": self.tool_choice,
                                    "parallel_tool_calls": self.parallel_tool_calls,
                                    "json_schema": self.json_schema, "json_object": self.json_object}


@dataclass
class CompletionRequest(ApiRequest):
    prompt: str = ""


def parse_chat(body: object, profiles: dict, default: str) -> ChatRequest:
    """A /v1/chat/completions body; ApiError (400, 404) names what is wrong."""
    chat = read_body(body, ChatBody)
    common = _common(chat, profiles, default, max_tokens=chat.max_completion_tokens or chat.max_tokens)
    if chat.top_logprobs is not None and not chat.logprobs:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    tools = json_within(msgspec.to_builtins(chat.tools), "tools") if chat.tools else None
    tool_choice = msgspec.to_builtins(chat.tool_choice)
    try:
        read_tool_choice(tool_choice, read_tools(tools))
    except ValueError as e:
        raise ApiError(400, str(e), param="tool_choice" if str(e).startswith("tool_choice") else "tools") from None
    json_schema, json_object = None, isinstance(chat.response_format, JsonObjectFormat)
    if isinstance(chat.response_format, JsonSchemaFormat):
        json_schema = json_within(chat.response_format.json_schema.schema, "response_format.json_schema.schema")
    if (json_schema is not None or json_object) and tools and tool_choice != "none":
        raise ApiError(400, "'response_format' and 'tools' cannot be used together: a reply is either JSON or a "
                            "tool call.", param="response_format")
    if (json_schema is not None or json_object) and common["settings"].ignore_eos:
        raise ApiError(400, "'ignore_eos' cannot be used with a JSON response_format: the document ends the reply.",
                       param="ignore_eos")
    return ChatRequest(**common, logprobs=(chat.top_logprobs or 0) if chat.logprobs else None,
                       conversation=_conversation(chat.messages, common["model"]), tools=tools,
                       tool_choice=tool_choice, parallel_tool_calls=chat.parallel_tool_calls is not False,
                       json_schema=json_schema, json_object=json_object)


def parse_completion(body: object, profiles: dict, default: str) -> CompletionRequest:
    """A /v1/completions body (OpenAI's default of 16 tokens for max_tokens); ApiError names what is wrong."""
    completion = read_body(body, CompletionBody)
    for name, why in [("echo", "echo (the prompt again in the reply) is not supported"),
                      ("suffix", "suffix (insertion) is not supported")]:
        if getattr(completion, name) not in (None, False):
            raise ApiError(400, f"'{name}': {why}.", param=name, code="unsupported_parameter")
    common = _common(completion, profiles, default, max_tokens=completion.max_tokens)
    if completion.best_of is not None and completion.best_of != common["n"]:
        raise ApiError(400, "'best_of' is not supported: ask for the replies you want with 'n'.", param="best_of",
                       code="unsupported_parameter")
    if common["settings"].max_new_tokens is None:
        common["settings"] = ReplySettings(max_new_tokens=16).over(common["settings"])
    prompt = completion.prompt if isinstance(completion.prompt, str) else completion.prompt[0]
    return CompletionRequest(**common, logprobs=completion.logprobs, prompt=prompt)


# ---- reading a body -----------------------------------------------------------------------------

B = TypeVar("B", bound=msgspec.Struct)
# msgspec's "... - at `$.a[0].b`", or "... - at `key` in `$.a`" for an object's key
AT = re.compile(r"(?P<what>.*?)(?: - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`)?", re.DOTALL)
FIELD = re.compile(r"Object (?P<kind>missing required|contains unknown) field `(?P<name>[^`]*)`")
RANGE = re.compile(r"Expected `(int|float)` [<>]")


# msgspec builds what it knows of a Struct type (and of those inside it) on the type's first use, and two threads
# doing that at once crash the process (a segfault: seen when the first 50 requests of a fresh server came at
# once, their bodies read in worker threads). Each type is built once, by one thread, before it is used.
_BUILT: set[type] = set()
_BUILDING = threading.Lock()


def _built(kind: type[B]) -> type[B]:
    if kind not in _BUILT:
        with _BUILDING:
            msgspec.json.Decoder(kind)  # builds the type's (and its fields' types') decoding information
            _BUILT.add(kind)
    return kind


def read_body(body: object, kind: type[B], refused: dict[str, str] = REFUSED) -> B:
    """The body as `kind`; ApiError names the first thing in it that is not as declared, or in `refused` (a
    parameter not done, and why) with a value that asks for something. Safe from any number of threads."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    found = json_problem(body)
    if found is not None:
        where, problem = found
        raise ApiError(400, f"'{where}' {problem}." if where else f"The request body {problem}.", param=where or None,
                       code="invalid_value")
    for name, value in list(body.items()):
        if name in refused:
            if value is not None and value not in HARMLESS.get(name, []):
                raise ApiError(400, f"'{name}': {refused[name]}.", param=name, code="unsupported_parameter")
            body = {k: v for k, v in body.items() if k != name}  # asks for nothing
    try:
        return msgspec.convert(body, _built(kind), strict=True)
    except msgspec.ValidationError as e:
        raise _invalid(str(e), kind, body) from None


def _invalid(error: str, kind: type[msgspec.Struct], body: dict) -> ApiError:
    """msgspec's error ("Expected `int` <= 4 - at `$.n`") as OpenAI's, with the parameter as `param`."""
    at = AT.fullmatch(error)
    what, where = at["what"], (at["path"] or "").replace("[...]", "").lstrip(".")  # ([...]: a value of a dict)
    if at["key"]:
        what = f"{what} for a key"
    field = FIELD.fullmatch(what)
    if field:
        where = f"{where}.{field['name']}".lstrip(".")
        if field["kind"] == "missing required":
            return ApiError(400, f"'{where}' is required.", param=where, code="missing_required_parameter")
        if where == field["name"]:
            return ApiError(400, f"Unrecognized request argument supplied: {where}", param=where,
                            code="unsupported_parameter")
        return ApiError(400, f"Unknown parameter: '{where}'.", param=where, code="unknown_parameter")  # as OpenAI's
    bounds = _bounds(kind, where) if RANGE.match(what) else None
    if bounds is not None:
        message = f"'{where}' must be {bounds}, not {json.dumps(_value(body, where))}."
    else:
        message = f"Invalid '{where}': {what[0].lower()}{what[1:]}." if where else f"Invalid request: {what}."
    return ApiError(400, message, param=where or None, code="invalid_type" if "got `" in what else "invalid_value")


def _bounds(kind: type[msgspec.Struct], where: str) -> str | None:
    """The range of a number field in words ("between 0 and 2", "greater than 0 and at most 1"), the field named
    by its path through nested structs ("options.temperature")."""
    fields = msgspec.inspect.type_info(kind).fields
    *path, name = where.split(".")
    for part in path:
        info = next((f for f in fields if f.name == part), None)
        nested = [t for t in getattr(info.type, "types", (info.type,)) if isinstance(t, msgspec.inspect.StructType)] \
            if info else []
        if not nested:
            return None
        fields = nested[0].fields
    for info in fields:
        if info.name == name:
            for t in getattr(info.type, "types", (info.type,)):
                if isinstance(t, msgspec.inspect.IntType | msgspec.inspect.FloatType):
                    if t.gt is None and t.le is not None:
                        return f"between {t.ge:g} and {t.le:g}" if isinstance(t.ge, float) else \
                            f"between {t.ge} and {t.le}"
                    return f"greater than {t.gt:g} and at most {t.le:g}"
    return None


def _value(body: dict, where: str) -> object:
    for part in where.split("."):
        body = body.get(part) if isinstance(body, dict) else None
    return body


def json_within(value, param: str):
    """Free-form JSON (tools, a JSON schema) no larger than MAX_JSON_CHARS as JSON text."""
    size = len(json.dumps(value))
    if size > MAX_JSON_CHARS:
        raise ApiError(400, f"'{param}' is {size:,} characters of JSON; at most {MAX_JSON_CHARS:,} are taken.",
                       param=param, code="invalid_value")
    return value


def _common(body: Body, profiles: dict, default: str, max_tokens: int | None) -> dict:
    model = body.model or default
    if model not in profiles:
        raise ApiError(404, f"The model '{model}' does not exist. Available: {', '.join(profiles)}.",
                       param="model", code="model_not_found")
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    settings = ReplySettings(
        max_new_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
        min_p=body.min_p, repetition_penalty=body.repetition_penalty, frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty, seed=body.seed, logit_bias=logit_bias(body.logit_bias),
        stop=tuple(s for s in stops if s), ignore_eos=bool(body.ignore_eos))
    return {"model": model, "settings": settings, "n": body.n or 1, "stream": bool(body.stream),
            "include_usage": bool(body.stream_options and body.stream_options.include_usage)}


TOKEN_ID = re.compile(r"[0-9]{1,10}")


def logit_bias(asked: dict[str, object] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias, {"token id": bias}, as {id: bias}: each key a token id written in decimal digits, each
    value a number in [-100, 100] (whether the id is in the model's vocabulary, the engine checks)."""
    if not asked:
        return None
    bias = {}
    for key, value in asked.items():
        if not TOKEN_ID.fullmatch(key) or int(key) > MAX_INT32:
            shown = key if len(key) <= 24 else key[:24] + "..."
            raise ApiError(400, f"'logit_bias': the key {json.dumps(shown, ensure_ascii=False)} is not a token id; "
                                'its keys are token ids as strings, such as "1234".', param="logit_bias",
                           code="invalid_value")
        try:
            bias[int(key)] = msgspec.convert(value, Bias, strict=True)
        except msgspec.ValidationError:
            raise ApiError(400, f"'logit_bias.{key}' is {json.dumps(value)[:40]}; expected a number from -100 to 100.",
                           param=f"logit_bias.{key}", code="invalid_value") from None
    return bias


def _conversation(messages: list[Message], model: str) -> Conversation:
    system, conversation = [], Conversation(model=model)
    deadline = read_deadline()  # for all the files of the request
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        content = _text(message.content)
        if isinstance(message, SystemMessage):  # a developer's message too
            system.append(content)
        elif isinstance(message, ToolMessage):
            conversation.add("tool", content, tool_call_id=message.tool_call_id)
        elif isinstance(message, AssistantMessage):
            calls = msgspec.to_builtins(message.tool_calls) if message.tool_calls else None
            if message.content is None and not calls:
                raise ApiError(400, f"{where}.content must be a string or a list of text parts.",
                               param=f"{where}.content")
            if calls:
                check_calls(calls, where)
            conversation.add("assistant", content, tool_calls=calls)
        else:
            conversation.add("user", content, files=_files(message.content, where, deadline))
    if not conversation.messages or conversation.messages[-1].role not in ("user", "tool"):
        raise ApiError(400, "The last message (after any system messages) must be the user's, or a tool's result: it "
                            "is the one answered.", param="messages")
    conversation.system_prompt = "\n\n".join(system) if system else None
    return conversation


def check_calls(calls: list[dict], where: str) -> None:
    """An assistant's tool calls: their arguments a JSON object (model.tools), and no JSON a request may not hold."""
    try:
        parsed = read_tool_calls(calls, where)
    except ValueError as e:
        raise ApiError(400, str(e), param=f"{where}.tool_calls") from None
    for j, call in enumerate(parsed):
        found = json_problem(call.arguments, max_depth=32)  # (a nesting the prompt's writers can follow)
        if found is not None:
            param = f"{where}.tool_calls[{j}].function.arguments"
            raise ApiError(400, f"'{param}': {'.'.join(filter(None, ['arguments', found[0]]))} {found[1]}.",
                           param=param, code="invalid_value")


def _text(content: Content | UserContent | None) -> str:
    """A message's content: a string, or its text parts joined."""
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(p.text for p in content if not isinstance(p, FilePart))


# Where a file part has no filename, its kind from the data URL's media type (else it is refused: the kind decides).
NAME_FOR_TYPE = {"application/pdf": "file.pdf", "text/plain": "file.txt", "text/markdown": "file.md",
                 "text/csv": "file.csv", "application/json": "file.json"}
DATA_URL = re.compile(r"data:(?P<type>[^;,]*)(?:;[^;,]*)*?(?P<base64>;base64)?,", re.IGNORECASE)


def has_files(body: object) -> bool:
    """Whether a chat body (as JSON decoded, not yet checked) has a part of type "file": those are read on
    app.files.read's READERS. Anything else about the body is parse_chat's to judge."""
    messages = body.get("messages") if isinstance(body, dict) else None
    return isinstance(messages, list) and any(
        isinstance(part, dict) and part.get("type") == "file"
        for message in messages if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"])


def _files(content: UserContent, where: str, deadline: float) -> list[Attachment] | None:
    """A user message's file parts, read (app.files.read); ApiError names the part and says what is wrong."""
    if isinstance(content, str):
        return None
    parts = [(j, part) for j, part in enumerate(content) if isinstance(part, FilePart)]
    if len(parts) > MAX_FILES:
        raise ApiError(400, f"{where} has {len(parts)} files; at most {MAX_FILES} are taken in one message.",
                       param=f"{where}.content", code="invalid_value")
    files = [_file(part, f"{where}.content[{j}]", deadline) for j, part in parts]
    try:
        check_together(files)
    except FileRefused as e:
        raise ApiError(400, f"{where}: {e}", param=f"{where}.content", code="invalid_value") from None
    return files or None


def _file(part: FilePart, where: str, deadline: float) -> Attachment:
    param = f"{where}.file"
    if part.file.file_id is not None:
        raise ApiError(400, f"'{param}.file_id': file_id is not supported: send file_data (the file's bytes in "
                            "base64, or as a data: URL) with its filename.", param=f"{param}.file_id",
                       code="unsupported_parameter")
    if not part.file.file_data:
        raise ApiError(400, f"'{param}.file_data' is required: the file's bytes in base64, or as a data: URL.",
                       param=f"{param}.file_data", code="missing_required_parameter")
    payload, media_type = part.file.file_data, ""
    if url := DATA_URL.match(payload):
        if not url["base64"]:
            raise ApiError(400, f"'{param}.file_data' is a data: URL without ';base64': send the bytes in base64.",
                           param=f"{param}.file_data", code="invalid_value")
        payload, media_type = payload[url.end():], url["type"].strip().lower()
    name = part.file.filename or NAME_FOR_TYPE.get(media_type)
    if not name:
        raise ApiError(400, f"'{param}.filename' is required (its extension tells the file's kind: .txt, .md, "
                            ".py, .csv, .json, .pdf, ...).", param=f"{param}.filename",
                       code="missing_required_parameter")
    if len(payload) // 4 * 3 > MAX_FILE_BYTES + 2:  # (before decoding it: base64 holds 3 bytes in 4 characters)
        raise ApiError(400, f"{where} ({name}): the file is larger than {MAX_FILE_BYTES // 2**20} MB, the most a "
                            "file may be.", param=f"{param}.file_data", code="invalid_value")
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)  # (line breaks, as some encoders write)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where} ({name}): file_data is not valid base64.", param=f"{param}.file_data",
                       code="invalid_value") from None
    try:
        return read_file(name, data, deadline)
    except FileRefused as e:
        raise ApiError(400, f"{where}: {e}", param=param, code="invalid_value") from None
