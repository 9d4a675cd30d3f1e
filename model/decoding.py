"""The decoding policy of one reply: which token comes next, what text it adds, when and why the reply ends.

`generate()` (model/generation.py) and the engine's sequences (app/engine/sequence.py) decode through a
`Decoding`, so a reply follows one set of rules wherever it runs:

    decoding = Decoding(tokenizer, prompt, sampling=params, max_new_tokens=512, context_limit=8192,
                        stop_ids=checkpoint.stop_ids, stop=["\\n\\n"])
    while not decoding.finished:
        token = decoding.sample(logits)   # the constraint's mask, then the sampler
        text = decoding.accept(token)     # the text to show now ("" while it is not sure yet)
        logits = ...                      # the model, one step on
    text = decoding.end()                 # what was still held back; a reply no rule ended is "cancelled"

accept() applies the rules in this order:
1. A constraint (a JSON reply, model/structured.py) takes every sampled id, a stop id too: its mask
   allowed it, and it then knows the document ended.
2. A stop id ends the reply ("stop"). It is not one of the reply's `tokens`, not in its text, not
   counted in its stats and has no logprob (OpenAI reports one logprob per completion token).
3. Every other id is the reply's: the sampler's penalties count it; a control token (<|python_tag|>)
   stays in `tokens` but adds no text; text grows by whole characters only (TextStream).
4. A stop string ends the reply ("stop") with the text before it; text that may begin one is held
   back until that is decided. A finished JSON document ends it too ("stop": only a stop id could follow).
5. Then the token limit ("length"): the prompt and the reply fit the context limit, and the reply
   `max_new_tokens`. A reply completed by its last allowed token ended by rule 4, not by its length.
6. With tools declared, text that may still be a call is held back; at the end a call to a declared
   tool becomes `tool_calls` (the text is then the content around it), anything else is given out. A reply
   that tool_choice forced to be a call (`forced`: the names it may call) and that its token limit (or a cancel)
   cut short is a call too: its whole calls and the last one as far as it went (model/tool_parser.py cut_calls),
   never text (none at all where not even a name was written).

A constraint that cannot go on (its grammar engine fails at some token: model/structured.py) raises
ConstraintFailed from mask() or advance(): the reply ends there ("constraint_failed", `error` says why), its
text so far kept; sample() then gives NO_TOKEN, which accept() takes as nothing. Only that reply ends.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import NamedTuple

import torch

from .sampling import Sampler, SamplingParams, token_logprobs
from .stats import Stats
from .tool_parser import cut_calls, may_be_tool_call, parse_tool_calls
from .tools import ToolCall

NO_TOKEN = -1  # what sample() gives once the reply ended without a token (its constraint failed)


class ConstraintFailed(RuntimeError):
    """A constraint whose grammar engine failed midway (a resource limit): its reply cannot go on. The message
    says what failed and where, for the reply's reader."""


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


class StopScanner:
    """Cuts streamed text at the first stop string, holding back a tail that may begin one."""

    def __init__(self, stops: Sequence[str]):
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


class Logprob(NamedTuple):
    """One token of a reply: its log-probability in the model's own distribution (before the constraint,
    penalties, filters and temperature, as OpenAI reports it) and the top alternatives, most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token, logprob)


class Decoding:
    """The decoding of one reply: its sampler, constraint, stop rules, text, logprobs, tool calls and stats.

    stop_ids: the ids that end the reply (empty: go on to the token limit). stop: a string or strings that
    end it (never shown). constraint: what the reply must be (model.structured.JsonConstraint: mask(), advance(),
    finished). logprobs: report each token's logprob and this many alternatives (None: off). tools: the
    names of the functions the reply may call; forced: those it must call one of (tool_choice "required" or a
    name: its constraint is the call's JSON). started: perf_counter() time the stats count from.
    """

    def __init__(self, tokenizer, prompt: list[int], *, sampling: SamplingParams, max_new_tokens: int,
                 context_limit: int, stop_ids: Collection[int], stop: str | Sequence[str] = (), constraint=None,
                 logprobs: int | None = None, tools: Collection[str] = (), parallel_tool_calls: bool = True,
                 forced: Collection[str] = (), device="cpu", started: float | None = None):
        self.tokenizer = tokenizer
        self.max_new_tokens = max(0, min(max_new_tokens, context_limit - len(prompt)))
        self.sampler = Sampler(sampling, device=device)
        self.sampler.accept(prompt)  # the repetition penalty looks at the prompt too
        self.stop_ids = set(stop_ids)
        self.constraint = constraint
        self.top_logprobs = logprobs
        self.tools = set(tools)
        self.forced = set(forced)
        self.parallel_tool_calls = parallel_tool_calls
        self.started = time.perf_counter() if started is None else started
        # Control tokens the model may emit (e.g. <|python_tag|>) stay in `tokens` but not in the text.
        self.hidden_ids = set(tokenizer.special_tokens.values())

        self.tokens: list[int] = []  # the reply's ids, a stop id not among them
        self.logprobs: list[Logprob] = []  # one per token, when asked for
        self.tool_calls: list[ToolCall] = []  # once ended
        self.stats = Stats(prompt_tokens=len(prompt))
        self.finish_reason: str | None = "length" if self.max_new_tokens == 0 else None
        self.error = ""  # why the reply ended early (finish_reason "constraint_failed")
        self._stream = TextStream(tokenizer)
        self._stop_strings = StopScanner([stop] if isinstance(stop, str) else stop)
        self._pieces: list[str] = []  # the reply's text, given out or held
        self._holding = bool(self.tools)  # may the reply still be a tool call?
        self._held: list[str] = []  # text not given out while it may be a call
        self._content = ""  # the text around the tool calls, once ended
        self._cut = False  # a forced call cut short: never text, even before a call began
        self._logprob: Logprob | None = None  # of the token sample() chose last
        self._first = True
        self._flushed = False
        self._ended = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The reply's text: what accept() and end() gave out and hold; the content around a tool call."""
        if self.tool_calls or self._cut:
            return self._content
        return "".join(self._pieces)

    def sample(self, logits: torch.Tensor) -> int:
        """The next token from the logits of the model at the reply's next position (vocab,)."""
        masked = logits
        if self.constraint is not None:
            try:
                allowed = self.constraint.mask()
            except ConstraintFailed as e:
                self._failed(e)
                return NO_TOKEN
            masked = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
        token = self.sampler.sample(masked)
        if self.top_logprobs is not None:
            self._logprob = Logprob(token, *token_logprobs(logits, token, self.top_logprobs))
        return token

    @property
    def drawable(self) -> bool:
        """Whether draw() may sample: no constraint and no logprobs, which need the host first."""
        return self.constraint is None and self.top_logprobs is None

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """sample() as a 0-dim tensor on the logits' device, not waited for (a reply that is `drawable`): its next
        step can be queued on the token before the host reads it."""
        if not self.drawable:
            raise ValueError("draw(): a reply with a constraint or logprobs samples on the host (sample())")
        return self.sampler.draw(logits)

    def accept(self, token: int) -> str:
        """Take the sampled token: the text it adds now (often "": a partial character, a possible stop
        string or tool call). Afterwards `finish_reason` says whether and why the reply ended."""
        if self.finished:  # NO_TOKEN: sample() ended the reply
            return ""
        if self._first:
            self._first = False
            self.stats.time_to_first_token = time.perf_counter() - self.started
        logprob, self._logprob = self._logprob, None
        if self.constraint is not None:
            try:
                self.constraint.advance(token)
            except ConstraintFailed as e:  # the token is not the reply's: the reply ends before it
                self._failed(e)
                return ""
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return self._emit(self._rest())
        self.tokens.append(token)
        self.stats.new_tokens = len(self.tokens)
        self.sampler.accept([token])
        if logprob is not None:
            self.logprobs.append(logprob)
        text = self._stop_strings.feed(self._stream.push(token) if token not in self.hidden_ids else "")
        if self._stop_strings.stopped or (self.constraint is not None and self.constraint.finished):
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.max_new_tokens:
            self.finish_reason = "length"
        if self.finished:
            text += self._rest()
        return self._emit(text)

    def cancel(self) -> None:
        """End the reply where it is (end() gives out what it held back)."""
        if self.finish_reason is None:
            self.finish_reason = "cancelled"

    def _failed(self, e: ConstraintFailed) -> None:
        self.finish_reason, self.error = "constraint_failed", str(e)

    def end(self) -> str:
        """Close the reply (as "cancelled" if no rule ended it): the text not given out yet, which is
        what was held back, unless it is a tool call. Sets the stats' total time and `tool_calls`."""
        if self._ended:
            return ""
        self._ended = True
        self.cancel()
        unsent = self._emit(self._rest())
        self.stats.total_time = time.perf_counter() - self.started
        if self.tools:
            text = self.tokenizer.decode(self.tokens)  # control tokens spelled out
            self._content, found = parse_tool_calls(text)
            calls = [call for call in found if call.name in self.tools]  # not Meta's built-ins, unless declared
            if not calls and self.forced and self.finish_reason in ("length", "cancelled"):  # the call cut short
                self._content, calls, self._cut = "", cut_calls(text, self.forced), True
            self.tool_calls = calls if self.parallel_tool_calls else calls[:1]
        if self.tool_calls or self._cut:
            return ""
        return unsent + "".join(self._held)

    def _rest(self) -> str:
        """What the detokenizer and the stop-string scanner still hold back, once the reply ended."""
        if self._flushed:
            return ""
        self._flushed = True
        return self._stop_strings.feed(self._stream.flush()) + self._stop_strings.flush()

    def _emit(self, text: str) -> str:
        self._pieces.append(text)
        if self._holding:
            self._held.append(text)
            if may_be_tool_call(self.tokenizer.decode(self.tokens)):  # control tokens spelled out
                return ""
            self._holding, text, self._held = False, "".join(self._held), []
        return text
