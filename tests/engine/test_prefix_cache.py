"""The prefix cache (app/engine/prefix_cache.py): what a request may reuse, taking over or copying, scopes, the budget."""

from __future__ import annotations

import torch

from app.engine.prefix_cache import PrefixCache
from model.config import LlamaConfig
from model.kv_cache import KVCache

CONFIG = LlamaConfig(dim=8, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=100, ffn_dim=16, head_dim=4)
PER_TOKEN = 2 * CONFIG.n_layers * CONFIG.n_kv_heads * CONFIG.head_dim * 4  # keys and values, fp32
CHUNK = 5  # prefill chunk of these caches
ALICE, BOB = ("m", "alice"), ("m", "bob")


def filled(tokens: list[int], max_len: int | None = None, prefilled: int | None = None) -> KVCache:
    """A cache whose position i holds the value tokens[i] everywhere, so copies can be checked: its first
    `prefilled` tokens (default: all) written as a prompt in whole and partial chunks, the rest as decode steps."""
    cache = KVCache(CONFIG, max_len or len(tokens), chunk=CHUNK)
    for i, t in enumerate(tokens):
        cache.k[:, :, :, i] = t
        cache.v[:, :, :, i] = -t
    prompt = tokens[:len(tokens) if prefilled is None else prefilled]
    while cache.length < len(prompt):
        cache.extend(prompt[cache.length:cache.chunk_end(len(prompt))])
    for t in tokens[len(prompt):]:
        cache.extend([t])
    return cache


def new_cache(max_len: int) -> KVCache:
    return KVCache(CONFIG, max_len, chunk=CHUNK)


def test_only_positions_of_whole_prefill_chunks_count_as_exact():
    assert filled(list(range(1, 31))).exact == 30
    assert filled(list(range(1, 34))).exact == 30  # 31-33: a last partial chunk
    assert filled(list(range(1, 41)), prefilled=22).exact == 20  # 21-22 partial, 23-40 decode steps
    cache = filled(list(range(1, 31)))
    cache.truncate(12)
    assert cache.exact == 12 and cache.length == 12
    assert cache.copy_prefix(8, 20).exact == 8


def test_a_conversation_going_on_takes_over_its_cache_without_a_copy():
    pool = PrefixCache(max_bytes=10**9)
    old = filled(list(range(1, 31)))
    pool.put(ALICE, old)
    cache, reused = pool.take(ALICE, list(range(1, 41)), 50, new_cache)
    assert reused == 30 and cache.max_len == 50 and cache.tokens == list(range(1, 31)) and len(pool) == 0
    assert torch.equal(cache.k[:, :, :, :30], old.k[:, :, :, :30])
    same = filled(list(range(1, 31)), max_len=60)
    pool.put(ALICE, same)
    cache, _ = pool.take(ALICE, list(range(1, 41)), 50, new_cache)
    assert cache is same  # large enough already: the very object


def test_a_reply_and_a_partial_chunk_are_computed_again():
    """Prompt 1-22 (chunks 1-5, ..., 16-20, then 21-22), reply 23-30 decoded: the follow-up 1-40 reuses 20."""
    pool = PrefixCache(max_bytes=10**9)
    pool.put(ALICE, filled(list(range(1, 31)), max_len=50, prefilled=22))
    cache, reused = pool.take(ALICE, list(range(1, 41)), 50, new_cache)
    assert reused == 20 and cache.tokens == list(range(1, 21)) and cache.exact == 20


def test_a_partial_match_copies_the_reused_part_and_keeps_the_original():
    pool = PrefixCache(max_bytes=10**9)
    old = filled(list(range(1, 41)))
    pool.put(ALICE, old)
    prompt = list(range(1, 28)) + [99, 98]
    cache, reused = pool.take(ALICE, prompt, 40, new_cache)
    assert reused == 25 and cache is not old and len(pool) == 1  # 27 shared, in whole chunks 25
    assert cache.tokens == prompt[:25] and torch.equal(cache.k[:, :, :, :25], old.k[:, :, :, :25])


def test_the_most_reusable_cache_of_the_same_scope_wins_and_at_least_one_token_is_left_to_run():
    pool = PrefixCache(max_bytes=10**9)
    pool.put(ALICE, filled(list(range(1, 21))))
    pool.put(ALICE, filled(list(range(1, 31)) + [7]))
    pool.put(("other model", "alice"), filled(list(range(1, 41))))
    pool.put(BOB, filled(list(range(1, 41))))
    cache, reused = pool.take(ALICE, list(range(1, 31)), 40, new_cache)
    assert reused == 25  # the whole prompt is cached; its last chunk runs again for the last token's logits
    assert cache.tokens == list(range(1, 26))


def test_a_user_never_takes_another_users_cache():
    pool = PrefixCache(max_bytes=10**9)
    pool.put(BOB, filled(list(range(1, 41))))
    cache, reused = pool.take(ALICE, list(range(1, 41)), 50, new_cache)
    assert reused == 0 and cache.tokens == [] and len(pool) == 1


def test_nothing_shorter_than_a_chunk_is_reused_and_such_caches_are_not_kept():
    pool = PrefixCache(max_bytes=10**9)
    pool.put(ALICE, filled(list(range(1, 41))))
    cache, reused = pool.take(ALICE, list(range(1, CHUNK)) + [0] * 30, 60, new_cache)
    assert reused == 0 and cache.tokens == [] and cache.max_len == 60
    pool.put(ALICE, filled([1, 2, 3]))  # shorter than a chunk: nothing in it could be reused
    assert len(pool) == 1
    pool.put(ALICE, filled(list(range(1, 9)), prefilled=3))  # no whole chunk computed yet, but one held
    assert len(pool) == 2


def test_the_budget_drops_the_least_recently_used_first_counting_running_caches():
    pool = PrefixCache(max_bytes=45 * PER_TOKEN)
    a, b = filled([1] * 20), filled([2] * 20)
    pool.put(ALICE, a)
    pool.put(ALICE, b)
    assert pool.nbytes == 40 * PER_TOKEN
    assert pool.take(ALICE, [1] * 18 + [3] * 10, 30, new_cache)[1] == 15  # a is used (copied from): most recent
    pool.put(ALICE, filled([4] * 20))  # 60 tokens > 45: b goes
    assert pool.nbytes == 40 * PER_TOKEN
    assert pool.take(ALICE, [2] * 21, 30, new_cache)[1] == 0  # b is gone
    pool.trim(in_use_bytes=10 * PER_TOKEN)  # running caches take room too: a, the older, goes
    assert pool.nbytes == 20 * PER_TOKEN
    assert pool.take(ALICE, [1] * 21, 30, new_cache)[1] == 0 and pool.take(ALICE, [4] * 21, 30, new_cache)[1] == 20


def test_kept_caches_holding_chunks_not_computed_as_a_prefill_are_listed_most_recent_first():
    pool = PrefixCache(max_bytes=10**9)
    older, newer = filled(list(range(1, 31)), prefilled=12), filled(list(range(1, 27)), prefilled=21)
    pool.put(ALICE, older)
    pool.put(BOB, newer)
    pool.put(ALICE, filled(list(range(1, 21))))  # exact already: nothing to compute again
    assert pool.inexact() == [(BOB, newer), (ALICE, older)]
    assert older.inexact_chunk() == (10, list(range(11, 16)))
    older.exact = 15  # what the engine sets once it has run that chunk (Engine.refine)
    assert older.inexact_chunk() == (15, list(range(16, 21)))
    older.exact, newer.exact = 30, 25  # newer holds 26: its last chunk is not whole, never computed again
    assert pool.inexact() == [] and newer.inexact_chunk() is None
