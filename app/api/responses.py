"""OpenAI's Responses API over the same engine requests as the chat route:

    POST   /v1/responses                     input (a string or items: messages, function calls and their
                                             outputs, files), instructions, tools (function tools), tool_choice,
                                             parallel_tool_calls, text.format (json_object, json_schema),
                                             max_output_tokens, sampling fields, truncation, stream (the
                                             Responses events), previous_response_id, store, include
                                             (message.output_text.logprobs) and top_logprobs
    GET    /v1/responses/{id}                a stored response
    GET    /v1/responses/{id}/input_items    what it was asked (the items of its input, oldest first)
    DELETE /v1/responses/{id}

A body is read into its declared type (app.api.responses_shapes.ResponseBody: a wrong type or an unknown
field is a 400 naming it), then written as the chat body it means and read by app.api.parse.parse_chat:
messages, files, tools, tool choice and JSON schemas are read by one set of rules for both routes, and
the request the engine gets is the chat route's. An error of that reading names the Responses field
(`input[2].content[0]`, `text.format`).

Stored responses (store, by default true) are kept in memory, per user (the API key's user: app.api.keys), at
most STORED_PER_USER of them and STORED_BYTES_PER_USER of their conversations, the oldest going first, and
STORED_BYTES for all users together (the user longest unused losing theirs first). They are held as their JSON,
so those bounds are the memory they take. They are gone when the server restarts: previous_response_id names one of the same user's, else it is a 404.
A continued response is asked with the earlier one's whole conversation (its input and output, not its
instructions, as OpenAI does), which the engine's prefix cache finds already computed.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import Response as HttpResponse
from fastapi.responses import StreamingResponse

from app.api import responses_shapes as shapes
from app.api.openai import ApiError
from app.api.parse import ChatRequest, has_files, parse_chat, read_body
from app.api.body import json_body, json_response
from app.api.pieces import Finish, Piece, cancel_on_disconnect, pieces
from app.api.openai import Usage, chat_logprobs
from app.messages import TokenLogprob
from app.backend.protocol import Backend, InvalidRequest, ServerBusy
from app.files.read import READERS

STORED_PER_USER = 1_000
STORED_BYTES_PER_USER = 64 * 2**20  # their conversations as JSON (files in them as base64), as held in memory
STORED_USERS = 256  # the users with stored responses kept; the one longest unused goes first
STORED_BYTES = 256 * 2**20  # all users' together: past it, the stored responses of the user longest unused go


# ---- stored responses ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Stored:
    """A stored response as the JSON of its parts: what it holds in memory is what it counts (`size`, within the
    bytes objects' few dozen bytes each). Kept as Python objects, the same conversation took about 5x its JSON."""
    id: str
    response_json: bytes  # the Response object, as GET /v1/responses/{id} answers it
    messages_json: bytes  # the chat messages of its whole conversation, its output last (no instructions)
    items_json: bytes  # its input items, as asked

    @classmethod
    def of(cls, response: shapes.Response, messages: list[dict], items: list[dict]) -> Stored:
        return cls(response.id, _exact(response), _exact(messages), _exact(items))

    @property
    def messages(self) -> list[dict]:
        return msgspec.json.decode(self.messages_json)

    @property
    def items(self) -> list[dict]:
        return msgspec.json.decode(self.items_json)

    @property
    def size(self) -> int:
        return len(self.response_json) + len(self.messages_json) + len(self.items_json)


def _exact(value) -> bytes:
    """value's JSON in a bytes object of its length: msgspec's own keeps the room its buffer grew to (~1.4x)."""
    return bytes(memoryview(msgspec.json.encode(value)))


class Store:
    """Stored responses by user, in memory, bounded (STORED_PER_USER, STORED_BYTES_PER_USER, STORED_USERS) and
    all users' together by STORED_BYTES (those of the user longest unused go first)."""

    def __init__(self, per_user: int = STORED_PER_USER, bytes_per_user: int = STORED_BYTES_PER_USER,
                 users: int = STORED_USERS, total_bytes: int = STORED_BYTES):
        self.per_user, self.bytes_per_user, self.users, self.total_bytes = per_user, bytes_per_user, users, total_bytes
        self._by_user: OrderedDict[str, OrderedDict[str, Stored]] = OrderedDict()
        self._bytes: dict[str, int] = {}  # each user's stored bytes

    def get(self, user: str, response_id: str) -> Stored | None:
        return self._by_user.get(user, {}).get(response_id)

    def put(self, user: str, stored: Stored) -> None:
        """Keep `stored`, the user's oldest going while they are over the bounds (it too, where it alone is), then
        the users longest unused while all are over STORED_BYTES."""
        kept = self._by_user.setdefault(user, OrderedDict())
        self._by_user.move_to_end(user)
        self._forget(user, stored.id)
        kept[stored.id] = stored
        self._bytes[user] = self._bytes.get(user, 0) + stored.size
        while kept and (len(kept) > self.per_user or self._bytes[user] > self.bytes_per_user):
            self._forget(user, next(iter(kept)))
        while len(self._by_user) > self.users or (len(self._by_user) > 1 and self.bytes > self.total_bytes):
            self._bytes.pop(self._by_user.popitem(last=False)[0], None)

    @property
    def bytes(self) -> int:
        return sum(self._bytes.values())

    def delete(self, user: str, response_id: str) -> bool:
        return self._forget(user, response_id)

    def _forget(self, user: str, response_id: str) -> bool:
        gone = self._by_user.get(user, {}).pop(response_id, None)
        if gone is not None:
            self._bytes[user] -= gone.size
        return gone is not None


def not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"No response with id '{response_id}' is stored (stored responses are kept in memory until "
                         "the server restarts, and only for the user who asked them).", param=param,
                    code="response_not_found")


# ---- a Responses body as the chat body it means -------------------------------------------------

def read_response_body(body: object) -> shapes.ResponseBody:
    """The body as ResponseBody; messages written without "type" (OpenAI's easy input messages) take it."""
    if isinstance(body, dict) and isinstance(body.get("input"), list):
        body = body | {"input": [item | {"type": "message"} if isinstance(item, dict) and "type" not in item
                                 and "role" in item else item for item in body["input"]]}
    if isinstance(body, dict):
        for name, value in body.items():
            if name in shapes.REFUSED and value is not None and value not in shapes.HARMLESS.get(name, []):
                raise ApiError(400, f"'{name}': {shapes.REFUSED[name]}.", param=name, code="unsupported_parameter")
        body = {k: v for k, v in body.items() if k not in shapes.REFUSED}
        tools = body.get("tools")
        for i, tool in enumerate(tools if isinstance(tools, list) else []):  # (another type: read_body names it)
            if isinstance(tool, dict) and tool.get("type") != "function":
                raise ApiError(400, f"'tools[{i}]': the built-in tool {str(tool.get('type'))[:40]!r} is not supported "
                                    "here: only function tools are.", param=f"tools[{i}].type",
                               code="unsupported_parameter")
    return read_body(body, shapes.ResponseBody)


def chat_body(asked: shapes.ResponseBody, earlier: list[dict]) -> tuple[dict, list[dict], list[str]]:
    """The chat body of a Responses body continuing `earlier` (chat messages); the conversation's messages
    without the instructions (what a later response continues); and where each chat message came from."""
    items = [shapes.MessageItem(role="user", content=asked.input)] if isinstance(asked.input, str) else asked.input
    messages, where = list(earlier), ["previous_response_id"] * len(earlier)
    for i, item in enumerate(items):
        at = "input" if isinstance(asked.input, str) else f"input[{i}]"
        if isinstance(item, shapes.FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and where[-1].startswith("input"):
                messages[-1].setdefault("tool_calls", []).append(call)  # a turn's calls are one message's
                messages[-1]["content"] = messages[-1]["content"] or None
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, shapes.FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        else:
            messages.append({"role": "system" if item.role == "developer" else item.role,
                             "content": message_content(item, at)})
        where.append(at)
    body = {"model": asked.model, "messages": messages, "stream": bool(asked.stream)}
    if asked.instructions:  # first, and not carried on to a continuing response (as OpenAI's)
        body["messages"] = [{"role": "system", "content": asked.instructions}, *messages]
        where = ["instructions", *where]
    if asked.tools:
        body["tools"] = [{"type": "function", "function": msgspec.to_builtins(tool)} for tool in asked.tools]
    if isinstance(asked.tool_choice, shapes.FunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": asked.tool_choice.name}}
    elif asked.tool_choice is not None:
        body["tool_choice"] = asked.tool_choice
    if asked.text is not None and asked.text.verbosity in ("low", "high"):
        raise ApiError(400, f"'text.verbosity': {asked.text.verbosity!r} is not supported here: the model answers "
                            "at its own length (only 'medium', the default, is).", param="text.verbosity",
                       code="unsupported_parameter")
    if asked.text is not None and asked.text.format is not None:
        format = msgspec.to_builtins(asked.text.format)
        if isinstance(asked.text.format, shapes.JsonSchemaFormat):
            format = {"type": "json_schema", "json_schema": {k: v for k, v in format.items() if k != "type"}}
        body["response_format"] = format
    body |= {name: value for name in ("parallel_tool_calls", "temperature", "top_p", "top_k", "min_p",
                                      "repetition_penalty", "frequency_penalty", "presence_penalty", "seed")
             if (value := getattr(asked, name)) is not None}
    if asked.max_output_tokens is not None:
        body["max_completion_tokens"] = asked.max_output_tokens
    if shapes.LOGPROBS in (asked.include or []) or asked.top_logprobs:  # (top_logprobs alone asks for them too)
        body |= {"logprobs": True, "top_logprobs": asked.top_logprobs or 0}
    return body, [dict(m) for m in messages], where


def message_content(item: shapes.MessageItem, at: str) -> str | list[dict]:
    """A message's content in the chat body's terms: text, or text and file parts in the same order."""
    if isinstance(item.content, str):
        return item.content
    parts = []
    for j, part in enumerate(item.content):
        if isinstance(part, shapes.InputImage):
            raise ApiError(400, f"'{at}.content[{j}]': images are not supported: the models here read text.",
                           param=f"{at}.content[{j}]", code="unsupported_parameter")
        if isinstance(part, shapes.InputFile):
            if part.file_url is not None:
                raise ApiError(400, f"'{at}.content[{j}].file_url': files are not fetched from addresses here: "
                                    "send file_data (the file's bytes in base64) with its filename.",
                               param=f"{at}.content[{j}].file_url", code="unsupported_parameter")
            if item.role != "user":
                raise ApiError(400, f"'{at}.content[{j}]': only a user's message may carry files.",
                               param=f"{at}.content[{j}]")
            parts.append({"type": "file", "file": {k: v for k, v in msgspec.structs.asdict(part).items()
                                                   if v is not None}})
        else:
            parts.append({"type": "text", "text": part.refusal if isinstance(part, shapes.Refusal) else part.text})
    if item.role != "user":  # (the chat body takes text parts only for the others)
        return "".join(p["text"] for p in parts)
    return parts


CHAT_PARAM = re.compile(r"messages\[(\d+)\]")
CHAT_CALL = re.compile(r"messages\[(\d+)\]\.tool_calls\[(\d+)\]\.(?:function\.)?")  # a function_call item's field
CHAT_CALLS = re.compile(r"(?<=\])\.tool_calls\b(?!\[)")
INPUT_ITEM = re.compile(r"input\[(\d+)\]")
CHAT_NAMES = {"max_completion_tokens": "max_output_tokens", "response_format.json_schema": "text.format",
              "response_format": "text.format"}


def in_response_terms(error: ApiError, where: list[str]) -> ApiError:
    """A chat body's error named by the Responses body's fields."""
    def call_item(m: re.Match) -> str:  # call k of the assistant message made of items i, i + 1, ...
        first = INPUT_ITEM.fullmatch(where[int(m[1])] if int(m[1]) < len(where) else "")
        return f"input[{int(first[1]) + int(m[2])}]." if first else m[0]

    def rename(text: str | None) -> str | None:
        if not text:
            return text
        text = CHAT_CALL.sub(call_item, text)
        text = CHAT_PARAM.sub(lambda m: where[int(m[1])] if int(m[1]) < len(where) else m[0], text)
        text = CHAT_CALLS.sub("", text)  # a message's calls: the function_call items from the one named on
        text = text.replace(".file.", ".")
        for chat, ours in CHAT_NAMES.items():
            text = text.replace(chat, ours)
        return text
    param = "input" if error.param == "messages" else rename(error.param)  # (the whole conversation: too long)
    return ApiError(error.status, rename(error.message), type=error.type, param=param, code=error.code)


# ---- the routes ---------------------------------------------------------------------------------

def add_routes(router: APIRouter, backend: Backend, max_body_mb: int, store: Store | None = None) -> Store:
    """Add the Responses routes to the /v1 router (its key check is theirs); the store they keep."""
    store = store or Store()

    @router.post("/v1/responses")
    async def create_response(http_request: HttpRequest) -> HttpResponse:
        user = http_request.state.user
        raw = await json_body(http_request, max_body_mb)
        asked = read_response_body(raw)
        if asked.previous_response_id == "":
            raise ApiError(400, "Invalid 'previous_response_id': an empty string; leave it out to start a new "
                                "conversation.", param="previous_response_id")
        earlier = store.get(user, asked.previous_response_id) if asked.previous_response_id else None
        if asked.previous_response_id and earlier is None:
            raise not_found(asked.previous_response_id, param="previous_response_id")
        if earlier is not None and asked.store is not False and \
                earlier.size + len(msgspec.json.encode(raw["input"])) > store.bytes_per_user:
            raise ApiError(400, f"Invalid 'previous_response_id': its conversation and this input are over the "
                                f"{store.bytes_per_user:,} bytes of conversation a user's stored responses may "
                                "hold, so this response could not be kept: start a new conversation, or send "
                                "store: false.", param="previous_response_id")
        body, messages, where = chat_body(asked, earlier.messages if earlier else [])
        try:
            chat = await asyncio.get_running_loop().run_in_executor(
                READERS if has_files(body) else None, parse_chat, body, backend.profiles, backend.default)
        except ApiError as e:
            raise in_response_terms(e, where) from None
        chat.trim = asked.truncation == "auto"  # else a conversation too long is a 400, as OpenAI's "disabled"
        items = raw["input"] if isinstance(raw["input"], list) else [{"type": "message", "role": "user",
                                                                      "content": raw["input"]}]
        return await respond(http_request, asked, chat, Turn(store if asked.store is not False else None, user,
                                                             messages, items), backend, where)

    @router.get("/v1/responses/{response_id}")
    async def get_response(http_request: HttpRequest, response_id: str) -> HttpResponse:
        stored = store.get(http_request.state.user, response_id)
        if stored is None:
            raise not_found(response_id)
        return HttpResponse(stored.response_json, media_type="application/json")

    @router.get("/v1/responses/{response_id}/input_items")
    async def input_items(http_request: HttpRequest, response_id: str) -> HttpResponse:
        stored = store.get(http_request.state.user, response_id)
        if stored is None:
            raise not_found(response_id)
        return json_response(item_page(stored.items, http_request.query_params))

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(http_request: HttpRequest, response_id: str) -> HttpResponse:
        if not store.delete(http_request.state.user, response_id):
            raise not_found(response_id)
        return json_response(shapes.DeletedResponse(response_id))

    return store


def item_page(items: list[dict], query) -> shapes.ItemList:
    """A page of a response's input items as OpenAI lists them: `order` desc (newest first, the default) or
    asc, at most `limit` (1-100, 20), those `after` an item id or `before` one in that order; has_more when
    the list goes on past the page."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"Invalid 'order': {order[:20]!r}; expected 'asc' or 'desc'.", param="order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise ApiError(400, f"Invalid 'limit': {query.get('limit', '')[:20]!r}; expected an integer from 1 to 100.",
                       param="limit")
    listed = items if order == "asc" else items[::-1]
    ids = [item.get("id") for item in listed]
    start, end = 0, len(listed)
    for name in ("after", "before"):
        if (cursor := query.get(name)) is not None:
            if cursor not in ids:
                raise ApiError(400, f"Invalid '{name}': no input item {cursor[:80]!r} in this response.", param=name)
            if name == "after":
                start = ids.index(cursor) + 1
            else:
                end = ids.index(cursor)
    window = listed[start:end]
    page = window[-limit:] if "before" in query and "after" not in query else window[:limit]  # nearest the cursor
    return shapes.ItemList(data=page, first_id=page[0].get("id") if page else None,
                           last_id=page[-1].get("id") if page else None, has_more=len(window) > len(page))


@dataclass
class Turn:
    """Where a response is kept once it is done (store None: not kept), and what it continues."""

    store: Store | None
    user: str
    messages: list[dict]
    items: list[dict]

    def keep(self, response: shapes.Response) -> None:
        if self.store is None or response.status == "failed":
            return
        said = [item for item in response.output if isinstance(item, shapes.OutputMessage)]
        calls = [{"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in response.output if isinstance(c, shapes.OutputFunctionCall)]
        text = "".join(p.text for m in said for p in m.content)
        answer = {"role": "assistant", "content": text or None, "tool_calls": calls} if calls else \
            {"role": "assistant", "content": text}  # (an empty reply is continued as one: content "")
        messages = [*self.messages, answer]
        items = [as_item(item) for item in self.items]
        self.store.put(self.user, Stored.of(response, messages, items))


def as_item(item: dict) -> dict:
    """An input item as OpenAI lists it back: with its type and an id, a message's text as a part."""
    item = {"type": "message", **item}
    if item["type"] == "message" and isinstance(item.get("content"), str):
        kind = "output_text" if item.get("role") == "assistant" else "input_text"
        item["content"] = [{"type": kind, "text": item["content"]}]
    prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}.get(item["type"], "item")
    return item | {"id": item.get("id") or f"{prefix}_{uuid.uuid4().hex}"}


async def respond(http_request: HttpRequest, asked: shapes.ResponseBody, chat: ChatRequest, turn: Turn,
                  backend: Backend, where: list[str]) -> HttpResponse:
    """The response to a request, whole or streamed. What fails before the first piece of the reply (a prompt
    too long, a schema the engine refuses) is an HTTP error either way; later, a streamed response fails."""
    try:
        request = backend.stream(chat.conversation, chat.settings, **chat.options(), user=turn.user)
    except ServerBusy as e:
        return ApiError(429, f"The server is busy: {e}. Retry in a few seconds.", type="server_error",
                        code="server_busy").response()
    except InvalidRequest as e:
        return ApiError(400, f"The request cannot be computed: {e}.").response()
    watcher = asyncio.create_task(cancel_on_disconnect(http_request, request))
    replies = named(pieces(request), where)
    response = shapes.Response(
        id=f"resp_{uuid.uuid4().hex}", created_at=int(time.time()), status="in_progress", model=chat.model,
        instructions=asked.instructions, previous_response_id=asked.previous_response_id,
        max_output_tokens=asked.max_output_tokens, temperature=asked.temperature, top_p=asked.top_p,
        tools=asked.tools or [], tool_choice=asked.tool_choice or "auto",
        parallel_tool_calls=asked.parallel_tool_calls is not False,
        text=asked.text if asked.text and asked.text.format else shapes.TextConfig(shapes.TextFormat()),
        truncation=asked.truncation or "disabled", store=asked.store is not False, metadata=asked.metadata or {},
        user=asked.user)

    async def close() -> None:
        request.cancel()  # a no-op once it is done
        watcher.cancel()
        await replies.aclose()

    try:
        first = await anext(replies)  # waits for a place in the batch; errors are known by then
    except ApiError as e:
        await close()
        return e.response()
    if not asked.stream:
        try:
            text, logprobs, finish, usage = [], [], None, None
            async for item in resumed(first, replies):
                if isinstance(item, Piece):
                    text.append(item.text)
                    logprobs += item.logprobs
                elif isinstance(item, Finish):
                    finish = item
                else:
                    usage = item
        except ApiError as e:
            return e.response()
        finally:
            await close()
        done(response, "".join(text), finish, usage, logprobs)
        turn.keep(response)
        return json_response(response)

    obfuscate = bool(asked.stream_options and asked.stream_options.include_obfuscation)
    return StreamingResponse(events(response, resumed(first, replies), close, turn, obfuscate),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def named(replies: AsyncIterator, where: list[str]) -> AsyncIterator:
    """The replies' pieces, their errors named by the Responses body's fields."""
    try:
        async for item in replies:
            yield item
    except ApiError as e:
        raise in_response_terms(e, where) from None
    finally:
        await replies.aclose()


async def resumed(first, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for item in rest:
        yield item


def done(response: shapes.Response, text: str, finish: Finish | None, usage: Usage | None,
         logprobs: list[TokenLogprob] = ()) -> None:
    """The response, complete: its output items (the text's logprobs where they were asked), status and usage."""
    if text or not (finish and finish.tool_calls):
        response.output.append(shapes.OutputMessage(id=f"msg_{uuid.uuid4().hex}", content=[
            shapes.OutputTextPart(text=text, logprobs=chat_logprobs(logprobs).content)]))
    cut = finish is not None and finish.reason == "length"
    for call in finish.tool_calls if finish else []:
        function = call.get("function") or {}
        response.output.append(shapes.OutputFunctionCall(id=f"fc_{uuid.uuid4().hex}", call_id=call.get("id") or "",
                                                         name=function.get("name", ""),
                                                         arguments=function.get("arguments", ""),
                                                         status="incomplete" if cut else "completed"))
    response.status = "incomplete" if cut else "completed"
    response.incomplete_details = shapes.IncompleteDetails("max_output_tokens") if cut else None
    if usage is not None:
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        response.usage = shapes.ResponseUsage(input_tokens=usage.prompt_tokens,
                                              input_tokens_details=shapes.InputTokensDetails(cached),
                                              output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens)


async def events(response: shapes.Response, replies: AsyncIterator, close, turn: Turn,
                 obfuscate: bool = False) -> AsyncIterator[str]:
    """The Responses stream: created, then a message item whose text comes in deltas, then each function
    call item, then completed (or incomplete, or failed with the error). obfuscate: each delta with random
    padding of a random length (OpenAI's `obfuscation`), so that event sizes do not tell the tokens' lengths."""
    number = 0

    def event(type: str, **fields) -> str:
        nonlocal number
        number += 1
        shape = shapes.Event(type=type, sequence_number=number - 1, **fields)
        return f"event: {type}\ndata: {msgspec.json.encode(shape).decode()}\n\n"

    message = shapes.OutputMessage(id=f"msg_{uuid.uuid4().hex}", status="in_progress")
    text, logprobs, finish, usage, started = [], [], None, None, False
    try:
        yield event("response.created", response=response)
        yield event("response.in_progress", response=response)
        async for item in replies:
            if isinstance(item, Piece) and item.text:
                if not started:
                    started = True
                    yield event("response.output_item.added", output_index=0, item=message)
                    yield event("response.content_part.added", item_id=message.id, output_index=0, content_index=0,
                                part=shapes.OutputTextPart())
                text.append(item.text)
                logprobs += item.logprobs
                yield event("response.output_text.delta", item_id=message.id, output_index=0, content_index=0,
                            delta=item.text, logprobs=chat_logprobs(item.logprobs).content,
                            **({"obfuscation": secrets.token_urlsafe(secrets.randbelow(24) + 1)} if obfuscate else {}))
            elif isinstance(item, Finish):
                finish = item
            elif isinstance(item, Usage):
                usage = item
    except ApiError as e:
        response.status, response.error = "failed", shapes.ResponseError(e.code or e.type, e.message)
        yield event("response.failed", response=response)
        await close()
        return
    finally:
        await close()
    done(response, "".join(text), finish, usage, logprobs)
    if started:
        whole = response.output[0]
        whole.id = message.id
        part = whole.content[0]
        yield event("response.output_text.done", item_id=message.id, output_index=0, content_index=0, text=part.text,
                    logprobs=part.logprobs)
        yield event("response.content_part.done", item_id=message.id, output_index=0, content_index=0, part=part)
        yield event("response.output_item.done", output_index=0, item=whole)
    for index, item in enumerate(response.output):
        if isinstance(item, shapes.OutputMessage):
            if not started:  # an empty answer still has its item, as in the whole response
                yield event("response.output_item.added", output_index=index, item=item)
                yield event("response.output_item.done", output_index=index, item=item)
            continue
        yield event("response.output_item.added", output_index=index,
                    item=shapes.OutputFunctionCall(id=item.id, call_id=item.call_id, name=item.name, arguments="",
                                                   status="in_progress"))
        yield event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                    delta=item.arguments)
        yield event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                    arguments=item.arguments, name=item.name)
        yield event("response.output_item.done", output_index=index, item=item)
    turn.keep(response)
    yield event("response.incomplete" if response.status == "incomplete" else "response.completed", response=response)
