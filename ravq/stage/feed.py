"""Stage 0's data: the micro-batches it takes from the task's iterator, those in flight, those to train again.

A micro-batch is named by its index in stage 0's data.  A pause drops the work in flight; stage 0
re-queues the dropped micro-batches, which are trained again under the same index before new data, so a
checkpoint's data position (``trained_prefix``) is the index below which every micro-batch is finished.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from ravq.stage.types import MicroBatch

Batch = tuple[Any, Any]
"""(inputs, targets) as the task's ``train_batches`` yields them."""


class DataFeed:
    """Stage 0's side of its data (compute thread)."""

    def __init__(self, batches: Iterator[Batch]) -> None:
        self._batches = batches
        self.position = 0
        """Micro-batches taken from the iterator."""
        self._requeue: deque[tuple[int, Batch]] = deque()
        """Dropped micro-batches (index, batch), trained again before new data."""
        self._in_flight: dict[MicroBatch, Batch] = {}
        """The batch of each micro-batch in flight, to re-queue it if a pause drops it."""

    def has_more(self, steps: int) -> bool:
        """A dropped micro-batch waits, or fewer than ``steps`` were taken."""
        return bool(self._requeue) or self.position < steps

    def take(self) -> tuple[int, Batch]:
        """The next micro-batch to train: a dropped one first, else the iterator's next."""
        if self._requeue:
            return self._requeue.popleft()
        batch = next(self._batches)
        self.position += 1
        return self.position - 1, batch

    def track(self, micro_batch: MicroBatch, batch: Batch) -> None:
        """``micro_batch`` is in flight (its backward has not reached stage 0)."""
        self._in_flight[micro_batch] = batch

    def complete(self, micro_batch: MicroBatch) -> bool:
        """``micro_batch``'s backward is done; whether it was in flight."""
        return self._in_flight.pop(micro_batch, None) is not None

    def requeue_in_flight(self) -> None:
        """A pause dropped the micro-batches in flight: train them again, in index order."""
        again = sorted((mb[1], batch) for mb, batch in self._in_flight.items())
        self._requeue = deque(sorted([*again, *self._requeue], key=lambda item: item[0]))
        self._in_flight.clear()

    def skip_to(self, position: int) -> None:
        """Resuming from a checkpoint: the micro-batches below ``position`` are trained."""
        for _ in range(position):
            next(self._batches)
        self.position = position

    def trained_prefix(self) -> int:
        """Data index below which every micro-batch is finished (a checkpoint's data_position)."""
        pending = [mb[1] for mb in self._in_flight] + [i for i, _ in self._requeue]
        return min(pending, default=self.position)
