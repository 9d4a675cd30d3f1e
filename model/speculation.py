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

`Speculation` holds one sequence's guesser and how many guesses to make: more after a step where all
stood, as many as stood plus one after one where some did not, and none for a while after steps
where none did (backing off 1, 2, 4... steps), so a reply that repeats nothing costs almost nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from .kv_cache import KVCache

MAX_GUESSES = 7  # with the last token, the decode kernel's 8 rows
MAX_NGRAM, MIN_NGRAM = 3, 2  # prompt lookup's longest and shortest n-gram (a single token matches too often)
MAX_BACKOFF = 16  # steps without guessing after many steps where no guess stood


class Guesser(Protocol):
    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that may follow `tokens` (the prompt and the reply so far)."""


class PromptLookup:
    """Guesses the tokens that followed the latest earlier occurrence of the last n tokens (n from
    MAX_NGRAM down to MIN_NGRAM). Keeps an index of every n-gram's latest continuation, updated as the
    sequence grows (a few dict writes a token), so a lookup costs the same in a prompt of 8,000 tokens."""

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM):
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest continuation starts
        self.seen: list[int] = []  # the tokens indexed: every n-gram that ends before the last one

    def propose(self, tokens: list[int], k: int) -> list[int]:
        self._index(tokens)
        for n in self.sizes:
            start = self.index.get(tuple(tokens[-n:])) if len(tokens) > n else None
            if start is not None:
                return tokens[start:start + k]
        return []

    def _index(self, tokens: list[int]) -> None:
        seen = self.seen
        if tokens[:len(seen)] != seen:  # not the same sequence grown: start again
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

    def __init__(self, checkpoint, max_len: int):
        self.model = checkpoint.model
        self.device = checkpoint.device
        self.cache = KVCache(checkpoint.config, max_len, device=checkpoint.device, dtype=checkpoint.dtype)

    @torch.inference_mode()
    def propose(self, tokens: list[int], k: int) -> list[int]:
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


class Speculation:
    """One sequence's guesser and how many guesses its next step makes."""

    def __init__(self, guesser: Guesser, max_guesses: int = MAX_GUESSES):
        self.guesser = guesser
        self.max_guesses = max_guesses
        self.k = max_guesses // 2  # guesses wanted at the next step
        self.backoff = 0  # steps to skip after steps where no guess stood
        self.skip = 0

    def guesses(self, tokens: list[int], room: int) -> list[int]:
        """Guesses for the step that runs `tokens[-1]`, at most `room`."""
        if self.skip > 0:
            self.skip -= 1
            return []
        return self.guesser.propose(tokens, min(self.k, room)) if min(self.k, room) > 0 else []

    def checked(self, guessed: int, stood: int) -> None:
        """`stood` of `guessed` guesses matched what the model sampled."""
        if guessed == 0:
            return
        if stood == guessed:
            self.k = min(self.k + 2, self.max_guesses)
        else:
            self.k = max(stood + 1, 1)
        if stood == 0:
            self.backoff = min(max(2 * self.backoff, 1), MAX_BACKOFF)
            self.skip = self.backoff
        else:
            self.backoff = 0


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
