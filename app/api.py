"""An OpenAI-compatible HTTP API over the GenerationService the chat UI uses.

    POST /v1/chat/completions   model, messages, temperature, top_p, top_k, max_tokens (or
                                max_completion_tokens), seed, stop, stream (server-sent events),
                                stream_options.include_usage
    GET  /v1/models             the models offered: the service's profiles
    GET  /v1/models/{model}

The chat app mounts these routes on Chainlit's server (`mount`), so API requests wait in the same
queue as the chats. `python -m app.api --port 8001` serves them alone. Errors have OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`: 400 for a bad parameter or a prompt too long for
the context (code context_length_exceeded), 401 for a missing or wrong key when LLAMA_API_KEY is
set, 404 for an unknown model. A client that goes away cancels its request. Sampling values left
out are the model's defaults, as in the UI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import math
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .service import Conversation, Done, Failed, ReplySettings, Text, Trimmed

log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 4
DISCONNECT_POLL_S = 0.25
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


# ---- the request --------------------------------------------------------------------------------

@dataclass
class ChatRequest:
    model: str
    conversation: Conversation
    settings: ReplySettings
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


def parse_chat_request(body: object, profiles: dict, default: str) -> ChatRequest:
    """A /v1/chat/completions body -> ChatRequest; ApiError (400, 404) names what is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    model = body.get("model")
    if model is None or model == "":
        model = default
    if not isinstance(model, str):
        raise ApiError(400, f"'model' must be a string, not {json.dumps(model)}.", param="model")
    if model not in profiles:
        raise ApiError(404, f"The model '{model}' does not exist. Available: {', '.join(profiles)}.",
                       param="model", code="model_not_found")
    n = body.get("n")
    if n is not None and n != 1:
        raise ApiError(400, f"'n' must be 1: one reply is computed per request, not {json.dumps(n)}.",
                       param="n", code="invalid_value")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object.", param="stream_options")
    max_tokens = _number(body, "max_completion_tokens", int, low=1)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", int, low=1)
    settings = ReplySettings(max_new_tokens=max_tokens,
                             temperature=_number(body, "temperature", float, low=0, high=2),
                             top_k=_number(body, "top_k", int, low=0),
                             top_p=_number(body, "top_p", float, low=0, high=1),
                             seed=_number(body, "seed", int))
    return ChatRequest(model=model, conversation=_conversation(body.get("messages"), model),
                       settings=settings, stop=_stop(body.get("stop")), stream=stream,
                       include_usage=bool(options and _flag(options, "include_usage", "stream_options.include_usage")))


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
        content = _text(message.get("content"), f"{where}.content")
        if role == "system":
            system.append(content)
        else:
            conversation.add(role, content)
    if not conversation.messages or conversation.messages[-1].role != "user":
        raise ApiError(400, "The last message (after any system messages) must be the user's: it is the one "
                            "answered.", param="messages")
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


# ---- the reply ----------------------------------------------------------------------------------

class StopScanner:
    """Cuts streamed text at the first stop string, holding back a tail that may begin one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text that is sure to come before any stop string."""
        if self.stopped:
            return ""
        self.held += text
        found = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            out, self.held = self.held[:min(found)], ""
            return out
        keep = next((k for k in range(min(len(self.held), max((len(s) for s in self.stops), default=1) - 1), 0, -1)
                     if any(s.startswith(self.held[-k:]) for s in self.stops)), 0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


@dataclass
class Finish:
    reason: str  # "stop" or "length"
    usage: dict


async def deltas(request, stop: list[str]) -> AsyncIterator[str | Finish]:
    """The reply's text in pieces, cut at a stop string, then a Finish. Raises ApiError when the
    request cannot be answered (before any text, except for a failure midway)."""
    scanner = StopScanner(stop)
    async for event in request:
        if isinstance(event, Text):
            text = scanner.feed(event.text)
            if text:
                yield text
            if scanner.stopped:
                request.cancel()  # the rest is not wanted: free the model
        elif isinstance(event, Trimmed):
            request.cancel()
            raise ApiError(400, "The messages do not fit in the model's context together with the reply "
                                "(max_tokens, or the server's longest reply). Send fewer or shorter messages, or "
                                "ask for a shorter reply.", param="messages", code="context_length_exceeded")
        elif isinstance(event, Failed):
            raise failure_error(event)
        elif isinstance(event, Done):
            tail = scanner.flush()
            if tail:
                yield tail
            s = event.stats
            reason = "length" if event.finish_reason == "length" and not scanner.stopped else "stop"
            yield Finish(reason, {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.new_tokens,
                                  "total_tokens": s.prompt_tokens + s.new_tokens})


def failure_error(failed: Failed) -> ApiError:
    if failed.reason == "prompt_too_long":
        return ApiError(400, failed.message, param="messages", code="context_length_exceeded")
    if failed.reason == "bad_request":
        return ApiError(400, failed.message)
    return ApiError(500 if failed.reason == "error" else 503, failed.message, type="server_error")


async def cancel_on_disconnect(http_request: HttpRequest, request) -> None:
    """Cancel the request when its client goes away (checked a few times a second)."""
    while True:
        if await http_request.is_disconnected():
            log.info("request %s: the client went away; cancelled", request.id)
            request.cancel()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


# ---- routes -------------------------------------------------------------------------------------

def create_router(service, api_key: str | None = None) -> APIRouter:
    """The /v1 routes over a GenerationService (or anything with its profiles, default and stream())."""
    router = APIRouter()
    started = int(time.time())

    def check_key(http_request: HttpRequest) -> None:
        if not api_key:
            return
        scheme, _, token = http_request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "No API key given: send it as 'Authorization: Bearer <key>'.", code="invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "Incorrect API key.", code="invalid_api_key")

    def model_card(name: str) -> dict:
        path = service.profiles[name]
        created = int(path.stat().st_mtime) if isinstance(path, Path) and path.exists() else started
        return {"id": name, "object": "model", "created": created, "owned_by": "llama-chat"}

    @router.get("/v1/models")
    async def list_models(http_request: HttpRequest) -> Response:
        try:
            check_key(http_request)
        except ApiError as e:
            return e.response()
        return JSONResponse({"object": "list", "data": [model_card(name) for name in service.profiles]})

    @router.get("/v1/models/{model:path}")
    async def get_model(model: str, http_request: HttpRequest) -> Response:
        try:
            check_key(http_request)
            if model not in service.profiles:
                raise ApiError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")
        except ApiError as e:
            return e.response()
        return JSONResponse(model_card(model))

    @router.post("/v1/chat/completions")
    async def chat_completions(http_request: HttpRequest) -> Response:
        try:
            check_key(http_request)
            try:
                body = json.loads(await http_request.body())
            except (ValueError, UnicodeDecodeError) as e:
                raise ApiError(400, f"The request body is not valid JSON: {e}.") from None
            chat = parse_chat_request(body, service.profiles, service.default)
        except ApiError as e:
            return e.response()
        request = service.stream(chat.conversation, chat.settings)
        watcher = asyncio.create_task(cancel_on_disconnect(http_request, request))
        pieces = deltas(request, chat.stop)
        completion_id, created = f"chatcmpl-{request.id}", int(time.time())
        streaming = False  # once the stream is handed over, it cleans up itself

        async def close() -> None:
            request.cancel()  # a no-op once it is done
            watcher.cancel()
            await pieces.aclose()

        try:
            first = await anext(pieces)  # waits its turn in the queue; errors are known by then
            if not chat.stream:
                text, finish = [], first
                while not isinstance(finish, Finish):
                    text.append(finish)
                    finish = await anext(pieces)
                return JSONResponse({
                    "id": completion_id, "object": "chat.completion", "created": created, "model": chat.model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                                 "logprobs": None, "finish_reason": finish.reason}],
                    "usage": finish.usage})
            streaming = True
        except ApiError as e:
            return e.response()
        finally:
            if not streaming:
                await close()

        def chunk(delta: dict, finish_reason: str | None = None) -> str:
            return sse({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                        "model": chat.model, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                          "finish_reason": finish_reason}]})

        async def events() -> AsyncIterator[str]:
            ended = False
            try:
                yield chunk({"role": "assistant", "content": ""})
                item = first
                while not isinstance(item, Finish):
                    yield chunk({"content": item})
                    item = await anext(pieces)
                yield chunk({}, item.reason)
                if chat.include_usage:
                    yield sse({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                               "model": chat.model, "choices": [], "usage": item.usage})
                ended = True
            except ApiError as e:  # a failure midway: the status is sent already
                ended = True
                yield sse(e.body())
            finally:
                if not ended:  # the server stopped streaming: the client went away
                    log.info("request %s: the client went away; cancelled", request.id)
                await close()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return router


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def mount(app: FastAPI, service, api_key: str | None = None) -> None:
    """Add the API's routes to an app, in front of its own: Chainlit's catch-all GET route would
    otherwise answer /v1/models with its web page."""
    app.router.routes[0:0] = create_router(service, api_key).routes


# ---- standalone server --------------------------------------------------------------------------

def create_app(service, api_key: str | None = None) -> FastAPI:
    """The API alone, loading the default model before it answers."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            await service.load()
        except Exception as e:  # still serve: each request reports the error
            log.error("the model %s could not be loaded: %s", service.default, e)
        yield
        service.close()

    app = FastAPI(title="llama-chat API", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    mount(app, service, api_key)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    return app


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from .service import GenerationService
    from .settings import Settings, SettingsError

    parser = argparse.ArgumentParser(prog="python -m app.api", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8001, help="port (default: 8001)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s - %(levelname)s - %(name)s - %(message)s")
    try:
        settings = Settings.from_env()
        service = GenerationService.from_settings(settings)
    except SettingsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not settings.api_key and not is_loopback(args.host):
        log.warning("serving on %s without LLAMA_API_KEY: anyone who can reach this port can use the model",
                    args.host)
    uvicorn.run(create_app(service, settings.api_key), host=args.host, port=args.port, log_level="info")
    return 0


if __name__ == "__main__":
    sys.exit(main())
