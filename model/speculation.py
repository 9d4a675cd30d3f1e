"""Speculative decoding: guess the next few tokens cheaply, check them in one forward pass.

Plain decoding reads every weight once per token, and one stream is then at the memory-bandwidth
limit. The decode step reads each matrix once for all its rows (up to MAX_KERNEL_ROWS), so the rows
[last, g1, ..., gk] of one sequence at positions L..L+k cost little more than the one row [last]:
row i's logits say what follows g_i, and every guess that matches what the model picks there is a
token gained.

Where the guesses come from:
- `PromptLookup` (Saxena 2023, "prompt lookup decoding"; vLLM's n-gram speculator): the tokens that
  followed the latest earlier occurrence of the sequence's last n tokens, in its prompt or its reply.
  Free to compute; right where a reply repeats its input (fixing a text, editing code, quoting).
- `Draft`: a smaller model with the same tokenizer decodes k tokens greedily.

How they are checked (`check`): the model samples each row as plain decoding would, with the same
sampler, penalties, constraint and random draws, in the same order; a guess stands while it equals
what was sampled. For a guesser that proposes one token with certainty (both of ours), this is the
acceptance rule of Leviathan et al. (2023) and Chen et al. (2023) with a one-hot draft distribution q:
accept g with probability min(1, p(g) / q(g)) = p(g), otherwise sample from max(p - q, 0), which is p
without g, renormalized; and sampling x ~ p then comparing x with g does exactly that. So a reply is
token for token the one plain decoding gives with the same seed, not only of the same distribution.
A draft model could also propose by sampling (more guesses accepted at high temperatures), at the
price of replies that differ from plain decoding's for a seed: not done.

`Speculation` holds one sequence's guesser and decides how many guesses a step makes: those that raise
the tokens expected per second, from how often its guesses stood and how long steps of each number of
rows take on this machine (`StepTimes`, measured as it runs: a row more costs ~5% of a step for a bf16
model on AVX-512, ~20% for the default model's 4-bit blocks on AVX-512 and ~45% on AVX2). A reply that
repeats nothing, or a batch with no rows to spare, guesses little or nothing.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from .static_decode import new_cache

MAX_GUESSES = 7  # with the last token, the decode kernel's 8 rows
MAX_NGRAM, MIN_NGRAM = 3, 1  # prompt lookup's longest and shortest n-gram
ONE_TOKEN_GUESSES = 2  # a match of a single token guesses at most this many tokens


class Guesser(Protocol):
    cost_per_guess: float  # seconds a guess takes to make (0 for a lookup)
    kinds: tuple[int, ...]  # kinds of guess whose acceptance is counted apart (0, 1, ...)
    kind: int  # the kind of the last guesses proposed

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that may follow `tokens` (the prompt and the reply so far)."""


class PromptLookup:
    """Guesses the tokens that followed the latest earlier occurrence of the last n tokens (n from
    MAX_NGRAM down to MIN_NGRAM). Keeps an index of every n-gram's latest continuation, updated as the
    sequence grows (a few dict writes a token), so a lookup costs the same in a prompt of 8,000 tokens.

    Where only the last token matches, it often guesses the rest of a word cut in pieces or the comma
    after it, and seldom a long run: such a match guesses at most `one_token` tokens, so that its misses
    cost little and do not pull down the acceptance that longer matches earned (docs/benchmarks.md,
    speculative decoding). A match of one token and a longer one are two kinds of guess (`kind` 0 and 1): in a
    reply that quotes its prompt the longer matches stand while the single tokens between them miss."""

    cost_per_guess = 0.0  # dict reads
    kinds = (0, 1)

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM, one_token: int = ONE_TOKEN_GUESSES):
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self.one_token = one_token
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest continuation starts
        self.seen: list[int] = []  # the tokens indexed: every n-gram that ends before the last one
        self.kind = 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        self._index(tokens)
        for n in self.sizes:
            start = self.index.get(tuple(tokens[-n:])) if len(tokens) > n else None
            if start is not None:
                self.kind = int(n > 1)
                return tokens[start:start + (k if n > 1 else min(k, self.one_token))]
        return []

    def _index(self, tokens: list[int]) -> None:
        seen = self.seen
        if len(tokens) < len(seen) or (seen and tokens[len(seen) - 1] != seen[-1]):  # another sequence: start again
            self.index, seen = {}, []
            self.seen = seen
        # The n-grams that end at positions len(seen) - 1 .. len(tokens) - 2 (not the last token: its
        # n-grams are what is looked up, and must find an earlier occurrence).
        for end in range(max(len(seen) - 1, 0), len(tokens) - 1):
            for n in self.sizes:
                if end + 1 >= n:
                    self.index[tuple(tokens[end + 1 - n:end + 1])] = end + 1
        seen.extend(tokens[len(seen):])


class Draft:
    """A smaller model with the same tokenizer guesses greedily, keeping its own KV cache in step with
    the sequence: what both agree on stays, the rest is computed again (usually one or two tokens)."""

    kinds, kind = (0,), 0

    def __init__(self, checkpoint, max_len: int):
        self.model = checkpoint.model
        self.device = checkpoint.device
        self.cache = new_cache(self.model, max_len, device=checkpoint.device, dtype=checkpoint.dtype)
        self.seconds_per_guess = 0.0  # measured: a moving average of propose()'s time over its guesses

    @property
    def cost_per_guess(self) -> float:
        return self.seconds_per_guess

    def propose(self, tokens: list[int], k: int) -> list[int]:
        started = time.perf_counter()
        guesses = self._propose(tokens, k)
        if guesses:
            seconds = (time.perf_counter() - started) / len(guesses)
            old = self.seconds_per_guess
            self.seconds_per_guess = seconds if not old else 0.8 * old + 0.2 * seconds
        return guesses

    @torch.inference_mode()
    def _propose(self, tokens: list[int], k: int) -> list[int]:
        cache = self.cache
        room = cache.max_len - len(tokens)  # guesses this cache can hold after the sequence
        k = min(k, room)
        if k <= 0:
            return []
        cache.truncate(min(cache.common_prefix(tokens), len(tokens) - 1))  # the last token runs for logits
        while cache.length < len(tokens):  # the new tokens, in prefill chunks
            start = cache.length
            chunk = tokens[start:cache.chunk_end(len(tokens))]
            logits = self.model(torch.tensor([chunk], device=self.device), start_pos=start, kv_cache=cache,
                                last_only=True)[0, -1]
            cache.extend(chunk)
        guesses = [int(logits.argmax())]
        while len(guesses) < k:
            logits = self.model.decode(torch.tensor(guesses[-1:], device=self.device), [cache])[0]
            cache.extend(guesses[-1:])
            guesses.append(int(logits.argmax()))
        return guesses


def same_tokenizer(target, draft) -> str | None:
    """Why `draft`'s tokenizer cannot guess for `target`'s (None: they read and write the same ids)."""
    if target.token_bytes() != draft.token_bytes():
        return "their vocabularies differ"
    if target.special_tokens != draft.special_tokens:
        return "their special tokens differ"
    return None


class StepTimes:
    """How long a model's decode step takes by its number of rows, as measured: what a guess costs. Per
    row count a moving average that falls at once to a faster step (a first step that built the kernel,
    or one slowed by another process, does not stay in it). Rows not measured yet are estimated from
    those that were. A row count not measured for STALE_STEPS steps is forgotten: a step slowed once (another
    process's threads on the cores, a first run) made its row count look too dear to try again, and, through
    the estimate of the others, could keep every guess off for the life of the server."""

    PRIOR_ROW_COST = 0.15  # a row more costs this part of a one-row step, until two row counts are measured
    STALE_STEPS = 200

    def __init__(self):
        self.seconds: dict[int, float] = {}
        self.measured_at: dict[int, int] = {}  # rows -> the step it was last measured at
        self.steps = 0
        # The host's work between two steps that a step with guesses leaves the device idle for, where a step
        # without them is queued before its tokens are read (the engine on a GPU's slots); 0 elsewhere.
        self.host = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        self.steps += 1
        self.seconds[rows] = self._average(self.seconds.get(rows), seconds)
        self.measured_at[rows] = self.steps
        for stale in [r for r, at in self.measured_at.items() if self.steps - at >= self.STALE_STEPS]:
            del self.seconds[stale], self.measured_at[stale]

    def observe_host(self, seconds: float) -> None:
        self.host = self._average(self.host or None, seconds)

    @staticmethod
    def _average(old: float | None, new: float) -> float:
        return new if old is None else min(new, 0.8 * old + 0.2 * new)

    def cost(self, rows: int) -> float:
        """The time of a step of `rows` rows (1.0 for one row before anything is measured)."""
        if rows in self.seconds:
            return self.seconds[rows]
        known = sorted(self.seconds)
        if not known:
            return 1.0 + self.PRIOR_ROW_COST * (rows - 1)
        low, high = known[0], known[-1]
        per_row = ((self.seconds[high] - self.seconds[low]) / (high - low) if high > low
                   else self.PRIOR_ROW_COST * self.seconds[low] / low)
        nearest = min(known, key=lambda r: abs(r - rows))
        return self.seconds[nearest] + max(per_row, 0.0) * (rows - nearest)


_step_times: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its StepTimes


def step_times(model) -> StepTimes:
    """The StepTimes of a model (one per model, shared by every sequence that decodes with it)."""
    if model not in _step_times:
        _step_times[model] = StepTimes()
    return _step_times[model]


class Speculation:
    """One sequence's guesser, and how many guesses its next step makes: as many as maximize the tokens
    the step is expected to give per second of the step (Leviathan et al. 2023, section 3.5), from the
    sequence's acceptance rate so far, the measured step times (`StepTimes`) and the time a guess
    takes to make (a draft model's steps). In a batch, the step's
    other rows and the tokens they are expected to give count too, so a guess is made only where it
    raises the whole batch's rate. The acceptance counts fade after each step that guesses, and slowly
    after one that does not: a sequence whose guesses failed tries again later, and one whose guesses
    seldom stand (a plain answer, where a single token matched) does not keep paying for them.

    Each kind of guess (`Guesser.kinds`: prompt lookup's matches of one token and of more) has counts of its
    own. A step asks the guesser for as many guesses as the most hopeful kind would earn, then keeps as many
    as the kind it got earns: a reply that quotes its prompt checks its long matches' guesses although the
    single tokens between them missed, which, counted together, stopped it guessing at all."""

    DECAY = 0.9  # the acceptance counts' weight after a step that guessed
    IDLE_DECAY = 0.98  # after a step that did not

    def __init__(self, guesser: Guesser, times: StepTimes, max_guesses: int = MAX_GUESSES):
        self.guesser = guesser
        self.times = times
        self.max_guesses = max_guesses
        self.stood = dict.fromkeys(guesser.kinds, 0.0)  # per kind of guess: guesses that stood (faded)
        self.missed = dict.fromkeys(guesser.kinds, 0.0)  # steps where a guess did not (faded)
        self.kind = guesser.kinds[0]  # of the last guesses

    def acceptance(self, kind: int | None = None) -> float:
        """The chance that a guess of this kind (the last guesses' by default) stands given the ones before it
        did (prior 1/2)."""
        kind = self.kind if kind is None else kind
        return (self.stood[kind] + 1.0) / (self.stood[kind] + self.missed[kind] + 2.0)

    def guesses(self, tokens: Callable[[], list[int]], room: int, rows: int = 1, expected: float = 1.0) -> list[int]:
        """Guesses for the step that runs the last of `tokens()` (the prompt and the reply so far, built
        only when a guess is worth making), at most `room`. rows: the step's rows before this sequence's
        guesses (its own last token included); expected: the tokens they should give."""
        room = min(room, self.max_guesses)
        hopeful = max(self.acceptance(kind) for kind in self.stood)
        k = self.best(room, rows, expected, hopeful)
        guesses = self.guesser.propose(tokens(), k) if k > 0 else []
        if guesses:
            self.kind = self.guesser.kind
            guesses = guesses[:self.best(len(guesses), rows, expected)]
        self._fade(self.DECAY if guesses else self.IDLE_DECAY)
        return guesses

    def planned(self, room: int, rows: int = 1, expected: float = 1.0) -> int:
        """How many guesses the next step would keep, judged by the last guesses' kind (the kind of the next
        is known only once its last token is): `best`, at most max_guesses."""
        return self.best(min(room, self.max_guesses), rows, expected)

    def passed(self) -> None:
        """A step ran without asking for guesses (it was queued before the last token was read): the counts
        fade as after any step without guesses."""
        self._fade(self.IDLE_DECAY)

    def _fade(self, fade: float) -> None:
        for kind in self.stood:
            self.stood[kind] *= fade
            self.missed[kind] *= fade

    def best(self, room: int, rows: int, expected: float, acceptance: float | None = None) -> int:
        """The number of guesses (0..room) that maximizes expected tokens over the step's time, for guesses
        that stand with this chance (the last kind's by default). A step with guesses also pays the host's time
        between steps where one without could be queued ahead (`StepTimes.host`)."""
        a = self.acceptance() if acceptance is None else acceptance
        best, best_rate = 0, expected / self.times.cost(rows)
        gain, chance = 0.0, 1.0
        for k in range(1, room + 1):
            chance *= a  # guesses 1..k all stand
            gain += chance
            seconds = self.times.cost(rows + k) + k * self.guesser.cost_per_guess + self.times.host
            rate = (expected + gain) / seconds
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def expected(self, guessed: int) -> float:
        """Tokens a step with `guessed` guesses (of the last kind) is expected to give beyond the one it always
        gives."""
        a = self.acceptance()
        return sum(a ** i for i in range(1, guessed + 1))

    def checked(self, guessed: int, stood: int) -> None:
        """`stood` of `guessed` guesses matched what the model sampled."""
        if guessed:
            self.stood[self.kind] += stood
            self.missed[self.kind] += stood < guessed


def check(decoding, logits: torch.Tensor, guesses: list[int]) -> Iterator[tuple[int, str]]:
    """Sample the rows of one sequence's step, logits (1 + len(guesses), vocab): row 0 follows the last
    token, row i + 1 follows guesses[i]. Yields (token, text) for each token taken, as plain decoding
    would have; stops after the first that differs from its guess, or that ends the reply. n tokens
    yielded: the step's inputs [last] + guesses[:n - 1] stand in the cache."""
    for i, row in enumerate(logits):
        token = decoding.sample(row)
        yield token, decoding.accept(token)
        if decoding.finished or i == len(guesses) or token != guesses[i]:
            return
