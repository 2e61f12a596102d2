"""One node's training session: the compute thread's run, then the end-of-training protocol.

The stage trains in the compute thread (``StageWorker.run``) and hands each message it produces to the
pipeline links (``emit``).  When it stops by itself its training is over: the node says so (phase
``finishing``), lets the averager finish its rounds and the stage apply what they brought
(``run_pending``), agrees on the weights once more when a cluster was disrupted (the clusters ended at
different step counts), brings the last rounds' deltas to every copy of a tied weight, and waits for
everything emitted to be sent.  A node that leaves a run going on skips all of it (its cluster redoes
what was in flight); a forced one skips what would wait on peers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from ravq.average.averager import Averager
from ravq.stage.pipeline import StageWorker
from ravq.stage.tied_hold import close_tied
from ravq.stage.types import Outbound

log = logging.getLogger("ravq.node")  # the node's own lines


class Ending(Protocol):
    """How the node stops, as the session reads it (``ravq.node.stopping.Stopping``)."""

    @property
    def leaving(self) -> bool:
        """It leaves a run that goes on."""

    @property
    def draining(self) -> bool:
        """A signal arrived."""

    @property
    def forced(self) -> bool:
        """It ends now, waiting for nothing."""

    def should_abort(self) -> bool:
        """The compute thread stops at its next operation."""

    def training_ended(self) -> None:
        """The compute thread ended by itself."""


class Outbox(Protocol):
    """Where the stage's messages go (``ravq.node.pipeline_links.StageLinks``)."""

    def emit(self, out: Outbound) -> None:
        """From the compute thread: send ``out``."""

    async def drained(self) -> None:
        """Return once everything emitted has been sent."""


class TrainingSession:
    def __init__(self, *, name: str, worker: StageWorker, outbox: Outbox, ending: Ending,
                 averager: Averager | None, set_phase: Callable[[str], None], disrupted: Callable[[], bool],
                 final_round_s: float) -> None:
        self.name, self.worker, self.outbox, self.ending = name, worker, outbox, ending
        self.averager = averager
        self._set_phase = set_phase
        """Tells the broker what this node does (``ravq.swarm.churn.Churn.set_phase``)."""
        self._disrupted = disrupted
        """Whether a cluster of the run was disrupted (its generation rose) as the broker last said."""
        self.final_round_s = final_round_s
        """How long the final averaging round may wait for the other clusters."""

    async def run(self) -> None:
        """Train until the stage is done, the node leaves or it is forced out; then end as above."""
        worker, ending = self.worker, self.ending
        await asyncio.to_thread(worker.run, self.outbox.emit, ending.should_abort)
        if ending.leaving:  # nothing to wait for: the cluster pauses and redoes what was in flight
            log.info("%s: left the run at step %d", self.name, worker.version)
            return
        ending.training_ended()
        if not ending.draining and not ending.forced:
            self._set_phase("finishing")
        if self.averager is not None and not ending.forced:
            await self.averager.drain()
            await asyncio.to_thread(worker.run_pending)
            if not ending.draining and self._disrupted():
                # a cluster was disrupted: clusters ended at different step counts; agree once more
                await self.averager.final_round(self.final_round_s)
        if worker.tied is not None and not ending.forced:  # the last rounds' deltas reach every copy
            await asyncio.to_thread(close_tied, worker)
        if self.averager is not None:
            self.averager.finish()  # a cluster still training is told at once, not after ring_step_s
        await self.outbox.drained()
        if ending.draining and not ending.forced:
            log.info("%s: drained at step %d", self.name, worker.version)
        elif not ending.forced:
            log.info("%s: training done at step %d (%d micro-batches)", self.name, worker.version,
                     worker.stats.backwards)
