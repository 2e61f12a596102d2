"""A node's side of churn: follow its cluster's state, pause, catch up, resume.

The node follows its cluster's state as the broker publishes it (``brokers.book``).  When a member is
lost or restarts, the cluster's generation rises: the node pauses (its stage drops the work in flight
and keeps weights and optimizer), and once every member is up again it catches up (from live holders
in other clusters when the broker says so) and reports ready; when all are ready the broker lets the
cluster train again.  (A node the plan leaves idle stands by first: ``ravq.swarm.standing.stand_by``.)

``Churn`` moves the node's standing along (``ravq.swarm.standing.Standing``: generation, phase,
readiness, how long the cluster has been paused); the node builds it once its stage is built
(``ravq.node.root``).  It reads the broker's state through ``BrokerView`` and acts on the stage, the
averager and the pipeline links only through their methods.
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
from ravq.swarm.report import NodeReport
from ravq.swarm.standing import Standing

log = logging.getLogger(__name__)


class PipelineLinks(Protocol):
    """What churn asks of the node's pipeline links (``ravq.node.pipeline_links.StageLinks``)."""

    def replace(self, renamed: dict[str, str], cluster_nodes: Sequence[str]) -> None:
        """Standbys took over lost peers (``renamed``: old name -> new): link to them instead."""


class BrokerView(Protocol):
    """The broker's state as the node follows it (``ravq.swarm.membership.MembershipState``)."""

    @property
    def plan(self) -> Plan | None:
        """The plan now (None before the node joined)."""

    @property
    def changed(self) -> asyncio.Event:
        """Set whenever a new state arrived."""

    @property
    def members(self) -> dict[str, str]:
        """Each node's state: missing, up, lost, left or done."""

    @property
    def phases(self) -> dict[str, str]:
        """What each node says it is doing."""

    def cluster_state(self, cluster: int) -> dict[str, Any]:
        """The broker's view of one cluster (state, generation, trained, catchup, source, reason)."""


class Churn:
    def __init__(self, *, name: str, topology: Topology, metrics: Metrics, broker: BrokerView,
                 report: NodeReport, standing: Standing, cluster: int, linked: Plan, worker: StageWorker,
                 averager: Averager | None, links: PipelineLinks, fail: Callable[[str], None]) -> None:
        """The node's stage is built: from now on pauses, catch-ups and replacements act on ``worker``,
        ``averager`` and ``links`` (opened along ``linked``'s cluster)."""
        self.name, self.topology, self.metrics, self.broker = name, topology, metrics, broker
        self.report = report
        """What this node tells the broker (it kept its own weights)."""
        self.standing = standing
        """Where this node stands (phase, generation, readiness): churn moves it along."""
        self.cluster = cluster
        self._fail = fail
        """Ends the node with a reason (``Node.fail``): this node was replaced, or waited too long."""
        self._linked = linked
        """The plan whose nodes the links point at, to tell a replacement (the broker's view owns the
        plan)."""
        self._worker, self._averager, self._links = worker, averager, links
        self.caught_up_from: dict[str, int] | None = None
        """The holders (node -> version) this stage's weights were last loaded from (its lineage)."""
        worker.join_cluster(generation=standing.generation, paused=standing.phase == "paused",
                            cluster_done=self.stage0_finished)

    def current_plan(self) -> Plan:
        plan = self.broker.plan
        assert plan is not None  # the node joined before its stage was built
        return plan

    def stage0_finished(self) -> bool:
        stage0 = self.current_plan().clusters[self.cluster].nodes[0]
        return self.broker.members.get(stage0) == "done" or self.broker.phases.get(stage0) in (
            "finishing", "done")

    async def follow_cluster(self) -> None:
        """React to the broker's view of this cluster: pause, catch up and report ready, resume."""
        while True:
            await self.broker.changed.wait()
            self.broker.changed.clear()
            plan = self.broker.plan
            if plan is not None:
                self._follow_replacements(plan)
                if self._averager is not None:
                    self._averager.on_plan(plan)
            await self._react(self.broker.cluster_state(self.cluster))

    def _follow_replacements(self, plan: Plan) -> None:
        """A standby took over a lost node's stage: link to it instead (pipeline and rings)."""
        renamed = {old: new for before, after in zip(self._linked.clusters, plan.clusters)
                   for old, new in zip(before.nodes, after.nodes) if old != new}
        if not renamed:
            return
        if self.name in renamed:  # this node was lost long enough to be replaced (a long freeze)
            self._fail(f"replaced by standby {renamed[self.name]}; restart to stand by")
            return
        self._linked = plan
        self._links.replace(renamed, plan.clusters[self.cluster].nodes)
        if self._averager is not None:
            self._averager.rename(renamed)
        log.info("%s: %s", self.name, ", ".join(f"{new} replaces {old}" for old, new in renamed.items()))

    async def _react(self, state: dict[str, Any]) -> None:
        standing = self.standing
        if standing.phase == "leaving":
            return
        generation = int(state.get("generation", 0))
        if generation > standing.generation:
            await self._pause(generation, str(state.get("reason", "")))
        if generation != standing.generation or standing.phase in ("training", "finishing"):
            return  # an older generation: a restarted broker that has not heard from everyone yet
        if state.get("state") == "recovering" and standing.ready < generation:
            source = state.get("source")
            await self._catch_up(bool(state.get("catchup")), source if isinstance(source, int) else None)
            standing.ready_in(generation)
            log.info("%s: ready to resume (generation %d)", self.name, generation)
        elif state.get("state") == "training" and standing.phase != "catching_up":
            trained = int(state.get("trained", 0))
            await self.in_compute(lambda w: w.resume(trained))
            self.metrics.pause_seconds.observe(standing.resumed())
            log.info("%s: training again (generation %d, from micro-batch %d)", self.name, generation,
                     trained)

    async def _pause(self, generation: int, reason: str) -> None:
        """Drop the work in flight (kept: weights, optimizer, data cursor) and wait for the cluster."""
        worker = self._worker
        log.warning("%s: cluster %d paused (generation %d): %s", self.name, self.cluster, generation, reason)
        self.standing.pause(generation)  # from now on messages of the old generation are dropped
        self.report.forget_kept()  # what this stage kept was said of the previous generation
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
        self.standing.set_phase("catching_up")
        try:
            holders: dict[str, dict[str, Any]] = {}
            tensors = await self._averager.fetch_catchup(holders, source)
            own = {"run_id": self._averager.run_id, "version": self._worker.version}
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
            kept = f"kept its own weights (version {self._worker.version}): catch-up failed"
            self.report.kept(kept)
            log.warning("%s: catch-up from peers failed (%s); %s", self.name, err, kept)
        finally:
            self.standing.set_phase("paused")

    async def watch_paused(self) -> None:
        """Exit 1 after ``give_up_s`` paused (default: never); warn when a paused cluster waits long."""
        give_up = self.topology.timeouts.give_up_s
        warned = False
        while True:
            await asyncio.sleep(1.0)
            since = self.standing.paused_since
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
