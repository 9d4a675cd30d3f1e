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
"""

from __future__ import annotations

import json
from functools import lru_cache

import llguidance
import numpy as np
import torch

ANY_OBJECT = {"type": "object"}  # json_object mode: any JSON object, as OpenAI's
# JSON whitespace, at most 16 characters between two tokens of the document: room for pretty-printing,
# none for the endless run of newlines a model can fall into when it does not know JSON is wanted.
WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"
MAX_FORMATS = 64  # compiled (tokenizer, schema) pairs kept; an API client may send a new schema per request


class SchemaError(ValueError):
    """A response format that cannot be compiled; the message names what is wrong (an HTTP 400)."""


def schema_text(schema: dict | None) -> str:
    """The schema as JSON text: the cache key (key order kept: it is the order properties are written)."""
    if schema is None:
        schema = ANY_OBJECT
    if not isinstance(schema, dict):
        raise SchemaError(f"response_format: expected a JSON schema object, found {type(schema).__name__}")
    try:
        return json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise SchemaError(f"response_format: the JSON schema is not JSON ({e})") from None


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


@lru_cache(maxsize=MAX_FORMATS)
def compiled_format(tokenizer, schema: str) -> llguidance.LLMatcher:
    """A matcher at the start of a document of `schema` (JSON text); each reply takes a copy."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_pattern": WHITESPACE})
    except ValueError as e:
        raise SchemaError(f"response_format: the JSON schema is not supported ({e})") from None
    matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar, log_level=0)
    if matcher.is_error():
        raise SchemaError(f"response_format: the JSON schema is not supported ({matcher.get_error()})")
    return matcher


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
    contradictions such as minLength > maxLength).
    """

    def __init__(self, tokenizer, schema: dict | None = None, *, vocab_size: int | None = None,
                 stop_ids=None):
        self.n_tokens = tokenizer.vocab_size
        self.vocab_size = self.n_tokens if vocab_size is None else vocab_size
        if self.vocab_size < self.n_tokens:
            raise ValueError(f"vocab_size={self.vocab_size}: expected at least the tokenizer's "
                             f"{self.n_tokens} ids")
        self.stop_ids = sorted(tokenizer.stop_ids if stop_ids is None else stop_ids)
        self.schema = schema
        self._matcher = compiled_format(tokenizer, schema_text(schema)).deep_copy()
        self._stopped = False  # a stop id was taken

    @property
    def complete(self) -> bool:
        """The text so far is a whole document of the format: a stop id may come next."""
        return self._stopped or self._matcher.is_accepting()

    @property
    def finished(self) -> bool:
        """Nothing but a stop id may come next (or one came)."""
        return self._stopped or self._matcher.is_stopped()

    def mask(self) -> torch.Tensor:
        """(vocab_size,) bool: True for each id that may come next."""
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        if not self._stopped:
            bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)  # one bit per id, little-endian
            mask[:self.n_tokens] = torch.from_numpy(np.unpackbits(bits, bitorder="little")[:self.n_tokens])
            if self._matcher.is_error():
                raise RuntimeError(f"JSON constraint: {self._matcher.get_error()}")
        mask[self.stop_ids] = self.complete
        return mask

    def advance(self, token: int) -> None:
        """Take the sampled id. One the mask did not allow raises ValueError and changes nothing."""
        if token in self.stop_ids and self.complete:
            self._stopped = True
            return
        taken = (not self._stopped and 0 <= token < self.n_tokens and token not in self.stop_ids
                 and self._matcher.try_consume_tokens([token]) == 1)
        if not taken:
            raise ValueError(f"token {token} does not continue the JSON reply (complete={self.complete}, "
                             f"finished={self.finished})")
