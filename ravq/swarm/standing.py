"""Where a node stands in its cluster: its phase, the generation it works in, the generation it is ready to
resume in, and since when its cluster has been paused.

The node has this from its first heartbeat on (``starting``, then ``standby`` for a node the plan leaves
idle), before its stage is built; churn (``ravq.swarm.churn``) moves it along once it is.  Every change
of phase is exported (``ravq_node_phase``) and asks for a heartbeat at once (``beat_now``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ravq.config import Plan
from ravq.metrics import Metrics
from ravq.net.protocol import NODE_PHASES
from ravq.swarm.report import NodeReport, Progress

log = logging.getLogger(__name__)

PHASES = NODE_PHASES
"""What a node says it is doing (``ravq.net.protocol``: the broker refuses a heartbeat with another)."""


class Standing:
    def __init__(self, *, name: str, metrics: Metrics) -> None:
        self.name, self.metrics = name, metrics
        self.generation = 0
        """The cluster generation this node works in; pipeline messages of any other are dropped."""
        self.phase = "starting"
        self.ready = -1
        """The last generation this node reported itself ready to resume in."""
        self.paused_since: float | None = None
        self.beat_now = asyncio.Event()
        """Set when the broker should hear from this node at once (a phase change)."""
        self._export_phase()

    def _export_phase(self) -> None:
        """ravq_node_phase, from the first scrape on (every phase at 0 but the current one)."""
        for p in PHASES:
            self.metrics.node_phase.labels(p).set(float(p == self.phase))

    def progress(self, *, trained: int, stage_bytes: int) -> Progress:
        """What the next heartbeat says of this node's progress."""
        return Progress(generation=self.generation, phase=self.phase, ready=self.ready, trained=trained,
                        stage_bytes=stage_bytes)

    def set_phase(self, phase: str) -> None:
        if phase != self.phase and self.phase != "leaving":  # a node that leaves stays leaving
            self.phase = phase
            self._export_phase()
            self.beat_now.set()  # the broker (and through it the cluster) should know at once

    def leave(self) -> None:
        """This node leaves the run (a signal while it goes on): tell the broker at once; from now on
        the cluster's pauses and resumptions are no longer this node's business."""
        self.set_phase("leaving")

    def pause(self, generation: int) -> None:
        """The cluster paused in ``generation``: from now on messages of older ones are dropped."""
        self.generation = generation
        self.paused_since = self.paused_since or time.monotonic()
        self.set_phase("paused")

    def ready_in(self, generation: int) -> None:
        """Ready to resume in ``generation`` (in-flight work dropped, caught up): the broker hears at once."""
        self.ready = generation
        self.beat_now.set()

    def resumed(self) -> float:
        """The cluster trains again; returns how long it was paused (seconds)."""
        paused_s = time.monotonic() - (self.paused_since or time.monotonic())
        self.paused_since = None
        self.set_phase("training")
        return paused_s

    def rejoin_if_running(self, state: dict[str, Any], cluster: int) -> bool:
        """Join through recovery when the broker says this node's ``cluster`` is not starting (it
        restarted); whether it did.  A node asks at registration and again once its stage is built: a
        restarted broker's book starts with every cluster ``starting`` and rebuilds it from the live
        members' heartbeats (``brokers.book.Book._adopt``), so a node whose REGISTER arrived first (the
        broker's PC rebooted with it) read ``starting`` of a cluster that runs on and, its restart
        noticed, is now paused.  Waiting for everyone as at a first start would wait for reachability
        verdicts and registrations that live nodes never send again."""
        if state["state"] == "starting":
            return False
        self.generation, self.paused_since = int(state["generation"]), time.monotonic()
        self.set_phase("paused")
        log.info("%s: cluster %d is %s (generation %d): rejoining", self.name, cluster, state["state"],
                 self.generation)
        return True


async def stand_by(*, name: str, standing: Standing, report: NodeReport, memory_bytes: int,
                   poll: Callable[[], Awaitable[Plan | None]], interval_s: float) -> Plan:
    """Not in the plan: wait as a standby until the broker hands this node a lost node's stage (``poll``:
    the broker's plan now, None when it does not answer in time); returns the plan that does."""
    standing.set_phase("standby")
    report.standing_by(memory_bytes)
    log.info("%s: not in the plan; standing by (%.1f GiB usable) to replace a lost node", name,
             memory_bytes / 2**30)
    while True:
        plan = await poll()
        if plan is not None and any(name in c.nodes for c in plan.clusters):
            cluster, stage = plan.locate(name)
            log.info("%s: the broker assigned this node stage %d of cluster %d", name, stage, cluster)
            return plan
        await asyncio.sleep(interval_s)
