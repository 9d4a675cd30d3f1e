"""The scheduler (app/engine/scheduler.py): who decodes, who prefills how much, who waits."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from app.engine.scheduler import Scheduler


@dataclass(eq=False)
class Seq:
    id: str
    next_chunk: int = 0  # prompt tokens of its next prefill chunk; 0: decoding
    ready: bool = True
    finished: bool = False


def test_every_running_decoding_sequence_decodes_and_prefill_spends_the_budget_oldest_first_in_whole_chunks():
    s = Scheduler(max_batch=8, prefill_budget=100)
    a, b, c, e, d = Seq("a"), Seq("b", next_chunk=70), Seq("c", next_chunk=70), Seq("e", next_chunk=20), Seq("d")
    for seq in (a, b, c, e, d):
        s.add(seq)
    assert s.admit() == [a, b, c, e, d]
    step = s.schedule()
    assert step.decode == [a, d]
    assert step.prefill == [b, e]  # c's chunk does not fit the 30 left and is never cut: it waits; e's fits


def test_the_first_chunk_of_a_step_runs_whatever_the_budget():
    s = Scheduler(max_batch=8, prefill_budget=10)
    big, small = Seq("big", next_chunk=64), Seq("small", next_chunk=4)
    s.add(big)
    s.add(small)
    s.admit()
    assert s.schedule().prefill == [big]


def test_the_batch_is_bounded_and_the_rest_wait_in_order():
    s = Scheduler(max_batch=2, prefill_budget=10)
    seqs = [Seq(str(i)) for i in range(5)]
    for seq in seqs:
        s.add(seq)
    assert s.admit() == seqs[:2]
    assert s.positions() == {seqs[2]: 1, seqs[3]: 2, seqs[4]: 3}
    s.remove(seqs[0])
    assert s.admit() == [seqs[2]] and s.positions() == {seqs[3]: 1, seqs[4]: 2}
    s.remove(seqs[4])  # a waiting one that left (cancelled)
    assert s.positions() == {seqs[3]: 1} and len(s) == 3


def test_a_sequence_whose_model_is_loading_keeps_its_place_without_holding_up_others():
    s = Scheduler(max_batch=1, prefill_budget=10)
    loading, other = Seq("loading", ready=False), Seq("other")
    s.add(loading)
    s.add(other)
    assert s.admit() == [other]
    assert s.positions() == {loading: 1}
    s.remove(other)
    loading.ready = True
    assert s.admit() == [loading]


def test_finished_sequences_are_not_scheduled_and_an_empty_step_is_false():
    s = Scheduler(max_batch=4, prefill_budget=10)
    done = Seq("done", finished=True)
    s.add(done)
    s.admit()
    assert not s.schedule()


def test_limits_must_be_positive():
    with pytest.raises(ValueError):
        Scheduler(max_batch=0, prefill_budget=10)
