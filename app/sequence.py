"""One request inside the engine: its prompt, its KV cache, its sampling, its reply so far.

The engine's step loop feeds a sequence prompt chunks (`prefill_chunk`, then `prefilled`) and the
logits of each position it must sample (`sample`), then asks `accept(token)` what text that token
adds; the sequence decides when it is done: a stop token, a stop string, its token limit, or a
cancel.
"""

from __future__ import annotations

import time

import torch

from model.generation import TextStream
from model.kv_cache import KVCache
from model.sampling import Sampler, SamplingParams, token_logprobs
from model.tool_parser import may_be_tool_call, parse_tool_calls

from .messages import Context, Done, Generate, ReplySettings, Stats, TokenLogprob


class StopScanner:
    """Cuts streamed text at the first stop string, holding back a tail that may begin one."""

    def __init__(self, stops: tuple[str, ...] | list[str]):
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
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
        keep = next((k for k in range(min(len(self.held), self.longest - 1), 0, -1)
                     if any(s.startswith(self.held[-k:]) for s in self.stops)), 0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


class Sequence:
    """One reply to a request from the web side (a request for n replies has n sequences: the first
    prefills the prompt, the others start from a copy of its cache)."""

    def __init__(self, request: Generate, arrived: float, index: int = 0, leader: Sequence | None = None):
        self.id = request.id
        self.index = index
        self.leader = leader  # the sequence whose prefilled prompt this one copies
        self.followers: list[Sequence] = []
        self.model = request.model
        self.scope = (request.model, request.user)  # kept KV caches are reused within one model and one user
        self.request = request
        self.arrived = arrived
        self.settings: ReplySettings | None = None  # every field set, once the model is known
        self.prompt: list[int] | None = None  # built once the model is loaded
        self.cache: KVCache | None = None  # taken when the sequence starts running
        self.tokens: list[int] = []  # the reply's ids
        self.pieces: list[str] = []  # the reply's text, as streamed
        self.finish_reason: str | None = None
        self.cancelled = False
        self.stats = Stats()
        self.context = Context()  # how its prompt fit the model's context, set by the engine with the prompt
        self._stream: TextStream | None = None
        self._stop_strings = StopScanner(())
        self._sampler: Sampler | None = None
        self._stop_ids: set[int] = set()
        self._hidden_ids: set[int] = set()
        self._max_new_tokens = 0
        self._tokenizer = None
        # With tools, a reply that may be a call is held back until it cannot be one (then streamed) or
        # ends (then parsed): a client never sees a call's text as content.
        self._tools = {t["function"]["name"] for t in request.tools or []} if request.tool_choice != "none" else set()
        self._holding = bool(self._tools)
        self._held: list[str] = []
        self.unsent = ""  # text held back that turned out not to be a call: the engine sends it at the end
        self._constraint = None  # model.structured.JsonConstraint, for a JSON reply
        self._token_bytes: list[bytes] | None = None  # with logprobs: every token's bytes
        self._logprobs: list[TokenLogprob] = []  # not yet sent

    def start(self, checkpoint, prompt: list[int], settings: ReplySettings, limit: int, *, constraint=None,
              token_bytes: list[bytes] | None = None) -> None:
        """Ready to run: the prompt's ids and the reply's settings (all set) are known. constraint: the
        JSON the reply must be; token_bytes: each token's bytes, when logprobs are asked for."""
        self._constraint, self._token_bytes = constraint, token_bytes
        self.prompt, self.settings = prompt, settings
        self._max_new_tokens = max(0, min(settings.max_new_tokens, limit - len(prompt)))
        self._stream = TextStream(checkpoint.tokenizer)
        self._tokenizer = checkpoint.tokenizer
        self._stop_strings = StopScanner(settings.stop)
        self._sampler = Sampler(SamplingParams(
            temperature=settings.temperature, top_k=settings.top_k or 0, top_p=settings.top_p, min_p=settings.min_p,
            repetition_penalty=settings.repetition_penalty, frequency_penalty=settings.frequency_penalty,
            presence_penalty=settings.presence_penalty, seed=settings.seed), device=checkpoint.device)
        self._sampler.accept(prompt)  # the repetition penalty looks at the prompt too
        self._stop_ids = set() if settings.ignore_eos else checkpoint.stop_ids
        # Control tokens the model may emit (e.g. <|python_tag|>) stay in `tokens` but not in the text.
        self._hidden_ids = set(checkpoint.tokenizer.special_tokens.values())
        self.stats.prompt_tokens = len(prompt)
        if self._max_new_tokens == 0:
            self.finish_reason = "length"

    # -- what the scheduler reads

    @property
    def ready(self) -> bool:
        """Its prompt is built, and (for a follower) its leader's prefilled prompt is copied."""
        return (self.prompt is not None and (self.leader is None or self.cache is not None)) or self.finished

    @property
    def prompt_left(self) -> int:
        if self.tokens or self.prompt is None:
            return 0
        return len(self.prompt) - (self.cache.length if self.cache is not None else 0)

    @property
    def next_chunk(self) -> int:
        """Prompt tokens in its next prefill chunk (model/kv_cache.py: chunks start at multiples of the
        chunk size, whatever else is prefilled in the step), 0 once its prompt is in its cache."""
        if self.prompt_left == 0:
            return 0
        return self.cache.chunk_end(len(self.prompt)) - self.cache.length

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def max_len(self) -> int:
        """Cache positions this sequence may need: its prompt and its longest reply."""
        return len(self.prompt) + self._max_new_tokens

    # -- what the engine calls

    def prefill_chunk(self) -> tuple[list[int], int]:
        """The prompt ids of its next prefill chunk, and the position of the first."""
        start = self.cache.length
        return self.prompt[start:start + self.next_chunk], start

    def sample(self, logits: torch.Tensor) -> int:
        """The next token, from the logits of the model at the reply's next position (vocab,)."""
        raw = logits
        if self._constraint is not None:
            logits = logits.masked_fill(~self._constraint.mask().to(logits.device), float("-inf"))
        token = self._sampler.sample(logits)
        if self._token_bytes is not None:
            logprob, top = token_logprobs(raw, token, self.request.logprobs)
            self._logprobs.append(TokenLogprob(*self._spelled(token), logprob,
                                               [TokenLogprob(*self._spelled(t), lp) for t, lp in top]))
        return token

    def _spelled(self, token: int) -> tuple[str, list[int]]:
        data = self._token_bytes[token] if token < len(self._token_bytes) else b""
        return data.decode("utf-8", errors="replace"), list(data)

    def take_logprobs(self) -> list[TokenLogprob]:
        """The logprobs of the tokens sampled since the last call (empty unless asked for)."""
        taken, self._logprobs = self._logprobs, []
        return taken

    def accept(self, token: int) -> str:
        """Take the sampled token; returns the text it adds (often "", for a partial character)."""
        if not self.stats.time_to_first_token:
            self.stats.time_to_first_token = time.perf_counter() - self.arrived
        self._sampler.accept([token])
        if self._constraint is not None:
            self._constraint.advance(token)
        if token in self._stop_ids:
            self.finish_reason = "stop"
            return self._emit(self._rest())
        self.tokens.append(token)
        self.stats.new_tokens = len(self.tokens)
        text = self._stop_strings.feed(self._stream.push(token) if token not in self._hidden_ids else "")
        if self._stop_strings.stopped or (self._constraint is not None and self._constraint.finished):
            self.finish_reason = "stop"  # (a finished JSON document: only a stop token could follow)
            text += self._rest()
        elif len(self.tokens) >= self._max_new_tokens:
            self.finish_reason = "length"
            text += self._rest()
        return self._emit(text)

    def _rest(self) -> str:
        """What the detokenizer and the stop-string scanner still hold back, at the end."""
        return self._stop_strings.feed(self._stream.flush()) + self._stop_strings.flush()

    def _emit(self, text: str) -> str:
        self.pieces.append(text)
        if self._holding:
            self._held.append(text)
            if may_be_tool_call(self._tokenizer.decode(self.tokens)):  # control tokens spelled out
                return ""
            self._holding, text, self._held = False, "".join(self._held), []
        return text

    def cancel(self) -> None:
        self.cancelled = True
        if self.finish_reason is None:
            self.finish_reason = "cancelled"

    def done(self) -> Done:
        if self.finish_reason in (None, "cancelled") and self._stream is not None:
            self._emit(self._rest())
        self.stats.total_time = time.perf_counter() - self.arrived
        text, calls = "".join(self.pieces), []
        if self._tools and self._tokenizer is not None:
            content, found = parse_tool_calls(self._tokenizer.decode(self.tokens))
            calls = [call.to_openai() for call in found if call.name in self._tools]  # not Meta's built-ins
            if calls:
                text = content
                calls = calls if self.request.parallel_tool_calls else calls[:1]
        if not calls and self._holding:
            self.unsent = "".join(self._held)
        return Done(self.id, text, self.finish_reason or "cancelled", self.stats, list(self.tokens), self.index,
                    calls, self.context)
