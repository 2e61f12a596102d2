"""A node's side of churn: follow its cluster's state, pause, catch up, resume; stand by.

The node follows its cluster's state as the broker publishes it (``brokers.book``).  When a member is
lost or restarts, the cluster's generation rises: the node pauses (its stage drops the work in flight
and keeps weights and optimizer), and once every member is up again it catches up (from live holders
in other clusters when the broker says so) and reports ready; when all are ready the broker lets the
cluster train again.  A node the plan leaves idle stands by until the broker hands it a lost node's
stage.

``Churn`` owns this state (generation, phase, readiness, how long the cluster has been paused) and is
the only writer of it; the node composes it and reads it (``ravq.node``).  It acts on the stage, the
averager and the pipeline links only through their methods, once ``attach`` has handed them over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ravq.average.averager import Averager
from ravq.average.catchup import CatchupError
from ravq.average.catchup import apply_tensors as catchup_apply
from ravq.config import Plan, Topology
from ravq.metrics import Metrics
from ravq.persist.lineage import older
from ravq.stage.pipeline import StageWorker
from ravq.swarm.membership import Membership
from ravq.swarm.report import NodeReport

log = logging.getLogger(__name__)

class PipelineLinks(Protocol):
    """What churn asks of the node's pipeline links (``ravq.node.pipeline_links.PipelineLinks``)."""

    def replace(self, renamed: dict[str, str], cluster_nodes: Sequence[str]) -> None:
        """Standbys took over lost peers (``renamed``: old name -> new): link to them instead."""


PHASES = ("starting", "standby", "training", "paused", "catching_up", "finishing", "leaving")


class Churn:
    def __init__(self, *, name: str, topology: Topology, metrics: Metrics, membership: Membership,
                 report: NodeReport, fail: Callable[[str], None]) -> None:
        self.name, self.topology, self.metrics, self.membership = name, topology, metrics, membership
        self.report = report
        """What this node tells the broker (it stands by, it kept its own weights)."""
        self._fail = fail
        """Ends the node with a reason (``Node.fail``): this node was replaced, or waited too long."""
        self.generation = 0
        """The cluster generation this node works in; pipeline messages of any other are dropped."""
        self.phase = "starting"
        self.ready = -1
        """The last generation this node reported itself ready to resume in."""
        self.paused_since: float | None = None
        self.beat_now = asyncio.Event()
        """Set when the broker should hear from this node at once (a phase change)."""
        self.plan: Plan | None = None
        self.cluster = -1
        self._worker: StageWorker | None = None
        self._averager: Averager | None = None
        self._links: PipelineLinks | None = None
        self.caught_up_from: dict[str, int] | None = None
        """The holders (node -> version) this stage's weights were last loaded from (its lineage)."""
        self._export_phase()

    def _export_phase(self) -> None:
        """ravq_node_phase, from the first scrape on (every phase at 0 but the current one)."""
        for p in PHASES:
            self.metrics.node_phase.labels(p).set(float(p == self.phase))

    def attach(self, *, plan: Plan, cluster: int, worker: StageWorker, averager: Averager | None,
               links: PipelineLinks) -> None:
        """The node's stage is built: from now on pauses, catch-ups and replacements act on these."""
        self.plan, self.cluster = plan, cluster
        self._worker, self._averager, self._links = worker, averager, links
        worker.join_cluster(generation=self.generation, paused=self.phase == "paused",
                            cluster_done=self.stage0_finished)

    def current_plan(self) -> Plan:
        plan = self.membership.plan or self.plan
        assert plan is not None
        return plan

    def rejoin_if_running(self, state: dict[str, Any]) -> bool:
        """Join through recovery (``rejoin``) when the broker says this node's cluster is not starting;
        whether it did.  A node asks at registration and again once its stage is built: a restarted broker's
        book starts with every cluster ``starting`` and rebuilds it from the live members' heartbeats
        (``brokers.book.Book._adopt``), so a node whose REGISTER arrived first (the broker's PC rebooted
        with it) read ``starting`` of a cluster that runs on and, its restart noticed, is now paused.
        Waiting for everyone as at a first start would wait for reachability verdicts and registrations
        that live nodes never send again."""
        if state["state"] == "starting":
            return False
        self.rejoin(state)
        return True

    def rejoin(self, state: dict[str, Any]) -> None:
        """This node starts while its cluster is not starting (it restarted): join through recovery."""
        self.generation, self.paused_since = int(state["generation"]), time.monotonic()
        self.set_phase("paused")
        log.info("%s: cluster %d is %s (generation %d): rejoining", self.name, self.cluster, state["state"],
                 self.generation)

    def set_phase(self, phase: str) -> None:
        if phase != self.phase and self.phase != "leaving":  # a node that leaves stays leaving
            self.phase = phase
            self._export_phase()
            self.beat_now.set()  # the broker (and through it the cluster) should know at once

    def leave(self) -> None:
        """This node leaves the run (a signal while it goes on): tell the broker at once; from now on
        the cluster's pauses and resumptions are no longer this node's business."""
        self.set_phase("leaving")

    async def standby(self, memory_bytes: int) -> Plan:
        """Not in the plan: wait as a standby until the broker hands this node a lost node's stage."""
        self.set_phase("standby")
        self.report.standing_by(memory_bytes)
        log.info("%s: not in the plan; standing by (%.1f GiB usable) to replace a lost node", self.name,
                 memory_bytes / 2**30)
        while True:
            plan = await self.membership.poll_snapshot()
            if plan is not None and any(self.name in c.nodes for c in plan.clusters):
                cluster, stage = plan.locate(self.name)
                log.info("%s: the broker assigned this node stage %d of cluster %d", self.name, stage, cluster)
                return plan
            await asyncio.sleep(self.topology.timeouts.heartbeat_interval_s)

    def stage0_finished(self) -> bool:
        stage0 = self.current_plan().clusters[self.cluster].nodes[0]
        return self.membership.members.get(stage0) == "done" or self.membership.phases.get(stage0) in (
            "finishing", "done")

    async def follow_cluster(self) -> None:
        """React to the broker's view of this cluster: pause, catch up and report ready, resume."""
        while True:
            await self.membership.changed.wait()
            self.membership.changed.clear()
            plan = self.membership.plan
            if plan is not None:
                self._follow_replacements(plan)
                if self._averager is not None:
                    self._averager.on_plan(plan)
            await self._react(self.membership.cluster_state(self.cluster))

    def _follow_replacements(self, plan: Plan) -> None:
        """A standby took over a lost node's stage: link to it instead (pipeline and rings)."""
        assert self.plan is not None and self._links is not None
        renamed = {old: new for before, after in zip(self.plan.clusters, plan.clusters)
                   for old, new in zip(before.nodes, after.nodes) if old != new}
        if not renamed:
            return
        if self.name in renamed:  # this node was lost long enough to be replaced (a long freeze)
            self._fail(f"replaced by standby {renamed[self.name]}; restart to stand by")
            return
        self.plan = plan
        self._links.replace(renamed, plan.clusters[self.cluster].nodes)
        if self._averager is not None:
            self._averager.rename(renamed)
        log.info("%s: %s", self.name, ", ".join(f"{new} replaces {old}" for old, new in renamed.items()))

    async def _react(self, state: dict[str, Any]) -> None:
        if self.phase == "leaving":
            return
        generation = int(state.get("generation", 0))
        if generation > self.generation:
            await self._pause(generation, str(state.get("reason", "")))
        if generation != self.generation or self.phase in ("training", "finishing"):
            return  # an older generation: a restarted broker that has not heard from everyone yet
        if state.get("state") == "recovering" and self.ready < generation:
            source = state.get("source")
            await self._catch_up(bool(state.get("catchup")), source if isinstance(source, int) else None)
            self.ready = generation
            self.beat_now.set()
            log.info("%s: ready to resume (generation %d)", self.name, generation)
        elif state.get("state") == "training" and self.phase != "catching_up":
            trained = int(state.get("trained", 0))
            await self.in_compute(lambda w: w.resume(trained))
            self.metrics.pause_seconds.observe(time.monotonic() - (self.paused_since or time.monotonic()))
            self.paused_since = None
            self.set_phase("training")
            log.info("%s: training again (generation %d, from micro-batch %d)", self.name, generation, trained)

    async def _pause(self, generation: int, reason: str) -> None:
        """Drop the work in flight (kept: weights, optimizer, data cursor) and wait for the cluster."""
        worker = self._worker
        assert worker is not None
        log.warning("%s: cluster %d paused (generation %d): %s", self.name, self.cluster, generation, reason)
        self.generation = generation  # from now on messages of the old generation are dropped
        self.report.forget_kept()  # what this stage kept was said of the previous generation
        self.paused_since = self.paused_since or time.monotonic()
        self.set_phase("paused")
        self.metrics.pauses.inc()
        worker.pause()

        def reset(w: StageWorker) -> int:
            if self._averager is not None:
                self._averager.reset()
            return w.reset(generation)

        dropped = await self.in_compute(reset)
        self.metrics.dropped_micro_batches.inc(dropped)
        if dropped:
            log.info("%s: dropped %d micro-batch(es) in flight", self.name, dropped)

    async def in_compute(self, fn: Callable[[StageWorker], Any]) -> Any:
        """Run ``fn`` in the compute thread between two of its steps (now, if that thread is idle)."""
        if self._averager is not None:
            return await self._averager.in_compute(fn)
        worker = self._worker
        assert worker is not None
        box: list[Any] = []
        done = asyncio.Event()
        loop = asyncio.get_running_loop()

        def call(w: StageWorker) -> None:
            box.append(fn(w))
            loop.call_soon_threadsafe(done.set)

        if not worker.call(call):
            call(worker)
        await done.wait()
        return box[0]

    async def _catch_up(self, from_peers: bool, source: int | None = None) -> None:
        """Load this stage from live holders in another cluster (``source``: the freshest, as the broker
        chose) when the broker says so; else keep the weights held (a survivor's, or a restarted node's
        checkpoint or seed)."""
        if not from_peers or self._averager is None:
            return
        self.set_phase("catching_up")
        try:
            holders: dict[str, dict[str, Any]] = {}
            tensors = await self._averager.fetch_catchup(holders, source)
            own = {"run_id": self._averager.run_id, "version": self._worker.version if self._worker else 0}
            refused = older(own, holders)
            if refused is not None:  # weights only move forward: never replace newer state with older
                kept = f"kept its own weights (version {own['version']}): {refused}"
                self.report.kept(kept)
                log.warning("%s: %s", self.name, kept)
                return
            version = min(int(h["version"]) for h in holders.values())
            loaded = await self.in_compute(lambda w: _adopt(w, tensors, version))
            self.caught_up_from = {n: int(h["version"]) for n, h in holders.items()}
            self.metrics.version.set(version)
            log.info("%s: caught up from live peers (%d tensors, version %d -> %d)", self.name, loaded,
                     own["version"], version)
        except (CatchupError, TimeoutError) as err:
            kept = f"kept its own weights (version {self._worker.version if self._worker else 0}): catch-up failed"
            self.report.kept(kept)
            log.warning("%s: catch-up from peers failed (%s); %s", self.name, err, kept)
        finally:
            self.set_phase("paused")

    async def watch_paused(self) -> None:
        """Exit 1 after ``give_up_s`` paused (default: never); warn when a paused cluster waits long."""
        give_up = self.topology.timeouts.give_up_s
        warned = False
        while True:
            await asyncio.sleep(1.0)
            since = self.paused_since
            if since is None:
                warned = False
                continue
            waited = time.monotonic() - since
            if give_up is not None and waited > give_up:
                self.metrics.peer_timeouts.labels("pipeline", "give_up").inc()
                self._fail(f"cluster paused for {waited:.0f}s (give_up_s {give_up:g})")
                return
            if not warned and waited > self.topology.timeouts.peer_s:
                warned = True
                log.warning("%s: cluster paused for %.0fs; waiting for its lost member (or a standby)",
                            self.name, waited)


def _adopt(worker: StageWorker, tensors: dict[str, Any], version: int) -> int:
    """Compute thread: load a holder's copy and take its version with it (the weights' lineage)."""
    loaded = catchup_apply(worker, tensors)
    worker.adopt_version(version)
    return loaded
