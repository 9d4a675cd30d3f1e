"""A decode step queued before the host reads the tokens it runs on: the engine's steps on a GPU's slots.

On a GPU the host queues a step (a replayed CUDA graph: model/static_decode.py) in microseconds and the
device runs it in about a millisecond; then the host reads the sampled tokens, detokenizes them, checks
stops, sends text and schedules, while the device waits. Where every row of a batch is drawn on the device
(no guesses, JSON constraint or logprobs: Sequence.drawable) and sits in a static slot, the engine queues
the next step on those tokens before it reads them (gpt-fast's loop never reads a token before the next
step), so the host's work overlaps the device's. `Ahead` is that step: its rows, and its logits, still
being computed. At the next engine step a sequence still running takes its row; one that ended at the
token read meanwhile leaves its row unused (its cache's length never counted the position written), and
one that joined since (its prompt just prefilled) runs in a step of its own beside it.

A step with guesses (model/speculation.py) cannot be queued so: its guesses follow the token the host
has not read. Its cost is then also the host's time between steps, measured here (`StepClock`) into the
model's StepTimes, so a reply guesses only where that pays. On the CPU every step is computed when it is
called and there is nothing to overlap: the engine's caches are slots only where a model decodes in CUDA graphs
(tests give a CPU model slots, and the same steps are queued ahead there, computed at once).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from model.speculation import StepTimes


@dataclass
class Ahead:
    """A step queued on tokens not yet read: its sequences in row order, its logits (rows, vocab) and its clock."""

    sequences: list
    logits: torch.Tensor
    clock: StepClock

    def rows(self, batch: list) -> dict:
        """The logits (1, vocab) of each of the batch's sequences that ran in this step, by sequence."""
        return {sequence: self.logits[i:i + 1] for i, sequence in enumerate(self.sequences) if sequence in batch}

    def without_finished(self) -> Ahead:
        """The same step, holding none of the sequences that ended (their caches, and slots, can go)."""
        return Ahead([None if sequence.finished else sequence for sequence in self.sequences], self.logits, self.clock)


def queues_ahead(batch: list, drawn: int, room: int) -> bool:
    """Whether the batch's next step can be queued on the tokens just drawn, before they are read: every row
    drawn on the device (`drawn` of them), every cache a slot of the static cache with room for a position
    more, and no sequence whose next step would ask for guesses (`room`: the guesses the step has room for)."""
    rows = len(batch)
    return drawn == rows and all(sequence.cache.slot is not None and sequence.cache.length + 1 < sequence.cache.max_len
                                 and not sequence.may_guess(room, rows, float(rows)) for sequence in batch)


class StepClock:
    """How long a decode step takes. On a GPU the call only queues it: its time is read between two events
    of the stream, once its tokens are read; elsewhere it is the call's. `observe` puts it into StepTimes."""

    def __init__(self, device: torch.device):
        self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) \
            if device.type == "cuda" else None
        self.seconds = 0.0

    def __enter__(self) -> StepClock:
        if self.events is not None:
            self.events[0].record()
        self.seconds = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.events is not None:
            self.events[1].record()
        self.seconds = time.perf_counter() - self.seconds

    def observe(self, times: StepTimes, rows: int) -> None:
        """Into `times`, once the step's work is done (its tokens read)."""
        if self.events is not None:
            self.events[1].synchronize()  # (done already where its tokens were read: no wait)
            self.seconds = self.events[0].elapsed_time(self.events[1]) / 1000
        times.observe(rows, self.seconds)
