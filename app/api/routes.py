"""An OpenAI-compatible HTTP API over the backend the chat UI uses (`app.backend.protocol`).

    POST /v1/chat/completions   model, messages, n (up to 4), temperature, top_p, top_k, min_p,
                                repetition_penalty, frequency_penalty, presence_penalty, logit_bias, max_tokens (or
                                max_completion_tokens), seed, stop, stream (server-sent events),
                                stream_options.include_usage, logprobs + top_logprobs, tools +
                                tool_choice + parallel_tool_calls (Llama 3), response_format (JSON),
                                ignore_eos (as vLLM's)
    POST /v1/completions        the same for a raw prompt (no chat format; logprobs as a number)
    POST /v1/responses          OpenAI's Responses API, read as a chat request (app.api.responses)
    GET  /v1/models             the models offered: the backend's profiles, each with "loaded" (whether it
                                is in memory now; an idle one is unloaded after LLAMA_KEEP_ALIVE)
    GET  /v1/models/{model}
    GET  /metrics               Prometheus metrics (app.api.metrics)
    any other /v1 path          404 in OpenAI's shape (code unknown_url), saying why for OpenAI's routes not
                                served here (embeddings, audio, images, files, ...)
    /api/chat, /api/generate,   Ollama's API, for the tools that speak only it (app.api.ollama)
    /api/tags, ...

The chat app mounts these routes on Chainlit's server (`mount`), so API requests are computed by
the same engine, in the same batches, as the chats. `python -m app.api --port 8001` serves them
alone.

tool_choice: "auto" (the default with tools) lets the model answer with text or calls; "none" leaves the tools
out of the prompt and reads no call; "required", or {"type": "function", "function": {"name": ...}}, masks the
reply to a call of one of the tools (of that one) whose arguments are valid against its `parameters` schema
(model/tool_choice.py), and parallel_tool_calls false to exactly one call. Calls come back as message.tool_calls
with content null and finish_reason "tool_calls"; streamed, one delta per call at the reply's end, none of the
call as content. A forced call cut by max_tokens is the call as far as it went, with finish_reason "length". A model without tool calling (a chat template's) refuses tools (400, param "tools").

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad parameter
(named in `param`), a prompt too long for the context (code context_length_exceeded) or a JSON schema refused
(code invalid_json_schema; a tool's parameters: invalid_function_parameters) or not followed to the reply's end
(code json_schema_failed; a stream ends with that error event), 401 for a missing or wrong key when
LLAMA_API_KEY or LLAMA_API_KEYS is set (app.api.keys: a key names its user), 403 for a model pulled, deleted or
unloaded by a user not in LLAMA_MODEL_ADMINS, 404 for an unknown model, 413 for a body larger than LLAMA_MAX_BODY_MB (files in it as
base64 included: 4 MB holds a 3 MB file, 28 MB a 20 MB one), 415
for a body that is not application/json, 429 (with Retry-After) when the
server's queue is full, 503 (with Retry-After) when the model process stopped or is restarting. A
client that goes away cancels its request; so does one that stops reading its stream (cut off past 1 MB of
text waiting, app.backend.reply, or LLAMA_WRITE_TIMEOUT seconds of taking nothing, app.web.http_server). Sampling values left out are the model's defaults, as in the UI. Every parameter of OpenAI's is either done or refused with a 400
that names it (app.api.parse; the shapes read and written are in app.api.openai). Both servers refuse requests from other web sites and host names
(app.api.guard).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI
from fastapi import Request as HttpRequest
import msgspec
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from msgspec import UNSET, Struct, UnsetType

from app.backend.protocol import Backend, InvalidRequest, ServerBusy, is_remote
from app.files.read import READERS
from app.messages import TokenLogprob
from app.api.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from app.api.metrics import Metrics
from app.api import ollama, responses
from app.api.body import json_body, json_response
from app.api.keys import ApiKeys
from app.api.parse import ApiRequest, ChatRequest, has_files, parse_chat, parse_completion
from app.api.pieces import Finish, Piece, cancel_on_disconnect, pieces
from app.api.openai import (
    ApiError,
    Call,
    CallFunction,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    chat_logprobs,
    ChunkChoice,
    Delta,
    ModelCard,
    ModelList,
    ReplyMessage,
    TextChoice,
    TextCompletion,
    TextLogprobs,
    Usage,
)
from app.settings import DEFAULT_MAX_BODY_MB
from app.weights import Weights
from model.options import Environment
from app.web.users import LOCAL_USER

log = logging.getLogger(__name__)


# ---- routes -------------------------------------------------------------------------------------

def create_router(backend: Backend, keys: ApiKeys | None = None, max_body_mb: int = DEFAULT_MAX_BODY_MB,
                  stored=dict, weights_dir: Path | None = None, max_context: int | None = None,
                  weights: Weights | None = None, may_manage: Callable[[str], bool] = lambda user: True) -> APIRouter:
    """The /v1 routes over a backend (`app.backend.protocol.Backend`), and Ollama's /api routes (app.api.ollama:
    models are pulled into and removed from weights_dir, by the users `may_manage` allows; max_context: the context
    a model not loaded yet will have); stored() gives the bytes on disk by part."""
    started = int(time.time())
    keys = keys or ApiKeys()

    def check_key(http_request: HttpRequest) -> None:
        """Every route's dependency: with keys given (app.api.keys), a request must carry one of them. Notes whose
        request it is in request.state.user (its stored responses, the scope of the engine's KV cache reuse) and
        whether that user manages models in request.state.may_manage_models."""
        http_request.state.user = LOCAL_USER
        if keys.required:
            scheme, _, token = http_request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise ApiError(401, "No API key given: send it as 'Authorization: Bearer <key>'.",
                               code="invalid_api_key")
            user = keys.user(token.strip())
            if user is None:
                raise ApiError(401, "Incorrect API key.", code="invalid_api_key")
            http_request.state.user = user
        http_request.state.may_manage_models = may_manage(http_request.state.user)

    router = APIRouter(dependencies=[Depends(check_key)])  # an ApiError anywhere is answered by answer_error

    def model_card(name: str) -> ModelCard:
        where = backend.profiles[name]  # a checkpoint's path, or a remote server's address
        path = Path(where)
        created = int(path.stat().st_mtime) if not is_remote(where) and path.exists() else started
        loaded = backend.in_memory(name)  # None: not known (a remote server's): not said
        return ModelCard(name, created=created, loaded=UNSET if loaded is None else loaded)

    metrics = Metrics(lambda: backend.stats, backend, stored)
    backend.observers.append(metrics.observe)

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        """Prometheus' text format (app.api.metrics); with LLAMA_API_KEY set, the key is needed here too."""
        return Response(metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    @router.get("/v1/models")
    async def list_models() -> Response:
        return json_response(ModelList([model_card(name) for name in backend.profiles]))

    @router.get("/v1/models/{model:path}")
    async def get_model(model: str) -> Response:
        if model not in backend.profiles:
            raise ApiError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")
        return json_response(model_card(model))

    @router.post("/v1/chat/completions")
    async def chat_completions(http_request: HttpRequest) -> Response:
        body = await json_body(http_request, max_body_mb)
        # on a thread: reading a file part (a PDF's pages) may take a while, and the loop serves every stream;
        # a body with files on the file readers' threads, so that a burst of them delays no other request
        chat = await asyncio.get_running_loop().run_in_executor(
            READERS if has_files(body) else None, parse_chat, body, backend.profiles, backend.default)
        return await answer(http_request, chat, lambda: backend.stream(
            chat.conversation, chat.settings, **chat.options(), user=http_request.state.user))

    @router.post("/v1/completions")
    async def completions(http_request: HttpRequest) -> Response:
        completion = parse_completion(await json_body(http_request, max_body_mb), backend.profiles, backend.default)
        return await answer(http_request, completion, lambda: backend.complete(
            completion.prompt, completion.model, completion.settings, **completion.options(),
            user=http_request.state.user))

    responses.add_routes(router, backend, max_body_mb)
    if weights is None:  # (the chat app passes the one its models panel uses)
        weights = Weights(backend, weights_dir, Environment().text("HF_ENDPOINT"))
    ollama.add_routes(router, backend, max_body_mb, weights, max_context)

    @router.api_route("/v1", methods=ELSEWHERE_METHODS)
    @router.api_route("/v1/{rest:path}", methods=ELSEWHERE_METHODS)
    async def elsewhere(http_request: HttpRequest, rest: str = "") -> Response:
        """Any other /v1 path, or method: OpenAI's 404 (not the chat page, nor a bare 405), saying why where
        OpenAI has the route."""
        why = NOT_SERVED.get(rest.split("/")[0], "")
        where = f"{http_request.method} {http_request.url.path}"
        raise ApiError(404, f"Invalid URL ({where[:200]}){': ' + why if why else ''}.", code="unknown_url")

    return router


ELSEWHERE_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD"]
NOT_SERVED = {  # OpenAI's routes this server does not have, and why
    "embeddings": "embeddings are not served here",
    "audio": "audio is not served here: the models here read and write text",
    "images": "images are not served here: the models here read and write text",
    "moderations": "moderation is not served here",
    "files": "files are not uploaded apart here: send a file in a chat message (a `file` content part)",
    "uploads": "files are not uploaded apart here: send a file in a chat message (a `file` content part)",
    "assistants": "the Assistants API is not served here: use /v1/responses or /v1/chat/completions",
    "threads": "the Assistants API is not served here: use /v1/responses or /v1/chat/completions",
    "batches": "batches are not served here: send the requests themselves, they are batched as they come",
    "fine_tuning": "fine-tuning is not served here",
    "vector_stores": "vector stores are not served here",
    "realtime": "the Realtime API is not served here",
}


async def answer(http_request: HttpRequest, asked: ApiRequest, start) -> Response:
    """Run the request (`start()` hands it to the backend) and answer it: one JSON object, or
    server-sent events as the text comes."""
    chat = isinstance(asked, ChatRequest)
    try:
        request = start()
    except ServerBusy as e:
        return ApiError(429, f"The server is busy: {e}. Retry in a few seconds.", type="server_error",
                        code="server_busy").response()
    except InvalidRequest as e:  # what the request body's types let through and the engine cannot take
        return ApiError(400, f"The request cannot be computed: {e}.").response()
    watcher = asyncio.create_task(cancel_on_disconnect(http_request, request))
    items = pieces(request)
    made = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request.id}", "created": int(time.time()), "model": asked.model}
    streaming = False  # once the stream is handed over, it cleans up itself

    async def close() -> None:
        request.cancel()  # a no-op once it is done
        watcher.cancel()
        await items.aclose()

    offsets = [0] * asked.n  # completions' text_offset: characters of each reply so far

    def report(index: int, logprobs: list[TokenLogprob]) -> ChatLogprobs | TextLogprobs | None:
        if asked.logprobs is None:
            return None
        if chat:
            return chat_logprobs(logprobs)
        offsets[index] += sum(len(t.token) for t in logprobs)
        return completion_logprobs(logprobs, offsets[index] - sum(len(t.token) for t in logprobs))

    def whole(index: int, text: str, finish: Finish, logprobs: list[TokenLogprob]) -> ChatChoice | TextChoice:
        if not chat:
            return TextChoice(index=index, text=text, logprobs=report(index, logprobs), finish_reason=finish.reason)
        calls = [Call(**call_fields(call)) for call in finish.tool_calls]
        message = ReplyMessage(content=text or (None if calls else ""), tool_calls=calls or UNSET)
        return ChatChoice(index=index, message=message, logprobs=report(index, logprobs), finish_reason=finish.reason)

    def piece(index: int, text: str | None = None, reason: str | None = None, calls: list[dict] = (),
              logprobs: list[TokenLogprob] = ()) -> ChunkChoice | TextChoice:
        if not chat:
            return TextChoice(index=index, text=text or "", finish_reason=reason,
                              logprobs=report(index, logprobs) if text is not None else None)
        delta = Delta(content=text, tool_calls=tuple(Call(index=k, **call_fields(c)) for k, c in enumerate(calls))
                      or None)
        return ChunkChoice(index=index, delta=delta, finish_reason=reason,
                           logprobs=report(index, logprobs) if text is not None else None)

    try:
        first = await anext(items)  # waits for a place in the batch; errors are known by then
        if not asked.stream:
            texts, logprobs, finishes, item = [[] for _ in range(asked.n)], [[] for _ in range(asked.n)], \
                [None] * asked.n, first
            while not isinstance(item, Usage):
                if isinstance(item, Piece):
                    texts[item.index].append(item.text)
                    logprobs[item.index] += item.logprobs
                else:
                    finishes[item.index] = item
                item = await anext(items)
            choices = [whole(i, "".join(texts[i]), f, logprobs[i]) for i, f in enumerate(finishes)]
            reply = ChatCompletion(**made, object="chat.completion", choices=choices, usage=item) if chat else \
                TextCompletion(**made, object="text_completion", choices=choices, usage=item)
            return json_response(reply)
        streaming = True
    except ApiError as e:
        return e.response()
    finally:
        if not streaming:
            await close()

    def chunk(choices: list, usage: Usage | UnsetType = UNSET) -> str:
        if chat:
            return sse(ChatCompletionChunk(**made, object="chat.completion.chunk", choices=choices, usage=usage))
        return sse(TextCompletion(**made, object="text_completion", choices=choices, usage=usage))

    async def events() -> AsyncIterator[str]:
        ended = False
        try:
            if chat:
                # a reply that is a call has no content, not even an empty one (as OpenAI's: null): one tool_choice
                # makes a call, or one whose first event is its end with calls (their text is held back until
                # told apart from an answer's)
                forced = bool(getattr(asked, "tools", None)) and getattr(asked, "tool_choice", None) not in (None, "auto", "none")
                calls_first = {first.index} if not isinstance(first, Piece) and getattr(first, "tool_calls", None) else set()
                yield chunk([ChunkChoice(index=i, delta=Delta(role="assistant",
                                                              content=None if forced or i in calls_first else ""))
                             for i in range(asked.n)])
            item = first
            while not isinstance(item, Usage):
                if isinstance(item, Piece):
                    yield chunk([piece(item.index, item.text, logprobs=item.logprobs)])
                else:
                    if item.tool_calls:
                        yield chunk([piece(item.index, calls=item.tool_calls)])
                    yield chunk([piece(item.index, reason=item.reason)])
                item = await anext(items)
            if asked.include_usage:
                yield chunk([], usage=item)
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


def completion_logprobs(entries: list[TokenLogprob], offset: int) -> TextLogprobs:
    starts = []
    for t in entries:
        starts.append(offset)
        offset += len(t.token)
    return TextLogprobs([t.token for t in entries], [t.logprob for t in entries],
                        [{top.token: top.logprob for top in t.top} for t in entries], starts)


def call_fields(call: dict) -> dict:
    """A tool call as the engine reports it ({"id", "type", "function": {"name", "arguments"}})."""
    function = call.get("function") or {}
    return {"id": call.get("id"), "type": call.get("type", "function"),
            "function": CallFunction(function.get("name", ""), function.get("arguments", ""))}


def sse(shape: Struct) -> str:
    return f"data: {msgspec.json.encode(shape).decode()}\n\n"


def mount(app: FastAPI, backend: Backend, keys: ApiKeys | None = None, max_body_mb: int = DEFAULT_MAX_BODY_MB,
          stored=dict, weights_dir: Path | None = None, max_context: int | None = None,
          weights: Weights | None = None, may_manage: Callable[[str], bool] = lambda user: True) -> None:
    """Add the API's routes to an app, in front of its own: Chainlit's catch-all GET route would
    otherwise answer /v1/models (and /api/tags) with its web page. stored: the bytes on disk by part, for
    /metrics."""
    app.router.routes[0:0] = create_router(backend, keys, max_body_mb, stored, weights_dir, max_context,
                                           weights, may_manage).routes
    app.add_exception_handler(ApiError, answer_error)


def health_route(backend: Backend) -> Route:
    """GET /health, of both servers: 200 once the default model is loaded, 503 before (and while a crashed
    engine restarts). No key needed: it says nothing but whether the server is up."""
    async def health(http_request: HttpRequest) -> Response:
        ready = backend.ready
        return JSONResponse({"status": "ok" if ready else "loading"}, status_code=200 if ready else 503)
    return Route("/health", health, methods=["GET"])


async def answer_error(http_request: HttpRequest, error: ApiError) -> Response:
    """A route's ApiError (a bad key, body or model) as OpenAI's error object with its status."""
    return error.response()


# ---- standalone server --------------------------------------------------------------------------

def create_app(backend: Backend, keys: ApiKeys | None = None, max_body_mb: int = DEFAULT_MAX_BODY_MB,
               weights_dir: Path | None = None, max_context: int | None = None,
               weights: Weights | None = None, may_manage: Callable[[str], bool] = lambda user: True) -> FastAPI:
    """The API alone; /health says 200 once the default model is loaded, and / what Ollama's says there (the
    chat server has its page there)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await backend.start()
        yield
        backend.close()

    app = FastAPI(title="llama-chat API", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    mount(app, backend, keys, max_body_mb, weights_dir=weights_dir, max_context=max_context, weights=weights,
          may_manage=may_manage)

    app.router.routes.insert(0, health_route(backend))

    async def running(http_request: HttpRequest) -> Response:  # Ollama's answer at its root, which tools probe
        return PlainTextResponse("Ollama is running")
    app.router.routes.insert(0, Route("/", running, methods=["GET", "HEAD"]))
    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from app.api import guard
    from app.web import http_server
    from app.backend.protocol import open_backend
    from app.settings import Settings, SettingsError

    parser = argparse.ArgumentParser(prog="python -m app.api", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8001, help="port (default: 8001)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s - %(levelname)s - %(name)s - %(message)s")
    try:
        settings = Settings.from_env()
        allowed = guard.Allowed.from_settings(settings, args.host, args.port)
        keys = ApiKeys.from_settings(settings)
        backend = open_backend(settings)
    except SettingsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not keys.required and not guard.is_loopback(args.host):
        log.warning("serving on %s without LLAMA_API_KEY or LLAMA_API_KEYS: anyone who can reach this port can "
                    "use the model",
                    args.host)
    weights = Weights(backend, settings.weights_dir, Environment().text("HF_ENDPOINT"), settings.max_pulls)
    app = create_app(backend, keys, settings.max_body_mb, settings.weights_dir, settings.max_context, weights,
                     settings.may_manage_models)
    guard.install(app, allowed)
    http_server.install(app)
    log.info("%s", allowed.summary())
    gc.freeze()  # what is loaded by now lives as long as the process: no collection walks it again (see app/main.py)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", **http_server.uvicorn_options(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
