"""The engine over a model that decodes in static KV slots (model/static_decode.py: CUDA graphs on a GPU, the
same steps run eagerly here): its replies are those of a model without slots, batched or alone; a finished
sequence frees its slot and the prefix cache keeps a copy, which a follow-up reuses from a slot again."""

from __future__ import annotations

import gc

import pytest
import torch
from support.engine import EngineHarness, last, request

from app.backend.conversation import Conversation
from app.engine import core
from app.messages import ReplySettings
from model.checkpoint import load_checkpoint
from model.generation import PREFILL_CHUNK
from model.static_decode import in_slot

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]

GREEDY = ReplySettings(max_new_tokens=24, temperature=0.0)
QUESTIONS = [f"Tell me about the number {i}." + " Please." * i for i in range(5)]
# More than a prefill chunk whatever the CPU makes it (256 tokens, 512 with AMX): about 11 tokens a sentence.
LONG_SYSTEM = "You are a helpful assistant who answers briefly and kindly. " * (PREFILL_CHUNK // 7)


@pytest.fixture(scope="module")
def static(tiny, device):
    return load_checkpoint(tiny, dtype=torch.float32, device=device, graphs=True, slots=3)


def harness(tiny, checkpoint, **config) -> EngineHarness:
    return EngineHarness(tiny, loader=lambda name, path: checkpoint, **config)


def test_replies_in_slots_batched_and_alone_are_the_replies_without_slots(tiny, checkpoint, static):
    plain = harness(tiny, checkpoint, kv_cache_mb=0)
    alone = [last(plain.ask(r := request(q, GREEDY))[r.id]).token_ids for q in QUESTIONS]
    slots = harness(tiny, static, kv_cache_mb=0)
    requests = [request(q, GREEDY) for q in QUESTIONS]  # 5 sequences, 3 slots: two decode in their own caches
    together = slots.ask(*requests)
    assert [last(together[r.id]).token_ids for r in requests] == alone
    gc.collect()
    assert sorted(static.model.static.cache.free) == [0, 1, 2]  # every slot back once the replies ended


def test_a_follow_up_reuses_the_copy_kept_of_a_slot(tiny, checkpoint, static, monkeypatch):
    h = harness(tiny, static)
    conversation = Conversation(system_prompt=LONG_SYSTEM)
    conversation.add("user", "What is the capital of France?")
    first = last(h.ask(r := request(conversation, GREEDY))[r.id])
    kept = [cache for _, cache in h.engine.prefix_cache._kept.values()]
    assert len(kept) == 1 and kept[0].slot is None and kept[0].length > PREFILL_CHUNK  # a copy, not the slot
    conversation.add("assistant", first.text, ids=first.token_ids)
    conversation.add("user", "And what river flows through it?")
    moved = []  # (the cache the prefix cache gave, the one the sequence decodes in)
    monkeypatch.setattr(core, "in_slot",
                        lambda model, cache: moved.append((cache, in_slot(model, cache))) or moved[-1][1])
    second = last(h.ask(r := request(conversation, GREEDY))[r.id])
    assert moved[0][0].slot is None and moved[0][1].slot is not None  # the kept positions, moved into a slot
    assert second.stats.reused_tokens == first.stats.prompt_tokens // PREFILL_CHUNK * PREFILL_CHUNK > 0
    fresh = harness(tiny, checkpoint, kv_cache_mb=0)
    assert last(fresh.ask(r := request(conversation, GREEDY))[r.id]).token_ids == second.token_ids
