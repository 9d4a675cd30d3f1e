"""What a request may hold: the range of each number, the size of each part, and what any JSON in it may be.

The ranges are annotated types (msgspec `Meta` constraints), declared once here and used by the
messages the engine gets (`app.messages`) and by the OpenAI request bodies (`app.api.parse`);
msgspec checks them wherever those are decoded. A number in range is one the engine can take: a
seed in range (64 bits, signed, as OpenAI's) gives each of a request's n replies a seed in range too
(`reply_seed`).

Free-form JSON (tool definitions, JSON schemas, tool call arguments) has no declared shape, so
`json_problem` checks what msgspec cannot: every string encodable as UTF-8 (a lone surrogate is not),
every number finite and within 64 bits, and no deeper nesting than MAX_DEPTH.
"""

from __future__ import annotations

import math
from typing import Annotated

from msgspec import Meta

MAX_N = 4  # replies per request (they share the prompt's prefill)
MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 256  # characters of one stop string (every token is checked against each)
MAX_MESSAGES = 2048  # messages of one request
MAX_TOOLS = 128
MAX_JSON_CHARS = 100_000  # tools, or a JSON schema, as JSON text
MAX_NAME_LENGTH = 256  # a model's, a tool's or a call's name or id
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # tokens one request's logit_bias may name
MAX_DEPTH = 64  # nesting of objects and arrays, the request body's own levels included
MAX_FILES = 10  # files attached to one message
MAX_FILE_BYTES = 20 * 2**20  # one file as uploaded
MAX_PENDING_FILES = 2 * MAX_FILES  # uploads of one chat session waiting for their message (app.web.uploads)
MAX_PENDING_BYTES = MAX_FILES * MAX_FILE_BYTES  # ... and their bytes together
MAX_FILE_CHARS = 4_000_000  # one file's text (about a million tokens: far past any context, BM25 picks from it)
MAX_PDF_PAGES = 500
FILES_READ_SECONDS = 60.0  # the files of one message (or one API request) are read within this, together
REPLY_BUFFER_BYTES = 2**20  # a reply's text its reader has not taken yet (app.backend.reply): past it, cut off
MAX_INT32 = 2**31 - 1
INT64 = 2**63  # msgspec's bounds, MessagePack's integers and torch's seeds all fit in [-2**63, 2**64)

Tokens = Annotated[int, Meta(ge=1, le=MAX_INT32)]
Temperature = Annotated[float, Meta(ge=0, le=100)]  # 0 is greedy
TopK = Annotated[int, Meta(ge=0, le=MAX_INT32)]  # 0 is off; more than the vocabulary is off too
TopP = Annotated[float, Meta(gt=0, le=1)]
MinP = Annotated[float, Meta(ge=0, le=1)]
RepetitionPenalty = Annotated[float, Meta(gt=0, le=10)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]  # OpenAI's frequency and presence penalties
Bias = Annotated[float, Meta(ge=-100, le=100)]  # OpenAI's logit_bias values
Seed = Annotated[int, Meta(ge=-INT64, le=INT64 - 1)]
StopString = Annotated[str, Meta(max_length=MAX_STOP_LENGTH)]
Replies = Annotated[int, Meta(ge=1, le=MAX_N)]
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]
Name = Annotated[str, Meta(max_length=MAX_NAME_LENGTH)]
TokenId = Annotated[int, Meta(ge=0, le=MAX_INT32)]
Count = Annotated[int, Meta(ge=0, le=MAX_INT32)]
FileText = Annotated[str, Meta(max_length=MAX_FILE_CHARS)]
# A request's labels, kept with a stored response: OpenAI's 16 pairs, keys of 64 characters, values of 512
Metadata = Annotated[dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]],
                     Meta(max_length=16)]


def reply_seed(seed: int, index: int) -> int:
    """The seed of a request's index-th reply: seed + index, wrapped around into Seed's range (torch takes
    a negative seed as that seed + 2**64, so the wrapped one is the same random stream)."""
    return (seed + index + INT64) % (2 * INT64) - INT64


def json_problem(value: object, max_depth: int = MAX_DEPTH) -> tuple[str, str] | None:
    """The first place in a JSON value (as `json.loads` reads it) that no request may hold, and what is
    wrong there: ("messages[0].content", "is not valid Unicode: ..."), or None. Walked without recursion,
    so that any depth is measured."""
    todo: list[tuple[object, str, int]] = [(value, "", 1)]
    while todo:
        item, where, depth = todo.pop()
        if isinstance(item, dict | list | tuple):
            if depth > max_depth:
                return where, f"nests deeper than {max_depth} levels"
            children = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in reversed(list(children)):
                if isinstance(key, str):
                    if problem := _text_problem(key):
                        return where, f"has a key that {problem}"
                    todo.append((child, f"{where}.{key}" if where else key, depth + 1))
                else:
                    todo.append((child, f"{where}[{key}]", depth + 1))
        elif isinstance(item, str):
            if problem := _text_problem(item):
                return where, problem
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, int):
            if not -INT64 <= item < 2 * INT64:
                return where, "is a whole number beyond 64 bits"
        elif isinstance(item, float):
            if not math.isfinite(item):
                return where, f"is {item}, not a finite number"
    return None


def _text_problem(text: str) -> str | None:
    try:
        text.encode()
    except UnicodeEncodeError as e:
        return f"is not valid Unicode: {text[e.start]!r} at character {e.start} is half of a surrogate pair"
    return None
