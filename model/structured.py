"""JSON replies by constrained decoding: which token ids may come next so that the reply stays JSON.

    constraint = JsonConstraint(tokenizer, schema, vocab_size=config.vocab_size, stop_ids=stop_ids)
    logits = logits.masked_fill(~constraint.mask(), float("-inf"))    # then sample as usual
    constraint.advance(token)                                         # after each sampled id

`schema` is None for any JSON object (OpenAI's json_object mode) or a JSON schema (a dict). The stop
ids are in the mask exactly when the text so far is a whole document of the format (`complete`), so
the model cannot end its reply early; `finished` says that only a stop id may follow.

The grammar work is llguidance's (an Earley parser over the vocabulary's token trie, in Rust): it
compiles a schema in about a millisecond, and mask() + advance() take about 0.2 ms per token inside
generation (2% of a default-model decode step). Why it and not xgrammar or outlines-core, and the
figures: docs/structured.md.

A schema is refused (SchemaError, an HTTP 400 at the API) before its reply starts when it is past a limit
(`check_shape`: llguidance fails midway past them), when llguidance cannot compile it, or when it fails at
the document's first token or right after the document opens (`{`, `[`, `"`: where every alternative
of the top level is open at once). A failure later (a resource limit at some token of the reply) raises
ConstraintFailed: the reply ends there (model/decoding.py), and the schema is refused from then on (Format).
"""

from __future__ import annotations

import json
from functools import lru_cache

import llguidance
import numpy as np
import torch

from .decoding import ConstraintFailed

ANY_OBJECT = {"type": "object"}  # json_object mode: any JSON object, as OpenAI's
# JSON whitespace, at most 16 characters between two tokens of the document: room for pretty-printing,
# none for the endless run of newlines a model can fall into when it does not know JSON is wanted.
WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"
MAX_FORMATS = 64  # compiled (tokenizer, schema) pairs kept; an API client may send a new schema per request
# What a schema may hold, checked before compiling. llguidance's parser keeps at most 2,000 items in a row of
# its chart: an object with 499 optional properties (4 items each), or an anyOf of 2,000 objects, compiles
# and then fails at the reply's first "{". Patterns build the lexer's automata as the reply goes, and a long
# one makes each mask slow (20,000 characters: 10 ms a token, as long as a decode step of the default model).
MAX_SCHEMA_BYTES = 100_000  # the schema as JSON text, UTF-8
MAX_SCHEMA_DEPTH = 64  # nesting of its objects and arrays (llguidance reads JSON 128 levels deep)
MAX_PROPERTIES = 256  # properties of one object
MAX_ALTERNATIVES = 1_000  # schemas of one anyOf or oneOf, values of one enum
MAX_PATTERN = 1_000  # characters of one pattern (or patternProperties key)
DATA_KEYWORDS = ("enum", "const", "default", "examples")  # their values are JSON documents, not schemas
NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
# A lexer that would build more than this (~2 ms of work) fails instead of taking seconds at one token:
# ^(x{1000}){1000}$ took 4 s with llguidance's default of 1,000,000. verbose_errors=False: a failure's
# message is one line, without the parser's state (which holds the reply so far).
LIMITS = llguidance.LLParserLimits(initial_lexer_fuel=100_000, verbose_errors=False)


class SchemaError(ValueError):
    """A response format that cannot be compiled; the message names what is wrong (an HTTP 400)."""


def schema_text(schema: dict | None, param: str = "response_format") -> str:
    """The schema as JSON text: the cache key (key order kept: it is the order properties are written)."""
    if schema is None:
        schema = ANY_OBJECT
    if not isinstance(schema, dict):
        raise SchemaError(f"{param}: expected a JSON schema object, found {type(schema).__name__}")
    check_shape(schema, param)
    try:
        text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise SchemaError(f"{param}: the JSON schema is not JSON ({e})") from None
    if (size := len(text.encode("utf-8", "surrogatepass"))) > MAX_SCHEMA_BYTES:
        raise SchemaError(f"{param}: the JSON schema is {size:,} bytes of JSON; at most "
                          f"{MAX_SCHEMA_BYTES:,} are taken")
    return text


def check_shape(schema: dict, param: str = "response_format") -> None:
    """SchemaError for the first place past a limit (MAX_SCHEMA_DEPTH, MAX_PROPERTIES, MAX_ALTERNATIVES,
    MAX_PATTERN), named by its path in the schema. Walked without recursion, so any depth is measured."""
    todo: list[tuple[object, str, int, str]] = [(schema, "", 1, "schema")]  # (value, where, depth, what it is)
    while todo:
        value, where, depth, kind = todo.pop()
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise SchemaError(f"{param}: the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels "
                              f"(at '{where}')")
        if isinstance(value, list):
            todo += [(item, f"{where}[{i}]", depth + 1, kind) for i, item in enumerate(value)]
            continue
        if kind == "schema":
            check_keywords(value, where, param)
        todo += [(item, at(where, key), depth + 1, inner(kind, key)) for key, item in value.items()]


def inner(kind: str, key: str) -> str:
    """What the value at `key` of a dict of this kind is: a schema, a dict of named schemas, or JSON data."""
    if kind == "schema":
        return "data" if key in DATA_KEYWORDS else "names" if key in NAMED_SCHEMAS else "schema"
    return "data" if kind == "data" else "schema"


def check_keywords(schema: dict, where: str, param: str) -> None:
    for keyword, limit, what in [("properties", MAX_PROPERTIES, "properties"), ("anyOf", MAX_ALTERNATIVES, "schemas"),
                                 ("oneOf", MAX_ALTERNATIVES, "schemas"), ("enum", MAX_ALTERNATIVES, "values")]:
        found = schema.get(keyword)
        if isinstance(found, dict | list) and len(found) > limit:
            raise SchemaError(f"{param}: the JSON schema's '{at(where, keyword)}' has {len(found):,} {what}; "
                              f"at most {limit:,} are taken")
    named = schema.get("patternProperties")
    for pattern in [schema.get("pattern"), *(named if isinstance(named, dict) else ())]:
        if isinstance(pattern, str) and len(pattern) > MAX_PATTERN:
            raise SchemaError(f"{param}: a pattern in the JSON schema's '{where or '(top)'}' has "
                              f"{len(pattern):,} characters; at most {MAX_PATTERN:,} are taken")


def at(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


class LLVocabulary:
    """What llguidance.TokenizerWrapper reads from a tokenizer: every id's bytes, the special ids, encode."""

    def __init__(self, tokenizer):
        self.tokens = tokenizer.token_bytes()
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        # Special ids, and ids that spell nothing, never stand for text in the document.
        self.special_token_ids = sorted({*tokenizer.special_tokens.values(),
                                         *(i for i, piece in enumerate(self.tokens) if not piece)})
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text)


@lru_cache(maxsize=8)
def ll_tokenizer(tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of one of our tokenizers (its token trie); about 0.2 s for 49k ids, 0.6 s for 128k."""
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(LLVocabulary(tokenizer)),
                                  eos_token=sorted(tokenizer.stop_ids))


class Format:
    """A compiled schema: a matcher at the start of its document, which each reply copies, and why a reply of
    it failed, once one did: the copies share one lexer, which llguidance leaves broken after a failure, so
    later replies of the schema are refused before they start."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher, self.failure = matcher, ""


@lru_cache(maxsize=MAX_FORMATS)
def compiled_format(tokenizer, schema: str, param: str = "response_format") -> Format:
    """`schema` (JSON text) compiled, its document's first mask and openings tried (SchemaError)."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_pattern": WHITESPACE})
    except ValueError as e:
        raise SchemaError(f"{param}: the JSON schema is not supported ({e})") from None
    matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar, log_level=0, limits=LIMITS)
    if matcher.is_error():
        raise SchemaError(f"{param}: the JSON schema is not supported ({failure(matcher)})")
    matcher.compute_bitmask()  # the first mask: where a schema that refers only to itself fails
    if matcher.is_error():
        raise SchemaError(f"{param}: the JSON schema is not supported (at the document's start: "
                          f"{failure(matcher)})")
    for opening in '{["':
        opened = matcher.deep_copy()
        ids = tokenizer.encode(opening)
        if opened.try_consume_tokens(ids) == len(ids):  # (a document of this schema may open so)
            opened.compute_bitmask()
        if opened.is_error():
            raise SchemaError(f"{param}: the JSON schema is not supported (after the document's first "
                              f"'{opening}': {failure(opened)})")
    return Format(matcher)


def failure(matcher: llguidance.LLMatcher) -> str:
    """llguidance's error, its first line (the rest is advice for grammar writers, or its state)."""
    return matcher.get_error().strip().splitlines()[0].split("; consider ")[0]


def forget_compiled() -> None:
    """Drop the tokenizer views and compiled formats kept for the next reply: they hold their tokenizers, so
    an unloaded model's would stay in memory. The loaded models' are built again on their next use."""
    compiled_format.cache_clear()
    ll_tokenizer.cache_clear()


class JsonConstraint:
    """The allowed next ids of one reply that must be a JSON document of a schema (None: any object).

    `vocab_size` is the model's (its logits' length), which may exceed the tokenizer's: the extra ids
    are never allowed. `stop_ids` (default: the tokenizer's) should be the ids that end the reply.
    Raises SchemaError for a schema llguidance cannot compile (unknown types or keywords, bad $ref,
    contradictions such as minLength > maxLength). `param`: the request parameter the schema came from, which
    the errors name ("tools" for the calls that tool_choice requires: model/tool_choice.py).
    """

    def __init__(self, tokenizer, schema: dict | None = None, *, vocab_size: int | None = None,
                 stop_ids=None, param: str = "response_format"):
        self.n_tokens = tokenizer.vocab_size
        self.vocab_size = self.n_tokens if vocab_size is None else vocab_size
        if self.vocab_size < self.n_tokens:
            raise ValueError(f"vocab_size={self.vocab_size}: expected at least the tokenizer's "
                             f"{self.n_tokens} ids")
        self.stop_ids = sorted(tokenizer.stop_ids if stop_ids is None else stop_ids)
        self.schema, self.param = schema, param
        self._format = compiled_format(tokenizer, schema_text(schema, param), param)
        if self._format.failure:
            raise SchemaError(f"{param}: the JSON schema is not supported (an earlier reply of it failed: "
                              f"{self._format.failure})")
        self._matcher = self._format.matcher.deep_copy()
        self._stopped = False  # a stop id was taken
        self._taken = 0  # ids of the document so far
        self._allowed: torch.Tensor | None = None  # the last mask

    @property
    def complete(self) -> bool:
        """The text so far is a whole document of the format: a stop id may come next."""
        return self._stopped or self._matcher.is_accepting()

    @property
    def finished(self) -> bool:
        """Nothing but a stop id may come next (or one came)."""
        return self._stopped or self._matcher.is_stopped()

    def mask(self) -> torch.Tensor:
        """(vocab_size,) bool: True for each id that may come next. ConstraintFailed where llguidance fails."""
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        if not self._stopped:
            bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)  # one bit per id, little-endian
            self._check()
            mask[:self.n_tokens] = torch.from_numpy(np.unpackbits(bits, bitorder="little")[:self.n_tokens])
        mask[self.stop_ids] = self.complete
        if not mask.any():
            self._fail("its mask allows no id")
        self._allowed = mask
        return mask

    def advance(self, token: int) -> None:
        """Take the sampled id. One the mask did not allow raises ValueError and changes nothing;
        ConstraintFailed where llguidance fails on one it allowed."""
        if token in self.stop_ids and self.complete:
            self._stopped = True
            return
        taken = (not self._stopped and 0 <= token < self.n_tokens and token not in self.stop_ids
                 and self._matcher.try_consume_tokens([token]) == 1)
        self._check()
        if not taken and self._allowed is not None and 0 <= token < self.vocab_size and self._allowed[token]:
            self._fail(f"it refused the id {token}, which its mask allowed")
        if not taken:
            raise ValueError(f"token {token} does not continue the JSON reply (complete={self.complete}, "
                             f"finished={self.finished})")
        self._taken += 1

    def _check(self) -> None:
        if self._matcher.is_error():
            self._fail(failure(self._matcher))

    def _fail(self, why: str):
        self._format.failure = self._format.failure or why
        raise ConstraintFailed(f"{self.param}: the JSON schema could not be followed after {self._taken} tokens "
                               f"of the reply ({why}): simplify it (fewer optional properties or alternatives, "
                               "shorter patterns)")
