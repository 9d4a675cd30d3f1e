"""A sequence's states (app/engine/sequence.py), driven by hand as the engine drives them: NEW until its
prompt is built, READY to join the batch, PREFILLING its prompt a chunk at a time, DECODING, FINISHED by
its Decoding's rules or a cancel; a follower (one of n replies) from NEW straight to DECODING."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.checkpoints import write_tiny_checkpoint

from app.engine.sequence import Sequence, State
from app.messages import Generate, ReplySettings
from model.checkpoint import load_checkpoint
from model.kv_cache import PREFILL_CHUNK, KVCache

pytestmark = pytest.mark.usefixtures("one_thread")

# Every setting given, as the engine gives them (the request's over the model's defaults).
SETTINGS = ReplySettings(max_new_tokens=3, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                         frequency_penalty=0.0, presence_penalty=0.0)
LIMIT = 8192  # the model's context


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return load_checkpoint(write_tiny_checkpoint(Path(tmp_path_factory.mktemp("weights")) / "tiny"),
                           dtype=torch.float32)


@pytest.fixture(scope="module")
def words(checkpoint) -> list[int]:
    """Ordinary token ids (no stop id among them), for prompts and replies."""
    ids = checkpoint.tokenizer.encode(" ".join(f"word{i}" for i in range(PREFILL_CHUNK)))
    assert len(ids) > PREFILL_CHUNK + 10 and not set(ids) & checkpoint.stop_ids
    return ids


def sequences(n: int = 1) -> list[Sequence]:
    """A request's n sequences, as the engine makes them: a leader and its followers."""
    request = Generate("r1", "tiny", SETTINGS, n=n)
    leader = Sequence(request, arrived=0.0)
    leader.followers = [Sequence(request, leader.arrived, i, leader) for i in range(1, n)]
    return [leader, *leader.followers]


def start(sequence: Sequence, checkpoint, prompt: list[int], limit: int = LIMIT, **settings) -> None:
    sequence.start(checkpoint, prompt, ReplySettings(**settings).over(SETTINGS), limit)


def take_cache(sequence: Sequence, checkpoint, max_len: int | None = None) -> None:
    sequence.take_cache(KVCache(checkpoint.config, max_len or sequence.max_len, dtype=torch.float32), 0)


def prefill(sequence: Sequence) -> None:
    """Its prompt's chunks into its cache (the ids only: which state follows does not depend on the values)."""
    while sequence.next_chunk:
        ids, _ = sequence.prefill_chunk()
        sequence.computed(ids)


@pytest.mark.cpu_rules
def test_a_reply_goes_through_every_state_and_ends_at_its_token_limit(checkpoint, words):
    sequence, = sequences()
    prompt = words[:PREFILL_CHUNK + 10]  # two chunks
    assert sequence.state is State.NEW and not sequence.ready and not sequence.finished

    start(sequence, checkpoint, prompt)
    assert sequence.state is State.READY and sequence.ready and sequence.next_chunk == 0  # (no cache yet)

    take_cache(sequence, checkpoint)
    assert sequence.state is State.PREFILLING and sequence.next_chunk == PREFILL_CHUNK
    ids, position = sequence.prefill_chunk()
    sequence.computed(ids)
    assert (ids, position) == (prompt[:PREFILL_CHUNK], 0)
    assert sequence.state is State.PREFILLING and sequence.next_chunk == 10
    ids, position = sequence.prefill_chunk()
    sequence.computed(ids)
    assert position == PREFILL_CHUNK and sequence.state is State.DECODING and sequence.next_chunk == 0

    reply = words[:3]
    for i, token in enumerate(reply):
        assert sequence.state is State.DECODING and sequence.finish_reason is None
        sequence.accept(token)
        if i < len(reply) - 1:
            sequence.computed([token])
    assert sequence.state is State.FINISHED and sequence.finished and sequence.finish_reason == "length"
    assert sequence.next_chunk == 0  # the scheduler no longer runs it
    done = sequence.done()
    assert done.finish_reason == "length" and done.token_ids == reply and sequence.state is State.FINISHED


def test_a_stop_id_finishes_the_reply(checkpoint, words):
    sequence, = sequences()
    start(sequence, checkpoint, words[:8], max_new_tokens=50)
    take_cache(sequence, checkpoint)
    prefill(sequence)
    sequence.accept(words[0])
    assert sequence.state is State.DECODING
    sequence.accept(checkpoint.tokenizer.eot_id)
    assert sequence.state is State.FINISHED and sequence.finish_reason == "stop"
    assert sequence.done().token_ids == words[:1]


def test_a_follower_waits_for_its_leaders_prompt_then_decodes_from_a_copy(checkpoint, words):
    leader, follower = sequences(n=2)
    prompt = words[:20]
    for sequence in (leader, follower):
        start(sequence, checkpoint, prompt)
    assert leader.state is State.READY
    assert follower.state is State.NEW and not follower.ready  # no cache of its own to take: it copies one

    take_cache(leader, checkpoint)
    assert follower.state is State.NEW
    prefill(leader)
    assert leader.state is State.DECODING
    follower.follow()
    assert follower.state is State.DECODING and follower.ready and follower.next_chunk == 0
    assert follower.cache.tokens == leader.cache.tokens == prompt and follower.cache is not leader.cache
    assert follower.cache.max_len == follower.max_len == len(prompt) + 3

    for token in words[:3]:
        follower.accept(token)
    assert follower.state is State.FINISHED and leader.state is State.DECODING  # each reply ends on its own


def test_a_cancel_while_waiting_for_the_model_finishes_it_and_a_later_start_keeps_it_finished(checkpoint, words):
    leader, follower = sequences(n=2)
    for sequence in (leader, follower):
        sequence.cancel()
        assert sequence.state is State.FINISHED and sequence.finish_reason == "cancelled"
    done = leader.done()
    assert done.finish_reason == "cancelled" and done.token_ids == [] and done.text == ""

    start(follower, checkpoint, words[:8])  # its model loaded meanwhile
    assert follower.state is State.FINISHED and follower.finish_reason == "cancelled"
    assert follower.done().finish_reason == "cancelled"


def test_a_cancel_while_waiting_in_line_finishes_it(checkpoint, words):
    sequence, = sequences()
    start(sequence, checkpoint, words[:8])
    sequence.cancel()
    assert sequence.state is State.FINISHED and sequence.cache is None
    assert sequence.done().finish_reason == "cancelled"


@pytest.mark.cpu_rules
def test_a_cancel_while_prefilling_finishes_it_before_its_next_chunk(checkpoint, words):
    sequence, = sequences()
    start(sequence, checkpoint, words[:PREFILL_CHUNK + 10])
    take_cache(sequence, checkpoint)
    sequence.computed(sequence.prefill_chunk()[0])
    assert sequence.state is State.PREFILLING and sequence.next_chunk == 10
    sequence.cancel()
    assert sequence.state is State.FINISHED and sequence.next_chunk == 0  # nothing more to prefill
    done = sequence.done()
    assert done.finish_reason == "cancelled" and done.token_ids == [] and sequence.cache.length == PREFILL_CHUNK


def test_a_reply_with_no_room_for_a_token_is_finished_at_its_start(checkpoint, words):
    sequence, = sequences()
    start(sequence, checkpoint, words[:8], limit=8)  # the prompt fills the context
    assert sequence.state is State.FINISHED and sequence.ready  # (it joins the batch only to leave it)
    assert sequence.next_chunk == 0 and sequence.done().finish_reason == "length"


def test_a_transition_out_of_turn_is_refused_and_changes_nothing(checkpoint, words):
    sequence, = sequences()
    with pytest.raises(RuntimeError, match="a NEW sequence cannot become PREFILLING"):
        take_cache(sequence, checkpoint, max_len=16)
    assert sequence.state is State.NEW and sequence.cache is None
    start(sequence, checkpoint, words[:8])
    take_cache(sequence, checkpoint)
    cache = sequence.cache
    with pytest.raises(RuntimeError, match="a PREFILLING sequence cannot become PREFILLING"):
        take_cache(sequence, checkpoint)
    assert sequence.cache is cache
