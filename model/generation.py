"""Prefill + decode with a per-request KV cache, stop tokens, cancellation and UTF-8 safe streaming."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from .checkpoint import Checkpoint
from .config import DEFAULT_MAX_CONTEXT
from .context import PromptTooLong
from .kv_cache import PREFILL_CHUNK, KVCache
from .sampling import Sampler, SamplingParams


class TextStream:
    """Turns token ids into text pieces, holding back a piece until its characters are whole.

    Emoji and many CJK characters span two or more byte-level tokens; decoding one token alone
    gives U+FFFD. Decoding a short window of recent ids and emitting only what grew, once it no
    longer ends in U+FFFD, is exact for any tokenizer with a `decode(ids)`.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] were already emitted; decoded as context for the next piece
        self.read = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        done = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if len(text) <= len(done) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done):]


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose keys/values came from the conversation's cache
    new_tokens: int = 0
    time_to_first_token: float = 0.0  # seconds from start to the first sampled token
    total_time: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        decode_time = self.total_time - self.time_to_first_token
        return (self.new_tokens - 1) / decode_time if self.new_tokens > 1 and decode_time > 0 else 0.0


class Generation:
    """One reply. Iterate it for text pieces; afterwards read `tokens`, `finish_reason`, `stats`.

    finish_reason: "stop" (a stop token, or a `constraint` after which only one may come), "length"
    (max_new_tokens or the context limit), "cancelled" (should_stop() returned True).

    Sampling comes from `sampling` or from the shorthand `temperature`, `top_k`, `top_p` (not both);
    `seed`, when given, replaces the seed of either. Neither given: greedy.
    """

    def __init__(self, checkpoint: Checkpoint, prompt_ids: list[int], *, max_new_tokens: int = 512,
                 sampling: SamplingParams | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, should_stop: Callable[[], bool] | None = None,
                 max_context: int | None = None, kv_cache: KVCache | None = None,
                 stop_ids: set[int] | None = None, constraint=None):
        model = checkpoint.model
        limit = min(max_context or DEFAULT_MAX_CONTEXT, checkpoint.config.max_seq_len)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= limit:
            raise PromptTooLong(f"the prompt has {len(prompt_ids)} tokens; the context limit is {limit} "
                                f"tokens, which must also leave room for the reply")
        self.checkpoint, self.prompt_ids = checkpoint, list(prompt_ids)
        self.max_new_tokens = max(0, min(max_new_tokens, limit - len(prompt_ids)))
        self.sampling = sampling_params(sampling, temperature, top_k, top_p, seed)
        self.sampler = Sampler(self.sampling, device=checkpoint.device)
        self.sampler.accept(self.prompt_ids)
        self.should_stop = should_stop or (lambda: False)
        self.stop_ids = checkpoint.stop_ids if stop_ids is None else stop_ids
        self.constraint = constraint  # e.g. model.structured.JsonConstraint: mask(), advance(token), finished
        needed = len(prompt_ids) + self.max_new_tokens
        if kv_cache is None:
            kv_cache = KVCache(checkpoint.config, needed, device=checkpoint.device, dtype=checkpoint.dtype)
        elif kv_cache.max_len < needed:
            kv_cache = kv_cache.resized(needed)
        self.kv_cache = kv_cache
        self.tokens: list[int] = []
        # Control tokens the model may emit (e.g. <|python_tag|>) stay in `tokens` but not in the text.
        self.hidden_ids = set(checkpoint.tokenizer.special_tokens.values())
        self.finish_reason: str | None = None
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self._model = model

    def __iter__(self) -> Iterator[str]:
        start_time = time.perf_counter()
        stream = TextStream(self.checkpoint.tokenizer)
        cache = self.kv_cache
        # Keys/values of a common prefix computed as this prompt's prefill would are kept (model/kv_cache.py);
        # at least the last prompt token is run for logits.
        reused = cache.reusable(self.prompt_ids)
        self.stats.reused_tokens = reused
        self.finish_reason = "length"
        cache.truncate(reused)
        while cache.length < len(self.prompt_ids):
            if self.should_stop():
                self.finish_reason = "cancelled"
                self.stats.total_time = time.perf_counter() - start_time
                return
            start = cache.length
            chunk = self.prompt_ids[start:cache.chunk_end(len(self.prompt_ids))]
            logits = self._prefill(chunk, start)
            cache.extend(chunk)
        for _ in range(self.max_new_tokens):
            if self.should_stop():
                self.finish_reason = "cancelled"
                break
            if self.constraint is not None:
                logits = logits.masked_fill(~self.constraint.mask().to(logits.device), float("-inf"))
            token = self.sampler.sample(logits)
            if not self.tokens:
                self.stats.time_to_first_token = time.perf_counter() - start_time
            if token in self.stop_ids:
                self.finish_reason = "stop"
                break
            if self.constraint is not None:
                self.constraint.advance(token)
            self.tokens.append(token)
            self.sampler.accept([token])
            self.stats.new_tokens = len(self.tokens)
            piece = stream.push(token) if token not in self.hidden_ids else ""
            if piece:
                yield piece
            if len(self.tokens) == self.max_new_tokens:
                break
            if self.constraint is not None and self.constraint.finished:  # only a stop id may follow
                self.finish_reason = "stop"
                break
            logits = self._decode(token)
            cache.extend([token])
        piece = stream.flush()
        if piece:
            yield piece
        self.stats.total_time = time.perf_counter() - start_time

    @property
    def text(self) -> str:
        return self.checkpoint.tokenizer.decode([t for t in self.tokens if t not in self.hidden_ids])

    @torch.inference_mode()
    def _prefill(self, ids: list[int], start_pos: int) -> torch.Tensor:
        """A prompt chunk at start_pos through the model, filling the cache; logits of its last token
        (vocab,). Always the forward pass, also for one token: a chunk is computed one way only."""
        tokens = torch.tensor([ids], dtype=torch.long, device=self.checkpoint.device)
        return self._model(tokens, start_pos=start_pos, kv_cache=self.kv_cache, last_only=True)[0, -1]

    @torch.inference_mode()
    def _decode(self, token: int) -> torch.Tensor:
        """One sampled token at the cache's length through the model; the next logits (vocab,)."""
        tokens = torch.tensor([token], dtype=torch.long, device=self.checkpoint.device)
        return self._model.decode(tokens, [self.kv_cache])[0]


def sampling_params(sampling: SamplingParams | None, temperature: float | None, top_k: int | None,
                    top_p: float | None, seed: int | None) -> SamplingParams:
    """One SamplingParams from Generation's `sampling` or its shorthand keywords."""
    shorthand = {k: v for k, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p))
                 if v is not None}
    if sampling is not None and shorthand:
        raise ValueError(f"Generation: pass either sampling= or {', '.join(shorthand)}=, not both")
    if sampling is None:
        sampling = SamplingParams(**{**shorthand, "top_k": shorthand.get("top_k") or 0})
    return sampling if seed is None else replace(sampling, seed=seed)


LLAMA3_TEMPERATURE, LLAMA3_TOP_P = 0.6, 0.9  # Meta's generation_config.json for Llama 3.x Instruct


def sampling_defaults(checkpoint: Checkpoint) -> SamplingParams:
    """The checkpoint's generation_config.json (Hugging Face names), else Llama 3's defaults.

    Reads temperature, top_k, top_p, min_p, repetition_penalty; do_sample=false means greedy.
    """
    g = checkpoint.generation_defaults

    def value(name: str, default, kind=float):
        found = g.get(name)
        if found is None:
            return default
        try:
            return kind(found)
        except (TypeError, ValueError):
            raise ValueError(f"{name}={found!r}: expected a {kind.__name__}") from None

    try:
        if g.get("do_sample") is False:  # greedy: only the penalty still matters
            return SamplingParams(repetition_penalty=value("repetition_penalty", 1.0))
        return SamplingParams(
            temperature=value("temperature", LLAMA3_TEMPERATURE), top_k=value("top_k", 0, int),
            top_p=value("top_p", LLAMA3_TOP_P), min_p=value("min_p", 0.0),
            repetition_penalty=value("repetition_penalty", 1.0))
    except ValueError as e:
        raise ValueError(f"generation_config.json of {checkpoint.name}: {e}") from None


def generate(checkpoint: Checkpoint, prompt_ids: list[int], **options) -> Generation:
    """Start a reply to prompt_ids; see Generation for the options and the results."""
    return Generation(checkpoint, prompt_ids, **options)
