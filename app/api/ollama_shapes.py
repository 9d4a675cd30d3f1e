"""Ollama's JSON shapes, as declared types: the request bodies of its routes (app.api.ollama reads a body into
them, so a wrong type or a number out of range is a 400 naming the field) and the replies they write.

Read from Ollama's API documentation (docs/api.md) and its Python client (ollama 0.6, _types.py). A field the
request types do not declare is left out of the request, as Ollama's server leaves out what it does not know
(Go's JSON reader drops it; an unknown option is a warning in its log): app.api.ollama names them in the log.
Fields Ollama has and this server does not do (images, context, template, suffix, think, most runner options)
are declared, so that app.api.ollama can refuse them by name unless their value asks for nothing. Replies
leave out what they do not have (`UNSET`), as Ollama's do: the statistics are in the last object of a reply
only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import datetime, timezone
from functools import cache
from typing import Annotated, Literal, TypeVar

import msgspec.inspect
from msgspec import UNSET, Meta, Struct, UnsetType

from app.bounds import (
    MAX_INT32,
    MAX_MESSAGES,
    MAX_STOP_STRINGS,
    MAX_TOOLS,
    MinP,
    Name,
    Penalty,
    RepetitionPenalty,
    Seed,
    StopString,
    Temperature,
    TopK,
    TopLogprobs,
    TopP,
)
from app.api.openai import Tool
from app.api.parse import read_body

log = logging.getLogger(__name__)

# The version of Ollama's API these routes follow (GET /api/version): structured outputs (0.5) and tool calls,
# before thinking models (0.9). Clients read it to tell what they may ask for.
OLLAMA_VERSION = "0.6.8"

NDJSON = "application/x-ndjson"  # a streamed reply: one JSON object a line


def now_text(at: float | None = None) -> str:
    """A moment as Ollama writes it (RFC 3339, UTC)."""
    moment = datetime.now(timezone.utc) if at is None else datetime.fromtimestamp(at, timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")



# ---- the bodies ---------------------------------------------------------------------------------

class Options(Struct, kw_only=True):
    """A request's `options` (Ollama's Modelfile parameters). null is as left out."""

    # The reply's sampling and length (app.messages.ReplySettings)
    temperature: Temperature | None = None
    top_k: TopK | None = None
    top_p: TopP | None = None
    min_p: MinP | None = None
    num_predict: Annotated[int, Meta(ge=-2, le=MAX_INT32)] | None = None  # -1, -2: to the context's end
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Seed | None = None
    repeat_penalty: RepetitionPenalty | None = None
    repeat_last_n: Annotated[int, Meta(ge=-1, le=MAX_INT32)] | None = None  # only the engine's 64, or 0: off
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    # Taken with the value that is off; another would change the reply in a way this server does not do
    typical_p: float | None = None  # 1.0
    tfs_z: float | None = None  # 1.0
    mirostat: int | None = None  # 0
    # No effect here: the context is the server's (LLAMA_MAX_CONTEXT), a prompt too long for it loses its oldest
    # messages whole (the system prompt stays), mirostat is off, newlines are tokens as any other
    num_ctx: Annotated[int, Meta(ge=-1, le=MAX_INT32)] | None = None
    num_keep: Annotated[int, Meta(ge=-1, le=MAX_INT32)] | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: bool | None = None
    # How Ollama's runner computes, not what: no effect here
    numa: bool | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: int | None = None


Format = Literal["", "json"] | dict[str, object]  # "json": any JSON object; an object: a JSON schema
KeepAlive = float | str  # seconds, or a duration such as "5m" (negative: forever)
Think = bool | Literal["low", "medium", "high"]


class Asked(Struct, kw_only=True):
    """What /api/chat and /api/generate both read."""

    model: Name
    format: Format | None = None
    options: Options | None = None
    stream: bool | None = None  # left out: true
    keep_alive: KeepAlive | None = None
    think: Think | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    truncate: bool | None = None  # left out or true: a conversation too long loses its oldest messages; false: a 400


class CallFunction(Struct, kw_only=True):
    name: Name
    arguments: dict[str, object] | str = {}  # Ollama writes an object; OpenAI's JSON text is taken too
    index: int | None = None  # (newer Ollama numbers its calls)


class ToolCall(Struct, kw_only=True):
    function: CallFunction
    id: Name | None = None
    type: Literal["function"] | None = None


class Message(Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""  # (the Python client leaves an empty one out)
    images: list[str] | None = None
    tool_calls: Annotated[list[ToolCall], Meta(max_length=MAX_TOOLS)] | None = None
    tool_name: Name | None = None  # a tool's result: the tool it comes from
    tool_call_id: Name | None = None
    thinking: str | None = None  # an earlier reply's thoughts (of a thinking model): not in the prompt


class ChatBody(Asked):
    messages: Annotated[list[Message], Meta(max_length=MAX_MESSAGES)] = []  # none: load (or unload) the model
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] | None = None


class GenerateBody(Asked):
    prompt: str = ""  # empty: load (or unload) the model
    system: str | None = None
    raw: bool | None = None  # the prompt is the model's whole input (no chat format)
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None


class ModelBody(Struct, kw_only=True):
    """/api/show, /api/delete and /api/pull: the model (older clients call it `name`)."""

    model: Name | None = None
    name: Name | None = None
    verbose: bool | None = None  # /api/show: nothing more to tell
    insecure: bool | None = None  # /api/pull: the hub is reached over HTTPS (or HF_ENDPOINT) either way
    stream: bool | None = None  # /api/pull; left out: true


B = TypeVar("B", bound=Struct)
MAX_NAMED = 8  # undeclared fields named in one log line


def read_ollama(body: object, kind: type[B]) -> B:
    """The body as `kind` (app.api.parse.read_body: a 400 names a field of a wrong type or value). What `kind`
    does not declare is left out and named in the log, as Ollama leaves out what it does not know: a client of
    a newer Ollama, or one that sends OpenAI's `user` or a model's old option (`rope_frequency_base`), is
    answered as Ollama answers it."""
    asked = read_body(body, kind, refused={})
    names = list(undeclared(body, _shape(kind)))
    if names:
        shown = ", ".join(repr(name[:64]) for name in names[:MAX_NAMED])
        log.warning("Ollama request: left out %d field(s) this API does not have: %s%s", len(names), shown,
                    ", ..." if len(names) > MAX_NAMED else "")
    return asked


@cache
def _shape(kind: type[Struct]) -> msgspec.inspect.Type:
    return msgspec.inspect.type_info(kind)


def undeclared(value: object, shape: msgspec.inspect.Type, where: str = "") -> Iterator[str]:
    """The paths ("options.rope_frequency_base", "messages[0].name") of the keys in `value` (JSON as read, already
    of `shape`) that `shape` does not declare, in the types that let them pass (no forbid_unknown_fields)."""
    if isinstance(shape, msgspec.inspect.UnionType):  # at most one member is a list, one an object
        for member in shape.types:
            yield from undeclared(value, member, where)
    elif isinstance(shape, msgspec.inspect.Metadata):
        yield from undeclared(value, shape.type, where)
    elif isinstance(shape, msgspec.inspect.ListType) and isinstance(value, list):
        for i, item in enumerate(value):
            yield from undeclared(item, shape.item_type, f"{where}[{i}]")
    elif isinstance(shape, msgspec.inspect.StructType) and isinstance(value, dict) and not shape.forbid_unknown_fields:
        fields = {field.encode_name: field.type for field in shape.fields}
        for name, item in value.items():
            path = f"{where}.{name}" if where else name
            if name in fields:
                yield from undeclared(item, fields[name], path)
            else:
                yield path


# ---- the replies --------------------------------------------------------------------------------

class ReplyFunction(Struct):
    name: str
    arguments: dict[str, object]


class ReplyCall(Struct):
    function: ReplyFunction


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class Logprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] | UnsetType = UNSET


class ReplyMessage(Struct, frozen=True):
    role: str = "assistant"
    content: str = ""
    tool_calls: list[ReplyCall] | UnsetType = UNSET


class Reply(Struct, kw_only=True):
    """What both routes' objects have: the last of a reply says why it ended and its figures (nanoseconds)."""

    model: str
    created_at: str
    done: bool = False
    done_reason: str | UnsetType = UNSET  # "stop", "length", "load" or "unload"
    total_duration: int | UnsetType = UNSET
    load_duration: int | UnsetType = UNSET
    prompt_eval_count: int | UnsetType = UNSET
    prompt_eval_duration: int | UnsetType = UNSET
    eval_count: int | UnsetType = UNSET
    eval_duration: int | UnsetType = UNSET
    logprobs: list[Logprob] | UnsetType = UNSET


class ChatReply(Reply):
    message: ReplyMessage = ReplyMessage()


class GenerateReply(Reply):
    response: str = ""


class Details(Struct):
    parent_model: str = ""
    format: str = ""
    family: str = ""
    families: list[str] | None = None
    parameter_size: str = ""
    quantization_level: str = ""


class ModelEntry(Struct, kw_only=True):
    """A model of /api/tags; of /api/ps with its expiry, memory and context."""

    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: Details
    expires_at: str | UnsetType = UNSET
    size_vram: int | UnsetType = UNSET
    context_length: int | UnsetType = UNSET


class ModelList(Struct):
    models: list[ModelEntry]


class ShowReply(Struct, kw_only=True):
    modelfile: str
    parameters: str
    template: str
    details: Details
    model_info: dict[str, object]
    capabilities: list[str]
    modified_at: str


class Progress(Struct, omit_defaults=True):
    """A line of /api/pull: what it is doing; while downloading, the bytes of the files it fetches."""

    status: str
    digest: str | None = None
    total: int | None = None
    completed: int | None = None


class Version(Struct):
    version: str = OLLAMA_VERSION


class Error(Struct):
    error: str
