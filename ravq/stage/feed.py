"""Stage 0's data: the micro-batches it takes from the task's iterator, those in flight, those to train again.

A micro-batch is named by its index in stage 0's data.  A pause drops the work in flight; stage 0
re-queues the dropped micro-batches, which are trained again under the same index before new data, so a
checkpoint's data position (``trained_prefix``) is the index below which every micro-batch is finished.

A resumed stage 0 opens its data at that position: a task whose ``train_batches`` takes ``start``
(``takes_start``) is asked for the batches from ``start`` on, in O(1); the older generator form, without
``start``, is replayed from the beginning to the position, in O(position) (docs/tasks.md).
"""

from __future__ import annotations

import inspect
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ravq.stage.types import MicroBatch

log = logging.getLogger(__name__)

Batch = tuple[Any, Any]
"""(inputs, targets) as the task's ``train_batches`` yields them."""


def takes_start(train_batches: Callable[..., Any]) -> bool:
    """Whether a task's ``train_batches`` takes the data position: a parameter named ``start`` (the index,
    from 0, of the first micro-batch it yields; default 0)."""
    try:
        return "start" in inspect.signature(train_batches).parameters
    except (TypeError, ValueError):  # a callable without a signature Python can read: the old form
        return False


@dataclass(kw_only=True, slots=True)
class DataSource:
    """One cluster's shard of the task's training data, opened at a data position."""

    train_batches: Callable[..., Iterable[Batch]]
    """The task's ``train_batches(micro_batch, shard, num_shards, seed[, start])``."""
    micro_batch: int
    shard: int
    """This cluster's shard (its cluster index)."""
    num_shards: int
    """The clusters."""
    seed: int

    def open(self, start: int) -> Iterator[Batch]:
        """The batches from index ``start`` on."""
        args = (self.micro_batch, self.shard, self.num_shards, self.seed)
        if takes_start(self.train_batches):
            log.info("cluster %d: data opened at micro-batch %d", self.shard, start)
            return iter(self.train_batches(*args, start=start))
        batches = iter(self.train_batches(*args))
        for _ in range(start):  # the generator form: replayed to the position
            next(batches)
        if start:
            log.info("cluster %d: data replayed to micro-batch %d (train_batches takes no start)", self.shard,
                     start)
        return batches


class DataFeed:
    """Stage 0's side of its data (compute thread)."""

    def __init__(self, batches: Iterator[Batch] | DataSource) -> None:
        self._source = batches if isinstance(batches, DataSource) else None
        """Where the batches come from, opened at the position when the first is taken (a resume moves it
        before); None: an iterator given as it is."""
        self._batches: Iterator[Batch] | None = None if isinstance(batches, DataSource) else batches
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
        if self._batches is None:
            assert self._source is not None
            self._batches = self._source.open(self.position)
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
        if self._source is not None:
            self._batches = None  # opened at ``position`` when the next batch is taken
        else:
            assert self._batches is not None
            for _ in range(position):
                next(self._batches)
        self.position = position

    def trained_prefix(self) -> int:
        """Data index below which every micro-batch is finished (a checkpoint's data_position)."""
        pending = [mb[1] for mb in self._in_flight] + [i for i, _ in self._requeue]
        return min(pending, default=self.position)
