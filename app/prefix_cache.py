"""KV caches of finished replies, kept so that a later request starting with the same tokens
prefills only what is new: a chat's follow-up, an API client resending a growing conversation,
several chats that share a system prompt.

A request takes the kept cache with the longest common prefix (of its model). When the whole kept
cache is a prefix of the new prompt (a conversation going on), the request takes it over: no copy.
When they part somewhere inside (an edited message, another user's chat with the same system
prompt), the common part is copied into a new cache and the kept one stays for others. The kept
caches and those of running requests together stay within a memory budget; past it, the caches
used longest ago are dropped first.

Written by hand: a few dozen lines over our KVCache; a paged-attention library would bring block
tables our CPU attention does not use.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from model.kv_cache import KVCache

MIN_SHARED = 16  # fewer common tokens than this are not worth a copy


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._kept: OrderedDict[int, tuple[str, KVCache]] = OrderedDict()  # least recently used first

    @property
    def nbytes(self) -> int:
        return sum(cache.used_bytes for _, cache in self._kept.values())

    def __len__(self) -> int:
        return len(self._kept)

    def take(self, model: str, ids: list[int], max_len: int,
             new_cache: Callable[[int], KVCache]) -> tuple[KVCache, int]:
        """A cache of at least max_len positions for a prompt of `ids`, and how many of its leading
        positions already hold them. At least the last prompt token is always left to run."""
        best, reused = None, 0
        for key, (owner, cache) in self._kept.items():
            if owner == model:
                n = cache.common_prefix(ids)
                if n > reused:
                    best, reused = key, n
        reused = min(reused, len(ids) - 1)
        if best is None or reused < min(MIN_SHARED, len(ids) - 1) or reused == 0:
            return new_cache(max_len), 0
        _, cache = self._kept[best]
        if reused == cache.length:  # the whole kept cache is this prompt's prefix: take it over
            del self._kept[best]
            if cache.max_len < max_len:
                cache = cache.resized(max_len)
            return cache, reused
        self._kept.move_to_end(best)
        return cache.copy_prefix(reused, max(max_len, reused + 1)), reused

    def put(self, model: str, cache: KVCache, in_use_bytes: int = 0) -> None:
        """Keep a finished request's cache; then drop the least recently used until the kept caches
        and `in_use_bytes` (those of running requests) fit the budget."""
        if cache.length:
            self._kept[id(cache)] = (model, cache)
        self.trim(in_use_bytes)

    def trim(self, in_use_bytes: int = 0) -> None:
        while self._kept and self.nbytes + in_use_bytes > self.max_bytes:
            self._kept.popitem(last=False)

    def clear(self, model: str | None = None) -> None:
        for key in [k for k, (owner, _) in self._kept.items() if model in (None, owner)]:
            del self._kept[key]
