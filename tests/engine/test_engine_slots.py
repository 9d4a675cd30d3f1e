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


@pytest.mark.cpu_rules
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


@pytest.mark.cpu_rules
def test_steps_queued_before_their_tokens_are_read_give_the_replies_of_plain_steps(tiny, static, monkeypatch):
    """Where no reply guesses, the engine queues a batch's next step in the slots on the tokens drawn on the
    device before it reads them (app/engine/ahead.py). Replies ending at different steps (their token limits),
    a seeded draw with a repetition penalty, one that joins midway, one cancelled midway, and a fourth
    sequence for 3 slots (in its own cache: no step is queued while it runs) give, each, the reply it gives
    alone without an engine; every slot is free at the end, and a follow-up reuses the kept cache."""
    from app.engine import ahead as queued_ahead
    from app.messages import Cancel
    from support.engine import reference

    ran = []  # rows of each step queued ahead that the next step used
    real_rows = queued_ahead.Ahead.rows
    monkeypatch.setattr(queued_ahead.Ahead, "rows", lambda self, batch: ran.append(len(r := real_rows(self, batch))) or r)
    plain = dict(top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
    settings = [ReplySettings(max_new_tokens=6, temperature=0.0, **plain),
                ReplySettings(max_new_tokens=20, temperature=0.0, **plain),
                ReplySettings(max_new_tokens=16, temperature=0.9, seed=7, **{**plain, "repetition_penalty": 1.3}),
                ReplySettings(max_new_tokens=12, temperature=0.0, **plain)]
    h = harness(tiny, static, speculate="off")
    conversation = Conversation(system_prompt=LONG_SYSTEM)  # longer than a prefill chunk: its cache is kept
    conversation.add("user", QUESTIONS[1])
    requests = [request(q, s) for q, s in zip([QUESTIONS[0], conversation, *QUESTIONS[2:4]], settings)]
    late, cancelled = request(QUESTIONS[4], settings[1]), request(QUESTIONS[0], settings[1])
    events = h.run(requests[0], requests[1], cancelled, max_steps=6)
    assert sum(ran) > 0  # steps ran ahead
    events += h.run(Cancel(cancelled.id), requests[2], max_steps=4)  # joins the two left
    events += h.run(late, requests[3])
    for r, s in [*zip(requests, settings), (late, settings[1])]:
        got = last([e for e in events if getattr(e, "id", None) == r.id])
        assert got.token_ids == reference(static, r, s).tokens, r
    assert last([e for e in events if getattr(e, "id", None) == cancelled.id]).finish_reason == "cancelled"
    gc.collect()
    assert sorted(static.model.static.cache.free) == [0, 1, 2]
    conversation.add("assistant", (first := last([e for e in events if getattr(e, "id", None) == requests[1].id])).text,
                     ids=first.token_ids)
    conversation.add("user", "And then?")
    follow_up = request(conversation, settings[1])
    again = last(h.ask(follow_up)[follow_up.id])
    assert again.stats.reused_tokens > 0 and again.token_ids == reference(static, follow_up, settings[1]).tokens


def test_a_step_with_guesses_pays_the_host_time_a_step_queued_ahead_hides():
    """On a GPU a step without guesses is queued before its tokens are read, one with guesses cannot be: so a
    guess must pay for the host's time between steps too (StepTimes.host, measured by the engine there)."""
    from model.speculation import PromptLookup, Speculation, StepTimes

    times = StepTimes()
    times.observe(1, 1.0e-3)
    times.observe(8, 1.05e-3)  # a GPU's rows: nearly free
    speculation = Speculation(PromptLookup(), times)
    for _ in range(3):
        speculation.checked(2, 0)  # its guesses seldom stand (a plain reply)
    assert speculation.planned(7) > 0  # no host time to pay: a guess is worth its row
    times.observe_host(0.4e-3)
    assert speculation.planned(7) == 0  # a plain reply's steps are queued ahead
    speculation.checked(7, 7)
    speculation.checked(7, 7)
    assert speculation.planned(7) > 0  # guesses that stand pay for it
