"""The engine (app/engine/core.py) driven step by step in this process on a tiny random Llama 3 checkpoint:
replies equal the engine's replies alone, batched or not; requests join and leave the batch; chunked
prefill between decode steps; cancel; the queue; the prefix cache; context trimming; faults."""

from __future__ import annotations

import json
import os
import shutil
import threading

import msgspec
import pytest
import torch
from support.engine import EngineHarness, last, reference, request

from app.backend.conversation import Conversation
from app.engine import core
from app.engine.sequence import State
from app.messages import (
    Cancel,
    Context,
    Done,
    Failed,
    Load,
    Loading,
    ModelFailed,
    ModelReady,
    Queued,
    ReplySettings,
    Text,
)
import model.checkpoint
from model.checkpoint import load_checkpoint
from model.decoding import ConstraintFailed
from model.generation import PREFILL_CHUNK
from model.kernels import kernels
from model.options import DEFAULT_MODEL_NAME

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]

GREEDY = ReplySettings(max_new_tokens=24, temperature=0.0)


def harness(tiny, checkpoint, **config) -> EngineHarness:
    return EngineHarness(tiny, loader=lambda name, path: checkpoint, **config)


def chat(*texts: str, system: str | None = None) -> Conversation:
    conversation = Conversation(system_prompt=system)
    for i, text in enumerate(texts):
        conversation.add("user" if i % 2 == 0 else "assistant", text)
    return conversation


QUESTIONS = [f"Tell me about the number {i}." + " Please." * i for i in range(6)]


# ---- replies, alone and batched -----------------------------------------------------------------

def test_a_reply_is_the_engines_reply_alone(tiny, checkpoint):
    h = harness(tiny, checkpoint)
    settings = ReplySettings(max_new_tokens=40, temperature=1.0, top_k=50, top_p=0.95, seed=3)
    r = request("Hello there", settings)
    events = h.ask(r)[r.id]
    done = last(events)
    expected = reference(checkpoint, r, settings)
    assert isinstance(done, Done) and all(isinstance(e, Text) for e in events[:-1])
    assert "".join(e.text for e in events[:-1]) == done.text == expected.text
    assert done.token_ids == expected.tokens
    assert done.stats.prompt_tokens == len(expected.prompt_ids) and done.stats.new_tokens == len(expected.tokens)


@pytest.mark.parametrize("max_batch", [8, 3])
def test_batched_greedy_replies_equal_the_replies_alone_exactly_in_fp32(tiny, checkpoint, max_batch):
    h = harness(tiny, checkpoint, max_batch=max_batch, kv_cache_mb=0)  # no prefix reuse between the runs
    requests = [request(q, GREEDY) for q in QUESTIONS]
    alone = [last(h.ask(r)[r.id]) for r in requests]
    requests = [request(q, GREEDY) for q in QUESTIONS]
    together = h.ask(*requests)
    for r, done in zip(requests, alone):
        assert last(together[r.id]).token_ids == done.token_ids
        assert last(together[r.id]).text == done.text
    if max_batch == 3:  # the last three waited for places, and were told their places
        positions = [[e.position for e in together[r.id] if isinstance(e, Queued)] for r in requests]
        assert positions[:3] == [[], [], []] and [p[0] for p in positions[3:]] == [1, 2, 3]
        assert all(p == sorted(p, reverse=True) for p in positions)


def test_each_sequence_of_a_batch_keeps_its_own_sampling_and_seed(tiny, checkpoint):
    h = harness(tiny, checkpoint, kv_cache_mb=0)
    settings = [ReplySettings(max_new_tokens=20, temperature=t, top_k=k, top_p=p, seed=s)
                for t, k, p, s in [(1.0, 0, 1.0, 1), (0.7, 40, 1.0, 2), (1.2, 0, 0.8, 3), (0.0, 0, 1.0, None)]]
    requests = [request("Write a poem", s) for s in settings]
    together = h.ask(*requests)
    for r, s in zip(requests, settings):
        assert last(together[r.id]).token_ids == reference(checkpoint, r, s).tokens


def test_a_batchs_plain_tokens_are_drawn_on_the_device_and_read_back_together(tiny, checkpoint, monkeypatch):
    """Rows that need nothing from the host to be sampled (no guesses, constraint or logprobs) are drawn where
    the logits are and read back in one copy a step (on a GPU one wait, not one a row); the replies are the
    ones sampled row by row, seeded draws included, and a row with logprobs is still sampled on the host."""
    from app.engine.sequence import Sequence
    h = harness(tiny, checkpoint, kv_cache_mb=0, speculate="off")
    settings = [ReplySettings(max_new_tokens=12, temperature=0.0),
                ReplySettings(max_new_tokens=12, temperature=0.9, top_k=0, top_p=1.0, seed=7),
                ReplySettings(max_new_tokens=12, temperature=0.0)]
    requests = [request(f"Count to {i}", s, **({"logprobs": 2} if i == 2 else {})) for i, s in enumerate(settings)]
    calls = {"draw": 0, "sample": 0, "reads": 0}
    draw, sample, stack = Sequence.draw, Sequence.sample, torch.stack
    monkeypatch.setattr(Sequence, "draw", lambda self, logits: calls.__setitem__("draw", calls["draw"] + 1)
                        or draw(self, logits))
    monkeypatch.setattr(Sequence, "sample", lambda self, logits: calls.__setitem__("sample", calls["sample"] + 1)
                        or sample(self, logits))
    monkeypatch.setattr(core.torch, "stack", lambda tensors, *a: calls.__setitem__("reads", calls["reads"] + 1)
                        or stack(tensors, *a))
    together = h.ask(*requests)
    for r, s in zip(requests, settings):
        assert last(together[r.id]).token_ids == reference(checkpoint, r, s).tokens
    assert calls["draw"] == 2 * 11  # the two plain replies' tokens after their first (that one: the prefill's)
    assert calls["sample"] == 3 + 11  # the first tokens, and every token of the reply with logprobs
    assert calls["reads"] == 11  # one read a step


def test_penalties_and_min_p_reach_each_sequences_sampler(tiny, checkpoint):
    h = harness(tiny, checkpoint, kv_cache_mb=0)
    settings = [ReplySettings(max_new_tokens=30, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.3),
                ReplySettings(max_new_tokens=30, temperature=0.8, top_k=0, top_p=1.0, min_p=0.2, seed=4,
                              frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.0)]
    requests = [request("Say something again and again", s) for s in settings]
    h.run(requests[1], max_steps=1)  # its prompt built and prefilled, its first token sampled
    params = h.engine.requests[requests[1].id][0].decoding.sampler.params
    assert (params.min_p, params.frequency_penalty, params.presence_penalty, params.seed) == (0.2, 1.5, 0.5, 4)
    h.run(Cancel(requests[1].id))
    together = h.ask(*requests)
    for r, s in zip(requests, settings):
        assert last(together[r.id]).token_ids == reference(checkpoint, r, s).tokens


def test_a_request_joins_the_running_batch_at_the_next_step(tiny, checkpoint):
    h = harness(tiny, checkpoint)
    first = request("One", ReplySettings(max_new_tokens=200, temperature=0.0))
    h.run(first, max_steps=5)
    second = request("Two", ReplySettings(max_new_tokens=5, temperature=0.0))
    before = len(h.engine.requests[first.id][0].tokens)
    h.run(second, max_steps=1)
    # one step: the newcomer's prompt was prefilled and its first token sampled, and the first went on
    assert len(h.engine.requests[second.id][0].tokens) == 1
    assert len(h.engine.requests[first.id][0].tokens) == before + 1
    h.run(max_steps=1)  # the next step decodes both in one batch
    assert len(h.engine.requests[second.id][0].tokens) == 2
    rest = h.run()
    assert last([e for e in rest if getattr(e, "id", None) == second.id]).finish_reason == "length"
    assert last([e for e in rest if getattr(e, "id", None) == first.id]).finish_reason == "length"


def test_the_running_streams_decode_while_a_prompt_is_built(tiny, checkpoint, monkeypatch):
    """A prompt is built on a thread (a long file's chunks ranked, a JSON schema compiled: up to a second): the
    running streams' steps go on meanwhile, and the request starts at the first step after."""
    built = threading.Event()
    choose = core.choose_prompt_files

    def slow(format, messages, *args, **kwargs):
        if "Slow" in repr(messages):
            assert built.wait(30), "the test did not let the prompt be built"
        return choose(format, messages, *args, **kwargs)

    monkeypatch.setattr(core, "choose_prompt_files", slow)
    h = harness(tiny, checkpoint, kv_cache_mb=0)
    first = request("One", ReplySettings(max_new_tokens=100, temperature=0.0))
    h.run(first, max_steps=2)
    second = request("Slow to build", GREEDY)
    h.engine.handle(second)
    before = len(h.engine.requests[first.id][0].tokens)
    for _ in range(5):
        h.engine.step()
    assert len(h.engine.requests[first.id][0].tokens) == before + 5
    assert h.engine.requests[second.id][0].state is State.NEW and h.engine.preparing
    built.set()
    h.engine.wait_for_prompts()
    h.engine.step()  # taken, prefilled, its first token sampled
    assert len(h.engine.requests[second.id][0].tokens) == 1
    rest = h.run()
    assert last([e for e in rest if getattr(e, "id", None) == second.id]).token_ids == reference(
        checkpoint, second, GREEDY).tokens


@pytest.mark.cpu_rules
def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(tiny, checkpoint):
    h = harness(tiny, checkpoint)
    streaming = request("Go on", ReplySettings(max_new_tokens=400, temperature=0.0))
    h.run(streaming, max_steps=3)
    long_prompt = request("word " * (3 * PREFILL_CHUNK), ReplySettings(max_new_tokens=4, temperature=0.0))
    steps, decoded = 0, 0
    h.engine.handle(long_prompt)
    while not h.engine.requests[long_prompt.id][0].tokens:
        before = len(h.engine.requests[streaming.id][0].tokens)
        h.step()
        decoded += len(h.engine.requests[streaming.id][0].tokens) - before
        steps += 1
    assert steps == -(-len(h.engine.requests[long_prompt.id][0].prompt) // PREFILL_CHUNK) >= 4
    assert decoded == steps  # the other stream got a token in every step of the long prefill
    h.run()


# ---- stop, cancel, the queue --------------------------------------------------------------------

def test_a_stop_string_ends_the_reply_before_it(tiny, checkpoint):
    h = harness(tiny, checkpoint)
    settings = ReplySettings(max_new_tokens=60, temperature=0.0)
    r = request("Hello", settings)
    full = last(h.ask(r)[r.id]).text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = request("Hello", ReplySettings(max_new_tokens=60, temperature=0.0, stop=(stop, "never there")))
    events = h.ask(cut)[cut.id]
    done = last(events)
    assert done.finish_reason == "stop" and done.text == full[:full.index(stop)]
    assert "".join(e.text for e in events if isinstance(e, Text)) == done.text


def test_cancelling_one_stream_leaves_the_others_running(tiny, checkpoint):
    h = harness(tiny, checkpoint)
    long = ReplySettings(max_new_tokens=100, temperature=0.0)
    a, b = request(QUESTIONS[0], long), request(QUESTIONS[1], long)
    alone_b = last(h.ask(b)[b.id])
    h.engine.prefix_cache.clear()
    b = request(QUESTIONS[1], long)
    h.run(a, b, max_steps=10)
    events = h.run(Cancel(a.id), max_steps=1)
    done_a = last([e for e in events if getattr(e, "id", None) == a.id])
    assert done_a.finish_reason == "cancelled" and 0 < done_a.stats.new_tokens < 100
    rest = h.run()
    assert not any(getattr(e, "id", None) == a.id for e in rest)
    assert last([e for e in rest if getattr(e, "id", None) == b.id]).token_ids == alone_b.token_ids


def test_cancel_while_waiting_ends_at_once(tiny, checkpoint):
    h = harness(tiny, checkpoint, max_batch=1)
    long = ReplySettings(max_new_tokens=100, temperature=1.0, ignore_eos=True)  # (a random model may sample a stop)
    running, waiting = request("One", long), request("Two", long)
    events = h.run(running, waiting, max_steps=3)
    assert Queued(waiting.id, 1) in events
    events = h.run(Cancel(waiting.id), max_steps=1)
    done = last([e for e in events if getattr(e, "id", None) == waiting.id])
    assert done.finish_reason == "cancelled" and done.stats.new_tokens == 0 and done.text == ""
    h.run(Cancel(running.id))
    assert not h.engine.requests and len(h.engine.scheduler) == 0
    h.run(Cancel("no-such-request"))  # ignored


# ---- the prefix cache ---------------------------------------------------------------------------

# More than a prefill chunk whatever the CPU makes it (256 tokens, 512 with AMX): about 11 tokens a sentence.
LONG_SYSTEM = "You are a helpful assistant who answers briefly and kindly. " * (PREFILL_CHUNK // 7)


@pytest.mark.cpu_rules
def test_a_follow_up_takes_the_whole_prefill_chunks_of_its_conversation(tiny, checkpoint):
    """A kept cache gives only positions computed by whole prefill chunks (model/kv_cache.py): the first
    prompt's last partial chunk and the reply run again, so the reply is the one a fresh engine gives."""
    h = harness(tiny, checkpoint)
    conversation = chat("What is the capital of France?", system=LONG_SYSTEM)
    first = last(h.ask(r := request(conversation, GREEDY))[r.id])
    assert first.stats.prompt_tokens > PREFILL_CHUNK
    conversation.add("assistant", first.text, ids=first.token_ids)
    conversation.add("user", "And what river flows through it?")
    second_request = request(conversation, GREEDY)
    second = last(h.ask(second_request)[second_request.id])
    assert second.stats.reused_tokens == first.stats.prompt_tokens // PREFILL_CHUNK * PREFILL_CHUNK > 0
    assert second.token_ids == reference(checkpoint, second_request, GREEDY).tokens
    fresh = harness(tiny, checkpoint, kv_cache_mb=0)
    again = request(conversation, GREEDY)
    assert last(fresh.ask(again)[again.id]).token_ids == second.token_ids


@pytest.mark.cpu_rules
@pytest.mark.parametrize("refine", [True, False])
def test_while_idle_a_kept_reply_is_computed_again_so_the_follow_up_reuses_it(tiny, checkpoint, refine):
    """A reply of 300 tokens crosses whole prefill chunks; while nothing else runs, the engine computes them
    again as a prefill would (Engine.refine), and the follow-up reuses them, with the reply a fresh engine gives."""
    long_reply = ReplySettings(max_new_tokens=300, temperature=0.0, ignore_eos=True)
    h = harness(tiny, checkpoint, refine=refine)
    conversation = chat("Tell me a long story.", system=LONG_SYSTEM)
    first = last(h.ask(r := request(conversation, long_reply))[r.id])
    assert first.stats.new_tokens == 300
    held = first.stats.prompt_tokens + 300 - 1  # the last token was sampled, never fed
    conversation.add("assistant", first.text, ids=first.token_ids)
    conversation.add("user", "And then?")
    second = last(h.ask(r := request(conversation, GREEDY))[r.id])
    exact = held // PREFILL_CHUNK * PREFILL_CHUNK if refine else first.stats.prompt_tokens // PREFILL_CHUNK * PREFILL_CHUNK
    assert second.stats.reused_tokens == exact
    fresh = harness(tiny, checkpoint, kv_cache_mb=0)
    again = request(conversation, GREEDY)
    assert last(fresh.ask(again)[again.id]).token_ids == second.token_ids


@pytest.mark.cpu_rules
def test_conversations_that_share_a_start_share_its_keys_and_values(tiny, checkpoint):
    h = harness(tiny, checkpoint)
    one = request(chat("Question one", system=LONG_SYSTEM), GREEDY)
    h.ask(one)
    two = request(chat("Another question", system=LONG_SYSTEM), GREEDY)
    done = last(h.ask(two)[two.id])
    shared = len(checkpoint.chat_format.encode_dialog([{"role": "system", "content": LONG_SYSTEM}],
                                                      add_generation_prompt=False))
    assert done.stats.reused_tokens == shared // PREFILL_CHUNK * PREFILL_CHUNK > 0
    assert done.token_ids == reference(checkpoint, two, GREEDY).tokens
    assert len(h.engine.prefix_cache) == 2  # the first chat's cache stayed for it


@pytest.mark.cpu_rules
def test_one_users_kept_caches_are_not_reused_for_another_user(tiny, checkpoint):
    h = harness(tiny, checkpoint)
    conversation = chat("What is the capital of France?", system=LONG_SYSTEM)
    h.ask(request(conversation, GREEDY, user="alice"))
    bob = last(h.ask(r := request(conversation, GREEDY, user="bob"))[r.id])
    alice = last(h.ask(r := request(conversation, GREEDY, user="alice"))[r.id])
    assert bob.stats.reused_tokens == 0 < alice.stats.reused_tokens
    assert bob.token_ids == alice.token_ids


def test_with_no_cache_budget_nothing_is_kept(tiny, checkpoint):
    h = harness(tiny, checkpoint, kv_cache_mb=0)
    r = request("Hello", GREEDY)
    h.ask(r)
    again = request("Hello", GREEDY)
    assert last(h.ask(again)[again.id]).stats.reused_tokens == 0 and len(h.engine.prefix_cache) == 0


# ---- context ------------------------------------------------------------------------------------

def long_chat(turns: int, system: str = "You are a pirate.") -> Conversation:
    texts = []
    for i in range(turns):
        texts += [f"Question {i}: " + "tell me more " * 20, f"Answer {i}: " + "here is more " * 20]
    return chat(*texts, f"Last question {turns}", system=system)


@pytest.mark.cpu_rules
def test_a_trimmed_chat_is_reported_with_the_reply_and_keeps_its_start(tiny, checkpoint):
    limit = 2 * PREFILL_CHUNK  # a context of two prefill chunks (whatever the CPU makes them): a start to keep
    h = harness(tiny, checkpoint, max_context=limit)
    conversation = long_chat(10 * limit // 512)
    first = last(h.ask(r := request(conversation, ReplySettings(max_new_tokens=8)))[r.id])
    assert isinstance(first, Done)
    # the context and the prompt's room (the limit less 8 for the reply), and the exchanges left out: whole ones
    room = limit - 8
    assert first.context.limit == limit and first.context.room == room
    assert first.context.left_out > 0 and first.context.left_out % 2 == 0
    assert first.context_used == first.stats.prompt_tokens + first.stats.new_tokens <= limit
    assert PREFILL_CHUNK < first.stats.prompt_tokens <= room - room // 4  # trimmed to three quarters of its room
    conversation.left_out = first.context.left_out  # as the web side does
    conversation.add("assistant", first.text, ids=first.token_ids)
    conversation.add("user", "Short question")
    second = last(h.ask(r := request(conversation, ReplySettings(max_new_tokens=8)))[r.id])
    assert second.context.left_out == first.context.left_out  # still fits: same start, cache reused
    assert second.stats.reused_tokens > 0


@pytest.mark.cpu_rules
def test_a_chat_that_fits_is_reported_whole(tiny, checkpoint):
    h = harness(tiny, checkpoint, max_context=512)
    done = last(h.ask(r := request(chat("Hi", "Hello!", "How are you?"), ReplySettings(max_new_tokens=300)))[r.id])
    assert done.context == Context(limit=512, room=256, left_out=0)  # the reply's room: at most half the context
    assert done.context_used == done.stats.prompt_tokens + done.stats.new_tokens > 0


def test_a_chat_that_may_not_be_trimmed_fails_before_it_runs(tiny, checkpoint):
    h = harness(tiny, checkpoint, max_context=512)
    conversation = long_chat(10)
    events = h.ask(r := request(conversation, ReplySettings(max_new_tokens=8), trim=False))[r.id]
    assert len(events) == 1 and isinstance(events[0], Failed) and events[0].reason == "prompt_too_long"
    assert "this model reads at most 512 tokens at once, 8 of them kept for the reply" in events[0].message
    assert not h.engine.requests and not h.engine.scheduler.running and len(h.engine.prefix_cache) == 0
    # what fits is answered as ever
    assert isinstance(last(h.ask(r := request(long_chat(1), ReplySettings(max_new_tokens=8), trim=False))[r.id]), Done)


def test_a_message_longer_than_the_context_is_a_polite_error_and_the_engine_goes_on(tiny, checkpoint):
    h = harness(tiny, checkpoint, max_context=256)
    events = h.ask(r := request("word " * 1000))[r.id]
    assert len(events) == 1 and isinstance(events[0], Failed) and events[0].reason == "prompt_too_long"
    assert "too long" in events[0].message and "256 tokens" in events[0].message
    assert isinstance(last(h.ask(r := request("Hi", ReplySettings(max_new_tokens=4)))[r.id]), Done)


# ---- models and faults --------------------------------------------------------------------------

@pytest.mark.cpu_rules
def test_models_load_on_first_use_once_and_a_broken_one_is_reported(tiny, tmp_path):
    loads = []

    def loader(name, path):
        loads.append(name)
        return load_checkpoint(path)

    weights = tmp_path / "weights"
    (weights / "broken").mkdir(parents=True)
    (weights / "broken" / "config.json").write_text("{}")
    (weights / "broken" / "model.safetensors").write_bytes(b"not safetensors")
    (weights / "other").mkdir()
    for file in ("config.json", "model.safetensors"):
        (weights / "other" / file).symlink_to(tiny / file)
    h = EngineHarness(tiny, loader=loader, weights_dir=str(weights))
    assert loads == ["tiny"] and list(h.engine.models.profiles) == ["tiny", "broken", "other"]

    events = h.ask(r := request("Hi", model="broken"))[r.id]
    assert isinstance(events[0], Loading) and last(events).reason == "load" and "broken" in last(events).message
    for _ in range(2):
        events = h.ask(r := request("Hi", ReplySettings(max_new_tokens=2), model="other"))[r.id]
        assert isinstance(last(events), Done)
    assert loads == ["tiny", "broken", "other"]  # each once
    events = h.ask(r := request("Hi", model="nothing"))[r.id]
    assert last(events).reason == "bad_request" and "nothing" in last(events).message


@pytest.mark.cpu_rules
def test_the_default_model_is_served_from_its_q4_1_blocks_where_the_kernel_runs_else_widened(
        tmp_path, monkeypatch, smollm2_gguf):
    """Prepared on start, the default model keeps its int4 blocks where the decode kernel multiplies them
    and is widened to floats where it would not (a GPU, no kernel); another folder of int4 blocks stays
    int4 either way (widened, a large model may not fit)."""
    weights = tmp_path / "weights"
    folder = weights / DEFAULT_MODEL_NAME  # converted by the first engine's start
    config = dict(weights_dir=str(weights), prepare_default=True, cache_dir=str(smollm2_gguf.parent))
    for kernel in ([kernels()] if kernels() else []) + [None]:
        monkeypatch.setattr(model.checkpoint, "kernels", lambda: kernel)  # None: no compiler, or LLAMA_KERNELS=off
        h = EngineHarness(folder, **config)
        wq = h.engine.models.checkpoints[DEFAULT_MODEL_NAME].model.layers[0].attention.wq
        assert (wq.weight.dtype == torch.uint8) == (kernel is not None) and (wq.scale is None) == (kernel is None)
        events = h.ask(r := request("Hi", ReplySettings(max_new_tokens=2), model=DEFAULT_MODEL_NAME))[r.id]
        assert isinstance(last(events), Done)
        if not (weights / "Other-Q4_1").exists():
            shutil.copytree(folder, weights / "Other-Q4_1", copy_function=os.link)
    events = h.ask(r := request("Hi", ReplySettings(max_new_tokens=2), model="Other-Q4_1"))[r.id]
    assert isinstance(last(events), Done)
    assert h.engine.models.checkpoints["Other-Q4_1"].model.layers[0].attention.wq.weight.dtype == torch.uint8


@pytest.mark.cpu_rules
def test_the_token_table_for_logprobs_is_read_while_the_model_loads(tiny, monkeypatch):
    """Not at the first request that asks for logprobs, whose first token would wait for it."""
    reads = []

    def loader(name, path):
        checkpoint = load_checkpoint(path)
        read = checkpoint.tokenizer.token_bytes
        monkeypatch.setattr(checkpoint.tokenizer, "token_bytes", lambda: reads.append(name) or read())
        return checkpoint

    h = EngineHarness(tiny, loader=loader)
    assert reads == ["tiny"]
    for _ in range(2):
        events = h.ask(r := request("Hi", ReplySettings(max_new_tokens=3), logprobs=2))[r.id]
        assert isinstance(last(events), Done)
        assert sum(len(e.logprobs) for e in events if isinstance(e, Text)) == 3
    assert reads == ["tiny"]


def test_a_model_that_fails_to_load_fails_its_requests(tiny, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    h = EngineHarness(broken)
    assert any(isinstance(e, ModelFailed) and "broken" in e.message for e in h.events)
    events = h.ask(r := request("Hi", model="broken"))[r.id]
    assert isinstance(events[0], Loading) and last(events).reason == "load" and "broken" in last(events).message


def test_reply_defaults_are_the_servers_over_the_checkpoints(tiny, checkpoint):
    h = harness(tiny, checkpoint, defaults=ReplySettings(temperature=0.0, max_new_tokens=77))
    info = next(e.info for e in h.events if isinstance(e, ModelReady))
    # tiny's generation_config.json says nothing: Llama 3's temperature 0.6 / top_p 0.9, overridden here
    assert info.defaults == ReplySettings(max_new_tokens=77, temperature=0.0, top_k=0, top_p=0.9, min_p=0.0,
                                          repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
    assert info.context_limit == 131072  # the model's own (LLAMA_MAX_CONTEXT unset), a quarter of memory holds it
    assert h.run(Load("tiny")) == [ModelReady(info)]


def test_a_failing_step_fails_only_its_sequences(tiny, checkpoint, monkeypatch):
    h = harness(tiny, checkpoint)
    decode = checkpoint.model.decode

    def broken(*args, **kwargs):
        monkeypatch.setattr(checkpoint.model, "decode", decode)  # once
        raise RuntimeError("out of memory")

    monkeypatch.setattr(checkpoint.model, "decode", broken)
    events = h.ask(r := request("Hi", GREEDY))[r.id]
    assert last(events).reason == "error" and "out of memory" in last(events).message
    assert isinstance(last(h.ask(r := request("Hi", GREEDY))[r.id]), Done)


class FailingConstraint:
    """A JSON constraint whose grammar engine fails at its mask once `after` ids were taken (it allows any id
    but a stop id before)."""

    complete = finished = False

    def __init__(self, checkpoint, after: int):
        self.vocab_size, self.stop_ids, self.after, self.taken = checkpoint.config.vocab_size, checkpoint.stop_ids, after, 0

    def mask(self) -> torch.Tensor:
        if self.taken == self.after:
            raise ConstraintFailed(f"response_format: failed after {self.taken} tokens")
        mask = torch.ones(self.vocab_size, dtype=torch.bool)
        mask[sorted(self.stop_ids)] = False
        return mask

    def advance(self, token: int) -> None:
        self.taken += 1


def test_a_constraint_that_fails_midway_ends_its_own_reply_alone(tiny, checkpoint, monkeypatch):
    """Neither the request's other reply nor another request of the batch notices; nothing is a Failed."""
    h = harness(tiny, checkpoint)
    made = set()

    def constraint(self, request, checkpoint, choice):  # the first reply of a JSON request fails at its 4th token
        if not request.json_object or request.id in made:
            return None
        made.add(request.id)
        return FailingConstraint(checkpoint, after=3)

    monkeypatch.setattr(core.Engine, "_constraint", constraint)
    json_request, other = request("Hi", GREEDY, json_object=True, n=2), request(QUESTIONS[1], GREEDY)
    events = h.ask(json_request, other)
    assert not any(isinstance(e, Failed) for e in h.events)
    failed, whole = sorted((e for e in events[json_request.id] if isinstance(e, Done)), key=lambda d: d.index)
    expected = reference(checkpoint, json_request, GREEDY)
    assert (failed.finish_reason, failed.error) == ("constraint_failed", "response_format: failed after 3 tokens")
    assert failed.token_ids == expected.tokens[:3] and failed.text == checkpoint.tokenizer.decode(expected.tokens[:3])
    assert (whole.finish_reason, whole.error, whole.token_ids) == ("length", "", expected.tokens)
    done = last(events[other.id])
    assert (done.finish_reason, done.token_ids) == ("length", reference(checkpoint, other, GREEDY).tokens)


def test_n_replies_share_one_prefill_and_each_is_the_reply_its_seed_gives(tiny, checkpoint):
    h = harness(tiny, checkpoint, kv_cache_mb=0)
    settings = ReplySettings(max_new_tokens=20, temperature=1.0, top_k=0, top_p=1.0, seed=5)
    r = request("Write a poem", settings, n=3)
    first = len(h.events)
    h.engine.handle(r)
    h.step()  # one step prefills the prompt once, and every reply has its first token
    leader, *followers = h.engine.requests[r.id]
    assert [len(s.tokens) for s in (leader, *followers)] == [1, 1, 1]
    assert all(f.cache.tokens == leader.cache.tokens == leader.prompt for f in followers)
    h.run()
    events = h.events[first:]
    dones = sorted((e for e in events if isinstance(e, Done)), key=lambda d: d.index)
    assert [d.index for d in dones] == [0, 1, 2]
    for d in dones:
        alone = reference(checkpoint, r, msgspec.structs.replace(settings, seed=5 + d.index))
        assert d.token_ids == alone.tokens
        assert d.text == "".join(e.text for e in events if isinstance(e, Text) and e.index == d.index)
    assert len({d.text for d in dones}) == 3
    cancelled = request("Write a poem", ReplySettings(max_new_tokens=500, temperature=1.0, ignore_eos=True), n=2)
    h.run(cancelled, max_steps=3)
    events = h.run(Cancel(cancelled.id))
    assert sorted(e.index for e in events if isinstance(e, Done) and e.finish_reason == "cancelled") == [0, 1]



@pytest.mark.cpu_rules
def test_the_engine_moves_a_leader_and_its_follower_through_their_states(tiny, checkpoint):
    h = harness(tiny, checkpoint, kv_cache_mb=0)
    r = request("word" + " word" * PREFILL_CHUNK, ReplySettings(max_new_tokens=3, temperature=0.0), n=2)
    h.engine.handle(r)
    leader, follower = h.engine.requests[r.id]
    assert (leader.state, follower.state) == (State.NEW, State.NEW) and h.engine.preparing  # its prompt: a thread's
    h.step()  # the prompt taken (READY), the leader takes a cache and prefills its first chunk; the follower waits
    assert PREFILL_CHUNK < len(leader.prompt) <= 2 * PREFILL_CHUNK  # two chunks
    assert (leader.state, follower.state) == (State.PREFILLING, State.NEW)
    assert follower not in h.engine.scheduler.running
    h.step()  # the last chunk: both sample their first token from its logits
    assert (leader.state, follower.state) == (State.DECODING, State.DECODING)
    assert follower.cache.tokens == leader.prompt and [len(leader.tokens), len(follower.tokens)] == [1, 1]
    h.step()  # the follower joins the batch; both decode
    assert (leader.state, follower.state) == (State.DECODING, State.DECODING) and len(follower.tokens) == 2
    first = len(h.events)
    h.step()  # the third token: the token limit; both end at the end of the step
    assert (leader.state, follower.state) == (State.FINISHED, State.FINISHED) and r.id not in h.engine.requests
    assert sorted(e.index for e in h.events[first:] if isinstance(e, Done) and e.finish_reason == "length") == [0, 1]


# ---- tools --------------------------------------------------------------------------------------

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def scripted(monkeypatch, checkpoint, text: str) -> None:
    """Every sequence samples the ids of `text`, then <|eot_id|> (on the host, or drawn on the device)."""
    ids = checkpoint.tokenizer.encode(text) + [checkpoint.tokenizer.eot_id]
    monkeypatch.setattr("app.engine.sequence.Sequence.sample", lambda self, logits: ids[len(self.tokens)])
    monkeypatch.setattr("app.engine.sequence.Sequence.draw", lambda self, logits: torch.tensor(ids[len(self.tokens)]))


@pytest.mark.cpu_rules
def test_a_tool_call_is_held_back_and_comes_as_a_call(tiny, checkpoint, monkeypatch):
    h = harness(tiny, checkpoint)
    scripted(monkeypatch, checkpoint, '[get_weather(city="Paris")]')
    r = request("What is the weather in Paris?", GREEDY, tools=WEATHER)
    events = h.ask(r)[r.id]
    done = last(events)
    assert not [e for e in events if isinstance(e, Text)]  # never streamed as content
    assert done.text == "" and len(done.tool_calls) == 1
    call = done.tool_calls[0]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"} and call["id"].startswith("call_")
    prompt = checkpoint.tokenizer.decode(checkpoint.chat_format.encode_dialog(
        [{"role": "user", "content": "What is the weather in Paris?"}], tools=WEATHER))
    assert "get_weather" in prompt  # the definitions were in the prompt the engine built


@pytest.mark.cpu_rules
def test_text_that_is_no_tool_call_streams_and_undeclared_calls_stay_text(tiny, checkpoint, monkeypatch):
    h = harness(tiny, checkpoint)
    scripted(monkeypatch, checkpoint, "It is sunny in Paris today.")
    events = h.ask(r := request("Weather?", GREEDY, tools=WEATHER))[r.id]
    assert "".join(e.text for e in events if isinstance(e, Text)) == last(events).text == "It is sunny in Paris today."
    assert last(events).tool_calls == []
    scripted(monkeypatch, checkpoint, '[launch_rocket(target="moon")]')  # a function nobody declared
    events = h.ask(r := request("Weather?", GREEDY, tools=WEATHER))[r.id]
    assert last(events).tool_calls == [] and last(events).text == '[launch_rocket(target="moon")]'
    assert "".join(e.text for e in events if isinstance(e, Text)) == last(events).text  # sent at the end


@pytest.mark.cpu_rules
def test_with_tool_choice_none_a_call_the_model_writes_is_text(tiny, checkpoint, monkeypatch):
    h = harness(tiny, checkpoint)
    call = '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}'
    scripted(monkeypatch, checkpoint, call)
    events = h.ask(r := request("Weather?", GREEDY, tools=WEATHER, tool_choice="none"))[r.id]
    assert last(events).tool_calls == [] and last(events).text == call
    assert "".join(e.text for e in events if isinstance(e, Text)) == call  # streamed as it came
    events = h.ask(r := request("Weather?", GREEDY, tools=WEATHER))[r.id]  # "auto": the same reply is a call
    assert last(events).text == "" and [c["function"]["name"] for c in last(events).tool_calls] == ["get_weather"]


@pytest.mark.cpu_rules
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_call_that_tool_choice_asks_for_is_what_the_reply_is(tiny, checkpoint, tool_choice):
    h = harness(tiny, checkpoint)
    settings = ReplySettings(max_new_tokens=200, temperature=1.0, top_p=1.0, seed=5)
    short = [{"type": "function", "function": {**WEATHER[0]["function"], "parameters": {  # a random model ends it
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}}}]
    for parallel in (False, True):
        events = h.ask(r := request("Weather?", settings, tools=short, tool_choice=tool_choice,
                                    parallel_tool_calls=parallel))[r.id]
        done = last(events)
        assert not [e for e in events if isinstance(e, Text)] and done.text == ""  # never streamed as content
        assert done.finish_reason == "stop" and done.tool_calls and (parallel or len(done.tool_calls) == 1)
        assert {c["function"]["name"] for c in done.tool_calls} == {"get_weather"}
        assert all(isinstance(json.loads(c["function"]["arguments"])["city"], str) for c in done.tool_calls)


@pytest.mark.cpu_rules
def test_a_model_without_tool_calling_answers_in_text_unless_a_call_is_demanded(tmp_path):
    """Clients that offer their tools with every message (Open WebUI) get text, as "auto" allows; "required" or a
    named function, which only a call satisfies, is a bad request that says why."""
    from support.special_checkpoints import write_chatml_checkpoint
    h = EngineHarness(write_chatml_checkpoint(tmp_path / "chatml"))
    plain = last(h.ask(r := request("Hi", GREEDY, model="chatml"))[r.id])
    for tool_choice in (None, "auto", "none"):
        done = last(h.ask(r := request("Hi", GREEDY, model="chatml", tools=WEATHER, tool_choice=tool_choice))[r.id])
        assert done.text == plain.text and not done.tool_calls  # the same prompt: the tools left out
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        events = h.ask(r := request("Hi", GREEDY, model="chatml", tools=WEATHER, tool_choice=tool_choice))[r.id]
        assert last(events).reason == "bad_request" and "has no tool calling" in last(events).message
        assert last(events).message.startswith("tools: ") and "tool_choice" in last(events).message


@pytest.mark.cpu_rules
def test_a_model_without_tool_calling_refuses_a_conversation_with_tool_results_by_what_it_holds(tmp_path):
    """A tool's result or an assistant's calls cannot go in a prompt whose template has no tools: refused naming
    the messages and why, not by the position the chat format numbers them at (the API's indices differ)."""
    from support.special_checkpoints import write_chatml_checkpoint
    h = EngineHarness(write_chatml_checkpoint(tmp_path / "chatml"))
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    with_result = chat("What is the weather in Paris?")
    with_result.add("assistant", "", tool_calls=[call])
    with_result.add("tool", "Sunny, 21 C", tool_call_id="call_1")
    with_result.add("user", "Thanks. And tomorrow?")
    for tools in (None, WEATHER):
        events = h.ask(r := request(with_result, GREEDY, model="chatml", tools=tools))[r.id]
        failed = last(events)
        assert failed.reason == "bad_request" and failed.message.startswith("messages: ")
        assert "has no tool calling" in failed.message and "message 2" not in failed.message
    assert last(h.ask(r := request("Hi", GREEDY, model="chatml"))[r.id]).text  # the engine answers the next


@pytest.mark.cpu_rules
def test_tool_calls_and_results_are_prompted_as_the_chat_format_writes_them(tiny, checkpoint):
    h = harness(tiny, checkpoint)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    conversation = chat("What is the weather in Paris?")
    conversation.add("assistant", "", tool_calls=[call])
    conversation.add("tool", "Sunny, 21 C", tool_call_id="call_1")
    r = request(conversation, GREEDY, tools=WEATHER, tool_choice="auto")
    h.run(r, max_steps=1)
    expected = checkpoint.chat_format.encode_dialog([
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}], tools=WEATHER, tool_choice="auto")
    assert h.engine.requests[r.id][0].prompt == expected
    h.run(Cancel(r.id))
