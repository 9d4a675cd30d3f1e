"""Which sequences run in the engine's next step: continuous batching with chunked prefill.

Every step decodes one token for every running sequence whose prompt is in its cache, and spends a
budget of prompt tokens on the running sequences that are still prefilling, oldest first, a whole
chunk each (a sequence's chunks start at fixed positions, model/kv_cache.py: one that does not fit
what is left of the budget waits for the next step); so a new request joins the batch at the next
step, and a long prompt is prefilled in chunks between decode steps instead of freezing the other
streams. At most `max_batch` sequences run; the rest wait in
arrival order and are admitted as running ones finish.

Written by hand: this loop is the point of the engine, and what a library would offer (vLLM's
scheduler) comes with paged GPU memory we do not have.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol


class Schedulable(Protocol):
    id: str

    @property
    def ready(self) -> bool: ...  # it may join the batch: its prompt is built (its model is loaded)

    @property
    def next_chunk(self) -> int: ...  # prompt tokens in its next prefill chunk (whole: its bounds decide its sums)

    @property
    def finished(self) -> bool: ...


@dataclass
class Step:
    prefill: list[Schedulable] = field(default_factory=list)  # its next prompt chunk each
    decode: list[Schedulable] = field(default_factory=list)  # one new token each

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


class Scheduler:
    def __init__(self, max_batch: int, prefill_budget: int):
        if max_batch < 1 or prefill_budget < 1:
            raise ValueError(f"max_batch={max_batch} and prefill_budget={prefill_budget} must be at least 1")
        self.max_batch = max_batch
        self.prefill_budget = prefill_budget
        self.waiting: deque[Schedulable] = deque()  # in arrival order
        self.running: list[Schedulable] = []  # in admission order

    def add(self, sequence: Schedulable) -> None:
        self.waiting.append(sequence)

    def remove(self, sequence: Schedulable) -> None:
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def admit(self) -> list[Schedulable]:
        """Move ready waiting sequences into the batch while it has room; returns those admitted.
        A sequence whose model is still loading keeps its place without holding up the others."""
        admitted = []
        for sequence in list(self.waiting):
            if len(self.running) >= self.max_batch:
                break
            if sequence.ready:
                self.waiting.remove(sequence)
                self.running.append(sequence)
                admitted.append(sequence)
        return admitted

    def schedule(self) -> Step:
        """The next step. Call admit() first, and remove() every sequence that finished."""
        step = Step()
        budget = self.prefill_budget
        for sequence in self.running:
            if sequence.finished:
                continue
            chunk = sequence.next_chunk
            if chunk == 0:
                step.decode.append(sequence)
            elif chunk <= budget or not step.prefill:  # the first always runs, whatever the budget
                step.prefill.append(sequence)
                budget -= chunk
        return step

    def positions(self) -> dict[Schedulable, int]:
        """Each waiting sequence's place in line: 1 is the next to run."""
        return {sequence: i + 1 for i, sequence in enumerate(self.waiting)}
