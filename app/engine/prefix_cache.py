"""KV caches of finished replies, kept so that a later request starting with the same tokens
prefills only what is new: a chat's follow-up, an API client resending a growing conversation,
several chats of one user that share a system prompt.

Caches are kept per scope, a model and a user: a request never takes another user's cache, so how
fast its prompt prefills tells nothing about what other users asked. Within a scope a request takes
the kept cache from which it can reuse the most (`KVCache.reusable`: positions computed by whole
prefill chunks, exactly as this request would compute them, so its reply is the same as without
the cache). When the new prompt goes on from the whole kept cache (a conversation going on), the
request takes it over: no copy. When they part somewhere inside (an edited message, another chat
with the same system prompt), the reused part is copied into a new cache and the kept one stays for
others. While nothing else runs, the engine computes a kept cache's reply again, a whole chunk at a
time, as a prefill would (`inexact`), so that the conversation's next request reuses that too. The
kept caches and those of running requests together stay within a memory budget; past it, the caches
used longest ago are dropped first. Their exact positions are also kept on disk (app/engine/kv_disk.py),
for requests after a restart.

Written by hand: a few dozen lines over our KVCache; a paged-attention library would bring block
tables our CPU attention does not use.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

from model.kv_cache import KVCache


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._kept: OrderedDict[int, tuple[Hashable, KVCache]] = OrderedDict()  # least recently used first

    @property
    def nbytes(self) -> int:
        return sum(cache.used_bytes for _, cache in self._kept.values())

    def __len__(self) -> int:
        return len(self._kept)

    def reusable(self, scope: Hashable, ids: list[int]) -> int:
        """How many leading positions `take` would give a prompt of `ids`."""
        return max((cache.reusable(ids) for owner, cache in self._kept.values() if owner == scope), default=0)

    def take(self, scope: Hashable, ids: list[int], max_len: int,
             new_cache: Callable[[int], KVCache]) -> tuple[KVCache, int]:
        """A cache of at least max_len positions for a prompt of `ids`, and how many of its leading
        positions already hold them (at least the last prompt token is always left to run)."""
        best, reused = None, 0
        for key, (owner, cache) in self._kept.items():
            if owner == scope and (n := cache.reusable(ids)) > reused:
                best, reused = key, n
        if best is None:
            return new_cache(max_len), 0
        _, cache = self._kept[best]
        if cache.common_prefix(ids) == cache.length:  # this prompt goes on from the whole cache: take it over
            del self._kept[best]
            cache.truncate(reused)
            if cache.max_len < max_len:
                cache = cache.resized(max_len)
            return cache, reused
        self._kept.move_to_end(best)
        return cache.copy_prefix(reused, max(max_len, reused + 1)), reused

    def put(self, scope: Hashable, cache: KVCache, in_use_bytes: int = 0) -> None:
        """Keep a finished request's cache; then drop the least recently used until the kept caches
        and `in_use_bytes` (those of running requests) fit the budget."""
        if cache.length >= cache.chunk:  # else nothing in it can be reused, even once computed again
            self._kept[id(cache)] = (scope, cache)
        self.trim(in_use_bytes)

    def trim(self, in_use_bytes: int = 0) -> None:
        while self._kept and self.nbytes + in_use_bytes > self.max_bytes:
            self._kept.popitem(last=False)

    def drop(self, cache: KVCache) -> None:
        self._kept.pop(id(cache), None)

    def inexact(self) -> list[tuple[Hashable, KVCache]]:
        """Kept caches holding whole prefill chunks of ids not yet computed as a prefill computes them (a
        reply's tokens, a partial chunk: KVCache.inexact_chunk), the most recently used first."""
        return [(scope, cache) for scope, cache in reversed(self._kept.values())
                if cache.exact + cache.chunk <= cache.length]

    def drop_model(self, model: str) -> None:
        """Drop the kept caches of a model (scopes are (model, user)): it is unloaded."""
        for key in [k for k, (owner, _) in self._kept.items() if owner[0] == model]:
            del self._kept[key]

    def clear(self, scope: Hashable | None = None) -> None:
        for key in [k for k, (owner, _) in self._kept.items() if scope in (None, owner)]:
            del self._kept[key]
