"""A backend request's events as the API's routes answer them: the replies' text in pieces, a Finish for each
reply, then the Usage of them all (`pieces`); a failure as the ApiError it is answered with; and the request
cancelled when its client goes away. The OpenAI routes (app.api.routes, app.api.responses) and Ollama's
(app.api.ollama) each write these in their own shapes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request as HttpRequest

from app.api.openai import ApiError, PromptTokensDetails, Usage
from app.messages import Done, Failed, Text, TokenLogprob

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25


@dataclass
class Piece:
    index: int  # which of the n replies
    text: str
    logprobs: list[TokenLogprob]


@dataclass
class Finish:
    index: int
    reason: str  # "stop", "length" or "tool_calls"
    tool_calls: list[dict]


async def pieces(request) -> AsyncIterator[Piece | Finish | Usage]:
    """The replies' text in pieces (the engine cuts it at a stop string), a Finish for each, then the
    Usage of them all. Raises ApiError when the request cannot be answered (before any text, except
    for a failure midway). A reply whose JSON schema could not be followed to its end is a 400 naming
    response_format: the schema, not the server, is what failed, and the same request would fail again."""
    prompt_tokens, completion_tokens, cached_tokens = 0, 0, 0
    async for event in request:
        if isinstance(event, Text):
            yield Piece(event.index, event.text, event.logprobs)
        elif isinstance(event, Failed):
            raise failure_error(event)
        elif isinstance(event, Done):
            if event.finish_reason == "constraint_failed":  # (the tools' schemas, for a call tool_choice asks for)
                param = "tools" if event.error.startswith("tools") else "response_format"
                raise ApiError(400, event.error, param=param, code="json_schema_failed")
            prompt_tokens = max(prompt_tokens, event.stats.prompt_tokens)  # the n replies share one prompt
            cached_tokens = max(cached_tokens, event.stats.reused_tokens)  # (kept caches are of this user only)
            completion_tokens += event.stats.new_tokens
            # (a call cut short by the token limit is a call, its finish_reason "length", as OpenAI's)
            reason = "length" if event.finish_reason == "length" else "tool_calls" if event.tool_calls else "stop"
            yield Finish(event.index, reason, event.tool_calls)
    yield Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens, PromptTokensDetails(cached_tokens))


def failure_error(failed: Failed) -> ApiError:
    if failed.reason == "prompt_too_long":
        return ApiError(400, failed.message, param="messages", code="context_length_exceeded")
    tools = failed.message.startswith("tools")  # (the engine names the tools where they are what it refuses)
    if failed.reason == "bad_request":  # (and the messages or logit_bias, where a model cannot take what they hold)
        param = "tools" if tools else next((name for name in ("messages", "logit_bias")
                                            if failed.message.startswith(f"{name}:")), None)
        return ApiError(400, failed.message, param=param)
    if failed.reason == "bad_schema":
        return ApiError(400, failed.message, param=failed.message.split(":")[0] if tools else "response_format",
                        code="invalid_function_parameters" if tools else "invalid_json_schema")
    return ApiError(500 if failed.reason == "error" else 503, failed.message, type="server_error")


async def cancel_on_disconnect(http_request: HttpRequest, request) -> None:
    """Cancel the request when its client goes away (checked a few times a second)."""
    while True:
        if await http_request.is_disconnected():
            log.info("request %s: the client went away; cancelled", request.id)
            request.cancel()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)
