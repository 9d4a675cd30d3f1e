"""OpenAI's JSON shapes, as declared types: the request bodies this server reads (`app.api.parse`
converts a body into them, so a wrong type or a number out of range is a 400 naming the parameter), the
replies it writes (`app.api`), which are also what the remote backend reads from another server
(`app.backend.remote`), and the error object.

The request types are strict (`forbid_unknown_fields`: a parameter OpenAI does not know is refused); the
reply types are lenient where other servers differ (a field left out is its default), so that one
declaration serves for writing ours and reading theirs.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from fastapi.responses import Response
from msgspec import UNSET, Meta, Struct, UnsetType

from app.messages import TokenLogprob
from app.bounds import (
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_STOP_STRINGS,
    MAX_TOOLS,
    Metadata,
    MinP,
    Name,
    Penalty,
    Replies,
    Seed,
    StopString,
    Tokens,
    TopK,
    TopLogprobs,
    TopP,
)

MAX_COMPLETION_LOGPROBS = 5
RETRY_AFTER_S = 5  # what a client refused for a full queue, or while the model restarts, is told to wait
# What the API has and this server does not do: a 400 that says so, unless the value asks for nothing.
REFUSED = {
    "audio": "audio output is not supported: this server answers in text",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "functions": "'functions' is deprecated and not supported",
    "function_call": "'function_call' is deprecated and not supported",
    "reasoning_effort": "this model does not reason in a separate channel",
    "verbosity": "verbosity is not supported",
}
HARMLESS = {"modalities": [["text"]]}


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> ErrorBody:
        return ErrorBody(ErrorObject(self.message, self.type, self.param, self.code))

    def response(self) -> Response:
        headers = {401: {"WWW-Authenticate": "Bearer"}, 429: {"Retry-After": str(RETRY_AFTER_S)},
                   503: {"Retry-After": str(RETRY_AFTER_S)}}.get(self.status)
        return Response(msgspec.json.encode(self.body()), status_code=self.status, headers=headers,
                        media_type="application/json")


# ---- the bodies, as declared types --------------------------------------------------------------

Temperature = Annotated[float, Meta(ge=0, le=2)]  # OpenAI's range (the engine takes more)
RepetitionPenalty = Annotated[float, Meta(ge=0.01, le=10)]
CompletionLogprobs = Annotated[int, Meta(ge=0, le=MAX_COMPLETION_LOGPROBS)]
Stop = StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)]


class StreamOptions(Struct):
    include_usage: bool | None = None


class Body(Struct, forbid_unknown_fields=True, kw_only=True):
    """What both endpoints read (llama.cpp's and vLLM's extras among them), and the labels they accept."""

    model: Name | None = None
    max_tokens: Tokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    seed: Seed | None = None  # the n replies take seed, seed + 1, ...
    logit_bias: Annotated[dict[str, object], Meta(max_length=MAX_LOGIT_BIAS)] | None = None  # read by parse.py
    stop: Stop | None = None
    n: Replies | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    # Labels of the request, with no effect on the reply.
    user: str | None = None
    metadata: Metadata | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class TextPart(Struct, tag_field="type", tag="text"):
    text: str


Content = str | list[TextPart]


class FileData(Struct, omit_defaults=True):
    """OpenAI's file input: file_data is the file's bytes in base64 (or a data: URL); file_id (a file uploaded
    to OpenAI's files API) is read only to be refused by name."""

    file_data: str | None = None
    filename: str | None = None
    file_id: str | None = None


class FilePart(Struct, tag_field="type", tag="file"):
    file: FileData


UserContent = str | list[TextPart | FilePart]  # a user's message may carry files (app.api.parse reads them)


class SystemMessage(Struct, tag_field="role", tag="system"):
    content: Content


class DeveloperMessage(SystemMessage, tag="developer"):
    pass


class UserMessage(Struct, tag_field="role", tag="user"):
    content: UserContent


# The tool structs are passed on as the client wrote them (msgspec.to_builtins): a field left out stays out.
class FunctionCall(Struct, omit_defaults=True):
    name: Name
    arguments: str | dict[str, object] | None = None  # JSON text, as OpenAI writes it


class ToolCall(Struct, omit_defaults=True, kw_only=True):
    id: Name | None = None
    type: Literal["function"] | None = None
    function: FunctionCall


class AssistantMessage(Struct, tag_field="role", tag="assistant"):
    content: Content | None = None
    tool_calls: Annotated[list[ToolCall], Meta(max_length=MAX_TOOLS)] | None = None


class ToolMessage(Struct, tag_field="role", tag="tool"):
    content: Content
    tool_call_id: Name


Message = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage


class FunctionDefinition(Struct, omit_defaults=True):
    name: Name
    description: str | None = None
    parameters: dict[str, object] | None = None  # a JSON schema (model.tools reads it)
    strict: bool | None = None


class Tool(Struct, omit_defaults=True, kw_only=True):
    type: Literal["function"] | None = None
    function: FunctionDefinition


class NamedFunction(Struct, omit_defaults=True):
    name: Name


class NamedToolChoice(Struct, omit_defaults=True, kw_only=True):
    type: Literal["function"] | None = None
    function: NamedFunction


# response_format's shapes take no key OpenAI's do not have: one that is not read is refused, not ignored (a
# "schema" beside "type": "json_object" would otherwise ask for a schema that nothing enforces).
class JsonSchema(Struct, forbid_unknown_fields=True):
    name: Name  # required by OpenAI (^[a-zA-Z0-9_-]{1,64}$ there; any name here)
    schema: dict[str, object]
    description: str | None = None
    strict: bool | None = None


class TextFormat(Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    pass


class JsonObjectFormat(Struct, tag_field="type", tag="json_object", forbid_unknown_fields=True):
    pass


class JsonSchemaFormat(Struct, tag_field="type", tag="json_schema", forbid_unknown_fields=True):
    json_schema: JsonSchema


class ChatBody(Body):
    messages: Annotated[list[Message], Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Tokens | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: TextFormat | JsonObjectFormat | JsonSchemaFormat | None = None


class CompletionBody(Body):
    prompt: str | Annotated[list[str], Meta(min_length=1, max_length=1)]  # a list of one string is that string
    logprobs: CompletionLogprobs | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: Replies | None = None


# ---- the replies --------------------------------------------------------------------------------

class PromptTokensDetails(Struct):
    cached_tokens: int = 0  # prompt tokens whose keys and values this user's kept caches served


class Usage(Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | UnsetType = UNSET  # always sent by this server, as OpenAI's


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(Struct):
    """The chat shape: each token with its log-probability, bytes and the top alternatives."""

    content: list[ChatTokenLogprob] | None = None
    refusal: str | None = None


def chat_logprobs(entries: list[TokenLogprob]) -> ChatLogprobs:
    """The engine's logprobs in the chat shape (the Responses API's output_text parts take its content too)."""
    return ChatLogprobs([ChatTokenLogprob(t.token, t.logprob, t.bytes, [TopLogprob(top.token, top.logprob, top.bytes)
                                                                        for top in t.top]) for t in entries])


class TextLogprobs(Struct):
    """The completions API's older shape: parallel lists, alternatives as {token: logprob}."""

    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = []


class CallFunction(Struct, frozen=True):
    name: str = ""
    arguments: str = ""


class Call(Struct, omit_defaults=True, kw_only=True):
    """A tool call in a reply; streamed in pieces (`index` says which call a piece belongs to)."""

    index: int | UnsetType = UNSET
    id: str | None = None
    type: str | None = None
    function: CallFunction = CallFunction()


class ReplyMessage(Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[Call] | UnsetType = UNSET


class Delta(Struct, omit_defaults=True, kw_only=True, frozen=True):
    """A piece of a streamed chat reply: only what it brings is written."""

    role: str | None = None
    content: str | None = None
    tool_calls: tuple[Call, ...] | None = None


class ChatChoice(Struct, kw_only=True):
    index: int = 0
    message: ReplyMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChunkChoice(Struct, kw_only=True):
    index: int = 0
    delta: Delta = Delta()
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class TextChoice(Struct, kw_only=True):
    index: int = 0
    text: str = ""
    logprobs: TextLogprobs | None = None
    finish_reason: str | None = None


class Completion(Struct, kw_only=True):
    id: str = ""
    object: str = ""
    created: int = 0
    model: str = ""
    usage: Usage | None | UnsetType = UNSET


class ChatCompletion(Completion):
    """A whole chat reply (object "chat.completion")."""

    choices: list[ChatChoice] = []


class ChatCompletionChunk(Completion):
    """A piece of a streamed chat reply (object "chat.completion.chunk")."""

    choices: list[ChunkChoice] = []


class TextCompletion(Completion):
    """A completions reply, whole or streamed in pieces (object "text_completion" both)."""

    choices: list[TextChoice] = []


class ModelCard(Struct):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "llama-chat"
    loaded: bool | UnsetType = UNSET  # ours, beside OpenAI's fields: whether it is in memory now (as Ollama's /api/ps)


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorObject(Struct):
    message: str = ""
    type: str | None = None
    param: str | None = None
    code: str | None = None


class ErrorBody(Struct):
    error: ErrorObject | str | None = None
