"""Ollama's API beside the OpenAI one, on the same server, by the same engine: for the tools that speak only
Ollama's routes (Open WebUI's Ollama connection, Continue, langchain-ollama, editor plugins).

    POST /api/chat      model, messages (system, user, assistant with tool_calls, tool), tools, format,
                        options, stream (by default true: one JSON object a line, application/x-ndjson),
                        keep_alive, logprobs + top_logprobs; no messages: load the model (keep_alive 0: unload it)
    POST /api/generate  model, prompt, system, raw (the prompt continued as it is: /v1/completions), format,
                        options, stream, keep_alive; an empty prompt: load or unload the model
    GET  /api/tags      the models, POST /api/show one of them, GET /api/ps those loaded now (app.api.ollama_models)
    POST /api/pull      download a model from Hugging Face, DELETE /api/delete remove one (app.weights)
    GET  /api/version   the version of Ollama's API these routes follow

Models are named as /v1/models names them; Ollama's `name:latest` is `name`. Each reply's last object says why
it ended (done_reason "stop" or "length") and its figures in nanoseconds (load_duration: the wait for the model
to load; prompt_eval_duration: to the first token; eval_duration: the rest). `format` "json" asks for any JSON
object, a JSON schema for a document of it (app.api.parse's response_format). Tool calls come back as Ollama
writes them, {"function": {"name", "arguments": {...}}}; a tool's result is matched to the call of the same
name (tool_name). `keep_alive` (seconds, or "5m", "1h"; negative: forever) sets how long the model stays loaded
after the request, until it is unloaded (app.backend.protocol's keep_alive); left out, the server's
LLAMA_KEEP_ALIVE holds again. A conversation too long for the context loses its oldest messages, as Ollama's
does (the system prompt stays).

`options`: temperature, top_k, top_p, min_p, num_predict (-1 or -2: to the context's end), stop (up to 4), seed,
repeat_penalty (over the last 64 tokens: repeat_last_n may be 64, or 0 to turn it off), frequency_penalty and
presence_penalty are done. num_ctx and num_keep are taken and change nothing: the context is the server's
(LLAMA_MAX_CONTEXT; /api/show tells it). The runner's options (num_thread, num_gpu, num_batch, use_mmap, ...)
change nothing here either. typical_p, tfs_z and mirostat are refused by name unless off (1, 1, 0); so are
images, context, template, suffix and think (this server's models do not think apart). A field Ollama does not
have is left out, as Ollama does, and named in the log (app.api.ollama_shapes.read_ollama).

Every request goes through the same API key check (LLAMA_API_KEY or LLAMA_API_KEYS, as `Authorization: Bearer`:
the ollama clients send OLLAMA_API_KEY so; app.api.keys) and the same guard as /v1 (app.api.guard), and its body through the same
reader (app.api.body.json_body, app.bounds.json_problem), which takes a body of any declared type from a
request without an Origin, as Ollama does (its own examples send `curl -d`, form-urlencoded). Errors are
Ollama's `{"error": "..."}` with their status: 400 for a bad field (named), 401, 403 (pull, delete or keep_alive
by a user not in LLAMA_MODEL_ADMINS: keep_alive says how long a model stays loaded for everyone, 0 unloads it), 404 "model 'x' not found",
413, 415, 500, 503 (busy: retry).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec
from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from msgspec import UNSET

from app.backend.conversation import Conversation
from app.weights import Weights
from app.backend.protocol import Backend, EngineError, InvalidRequest, ServerBusy
from app.bounds import MAX_INT32
from app.messages import Done, Failed, ReplySettings, Text, TokenLogprob
from app.settings import parse_duration
from model.tools import read_tools

from app.api.keys import check_may_manage
from app.api.openai import ApiError
from app.api.parse import ApiRequest, ChatRequest, CompletionRequest, check_calls, json_within
from app.api import ollama_models
from app.api.body import json_body
from app.api.ollama_models import model_named
from app.api.pieces import cancel_on_disconnect, failure_error
from app.api.ollama_shapes import (
    NDJSON,
    Asked,
    ChatBody,
    ChatReply,
    Error,
    GenerateBody,
    GenerateReply,
    Logprob,
    Message,
    Options,
    Reply,
    ReplyCall,
    ReplyFunction,
    ReplyMessage,
    TopLogprob,
    Version,
    now_text,
    read_ollama,
)

REPEAT_LAST_N = 64  # tokens the repeat penalty looks back over (model/decoding.py)
UNLOAD_WAIT_S = 10.0  # an unload waits this long for the model's running requests to end, at most
UNLOAD_POLL_S = 0.05
NOT_HERE = {  # Ollama's routes this server does not have, and why
    "embed": "embeddings are not served here",
    "embeddings": "embeddings are not served here",
    "create": "models are not created here: bring one with POST /api/pull or `python -m model.fetch`",
    "copy": "models are not copied here",
    "push": "models are not pushed from here",
    "blobs": "blobs are not taken here: bring a model with POST /api/pull or `python -m model.fetch`",
}


# ---- errors in Ollama's shape -------------------------------------------------------------------

class OllamaRoute(APIRoute):
    """A route of Ollama's: an ApiError anywhere in it (the key, the body, the model) is answered as Ollama
    answers, `{"error": "..."}` with its status (and headers: Retry-After, WWW-Authenticate)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def handle(http_request: HttpRequest) -> Response:
            try:
                return await handler(http_request)
            except ApiError as e:
                return error_response(e)
        return handle


def error_response(error: ApiError) -> Response:
    headers = {k: v for k, v in error.response().headers.items() if k in ("retry-after", "www-authenticate")}
    return Response(msgspec.json.encode(Error(error.message)), status_code=error.status, headers=headers,
                    media_type="application/json")


# ---- reading a request ----------------------------------------------------------------------------

@dataclass
class Run:
    """An Ollama request read: what the backend takes, and how to answer."""

    chat: bool  # /api/chat (a message in each reply object), else /api/generate (a response)
    named: str  # the model as the client named it (each reply object says it back)
    asked: ChatRequest | CompletionRequest  # a chat's messages, or (raw) a prompt as it is
    options: dict  # what the backend's stream() or complete() takes besides
    stream: bool
    keep_alive: float | None  # seconds (negative: forever); None: the server's LLAMA_KEEP_ALIVE
    load_only: bool  # no messages, or an empty prompt: load the model, or unload it (keep_alive 0)

    @property
    def model(self) -> str:
        return self.asked.model

    def start(self, backend: Backend, user: str):
        if isinstance(self.asked, ChatRequest):
            return backend.stream(self.asked.conversation, self.asked.settings, **self.options, user=user)
        return backend.complete(self.asked.prompt, self.model, self.asked.settings, **self.options, user=user)


def read_chat(body: object, profiles: dict) -> Run:
    chat = read_ollama(body, ChatBody)
    common = _common(chat, profiles)
    tools = json_within(msgspec.to_builtins(chat.tools), "tools") if chat.tools else None
    try:
        read_tools(tools)
    except ValueError as e:
        raise ApiError(400, str(e), param="tools") from None
    json_schema, json_object = _format(chat.format)
    if (json_schema is not None or json_object) and tools:
        raise ApiError(400, "'format' and 'tools' cannot be used together: a reply is either JSON or a tool call.",
                       param="format")
    conversation = _conversation(chat.messages, common["model"]) if chat.messages else Conversation()
    asked = ChatRequest(**common, conversation=conversation, tools=tools, json_schema=json_schema,
                        json_object=json_object)
    # trim: a conversation too long for the context loses its oldest messages, as Ollama's does (unless truncate false)
    return Run(True, chat.model, asked, asked.options() | {"trim": chat.truncate is not False}, chat.stream is not False,
               _keep_alive(chat.keep_alive), not chat.messages)


def read_generate(body: object, profiles: dict) -> Run:
    generate = read_ollama(body, GenerateBody)
    for name, empty, why in [("images", [], "images are not supported: the models here read text"),
                             ("context", [], "context (the token ids of an earlier reply) is not taken: send the "
                                             "conversation to /api/chat instead"),
                             ("suffix", "", "suffix (fill in the middle) is not supported"),
                             ("template", "", "a prompt template is not taken: the model's own chat format is used "
                                              "(raw: true sends the prompt as it is)")]:
        if getattr(generate, name) not in (None, empty):
            raise ApiError(400, f"'{name}': {why}.", param=name, code="unsupported_parameter")
    if generate.raw and generate.system:
        raise ApiError(400, "'system' cannot be used with raw: the prompt is the model's whole input.", param="system")
    common = _common(generate, profiles)
    json_schema, json_object = _format(generate.format)
    formats = {"json_schema": json_schema, "json_object": json_object}
    if generate.raw:
        asked: ApiRequest = CompletionRequest(**common, prompt=generate.prompt)
        options = asked.options() | formats
    else:
        conversation = Conversation(model=common["model"], system_prompt=generate.system or None)
        conversation.add("user", generate.prompt)
        asked = ChatRequest(**common, conversation=conversation, **formats)
        options = asked.options() | {"trim": generate.truncate is not False}
    return Run(False, generate.model, asked, options, generate.stream is not False, _keep_alive(generate.keep_alive),
               not generate.prompt)


def _common(body: Asked, profiles: dict) -> dict:
    """What chat and generate both read: the model, the options, logprobs; think refused."""
    if body.think not in (None, False):
        raise ApiError(400, f"'think': {body.model} does not think apart from its reply: leave think out or false.",
                       param="think", code="unsupported_parameter")
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    model = model_named(body.model, profiles)
    return {"model": model, "settings": reply_settings(body.options or Options()), "stream": body.stream is not False,
            "logprobs": (body.top_logprobs or 0) if body.logprobs else None}


def reply_settings(options: Options) -> ReplySettings:
    """Ollama's options as the engine's settings; those that would change the reply in a way not done here are
    refused by name (their values that are off are taken)."""
    for name, off, why in [("typical_p", 1.0, "typical sampling is not done here"),
                           ("tfs_z", 1.0, "tail-free sampling is not done here"),
                           ("mirostat", 0, "mirostat sampling is not done here")]:
        if getattr(options, name) not in (None, off):
            raise ApiError(400, f"'options.{name}': {why}; leave it out (or {off}).", param=f"options.{name}",
                           code="unsupported_parameter")
    if options.repeat_last_n not in (None, 0, REPEAT_LAST_N):
        raise ApiError(400, f"'options.repeat_last_n': the repeat penalty looks at the last {REPEAT_LAST_N} tokens "
                            f"here; leave it out, or give {REPEAT_LAST_N} (0 turns the penalty off).",
                       param="options.repeat_last_n", code="unsupported_parameter")
    if options.num_predict == 0:
        raise ApiError(400, "'options.num_predict' must be a number of tokens, or -1 (to the context's end).",
                       param="options.num_predict", code="invalid_value")
    stops = [options.stop] if isinstance(options.stop, str) else options.stop or []
    num_predict = MAX_INT32 if options.num_predict is not None and options.num_predict < 0 else options.num_predict
    return ReplySettings(
        max_new_tokens=num_predict, temperature=options.temperature, top_k=options.top_k, top_p=options.top_p,
        min_p=options.min_p, frequency_penalty=options.frequency_penalty, presence_penalty=options.presence_penalty,
        repetition_penalty=1.0 if options.repeat_last_n == 0 else options.repeat_penalty, seed=options.seed,
        stop=tuple(s for s in stops if s))


def _format(format: str | dict | None) -> tuple[dict | None, bool]:
    """(json_schema, json_object) for the engine: "json" is any JSON object, an object a JSON schema."""
    if isinstance(format, dict):
        return json_within(format, "format"), False
    return None, format == "json"


def _keep_alive(value: float | str | None) -> float | None:
    """Seconds (negative: forever). One past Go's longest duration (Ollama's limit, ~292 years) is forever too:
    its end could not be written as a date."""
    if value is None:
        return None
    try:
        seconds = value if isinstance(value, float | int) else parse_duration(value)
    except ValueError:
        raise ApiError(400, f"'keep_alive': {value!r} is not a number of seconds or a duration such as 30s, 5m or "
                            "1h (negative: forever).", param="keep_alive", code="invalid_value") from None
    return -1.0 if seconds >= ollama_models.FOREVER_S else seconds


def _conversation(messages: list[Message], model: str) -> Conversation:
    """Ollama's messages as a conversation: system messages make its system prompt; an assistant's tool calls
    get ids (Ollama's have none), and each tool result answers the first call of its tool_name not answered yet."""
    system, conversation, calls = [], Conversation(model=model), []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if message.images:
            raise ApiError(400, f"'{where}.images': images are not supported: the models here read text.",
                           param=f"{where}.images", code="unsupported_parameter")
        if message.role == "system":
            system.append(message.content)
        elif message.role == "user":
            conversation.add("user", message.content)
        elif message.role == "assistant":
            calls = [openai_call(call, f"call_{i}_{j}") for j, call in enumerate(message.tool_calls or [])]
            if calls:
                check_calls(calls, where)
            conversation.add("assistant", message.content, tool_calls=calls or None)
        else:
            answered = message.tool_call_id or next(
                (c["id"] for c in calls if c["function"]["name"] == message.tool_name), calls[0]["id"] if calls else None)
            calls = [c for c in calls if c["id"] != answered]
            conversation.add("tool", message.content, tool_call_id=answered)
    if not conversation.messages or conversation.messages[-1].role not in ("user", "tool"):
        raise ApiError(400, "'messages': the last message (after any system messages) must be the user's, or a "
                            "tool's result: it is the one answered.", param="messages")
    conversation.system_prompt = "\n\n".join(system) if system else None
    return conversation


def openai_call(call, call_id: str) -> dict:
    """An Ollama tool call (arguments an object) as the engine and OpenAI's servers take it (arguments as JSON)."""
    arguments = call.function.arguments
    return {"id": call.id or call_id, "type": "function",
            "function": {"name": call.function.name,
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


# ---- answering ----------------------------------------------------------------------------------

async def answer(http_request: HttpRequest, backend: Backend, run: Run) -> Response:
    """Run the request and answer it: one JSON object, or (stream) one a line as the text comes."""
    started = time.perf_counter()
    if run.keep_alive is not None:  # how long the model stays loaded, for everyone: a model admin's to say
        check_may_manage(http_request, "set how long a model stays loaded (keep_alive)")
    if run.load_only:
        return await load_or_unload(backend, run)
    load_ns = await load(backend, run.model)
    try:
        request = run.start(backend, http_request.state.user)
    except ServerBusy as e:
        raise ApiError(503, f"server busy, please try again: {e}", type="server_error") from None
    except InvalidRequest as e:
        raise ApiError(400, f"The request cannot be computed: {e}.") from None
    backend.keep_alive(run.model, run.keep_alive)  # (after the request, which keeps the model meanwhile)
    watcher = asyncio.create_task(cancel_on_disconnect(http_request, request))

    async def items() -> AsyncIterator[Text | Done]:
        async for event in request:
            if isinstance(event, Failed):
                raise failure_error(event)
            if isinstance(event, Done) and event.finish_reason == "constraint_failed":
                raise ApiError(400, event.error, param="format", code="json_schema_failed")
            if isinstance(event, Text | Done):
                yield event

    def reply(text: str = "", logprobs: list[TokenLogprob] = (), calls: list[dict] = (),
              done: Done | None = None) -> Reply:
        made = {"model": run.named, "created_at": now_text(), "done": done is not None,
                "logprobs": [logprob(t) for t in logprobs] if run.asked.logprobs is not None else UNSET}
        if done is not None:
            made |= figures(done, load_ns, time.perf_counter() - started)
        if not run.chat:
            return GenerateReply(**made, response=text)
        return ChatReply(**made, message=ReplyMessage(content=text, tool_calls=[ollama_call(c) for c in calls]
                                                      or UNSET))

    events = items()
    streaming = False

    async def close() -> None:
        request.cancel()  # a no-op once it is done
        watcher.cancel()
        await events.aclose()

    try:
        first = await anext(events)  # waits for a place in the batch; errors are known by then
        if not run.stream:
            texts, logprobs, item = [], [], first
            while isinstance(item, Text):
                texts.append(item.text)
                logprobs += item.logprobs
                item = await anext(events)
            whole = reply("".join(texts), logprobs, item.tool_calls, done=item)
            return Response(msgspec.json.encode(whole), media_type="application/json")
        streaming = True
    finally:
        if not streaming:
            await close()

    async def lines() -> AsyncIterator[bytes]:
        try:
            item = first
            while isinstance(item, Text):
                yield msgspec.json.encode(reply(item.text, item.logprobs)) + b"\n"
                item = await anext(events)
            if item.tool_calls:  # as Ollama streams them: in an object of their own, before the last
                yield msgspec.json.encode(reply(calls=item.tool_calls)) + b"\n"
            yield msgspec.json.encode(reply(done=item)) + b"\n"
        except ApiError as e:  # a failure midway: the status is sent already
            yield msgspec.json.encode(Error(e.message)) + b"\n"
        finally:
            await close()

    return StreamingResponse(lines(), media_type=NDJSON, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def figures(done: Done, load_ns: int, total_s: float) -> dict:
    """The last object's fields: why the reply ended, and its figures in nanoseconds."""
    s = done.stats
    return {"done_reason": "length" if done.finish_reason == "length" else "stop",
            "total_duration": int(total_s * 1e9), "load_duration": load_ns, "prompt_eval_count": s.prompt_tokens,
            "prompt_eval_duration": int(s.time_to_first_token * 1e9), "eval_count": s.new_tokens,
            "eval_duration": int(max(0.0, s.total_time - s.time_to_first_token) * 1e9)}


def ollama_call(call: dict) -> ReplyCall:
    """A call as the engine reports it (OpenAI's shape, arguments as JSON text) as Ollama writes it."""
    function = call.get("function") or {}
    return ReplyCall(ReplyFunction(function.get("name", ""), json.loads(function.get("arguments") or "{}")))


def logprob(t: TokenLogprob) -> Logprob:
    return Logprob(t.token, t.logprob, t.bytes, [TopLogprob(top.token, top.logprob, top.bytes) for top in t.top])


async def load(backend: Backend, model: str) -> int:
    """Load the model if it is not in memory (as Ollama does before it computes); the nanoseconds it took."""
    if backend.in_memory(model) is not False:
        return 0
    started = time.perf_counter()
    try:
        await backend.load(model)
    except EngineError as e:
        raise ApiError(500, f"model '{model}' could not be loaded: {e}", type="server_error") from None
    return int((time.perf_counter() - started) * 1e9)


async def load_or_unload(backend: Backend, run: Run) -> Response:
    """A request with nothing to answer: load the model (done_reason "load"), or with keep_alive 0 unload it
    once no request uses it (waiting UNLOAD_WAIT_S for that at most; "unload")."""
    if run.keep_alive == 0:
        backend.keep_alive(run.model, 0)
        deadline = time.monotonic() + UNLOAD_WAIT_S
        while backend.in_memory(run.model) and time.monotonic() < deadline:
            await asyncio.sleep(UNLOAD_POLL_S)
        reason = "unload"
    else:
        await load(backend, run.model)
        backend.keep_alive(run.model, run.keep_alive)
        reason = "load"
    made = {"model": run.named, "created_at": now_text(), "done": True, "done_reason": reason}
    reply = ChatReply(**made) if run.chat else GenerateReply(**made)
    return Response(msgspec.json.encode(reply), media_type=NDJSON if run.stream else "application/json")


# ---- routes -------------------------------------------------------------------------------------

def add_routes(router: APIRouter, backend: Backend, max_body_mb: int, weights: Weights, max_context: int | None) -> None:
    """Ollama's routes on the API's router (its key check too), each answering errors in Ollama's shape."""
    def route(path: str, methods: list[str]):
        def add(endpoint):
            router.add_api_route(path, endpoint, methods=methods, route_class_override=OllamaRoute)
            return endpoint
        return add

    @route("/api/chat", ["POST"])
    async def chat(http_request: HttpRequest) -> Response:
        body = await json_body(http_request, max_body_mb, any_type=True)
        return await answer(http_request, backend, read_chat(body, backend.profiles))

    @route("/api/generate", ["POST"])
    async def generate(http_request: HttpRequest) -> Response:
        body = await json_body(http_request, max_body_mb, any_type=True)
        return await answer(http_request, backend, read_generate(body, backend.profiles))

    @route("/api/version", ["GET"])
    async def version() -> Response:
        return Response(msgspec.json.encode(Version()), media_type="application/json")

    ollama_models.add_routes(route, backend, max_body_mb, weights, max_context)

    @route("/api/{rest:path}", ["GET", "POST", "PUT", "DELETE", "HEAD"])
    async def elsewhere(rest: str) -> Response:
        why = NOT_HERE.get(rest.split("/")[0], "Ollama's API has no such route here")
        raise ApiError(404, f"/api/{rest}: {why}.")
