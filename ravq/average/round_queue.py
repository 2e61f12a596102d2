"""The event loop's side of overlapped averaging: a short queue of snapshotted rounds, run one by one.

The compute thread snapshots a round and queues it here without ever blocking; the event loop runs
the queued rounds in order (``ravq.average.rounds``) and hands each result back through its future.
When rounds queue faster than the rings finish them, a new round is skipped and its ring peers are told,
so they abandon it at once.  Every round's outcome is counted here and in the node's metrics.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable

from torch import Tensor

from ravq.average.mailbox import Mailbox, RingAborted
from ravq.average.ring import RingLink
from ravq.average.ring_compression import RingCompression
from ravq.average.rounds import ROUNDS_PER_EPOCH, RoundResult, average_segments
from ravq.average.segments import Segment
from ravq.config import Plan
from ravq.metrics import Metrics

log = logging.getLogger(__name__)

PENDING_ROUNDS = 2
"""Snapshots waiting for their round; when more would queue, the new round is skipped (and its ring
peers told, so they abandon it at once)."""

QueuedRound = tuple[int, dict[int, Tensor], list[Segment], concurrent.futures.Future[RoundResult]]
"""Round id, ring_id -> flat snapshot, this node's segments, and the future its result goes to."""


class RoundQueue:
    """The rounds a node's compute thread queued, run on the event loop with their outcomes counted."""

    def __init__(self, *, me: str, plan: Callable[[], Plan], mailbox: Mailbox, link: RingLink,
                 metrics: Metrics, piece_bytes: int, timeout_s: float, notify_s: float,
                 compression: RingCompression | None,
                 spared: Callable[[int, list[Segment]], bool | None] = lambda round_id, rings: None) -> None:
        self.me, self.plan, self.mailbox, self.link, self.metrics = me, plan, mailbox, link, metrics
        self.spared = spared
        """Whether a queued round of an older plan epoch still runs (group averaging: its group untouched);
        False: it is dropped and its ring peers told (a peer may have started it); None: dropped (global
        rings: every peer drops it too)."""
        self.piece_bytes, self.timeout_s, self.compression = piece_bytes, timeout_s, compression
        self.notify_s = notify_s
        """How long telling one peer of a skipped round may take."""
        self.rounds: asyncio.Queue[QueuedRound] = asyncio.Queue(PENDING_ROUNDS)
        self._skips: asyncio.Queue[tuple[str, int, int, str]] = asyncio.Queue()
        """RING_ABORTs to send: (peer, ring, round, reason)."""
        self.skipped = 0
        self.completed = 0
        self.seconds_total = 0.0
        self.aborts = 0
        self._timed_epoch = -1
        """The plan epoch whose first finished round was logged."""

    def enqueue(self, item: QueuedRound) -> None:
        """Queue a round without ever blocking the compute thread; when the queue is full (a ring is
        stuck or a member slow), skip the round and tell its ring peers, who abandon it at once."""
        round_id, _, segments, done = item
        try:
            self.rounds.put_nowait(item)
        except asyncio.QueueFull:
            log.warning("%s: round %d skipped: %d rounds already wait for their rings", self.me, round_id,
                        self.rounds.qsize())
            self.skipped += 1
            self.skip(round_id, segments)
            done.set_result(RoundResult(aborted={s.ring_id: RingAborted(s.ring_id, round_id, "skipped")
                                                 for s in segments}))

    def skip(self, round_id: int, segments: list[Segment]) -> None:
        """Tell the round's ring peers this node will not run it (it saw a new plan epoch first)."""
        for seg in segments:
            for peer in seg.ring:
                if peer != self.me:
                    self._skips.put_nowait((peer, seg.ring_id, round_id, "skipped"))

    def refuse(self, peer: str, ring_id: int, round_id: int) -> None:
        """Tell ``peer`` this node runs no more rounds (``Mailbox.finish``)."""
        self._skips.put_nowait((peer, ring_id, round_id, "finished"))

    async def send_skips(self) -> None:
        """Tell ring peers about skipped and refused rounds (best effort: one RING_ABORT each)."""
        while True:
            peer, ring_id, round_id, reason = await self._skips.get()
            try:
                async with asyncio.timeout(self.notify_s):
                    await self.link.send_abort(peer, ring_id, round_id, reason)
            except TimeoutError:
                log.debug("%s: %s of round %d not sent to %s", self.me, reason, round_id, peer)

    async def run(self) -> None:
        """Run the queued rounds in order, for ever; a round of an older plan epoch cannot finish (its
        rings changed) and is aborted without starting, unless ``spared`` (its group was untouched)."""
        while True:
            round_id, snapshots, segments, done = await self.rounds.get()
            try:
                old = round_id // ROUNDS_PER_EPOCH < self.plan().epoch
                if old and not (runs := self.spared(round_id, segments)):
                    if runs is False:  # a peer may have started it: tell it
                        self.skip(round_id, segments)
                    result = RoundResult(aborted={s.ring_id: RingAborted(s.ring_id, round_id, "plan_changed")
                                                  for s in segments})
                else:
                    result = await average_segments(
                        snapshots, segments, me=self.me, round_id=round_id, link=self.link,
                        mailbox=self.mailbox, piece_bytes=self.piece_bytes, timeout_s=self.timeout_s,
                        compression=self.compression)
                self._account(round_id, result)
                done.set_result(result)
            finally:
                self.rounds.task_done()

    def _account(self, round_id: int, result: RoundResult) -> None:
        for ring, nbytes in result.bytes_sent.items():
            self.metrics.allreduce_bytes.labels(str(ring)).inc(nbytes)
        if result.aborted:
            self.aborts += 1
            reasons = {e.reason for e in result.aborted.values()}
            for reason in reasons:
                self.metrics.allreduce_aborts.labels(reason[:32]).inc()
            log.warning("%s: averaging round %d aborted on %d ring(s) (%s); training goes on", self.me,
                        round_id, len(result.aborted), ", ".join(sorted(reasons)))
        else:
            self.completed += 1
            epoch = round_id // ROUNDS_PER_EPOCH
            if epoch != self._timed_epoch:  # the first round of an epoch: what its links and start-up cost
                self._timed_epoch = epoch
                log.info("%s: first averaging round of plan epoch %d took %.2fs", self.me, epoch,
                         result.seconds)
            else:
                log.debug("%s: averaging round %d took %.2fs", self.me, round_id, result.seconds)
            self.seconds_total += result.seconds
            self.metrics.allreduce_rounds.inc()
            self.metrics.allreduce_seconds.observe(result.seconds)

    async def drain(self) -> None:
        """Wait until every queued round has finished (at the end of training)."""
        await self.rounds.join()

    def mean_seconds(self) -> float:
        """Mean duration of the rounds that finished."""
        return self.seconds_total / self.completed if self.completed else 0.0
