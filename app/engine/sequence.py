"""One request inside the engine: its prompt, its KV cache, its place in the batch, its reply so far.

The engine's step loop runs a sequence's prompt chunks (`prefill_chunk`, then `computed`), samples
its first token from the last chunk's logits (`sample`, then `accept(token)`: the text it adds), then
runs its last token and the tokens guessed to follow it (`guesses`: model/speculation.py) in each
decode step, and hands it their logits (`decoded`: the text of the tokens that came out, the inputs
that stood kept in its cache). What a token means for the reply
(stop tokens and strings, the JSON constraint, the token limit, logprobs, tool calls, stats) is the
reply's `Decoding` (model/decoding.py), the rules `generate()` follows too; here: when the sequence
runs, and its messages.

A sequence's `state` changes only in its own methods:

    NEW         start()          -> READY        its prompt is built (a follower stays NEW)
    NEW         follow()         -> DECODING     a follower: a copy of its leader's prefilled prompt
    READY       take_cache()     -> PREFILLING   a fresh or kept cache (a kept one leaves a prompt token to run)
    PREFILLING  computed(ids)    -> DECODING     the prompt's last chunk is in its cache
    DECODING    accept(token)    -> FINISHED     a stop id or string, the token limit, the end of the JSON,
                                                 a JSON constraint that failed (at sample(): accept takes NO_TOKEN)
    any         cancel(), done() -> FINISHED     the reply ends where it is

start() finishes a reply with no room for a token at once; a sequence cancelled while NEW stays FINISHED.
The engine sends a FINISHED sequence's done() at the end of the step (at once, when one not in the batch
is cancelled).
"""

from __future__ import annotations

import enum
import time

import torch

from model.decoding import Decoding
from model.kv_cache import KVCache
from model.sampling import SamplingParams
from model.speculation import Speculation, check
from model.tools import forces_call

from app.messages import Context, Done, Generate, ReplySettings, Stats, TokenLogprob


class State(enum.Enum):
    NEW = "new"  # its model loads (its prompt is not built); a follower: its leader's prompt is not prefilled
    READY = "ready"  # its prompt is built: it may join the batch, where it takes a KV cache
    PREFILLING = "prefilling"  # its prompt goes into its cache, a chunk a step
    DECODING = "decoding"  # its prompt is in its cache: a token a step
    FINISHED = "finished"  # its reply ended (by a rule of its Decoding, or cancelled): Done is next


_NEXT = {  # the table above
    State.NEW: {State.READY, State.DECODING, State.FINISHED},
    State.READY: {State.PREFILLING, State.FINISHED},
    State.PREFILLING: {State.DECODING, State.FINISHED},
    State.DECODING: {State.FINISHED},
    State.FINISHED: {State.FINISHED},
}


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
        self.decoding: Decoding | None = None  # once started
        self.unsent = ""  # text the reply held back to its end (e.g. a possible tool call): sent before Done
        self.state = State.NEW
        self.speculation: Speculation | None = None
        self._stats = Stats()  # before it starts
        self.context = Context()  # how its prompt fit the model's context, set by the engine with the prompt
        self._token_bytes: list[bytes] | None = None  # with logprobs: every token's bytes
        self._logprobs_sent = 0

    def start(self, checkpoint, prompt: list[int], settings: ReplySettings, limit: int, *, constraint=None,
              tool_choice: str = "none", token_bytes: list[bytes] | None = None,
              speculation: Speculation | None = None) -> None:
        """Ready to run: the prompt's ids and the reply's settings (all set) are known. constraint: the
        JSON the reply must be; tool_choice: the request's, as model.tools.read_tool_choice reads it (the engine
        reads it once); token_bytes: each token's bytes, when logprobs are asked for; speculation: how its decode
        steps guess tokens ahead (None: they do not)."""
        self.prompt, self.settings, self._token_bytes = prompt, settings, token_bytes
        self.speculation = speculation
        request = self.request
        tools = ({t["function"]["name"] for t in request.tools or []}
                 if request.tool_choice != "none" and checkpoint.chat_format.supports_tools else set())
        forced = ((tools if tool_choice == "required" else {tool_choice})
                  if tools and forces_call(tool_choice) else set())
        self.decoding = Decoding(
            checkpoint.tokenizer, prompt, max_new_tokens=settings.max_new_tokens, context_limit=limit,
            sampling=SamplingParams(
                temperature=settings.temperature, top_k=settings.top_k or 0, top_p=settings.top_p,
                min_p=settings.min_p, repetition_penalty=settings.repetition_penalty,
                frequency_penalty=settings.frequency_penalty, presence_penalty=settings.presence_penalty,
                seed=settings.seed, logit_bias=tuple((settings.logit_bias or {}).items())),
            stop_ids=set() if settings.ignore_eos else checkpoint.stop_ids, stop=settings.stop,
            constraint=constraint, logprobs=request.logprobs if token_bytes is not None else None,
            tools=tools, parallel_tool_calls=request.parallel_tool_calls, forced=forced, device=checkpoint.device,
            started=self.arrived)
        if self.state is State.FINISHED:  # cancelled while its model loaded
            self.decoding.cancel()
        elif self.decoding.finished:  # no room for a token
            self._move(State.FINISHED)
        elif self.leader is None:  # (a follower waits for its leader's prefilled prompt: follow())
            self._move(State.READY)

    @property
    def tokens(self) -> list[int]:
        """The reply's ids so far."""
        return self.decoding.tokens if self.decoding is not None else []

    @property
    def stats(self) -> Stats:
        return self.decoding.stats if self.decoding is not None else self._stats

    @property
    def finish_reason(self) -> str | None:
        if self.decoding is not None:
            return self.decoding.finish_reason
        return "cancelled" if self.state is State.FINISHED else None

    # -- what the scheduler reads

    @property
    def ready(self) -> bool:
        """It may join the batch (a finished one, to leave it at the end of the step)."""
        return self.state is not State.NEW

    @property
    def next_chunk(self) -> int:
        """Prompt tokens in its next prefill chunk (model/kv_cache.py: chunks start at multiples of the
        chunk size, whatever else is prefilled in the step), 0 once its prompt is in its cache."""
        if self.state is not State.PREFILLING:
            return 0
        return self.cache.chunk_end(len(self.prompt)) - self.cache.length

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED

    @property
    def max_len(self) -> int:
        """Cache positions this sequence may need: its prompt and its longest reply."""
        return len(self.prompt) + self.decoding.max_new_tokens

    # -- what the engine calls

    def take_cache(self, cache: KVCache, reused: int) -> None:
        """Its KV cache, whose first `reused` positions hold its prompt's first ids already (a kept cache)."""
        self._move(State.PREFILLING)
        self.cache, self.stats.reused_tokens = cache, reused

    def follow(self) -> None:
        """A follower starts from a copy of its leader's prompt, now in the leader's cache."""
        cache = self.leader.cache.copy_prefix(self.leader.cache.length, self.max_len)
        self._move(State.DECODING)
        self.cache = cache

    def prefill_chunk(self) -> tuple[list[int], int]:
        """The prompt ids of its next prefill chunk, and the position of the first."""
        start = self.cache.length
        return self.prompt[start:start + self.next_chunk], start

    def computed(self, ids: list[int]) -> None:
        """These ids (a prompt chunk, or the last sampled token) went through the model into its cache."""
        self.cache.extend(ids)
        if self.state is State.PREFILLING and self.cache.length == len(self.prompt):
            self._move(State.DECODING)

    def guesses(self, room: int, rows: int = 1, expected: float = 1.0) -> list[int]:
        """Tokens guessed to follow its last one, for its next decode step: at most `room`, and no more
        than its cache and its token limit have room for; as many as raise the step's expected tokens
        per second, given its `rows` so far and the tokens they should give (model/speculation.py)."""
        room = self._room(room)
        if self.speculation is None or room <= 0:
            return []
        return self.speculation.guesses(lambda: self.prompt + self.tokens, room, rows, expected)

    def may_guess(self, room: int, rows: int = 1, expected: float = 1.0) -> bool:
        """Whether its next step would ask for guesses, whatever its next token (guesses() may still find
        none): where it would not, the step can be queued before that token is read."""
        room = self._room(room)
        return self.speculation is not None and room > 0 and self.speculation.planned(room, rows, expected) > 0

    def passed(self) -> None:
        """A decode step ran its last token alone, queued before it was read (no guesses asked for)."""
        if self.speculation is not None:
            self.speculation.passed()

    def _room(self, room: int) -> int:
        """Guesses its next step has room for: at most `room`, its cache's and its token limit's."""
        return min(room, self.cache.max_len - self.cache.length - 1, self.decoding.max_new_tokens - len(self.tokens) - 1)

    @property
    def drawable(self) -> bool:
        """Whether its next token can be drawn on the device and read later (Decoding.drawable)."""
        return self.decoding.drawable

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """Its next token from logits (vocab,), as a 0-dim tensor on their device, not waited for."""
        return self.decoding.draw(logits)

    def decoded(self, logits: torch.Tensor, inputs: list[int], drawn: int | None = None) -> str:
        """A decode step ran `inputs` ([its last token, *guesses]) at its cache's length on, with these
        logits (len(inputs), vocab): sample each row as plain decoding would while the guesses stand
        (model/speculation.py), keep the inputs that did in the cache; the text the new tokens add. `drawn`:
        the token draw() gave for a step of one row (read back with the batch's others)."""
        taken, texts = 0, []
        if drawn is not None:
            taken, texts = 1, [self.accept(drawn)]
        else:
            for _, text in check(self, logits, inputs[1:]):
                taken += 1
                texts.append(text)
        self.computed(inputs[:taken])
        self.stats.step(len(inputs) - 1, taken)
        if self.speculation is not None:
            self.speculation.checked(len(inputs) - 1, taken - 1)
        return "".join(texts)

    def sample(self, logits: torch.Tensor) -> int:
        """The next token, from the logits of the model at the reply's next position (vocab,)."""
        return self.decoding.sample(logits)

    def accept(self, token: int) -> str:
        """Take the sampled token; returns the text it adds (often "", for a partial character)."""
        text = self.decoding.accept(token)
        if self.decoding.finished:  # its last token
            self._move(State.FINISHED)
        return text

    def take_logprobs(self) -> list[TokenLogprob]:
        """The logprobs of the reply's tokens since the last call (empty unless asked for)."""
        if self.decoding is None:
            return []
        new = self.decoding.logprobs[self._logprobs_sent:]
        self._logprobs_sent += len(new)
        return [TokenLogprob(*self._spelled(lp.token), lp.logprob, [TokenLogprob(*self._spelled(t), top)
                                                                     for t, top in lp.top]) for lp in new]

    def _spelled(self, token: int) -> tuple[str, list[int]]:
        data = self._token_bytes[token] if token < len(self._token_bytes) else b""
        return data.decode("utf-8", errors="replace"), list(data)

    def cancel(self) -> None:
        """End the reply where it is (the engine sends its Done: at once if it waits, else after its step)."""
        if self.decoding is not None:
            self.decoding.cancel()
        self._move(State.FINISHED)

    def done(self) -> Done:
        """The reply's last message; `unsent` is the text it still held back, to send before it."""
        self._move(State.FINISHED)  # (ended already, by a rule of its Decoding or a cancel)
        if self.decoding is None:  # cancelled (or failed) before it started
            self._stats.total_time = time.perf_counter() - self.arrived
            return Done(self.id, "", "cancelled", self._stats, [], self.index, [], self.context)
        decoding = self.decoding
        self.unsent = decoding.end()
        calls = [call.to_openai() for call in decoding.tool_calls]
        return Done(self.id, decoding.text, decoding.finish_reason, decoding.stats, list(decoding.tokens),
                    self.index, calls, self.context, decoding.error)

    def _move(self, to: State) -> None:
        if to not in _NEXT[self.state]:
            raise RuntimeError(f"request {self.id}, reply {self.index}: a {self.state.name} sequence cannot "
                               f"become {to.name}")
        self.state = to
