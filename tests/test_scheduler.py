"""The scheduler (app/scheduler.py): who decodes, who prefills how much, who waits."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from app.scheduler import Scheduler


@dataclass(eq=False)
class Seq:
    id: str
    prompt_left: int = 0
    ready: bool = True
    finished: bool = False


def test_every_running_decoding_sequence_decodes_and_prefill_spends_the_budget_oldest_first():
    s = Scheduler(max_batch=8, prefill_budget=100)
    a, b, c, d = Seq("a"), Seq("b", prompt_left=70), Seq("c", prompt_left=70), Seq("d")
    for seq in (a, b, c, d):
        s.add(seq)
    assert s.admit() == [a, b, c, d]
    step = s.schedule()
    assert step.decode == [a, d]
    assert step.prefill == [(b, 70), (c, 30)]  # c gets what is left of the budget


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
