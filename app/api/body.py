"""JSON bodies in and out of the API's routes: a request's body read within its size limit and media type
(`json_body`), a declared shape written as a response (`json_response`)."""

from __future__ import annotations

import json

import msgspec
from fastapi import Request as HttpRequest
from fastapi.responses import Response
from msgspec import Struct

from app.api.openai import ApiError
from app.settings import DEFAULT_MAX_BODY_MB


async def json_body(http_request: HttpRequest, max_mb: int = DEFAULT_MAX_BODY_MB, any_type: bool = False) -> object:
    """The request's JSON body, of at most max_mb MB (413 past it, read no further). Only application/json
    is read (415 otherwise): a web page may send text/plain to another site without the browser asking
    that site first, application/json it may not. any_type: a body of another declared type (or none) is
    read too from a request that names no Origin, as Ollama reads `curl -d '{...}'` (form-urlencoded);
    a browser names the page's origin in every POST, so a page's text/plain is still refused."""
    kind = http_request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind != "application/json" and not (any_type and "origin" not in http_request.headers):
        raise ApiError(415, f"Expected a body of Content-Type application/json, found {kind or 'none'}.",
                       code="unsupported_media_type")
    too_large = ApiError(413, f"The request body is larger than {max_mb} MB (LLAMA_MAX_BODY_MB). A file sent in it "
                              f"takes 4/3 of its size as base64: files of up to {max_mb * 3 / 4:g} MB or so fit.",
                         code="request_too_large")
    limit, declared = max_mb * 2**20, http_request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in http_request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    try:
        # json.loads reads "\ud800" escapes as lone surrogates, NaN and Infinity as floats, 1e400 as inf
        # and integers of any size (up to 4300 digits), so that app.bounds.json_problem can name where
        # they are; msgspec's decoder refuses the first two without saying where. Deep nesting stops it.
        return json.loads(body)
    except RecursionError:
        raise ApiError(400, "The request body is not valid JSON: it nests too deeply.") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"The request body is not valid JSON: {e}.") from None


def json_response(shape: Struct, status: int = 200) -> Response:
    return Response(msgspec.json.encode(shape), status_code=status, media_type="application/json")
