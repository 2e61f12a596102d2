"""How a node ends: its training is over, it leaves the run, or it is forced out.

A SIGTERM (``systemctl stop``/``restart``: an upgrade, a reboot) while the run goes on is a *leave*,
not an end: the node tells the broker at once (its next heartbeat says ``left``; the broker pauses its
cluster without waiting ``lost_s``, a standby may take its stage, and the node rejoins when it comes
back), its compute thread stops at the next operation without waiting for in-flight micro-batches or
averaging rounds (its cluster drops and redoes them anyway, and their peers may be gone), and the node
writes a final checkpoint and exits: within a few seconds, never waiting for peers that already left.
A signal once its own training is over (the final averaging round) ends it at once.  A second signal,
or ``timeouts.drain_s`` after the first, forces the exit.  ``done`` in the last heartbeat means the
node's training is over, nothing else.
"""

from __future__ import annotations

import asyncio
import logging

from ravq.stage.pipeline import StageWorker
from ravq.swarm.report import NodeReport
from ravq.swarm.standing import Standing

log = logging.getLogger(__name__)


class Stopping:
    def __init__(self, *, name: str, drain_s: float, standing: Standing, report: NodeReport) -> None:
        self.name, self.drain_s, self.standing, self.report = name, drain_s, standing, report
        self.force = asyncio.Event()
        """Set to end the node now (a second signal, drain_s after the first, a failure)."""
        self.draining = False
        """A signal arrived."""
        self.leaving = False
        """The node leaves a run that goes on (a signal before its training was over)."""
        self.trained_out = False
        """The stage finished its training (the compute thread ended by itself)."""

    @property
    def forced(self) -> bool:
        """The node ends now, waiting for nothing."""
        return self.force.is_set()

    def training_ended(self) -> None:
        """The compute thread ended by itself: unless forced meanwhile, the stage's training is over."""
        self.trained_out = not self.force.is_set()

    def should_abort(self) -> bool:
        """The compute thread stops at its next operation (and stops holding back for a round)."""
        return self.force.is_set() or self.leaving

    @property
    def done(self) -> bool:
        """What the last heartbeat says: this node's training is over."""
        return self.trained_out and not self.leaving

    def ended(self, failure: str | None) -> str:
        """Why the node exits, for its summary: done, left, forced or failed."""
        if failure:
            return "failed"
        if self.leaving:
            return "forced" if self.force.is_set() and not self.trained_out else "left"
        return "done" if self.trained_out else "forced"

    def on_signal(self, worker: StageWorker) -> None:
        if self.draining:
            log.warning("%s: second signal: forcing exit", self.name)
            self.force.set()
            return
        self.draining = True
        loop = asyncio.get_running_loop()
        loop.call_later(self.drain_s, self._drain_expired, worker)
        if self.trained_out:
            log.info("%s: signal after training ended at step %d: exiting", self.name, worker.version)
            self.force.set()
            return
        self.leaving = True
        self.report.left()
        self.standing.leave()
        log.info("%s: leaving the run at step %d (%d micro-batch(es) in flight are redone by its cluster): a "
                 "final checkpoint, then exit; send again to force", self.name, worker.version,
                 worker.stats.inflight)
        worker.stop()

    def _drain_expired(self, worker: StageWorker) -> None:
        if not self.force.is_set():
            log.warning("%s: stop limit of %.0fs (timeouts.drain_s) reached with %d micro-batch(es) in "
                        "flight; forcing exit", self.name, self.drain_s, worker.stats.inflight)
        self.force.set()
