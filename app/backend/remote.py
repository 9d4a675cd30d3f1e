"""RemoteClient: the backend interface of `app.backend.engine_client.EngineClient`, over any OpenAI-compatible server.

With LLAMA_BACKEND_URL set, `app.backend.protocol.open_backend` returns this instead: the chat UI and the
HTTP API then front a serving cluster (vLLM, llama.cpp's server, another copy of this app's API,
...) instead of computing replies here. Each reply is one streaming
`POST {LLAMA_BACKEND_URL}/chat/completions`; its server-sent events become the same events a local
reply gives (Text, then Done or Failed). Stop closes the HTTP stream, which a well-behaved server
takes as a cancel. The server queues or batches requests itself, so nothing waits here.

A message's files go as text, in its content, in the blocks the engine writes (app.files.prompt), not as
OpenAI "file" parts, which few servers take (vLLM and llama.cpp's do not). Which chunks of a long file go
is decided here as the engine decides it, with tokens estimated from characters (there is no tokenizer
here) against LLAMA_MAX_CONTEXT, and reported the same way (Done.context.files), so the web side keeps the
decision and the message is sent the same on later turns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit

import httpx
import msgspec

from model.config import DEFAULT_MAX_CONTEXT
from model.options import DEFAULT_MAX_NEW_TOKENS

from app.backend.conversation import Conversation
from app.files.prompt import choose_files, files_share, render, without_files
from app.messages import (
    ChatMessage,
    Context,
    Done,
    EngineStats,
    Event,
    Failed,
    FileUse,
    ModelInfo,
    ReplySettings,
    Stats,
    Text,
    TokenLogprob,
)
from app.backend.reply import STREAM_INTERVAL, Reply
from app.api.openai import (
    Call,
    ChatCompletionChunk,
    ChatLogprobs,
    ErrorBody,
    ErrorObject,
    ModelList,
    TextChoice,
    TextCompletion,
    TextLogprobs,
    Usage,
)
from app.settings import Settings, SettingsError

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request in the app's log

# Used for the settings panel when neither LLAMA_* nor the server says otherwise (Llama 3's defaults).
FALLBACK = ReplySettings(max_new_tokens=DEFAULT_MAX_NEW_TOKENS, temperature=0.6, top_k=0, top_p=0.9, min_p=0.0,
                         repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
CHARS_PER_TOKEN = 3  # the estimate of a file's tokens: about 4 characters make a token of English; 3 leaves room
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0  # between two pieces of a reply, waiting in the server's queue included


def files_as_text(messages: list[ChatMessage], limit: int,
                  max_new_tokens: int) -> tuple[list[ChatMessage], list[FileUse]]:
    """The messages with their files decided (app.files.prompt.choose_files) by estimated tokens, and how the
    last user message's files went in."""
    def estimate(text: str) -> int:
        return len(text) // CHARS_PER_TOKEN + 1

    system = [m for m in messages if m.role == "system"]

    def room_for(message: ChatMessage) -> int:
        return files_share(limit, max_new_tokens) - sum(estimate(render(m)) for m in system + [without_files(message)])

    return choose_files(messages, room_for, estimate)


def api_base(url: str) -> str:
    """The base URL requests are made under: the given one, with /v1 added when it has no path."""
    url = url.rstrip("/")
    return url if urlsplit(url).path.strip("/") else f"{url}/v1"


class RemoteClient:
    """Replies computed by an OpenAI-compatible server; profiles are the models it serves."""

    def __init__(self, url: str, models: list[str], *, default: str | None = None, key: str | None = None,
                 max_context: int = DEFAULT_MAX_CONTEXT, defaults: ReplySettings = ReplySettings(),
                 stream_interval: float = STREAM_INTERVAL):
        if not models:
            raise ValueError(f"{url} serves no models")
        self.url = api_base(url)
        self.profiles = {name: self.url for name in models}
        self.default = default or models[0]
        if self.default not in self.profiles:
            raise ValueError(f"default model {self.default!r} is not one of {', '.join(self.profiles)}")
        self.key = key
        self.max_context = max_context
        self.defaults = defaults
        self.stream_interval = stream_interval
        self._running: dict[Reply, asyncio.Task] = {}
        self.observers: list[Callable[[Event], None]] = []  # called with each reply's last event (metrics)

    @classmethod
    def from_settings(cls, settings: Settings, **options) -> RemoteClient:
        """LLAMA_BACKEND_URL's models (GET /models): LLAMA_BACKEND_MODEL first when set."""
        url, chosen = api_base(settings.backend_url), settings.backend_model
        try:
            models = list_models(url, settings.backend_key)
        except (httpx.HTTPError, ValueError) as e:
            if not chosen:
                raise SettingsError(f"LLAMA_BACKEND_URL={settings.backend_url}: could not list its models "
                                    f"(GET {url}/models): {e}. Check the address (it usually ends in /v1), "
                                    "or name the model with LLAMA_BACKEND_MODEL.") from None
            log.warning("could not list the models of %s (%s); using %s", url, e, chosen)
            models = []
        if chosen:
            models = [chosen] + [m for m in models if m != chosen]
        if not models:
            raise SettingsError(f"LLAMA_BACKEND_URL={settings.backend_url}: the server lists no models; "
                                "name one with LLAMA_BACKEND_MODEL")
        defaults = ReplySettings(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                                 top_k=settings.top_k, top_p=settings.top_p, min_p=settings.min_p,
                                 repetition_penalty=settings.repetition_penalty)
        return cls(url, models, key=settings.backend_key, max_context=settings.max_context or DEFAULT_MAX_CONTEXT, defaults=defaults,
                   **options)

    # -- what EngineClient offers

    ready = True  # the server has its models

    async def start(self) -> None:
        """Nothing to start: the models were listed when this was made."""

    def is_loaded(self, name: str | None = None) -> bool:
        return True

    def in_memory(self, name: str | None = None) -> None:
        """Not known: an OpenAI-compatible server does not say which of its models are loaded."""
        return None

    async def load(self, name: str | None = None) -> ModelInfo:
        """Nothing to load here: the server has its models."""
        return ModelInfo(name or self.default, self.max_context, self.reply_defaults(name))

    def context_limit(self, name: str | None = None) -> int:
        return self.max_context

    def reply_defaults(self, name: str | None = None) -> ReplySettings:
        return self.defaults.over(FALLBACK)

    def memory_bytes(self, name: str | None = None) -> None:
        return None

    def device_memory_bytes(self, name: str | None = None) -> int:
        return 0

    def keep_alive(self, name: str | None, seconds: float | None) -> None:
        """Nothing: the server keeps its models loaded as it sees fit."""

    def unloads_at(self, name: str | None = None) -> None:
        """Not known (nor whether the model is loaded: in_memory)."""
        return None

    async def find_models(self) -> dict[str, str]:
        """The server's models, as listed when this was made."""
        return self.profiles

    def stream(self, conversation: Conversation, settings: ReplySettings | None = None, n: int = 1,
               user: str = "", **options) -> Reply:
        """Start a reply (n replies) to the conversation's last message; call from the event loop that
        iterates it. options: as EngineClient.stream's (tools, json_schema, logprobs, ...). The user is not
        sent on: that server knows only LLAMA_BACKEND_KEY, and scopes its caches by that."""
        if not conversation.messages:
            raise ValueError("the conversation has no message to reply to")
        reply = self._reply(conversation, settings, n)
        chat, files = files_as_text(conversation.chat_messages(), self.max_context,
                                    reply.settings.over(FALLBACK).max_new_tokens)
        messages = [{"role": m.role, "content": render(m),
                     **{k: v for k in ("tool_calls", "tool_call_id") if (v := getattr(m, k))}}
                    for m in chat]
        request = {"messages": messages, **chat_options(**options)}
        return self._start(reply, "chat/completions", request, files)

    def complete(self, prompt: str, model: str | None = None, settings: ReplySettings | None = None,
                 n: int = 1, logprobs: int | None = None, user: str = "") -> Reply:
        """Continue a raw text prompt (POST /completions); otherwise as stream()."""
        return self._start(self._reply(Conversation(model=model), settings, n), "completions",
                           {"prompt": prompt, "logprobs": logprobs})

    def _reply(self, conversation: Conversation, settings: ReplySettings | None, n: int) -> Reply:
        model = conversation.model or self.default
        if model not in self.profiles:
            raise ValueError(f"no model named {model!r}; there are: {', '.join(self.profiles)}")
        return Reply(conversation, (settings or ReplySettings()).over(self.defaults), model, self._cancel,
                     self.stream_interval, n)

    def _start(self, reply: Reply, path: str, request: dict, files: list[FileUse] | None = None) -> Reply:
        """files: how the last message's files went in (its Done's context says so)."""
        self._running[reply] = asyncio.get_running_loop().create_task(self._run(reply, path, request, files or []))
        return reply

    def cancel(self, request_id: str) -> bool:
        found = [r for r in self._running if r.id == request_id]
        for reply in found:
            reply.cancel()
        return bool(found)

    @property
    def active(self) -> int:
        """Replies being streamed from the server."""
        return len(self._running)

    @property
    def places_taken(self) -> int:
        """Nothing waits here (the server has its own queue): the replies streaming, n for a request of n."""
        return sum(reply.n for reply in self._running)

    restarts = 0  # (the server's own restarts are not seen from here)

    @property
    def stats(self) -> EngineStats:
        """What is known here of the server's state: the replies streaming from it."""
        return EngineStats(running=len(self._running))

    def _deliver(self, reply: Reply, event: Event) -> None:
        reply.deliver(event)
        if isinstance(event, Done | Failed):
            for observe in self.observers:
                observe(event)

    def close(self, timeout: float = 10.0) -> None:
        for reply in list(self._running):
            reply.cancel()

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def _cancel(self, reply: Reply) -> None:
        """Close the reply's HTTP stream (safe from any thread)."""
        task = self._running.get(reply)
        if task is not None:
            try:
                task.get_loop().call_soon_threadsafe(task.cancel)
            except RuntimeError:  # the loop is closed: the task is gone with it
                pass

    def body(self, reply: Reply, request: dict) -> dict:
        """The request's body: its messages or prompt, the reply's settings, streamed with usage."""
        s = reply.settings
        body = {"model": reply.model, **request, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p, "seed": s.seed,
                "stop": list(s.stop) or None, "n": reply.n if reply.n > 1 else None}
        body |= {"frequency_penalty": s.frequency_penalty or None, "presence_penalty": s.presence_penalty or None}
        # not OpenAI's; vLLM, llama.cpp's server and this app's API take them
        body |= {"top_k": s.top_k or None, "min_p": s.min_p or None,
                 "repetition_penalty": s.repetition_penalty if s.repetition_penalty not in (None, 1.0) else None}
        if s.logit_bias:
            body["logit_bias"] = {str(token): bias for token, bias in s.logit_bias.items()}
        if s.ignore_eos:
            body["ignore_eos"] = True
        return {k: v for k, v in body.items() if v is not None}

    async def _run(self, reply: Reply, path: str, request: dict, files: list[FileUse]) -> None:
        pieces: dict[int, list[str]] = {i: [] for i in range(reply.n)}
        finish: dict[int, str | None] = {i: None for i in range(reply.n)}
        calls: dict[int, dict[int, dict]] = {i: {} for i in range(reply.n)}  # reply -> call index -> call
        started, first = time.perf_counter(), None
        usage = Usage()

        def stats(index: int) -> Stats:
            now = time.perf_counter()
            tokens = usage.completion_tokens if reply.n == 1 else None  # the server's count is of all n
            return Stats(prompt_tokens=usage.prompt_tokens,
                         new_tokens=int(tokens or len(pieces[index])),
                         time_to_first_token=(first or now) - started, total_time=now - started)

        def done(reason_of) -> None:
            for i in range(reply.n):
                self._deliver(reply, Done(reply.id, "".join(pieces[i]), reason_of(i), stats(i), index=i,
                                          tool_calls=[calls[i][k] for k in sorted(calls[i])],
                                          context=Context(self.max_context, files=files)))  # (it leaves nothing out)

        url = f"{self.url}/{path}"
        try:
            if reply.cancelled:
                raise asyncio.CancelledError
            timeout = httpx.Timeout(CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S)
            async with httpx.AsyncClient(timeout=timeout) as client:
                async with client.stream("POST", url, json=self.body(reply, request),
                                         headers=self.headers()) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        self._deliver(reply, http_failure(reply.id, response, reply.model))
                        return
                    # read to the end, never break off: an abandoned httpx stream iterator is closed
                    # later, by the garbage collector, in another task, which anyio refuses noisily
                    failure = None
                    shape = ChatCompletionChunk if path == "chat/completions" else TextCompletion
                    async for data in sse_data(response):
                        if data == "[DONE]" or failure:
                            continue
                        try:
                            item = msgspec.json.decode(data)
                            if isinstance(item, dict) and "error" in item:
                                failure = Failed(reply.id, f"The backend failed: {error_message(item)}", "error")
                                continue
                            chunk = msgspec.convert(item, shape)
                        except (msgspec.DecodeError, msgspec.ValidationError) as e:  # not the stream the API describes
                            failure = Failed(reply.id, f"The backend at {self.url} sent something unexpected: "
                                                       f"{e} in {data[:200]!r}", "error")
                            continue
                        for choice in chunk.choices:
                            index = choice.index
                            if not 0 <= index < reply.n:
                                failure = Failed(reply.id, f"The backend at {self.url} sent a choice {index} of "
                                                           f"{reply.n}", "error")
                                break
                            piece = choice.text if isinstance(choice, TextChoice) else choice.delta.content
                            logprobs = read_logprobs(choice.logprobs)
                            if piece or logprobs:
                                first = first or time.perf_counter()
                                pieces[index].append(piece or "")
                                reply.deliver(Text(reply.id, piece or "", index, logprobs))
                            for call in () if isinstance(choice, TextChoice) else choice.delta.tool_calls or ():
                                add_call_delta(calls[index], call)
                            finish[index] = choice.finish_reason or finish[index]
                        usage = chunk.usage or usage
                    if failure:
                        self._deliver(reply, failure)
                        return
            done(lambda i: "length" if finish[i] == "length" else "stop")
        except asyncio.CancelledError:  # cancel(): leaving the `async with` closed the stream
            done(lambda i: "cancelled")
        except httpx.HTTPError as e:
            self._deliver(reply, Failed(reply.id, f"The backend at {self.url} could not be reached or broke off: "
                                                  f"{type(e).__name__}: {e}", "error"))
        except (ValueError, TypeError) as e:  # the body is not JSON (a NaN, a lone surrogate): never sent
            self._deliver(reply, Failed(reply.id, f"The request could not be sent to the backend: {e}", "error"))
        finally:
            self._running.pop(reply, None)


def chat_options(tools=None, tool_choice=None, parallel_tool_calls=True, json_schema=None, json_object=False,
                 logprobs=None, trim=True) -> dict:
    """The body fields of a chat request for EngineClient.stream's options. (trim: an OpenAI-compatible server
    never trims; messages that do not fit are its 400 context_length_exceeded, a Failed "prompt_too_long".)"""
    response_format = ({"type": "json_schema", "json_schema": {"name": "reply", "schema": json_schema}}
                       if json_schema is not None else {"type": "json_object"} if json_object else None)
    return {"tools": tools, "tool_choice": tool_choice if tools else None,
            "parallel_tool_calls": None if parallel_tool_calls or not tools else False,
            "response_format": response_format, "logprobs": True if logprobs is not None else None,
            "top_logprobs": logprobs or None}


def add_call_delta(calls: dict[int, dict], delta: Call) -> None:
    """Merge a streamed tool-call delta (its id, name and pieces of its arguments) into the calls so far."""
    index = delta.index if isinstance(delta.index, int) else 0
    call = calls.setdefault(index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
    call["id"] = delta.id or call["id"]
    call["function"]["name"] += delta.function.name
    call["function"]["arguments"] += delta.function.arguments


def read_logprobs(report: ChatLogprobs | TextLogprobs | None) -> list[TokenLogprob]:
    """A choice's logprobs, in the chat shape or the completions one (parallel lists)."""
    if isinstance(report, ChatLogprobs):
        return [TokenLogprob(e.token, e.bytes or list(e.token.encode()), e.logprob,
                             [TokenLogprob(t.token, t.bytes or list(t.token.encode()), t.logprob)
                              for t in e.top_logprobs]) for e in report.content or []]
    if isinstance(report, TextLogprobs):
        tops = report.top_logprobs or [{}] * len(report.tokens)
        return [TokenLogprob(token, list(token.encode()), logprob,
                             [TokenLogprob(t, list(t.encode()), lp) for t, lp in (top or {}).items()])
                for token, logprob, top in zip(report.tokens, report.token_logprobs, tops)]
    return []


def list_models(url: str, key: str | None = None) -> list[str]:
    """The ids of GET {url}/models."""
    response = httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {key}"} if key else {},
                         timeout=CONNECT_TIMEOUT_S)
    response.raise_for_status()
    try:
        return [card.id for card in msgspec.json.decode(response.content, type=ModelList).data]
    except msgspec.DecodeError as e:
        raise ValueError(f"the answer is not a list of models: {e}") from None


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The data of each server-sent event (data lines joined; comments and other fields skipped)."""
    data: list[str] = []
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield "\n".join(data)


def error_message(body: object) -> str:
    """The message of OpenAI's error object, or what came instead of one."""
    try:
        error = msgspec.convert(body, ErrorBody).error
    except msgspec.ValidationError:
        error = None
    if isinstance(error, ErrorObject) and error.message:
        return error.message
    return str(error or body)[:500]


def http_failure(request_id: str, response: httpx.Response, model: str) -> Failed:
    """The Failed event for an error answer, with its reason as a local reply would have it."""
    try:
        body = response.json()
    except ValueError:
        body = response.text
    message = error_message(body)
    try:
        error = msgspec.convert(body, ErrorBody).error
    except msgspec.ValidationError:
        error = None
    code = error.code if isinstance(error, ErrorObject) else None
    if code == "context_length_exceeded":
        return Failed(request_id, message, "prompt_too_long")
    if response.status_code == 404:
        return Failed(request_id, f"The backend has no model {model}: {message}", "load")
    if response.status_code in (401, 403):
        return Failed(request_id, f"The backend refused the request (check LLAMA_BACKEND_KEY): {message}", "error")
    if response.status_code == 400:
        return Failed(request_id, f"The backend refused the request: {message}", "bad_request")
    return Failed(request_id, f"The backend answered {response.status_code}: {message}", "error")
