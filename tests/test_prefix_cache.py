"""The prefix cache (app/prefix_cache.py): longest-prefix matching, taking over or copying, the budget."""

from __future__ import annotations

import torch

from app.prefix_cache import MIN_SHARED, PrefixCache
from model.config import LlamaConfig
from model.kv_cache import KVCache

CONFIG = LlamaConfig(dim=8, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=100, ffn_dim=16, head_dim=4)
PER_TOKEN = 2 * CONFIG.n_layers * CONFIG.n_kv_heads * CONFIG.head_dim * 4  # keys and values, fp32


def filled(tokens: list[int], max_len: int | None = None) -> KVCache:
    """A cache whose position i holds the value tokens[i] everywhere, so copies can be checked."""
    cache = KVCache(CONFIG, max_len or len(tokens))
    for i, t in enumerate(tokens):
        cache.k[:, :, :, i] = t
        cache.v[:, :, :, i] = -t
    cache.tokens = list(tokens)
    return cache


def new_cache(max_len: int) -> KVCache:
    return KVCache(CONFIG, max_len)


def test_a_conversation_going_on_takes_over_its_cache_without_a_copy():
    pool = PrefixCache(max_bytes=10**9)
    old = filled(list(range(1, 31)))
    pool.put("m", old)
    cache, reused = pool.take("m", list(range(1, 41)), 50, new_cache)
    assert reused == 30 and cache.max_len == 50 and cache.tokens == list(range(1, 31)) and len(pool) == 0
    assert torch.equal(cache.k[:, :, :, :30], old.k[:, :, :, :30])
    same = filled(list(range(1, 31)), max_len=60)
    pool.put("m", same)
    cache, _ = pool.take("m", list(range(1, 41)), 50, new_cache)
    assert cache is same  # large enough already: the very object


def test_a_partial_match_copies_the_common_part_and_keeps_the_original():
    pool = PrefixCache(max_bytes=10**9)
    old = filled(list(range(1, 41)))
    pool.put("m", old)
    prompt = list(range(1, 26)) + [99, 98]
    cache, reused = pool.take("m", prompt, 40, new_cache)
    assert reused == 25 and cache is not old and len(pool) == 1
    assert cache.tokens == prompt[:25] and torch.equal(cache.k[:, :, :, :25], old.k[:, :, :, :25])


def test_the_longest_match_of_the_same_model_wins_and_at_least_one_token_is_left_to_run():
    pool = PrefixCache(max_bytes=10**9)
    pool.put("m", filled(list(range(1, 21))))
    pool.put("m", filled(list(range(1, 31)) + [7]))
    pool.put("other", filled(list(range(1, 41))))
    cache, reused = pool.take("m", list(range(1, 31)), 40, new_cache)
    assert reused == 29  # the whole prompt is cached; its last token must run again for its logits
    assert cache.tokens == list(range(1, 30))


def test_short_matches_are_not_worth_a_copy():
    pool = PrefixCache(max_bytes=10**9)
    pool.put("m", filled(list(range(1, 41))))
    cache, reused = pool.take("m", list(range(1, MIN_SHARED)) + [0] * 30, 60, new_cache)
    assert reused == 0 and cache.tokens == [] and cache.max_len == 60


def test_the_budget_drops_the_least_recently_used_first_counting_running_caches():
    pool = PrefixCache(max_bytes=45 * PER_TOKEN)
    a, b = filled([1] * 20), filled([2] * 20)
    pool.put("m", a)
    pool.put("m", b)
    assert pool.nbytes == 40 * PER_TOKEN
    pool.take("m", [1] * 18 + [3] * 10, 30, new_cache)  # a is used (copied from): now the most recent
    pool.put("m", filled([4] * 20))  # 60 tokens > 45: b goes
    assert pool.nbytes == 40 * PER_TOKEN
    assert pool.take("m", [2] * 21, 30, new_cache)[1] == 0  # b is gone
    pool.trim(in_use_bytes=10 * PER_TOKEN)  # running caches take room too: a, the older, goes
    assert pool.nbytes == 20 * PER_TOKEN
    assert pool.take("m", [1] * 21, 30, new_cache)[1] == 0 and pool.take("m", [4] * 21, 30, new_cache)[1] == 20
