"""OpenAI's Responses API shapes, as declared types: the body of POST /v1/responses (strict: a field
OpenAI does not know is refused, a wrong type names the field) and the response object and stream
events this server writes. app.api.responses reads and answers them.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from app.bounds import MAX_MESSAGES, MAX_TOOLS, Metadata, MinP, Name, Penalty, Seed, Tokens, TopK, TopLogprobs, TopP
from app.api.openai import RepetitionPenalty, Temperature

# What the Responses API has and this server does not do: a 400 that says so, unless the value asks for nothing.
REFUSED = {
    "reasoning": "this model does not reason in a separate channel",
    "background": "background responses are not supported: ask with stream or wait for the reply",
    "conversation": "conversation objects are not supported: chain replies with previous_response_id",
    "prompt": "stored prompt templates are not supported: send instructions and input",
    "max_tool_calls": "max_tool_calls is not supported: use parallel_tool_calls false for one call",
}
HARMLESS = {"reasoning": [{}], "background": [False]}
LOGPROBS = "message.output_text.logprobs"  # the one `include` value that adds to this server's output
# The other values OpenAI's `include` takes ask for fields of items this server never writes (searches, code runs,
# images, reasoning): asking for them changes nothing.
Include = Literal["message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
                  "web_search_call.results", "web_search_call.action.sources", "code_interpreter_call.outputs",
                  "computer_call_output.output.image_url", "message.input_image.image_url"]


# ---- the body -----------------------------------------------------------------------------------

class InputText(Struct, tag_field="type", tag="input_text"):
    text: str


class OutputText(Struct, tag_field="type", tag="output_text"):
    """An earlier answer's text, as a client sends its own copy of the output back."""

    text: str
    annotations: list | None = None
    logprobs: list | None = None


class Refusal(Struct, tag_field="type", tag="refusal"):
    refusal: str


class InputFile(Struct, tag_field="type", tag="input_file", omit_defaults=True):
    """A file's bytes in base64 (or a data: URL) with its name; file_id and file_url are read to be refused."""

    file_data: str | None = None
    filename: str | None = None
    file_id: str | None = None
    file_url: str | None = None


class InputImage(Struct, tag_field="type", tag="input_image"):
    """Read to be refused by name: the models here read text."""

    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


Part = InputText | OutputText | Refusal | InputFile | InputImage


class MessageItem(Struct, tag_field="type", tag="message", kw_only=True):
    """A message of the input; `type` may be left out (app.api.responses adds it)."""

    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[Part], Meta(max_length=MAX_MESSAGES)]
    id: Name | None = None
    status: str | None = None


class FunctionCallItem(Struct, tag_field="type", tag="function_call", kw_only=True):
    """A call the model made earlier, sent back with its output."""

    call_id: Name
    name: Name
    arguments: str
    id: Name | None = None
    status: str | None = None


class FunctionCallOutputItem(Struct, tag_field="type", tag="function_call_output", kw_only=True):
    call_id: Name
    output: str | Annotated[list[InputText], Meta(max_length=MAX_MESSAGES)]
    id: Name | None = None
    status: str | None = None


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(Struct, tag_field="type", tag="function", kw_only=True, omit_defaults=True):
    name: Name
    description: str | None = None
    parameters: dict[str, object] | None = None  # a JSON schema (model.tools reads it)
    strict: bool | None = None


class FunctionChoice(Struct, tag_field="type", tag="function"):
    name: Name


class TextFormat(Struct, tag_field="type", tag="text", frozen=True, forbid_unknown_fields=True):
    pass


class JsonObjectFormat(Struct, tag_field="type", tag="json_object", forbid_unknown_fields=True):
    pass


class JsonSchemaFormat(Struct, tag_field="type", tag="json_schema", kw_only=True, omit_defaults=True,
                       forbid_unknown_fields=True):
    name: Name
    schema: dict[str, object]
    description: str | None = None
    strict: bool | None = None


class TextConfig(Struct, forbid_unknown_fields=True, omit_defaults=True):
    format: TextFormat | JsonObjectFormat | JsonSchemaFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # "low"/"high": refused as not supported (responses.py)


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_obfuscation: bool | None = None  # true: each text delta event carries random padding, `obfuscation`


class ResponseBody(Struct, forbid_unknown_fields=True, kw_only=True):
    model: Name | None = None
    input: str | Annotated[list[Item], Meta(min_length=1, max_length=MAX_MESSAGES)]
    instructions: str | None = None
    previous_response_id: Name | None = None
    tools: Annotated[list[FunctionTool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Tokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    truncation: Literal["auto", "disabled"] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    store: bool | None = None  # (default true: the response can be read back and continued)
    include: Annotated[list[Include], Meta(max_length=16)] | None = None
    top_logprobs: TopLogprobs | None = None  # with include's LOGPROBS: the most likely tokens at each place
    # not OpenAI's in this API; this server's chat route takes them too
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    seed: Seed | None = None
    # Labels of the request, with no effect on the reply.
    user: str | None = None
    metadata: Metadata | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None


# ---- the response -------------------------------------------------------------------------------

class OutputTextPart(Struct, kw_only=True):
    type: str = "output_text"
    text: str = ""
    annotations: list = []
    logprobs: list = []


class OutputMessage(Struct, kw_only=True):
    id: str
    type: str = "message"
    status: str = "completed"
    role: str = "assistant"
    content: list[OutputTextPart] = []


class OutputFunctionCall(Struct, kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str
    type: str = "function_call"
    status: str = "completed"


class InputTokensDetails(Struct, frozen=True):
    cached_tokens: int = 0  # input tokens whose keys and values this user's kept caches served


class OutputTokensDetails(Struct, frozen=True):
    reasoning_tokens: int = 0


class ResponseUsage(Struct, kw_only=True):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int = 0


class ResponseError(Struct):
    code: str
    message: str


class IncompleteDetails(Struct):
    reason: str  # "max_output_tokens"


class Response(Struct, kw_only=True):
    id: str
    object: str = "response"
    created_at: int
    status: str  # "in_progress", "completed", "incomplete" or "failed"
    model: str
    output: list[OutputMessage | OutputFunctionCall] = []
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = []
    tool_choice: str | FunctionChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = msgspec.field(default_factory=lambda: TextConfig(TextFormat()))
    truncation: str = "disabled"
    store: bool = True
    metadata: dict[str, str] = {}
    user: str | None = None


class DeletedResponse(Struct):
    id: str
    object: str = "response.deleted"
    deleted: bool = True


class ItemList(Struct, kw_only=True):
    data: list[dict]
    object: str = "list"
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class Event(Struct, kw_only=True, omit_defaults=True):
    """One event of a streamed response (server-sent, `event:` its type): only what it carries is written."""

    type: str
    sequence_number: int
    response: Response | UnsetType = UNSET
    output_index: int | UnsetType = UNSET
    content_index: int | UnsetType = UNSET
    item_id: str | UnsetType = UNSET
    item: OutputMessage | OutputFunctionCall | UnsetType = UNSET
    part: OutputTextPart | UnsetType = UNSET
    delta: str | UnsetType = UNSET
    text: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET
    name: str | UnsetType = UNSET
    logprobs: list | UnsetType = UNSET
    obfuscation: str | UnsetType = UNSET  # random padding of a delta (stream_options.include_obfuscation)
