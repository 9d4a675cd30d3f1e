"""OpenAI request bodies -> what the backend takes; every parameter is either done or refused by name.

`parse_chat` reads a /v1/chat/completions body, `parse_completion` a /v1/completions body. A
parameter this server does is read and checked; one it cannot do (audio, logit_bias, ...) is a 400
naming it; one that only labels the request (user, metadata, ...) is accepted and has no effect; and
one OpenAI does not know either is a 400 too ("Unrecognized request argument"), as OpenAI answers.
Errors are `ApiError`s in OpenAI's shape.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse

from model.tools import read_tool_calls, read_tool_choice, read_tools

from .conversation import Conversation
from .messages import ReplySettings

MAX_STOP_STRINGS = 4
MAX_N = 4  # replies per request (they share the prompt's prefill)
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
RETRY_AFTER_S = 5  # what a client refused for a full queue is told to wait
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}

# Read by both endpoints (llama.cpp's and vLLM's extras among them).
SAMPLING = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
            "frequency_penalty", "presence_penalty", "seed", "stop", "n", "stream", "stream_options",
            "ignore_eos"}
CHAT = SAMPLING | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                   "parallel_tool_calls", "response_format"}
COMPLETION = SAMPLING | {"prompt", "logprobs", "echo", "suffix", "best_of"}
# Labels of the request, with no effect on the reply: accepted and not used.
LABELS = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
# What the API has and this server does not do: a 400 that says so, unless the value asks for nothing.
REFUSED = {
    "audio": "audio output is not supported: this server answers in text",
    "modalities": "only text output is supported",
    "logit_bias": "logit_bias is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "functions": "'functions' is deprecated and not supported",
    "function_call": "'function_call' is deprecated and not supported",
    "reasoning_effort": "this model does not reason in a separate channel",
    "verbosity": "verbosity is not supported",
}
HARMLESS = {"modalities": [["text"]], "logit_bias": [{}], "store": [False], "n": [1], "best_of": [1],
            "echo": [False], "tools": [[]], "tool_choice": ["none"]}


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {401: {"WWW-Authenticate": "Bearer"}, 429: {"Retry-After": str(RETRY_AFTER_S)}}.get(self.status)
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


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

    def options(self) -> dict:
        return super().options() | {"tools": self.tools, "tool_choice": self.tool_choice,
                                    "parallel_tool_calls": self.parallel_tool_calls,
                                    "json_schema": self.json_schema, "json_object": self.json_object}


@dataclass
class CompletionRequest(ApiRequest):
    prompt: str = ""


def parse_chat(body: object, profiles: dict, default: str) -> ChatRequest:
    """A /v1/chat/completions body; ApiError (400, 404) names what is wrong."""
    body = _object(body)
    _check_names(body, CHAT)
    common = _common(body, profiles, default, max_tokens=_number(body, "max_completion_tokens", int, low=1))
    logprobs = None
    if _flag(body, "logprobs"):
        logprobs = _number(body, "top_logprobs", int, low=0, high=MAX_TOP_LOGPROBS) or 0
    elif body.get("top_logprobs") is not None:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    tools, tool_choice = body.get("tools") or None, body.get("tool_choice")
    try:
        read_tool_choice(tool_choice, read_tools(tools))
    except ValueError as e:
        raise ApiError(400, str(e), param="tool_choice" if str(e).startswith("tool_choice") else "tools") from None
    json_schema, json_object = _response_format(body.get("response_format"))
    if (json_schema is not None or json_object) and tools and tool_choice != "none":
        raise ApiError(400, "'response_format' and 'tools' cannot be used together: a reply is either JSON or a "
                            "tool call.", param="response_format")
    if (json_schema is not None or json_object) and common["settings"].ignore_eos:
        raise ApiError(400, "'ignore_eos' cannot be used with a JSON response_format: the document ends the reply.",
                       param="ignore_eos")
    return ChatRequest(**common, logprobs=logprobs, conversation=_conversation(body.get("messages"), common["model"]),
                       tools=tools, tool_choice=tool_choice,
                       parallel_tool_calls=body.get("parallel_tool_calls") is not False,
                       json_schema=json_schema, json_object=json_object)


def parse_completion(body: object, profiles: dict, default: str) -> CompletionRequest:
    """A /v1/completions body (OpenAI's default of 16 tokens for max_tokens); ApiError names what is wrong."""
    body = _object(body)
    _check_names(body, COMPLETION)
    for name, why in [("echo", "echo (the prompt again in the reply) is not supported"),
                      ("suffix", "suffix (insertion) is not supported")]:
        if body.get(name) not in (None, False):
            raise ApiError(400, f"'{name}': {why}.", param=name, code="unsupported_parameter")
    common = _common(body, profiles, default, max_tokens=None)
    best_of = _number(body, "best_of", int, low=1)
    if best_of is not None and best_of != common["n"]:
        raise ApiError(400, "'best_of' is not supported: ask for the replies you want with 'n'.", param="best_of",
                       code="unsupported_parameter")
    if common["settings"].max_new_tokens is None:
        common["settings"] = ReplySettings(max_new_tokens=16).over(common["settings"])
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(400, "'prompt' must be a string (or a list of one string).", param="prompt")
    return CompletionRequest(**common, logprobs=_number(body, "logprobs", int, low=0, high=MAX_COMPLETION_LOGPROBS),
                             prompt=prompt)


# ---- the parts ----------------------------------------------------------------------------------

def _response_format(value: object) -> tuple[dict | None, bool]:
    """response_format -> (JSON schema or None, JSON object mode)."""
    if value is None:
        return None, False
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None, False
    if kind == "json_object":
        return None, True
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "'response_format.json_schema.schema' must be a JSON schema object.",
                           param="response_format.json_schema.schema")
        return schema, False
    raise ApiError(400, "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                        "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}.",
                   param="response_format")


def _object(body: object) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return body


def _check_names(body: dict, known: set[str]) -> None:
    for name, value in body.items():
        if name in known or name in LABELS:
            continue
        if name in REFUSED:
            if value is None or value in HARMLESS.get(name, []):
                continue
            raise ApiError(400, f"'{name}': {REFUSED[name]}.", param=name, code="unsupported_parameter")
        raise ApiError(400, f"Unrecognized request argument supplied: {name}", param=name,
                       code="unsupported_parameter")


def _common(body: dict, profiles: dict, default: str, max_tokens: int | None) -> dict:
    model = body.get("model")
    if model is None or model == "":
        model = default
    if not isinstance(model, str):
        raise ApiError(400, f"'model' must be a string, not {json.dumps(model)}.", param="model")
    if model not in profiles:
        raise ApiError(404, f"The model '{model}' does not exist. Available: {', '.join(profiles)}.",
                       param="model", code="model_not_found")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object.", param="stream_options")
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", int, low=1)
    settings = ReplySettings(
        max_new_tokens=max_tokens,
        temperature=_number(body, "temperature", float, low=0, high=2),
        top_k=_number(body, "top_k", int, low=0),
        top_p=_number(body, "top_p", float, low=0, high=1),
        min_p=_number(body, "min_p", float, low=0, high=1),
        repetition_penalty=_number(body, "repetition_penalty", float, low=0.01, high=10),
        frequency_penalty=_number(body, "frequency_penalty", float, low=-2, high=2),
        presence_penalty=_number(body, "presence_penalty", float, low=-2, high=2),
        seed=_number(body, "seed", int),
        stop=tuple(_stop(body.get("stop"))),
        ignore_eos=_flag(body, "ignore_eos"))
    n = _number(body, "n", int, low=1, high=MAX_N)
    return {"model": model, "settings": settings, "n": n or 1, "stream": _flag(body, "stream"),
            "include_usage": bool(options and _flag(options, "include_usage", "stream_options.include_usage"))}


def _conversation(messages: object, model: str) -> Conversation:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of messages.", param="messages")
    system, conversation = [], Conversation(model=model)
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where} must be an object with 'role' and 'content'.", param=where)
        role = ROLES.get(message.get("role"))
        if role is None:
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}, not "
                                f"{json.dumps(message.get('role'))}.", param=f"{where}.role")
        calls = message.get("tool_calls") if role == "assistant" else None
        content = "" if calls and message.get("content") is None else _text(message.get("content"), f"{where}.content")
        if role == "system":
            system.append(content)
        elif role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise ApiError(400, f"{where}.tool_call_id must name the call this result answers.",
                               param=f"{where}.tool_call_id")
            conversation.add(role, content, tool_call_id=message["tool_call_id"])
        else:
            if calls is not None:
                try:
                    read_tool_calls(calls, where)
                except ValueError as e:
                    raise ApiError(400, str(e), param=f"{where}.tool_calls") from None
            conversation.add(role, content, tool_calls=calls or None)
    if not conversation.messages or conversation.messages[-1].role not in ("user", "tool"):
        raise ApiError(400, "The last message (after any system messages) must be the user's, or a tool's result: it "
                            "is the one answered.", param="messages")
    conversation.system_prompt = "\n\n".join(system) if system else None
    return conversation


def _text(content: object, where: str) -> str:
    """A message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                                    "supported.", param=f"{where}[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{where} must be a string or a list of text parts.", param=where)


def _flag(body: dict, name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"'{param or name}' must be true or false, not {json.dumps(value)}.",
                       param=param or name, code="invalid_type")
    return value


def _number(body: dict, name: str, kind: type, low: float | None = None, high: float | None = None):
    value = body.get(name)
    if value is None:
        return None
    wanted = "a whole number" if kind is int else "a number"
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) or (kind is float and not math.isfinite(value)):
        raise ApiError(400, f"'{name}' must be {wanted}, not {json.dumps(value)}.", param=name, code="invalid_type")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"at least {low:g}" if high is None else f"between {low:g} and {high:g}"
        raise ApiError(400, f"'{name}' must be {bounds}, not {value:g}.", param=name, code="invalid_value")
    return value


def _stop(stop: object) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)
            or len(stops) > MAX_STOP_STRINGS):
        raise ApiError(400, f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings.",
                       param="stop", code="invalid_value")
    return [s for s in stops if s]
