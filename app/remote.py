"""RemoteService: the GenerationService interface over any OpenAI-compatible server.

With LLAMA_BACKEND_URL set, `GenerationService.from_settings` returns this instead: the chat UI
and the HTTP API then front a serving cluster (vLLM, llama.cpp's server, another copy of this app's
API, ...) instead of computing replies here. Each reply is one streaming
`POST {LLAMA_BACKEND_URL}/chat/completions`; its server-sent events become the same events a local
reply gives (Text, then Done or Failed). Stop closes the HTTP stream, which a well-behaved server
takes as a cancel. The server queues or batches requests itself, so nothing waits here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx

from model.generate import GenerationStats

from .service import STREAM_INTERVAL, Conversation, Done, Failed, ReplySettings, Request, Text
from .settings import DEFAULT_MAX_NEW_TOKENS, Settings, SettingsError

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request in the app's log

# Used for the settings panel when neither LLAMA_* nor the server says otherwise (Llama 3's defaults).
FALLBACK = ReplySettings(max_new_tokens=DEFAULT_MAX_NEW_TOKENS, temperature=0.6, top_k=0, top_p=0.9)
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0  # between two pieces of a reply, waiting in the server's queue included


def api_base(url: str) -> str:
    """The base URL requests are made under: the given one, with /v1 added when it has no path."""
    url = url.rstrip("/")
    return url if urlsplit(url).path.strip("/") else f"{url}/v1"


class RemoteService:
    """Replies computed by an OpenAI-compatible server; profiles are the models it serves."""

    def __init__(self, url: str, models: list[str], *, default: str | None = None, key: str | None = None,
                 max_context: int = 8192, defaults: ReplySettings = ReplySettings(),
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
        self._running: set[RemoteRequest] = set()

    @classmethod
    def from_settings(cls, settings: Settings, **options) -> RemoteService:
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
                                 top_k=settings.top_k, top_p=settings.top_p)
        return cls(url, models, key=settings.backend_key, max_context=settings.max_context, defaults=defaults,
                   **options)

    # -- what GenerationService offers

    def is_loaded(self, name: str | None = None) -> bool:
        return True

    async def load(self, name: str | None = None) -> None:
        """Nothing to load here: the server has its models."""

    def context_limit(self, name: str | None = None) -> int:
        return self.max_context

    def reply_defaults(self, name: str | None = None) -> ReplySettings:
        return self.defaults.over(FALLBACK)

    def stream(self, conversation: Conversation, settings: ReplySettings | None = None) -> RemoteRequest:
        """Start a reply to the conversation's last message; call from the event loop that iterates it."""
        if not conversation.messages:
            raise ValueError("the conversation has no message to reply to")
        model = conversation.model or self.default
        if model not in self.profiles:
            raise ValueError(f"no model named {model!r}; there are: {', '.join(self.profiles)}")
        return RemoteRequest(self, conversation, (settings or ReplySettings()).over(self.defaults), model,
                             self.stream_interval)

    def cancel(self, request_id: str) -> bool:
        found = [r for r in self._running if r.id == request_id]
        for request in found:
            request.cancel()
        return bool(found)

    @property
    def waiting(self) -> int:
        return 0

    @property
    def active(self) -> int:
        """Replies being streamed from the server."""
        return len(self._running)

    def close(self, timeout: float = 10.0) -> None:
        for request in list(self._running):
            request.cancel()

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def _withdraw(self, request: Request) -> None:
        self._running.discard(request)


def list_models(url: str, key: str | None = None) -> list[str]:
    """The ids of GET {url}/models."""
    response = httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {key}"} if key else {},
                         timeout=CONNECT_TIMEOUT_S)
    response.raise_for_status()
    data = response.json().get("data")
    if not isinstance(data, list):
        raise ValueError("the answer has no 'data' list")
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


class RemoteRequest(Request):
    """One reply streamed from the server: iterate it (async) for events; `cancel()` closes the stream."""

    def __init__(self, service: RemoteService, conversation: Conversation, settings: ReplySettings, model: str,
                 stream_interval: float):
        super().__init__(service, conversation, settings, model, stream_interval)
        self.service: RemoteService = service
        service._running.add(self)
        self._task = self._loop.create_task(self._run())

    def cancel(self) -> None:
        """Stop this reply: the HTTP stream is closed. Safe from any thread, and twice."""
        self.stop.set()
        try:
            self._loop.call_soon_threadsafe(self._task.cancel)
        except RuntimeError:  # the loop is closed: the task is gone with it
            pass

    def body(self) -> dict:
        dialog = Conversation(system_prompt=self.system_prompt, messages=self.messages).dialog()
        s = self.settings
        body = {"model": self.model, "messages": dialog, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p, "seed": s.seed}
        if s.top_k:  # not OpenAI's; vLLM and this app's API take it
            body["top_k"] = s.top_k
        return {k: v for k, v in body.items() if v is not None}

    async def _run(self) -> None:
        pieces: list[str] = []
        started, first = time.perf_counter(), None
        usage, finish = {}, None

        def stats() -> GenerationStats:
            now = time.perf_counter()
            return GenerationStats(prompt_tokens=int(usage.get("prompt_tokens") or 0),
                                   new_tokens=int(usage.get("completion_tokens") or len(pieces)),
                                   time_to_first_token=(first or now) - started, total_time=now - started)

        url = f"{self.service.url}/chat/completions"
        try:
            if self.stop.is_set():
                raise asyncio.CancelledError
            timeout = httpx.Timeout(CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S)
            async with httpx.AsyncClient(timeout=timeout) as client:
                async with client.stream("POST", url, json=self.body(), headers=self.service.headers()) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        self.emit(http_failure(response, self.model))
                        return
                    # read to the end, never break off: an abandoned httpx stream iterator is closed
                    # later, by the garbage collector, in another task, which anyio refuses noisily
                    failure = None
                    async for data in sse_data(response):
                        if data == "[DONE]" or failure:
                            continue
                        try:
                            chunk = json.loads(data)
                            if "error" in chunk:
                                failure = Failed(f"The backend failed: {error_message(chunk)}", "error")
                                continue
                            for choice in chunk.get("choices") or []:
                                piece = (choice.get("delta") or {}).get("content")
                                if piece:
                                    first = first or time.perf_counter()
                                    pieces.append(piece)
                                    self.emit(Text(piece))
                                finish = choice.get("finish_reason") or finish
                            usage = chunk.get("usage") or usage
                        except (ValueError, TypeError, AttributeError) as e:  # not the stream the API describes
                            failure = Failed(f"The backend at {self.service.url} sent something unexpected: "
                                             f"{type(e).__name__}: {e} in {data[:200]!r}", "error")
                    if failure:
                        self.emit(failure)
                        return
            self.emit(Done("".join(pieces), "length" if finish == "length" else "stop", stats()))
        except asyncio.CancelledError:  # cancel(): leaving the `async with` closed the stream
            self.emit(Done("".join(pieces), "cancelled", stats()))
        except httpx.HTTPError as e:
            self.emit(Failed(f"The backend at {self.service.url} could not be reached or broke off: "
                             f"{type(e).__name__}: {e}", "error"))
        finally:
            self.service._running.discard(self)


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
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return str(error or body)[:500]


def http_failure(response: httpx.Response, model: str) -> Failed:
    """The Failed event for an error answer, with its reason as a local reply would have it."""
    try:
        body = response.json()
    except ValueError:
        body = response.text
    message = error_message(body)
    code = body.get("error", {}).get("code") if isinstance(body, dict) and isinstance(body.get("error"), dict) else None
    if code == "context_length_exceeded":
        return Failed(message, "prompt_too_long")
    if response.status_code == 404:
        return Failed(f"The backend has no model {model}: {message}", "load")
    if response.status_code in (401, 403):
        return Failed(f"The backend refused the request (check LLAMA_BACKEND_KEY): {message}", "error")
    if response.status_code == 400:
        return Failed(f"The backend refused the request: {message}", "bad_request")
    return Failed(f"The backend answered {response.status_code}: {message}", "error")
