"""A node's side of churn: follow its cluster's state, pause, catch up, resume; stand by.

The node follows its cluster's state as the broker publishes it (``brokers.book``).  When a member is
lost or restarts, the cluster's generation rises: the node pauses (its stage drops the work in flight
and keeps weights and optimizer), and once every member is up again it catches up (from live holders
in other clusters when the broker says so) and reports ready; when all are ready the broker lets the
cluster train again.  A node the plan leaves idle stands by until the broker hands it a lost node's
stage.  ``ChurnMixin`` is part of ``ravq.node.Node``; it only uses the node's own attributes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from ravq.average.catchup import CatchupError
from ravq.average.catchup import apply_tensors as catchup_apply
from ravq.config import Plan
from ravq.stage.pipeline import StageWorker
from ravq.net.transport import Outlink, endpoint

if TYPE_CHECKING:
    from ravq.average.averager import Averager
    from ravq.config import NodeConfig, Topology
    from ravq.swarm.membership import Membership
    from ravq.metrics import Metrics
    from ravq.net.security import SocketOptions
    from ravq.net.wire import DecodeLimits

log = logging.getLogger(__name__)


class ChurnMixin:
    # the node's attributes used here (set by ravq.node.Node)
    name: str
    topology: Topology
    config: NodeConfig
    metrics: Metrics
    membership: Membership
    worker: StageWorker | None
    averager: Averager | None
    plan: Plan | None
    cluster: int
    generation: int
    phase: str
    ready: int
    failure: str | None
    links: dict[int, Outlink]
    stage_of: dict[str, int]
    limits: DecodeLimits
    sock_opts: SocketOptions
    ctx: Any
    _paused_since: float | None
    _beat_now: asyncio.Event
    _force: asyncio.Event

    def _current_plan(self) -> Plan:
        return self.membership.plan or self.plan  # type: ignore[return-value]

    async def _standby(self) -> Plan:
        """Not in the plan: wait as a standby until the broker hands this node a lost node's stage."""
        self._set_phase("standby")
        self.membership.report["memory_bytes"] = self._memory_bytes()
        log.info("%s: not in the plan; standing by (%.1f GiB usable) to replace a lost node", self.name,
                 self.membership.report["memory_bytes"] / 2**30)
        while True:
            plan = await self.membership.poll_snapshot()
            if plan is not None and any(self.name in c.nodes for c in plan.clusters):
                log.info("%s: the broker assigned this node stage %d of cluster %d", self.name,
                         plan.locate(self.name)[1], plan.locate(self.name)[0])
                return plan
            await asyncio.sleep(self.topology.timeouts.heartbeat_interval_s)

    def _memory_bytes(self) -> int:
        if self.config.memory_bytes is not None:
            return self.config.memory_bytes
        from ravq.profile.measure import usable_memory_bytes
        return usable_memory_bytes(self.config.device)

    def _stage0_finished(self) -> bool:
        plan = self._current_plan()
        stage0 = plan.clusters[self.cluster].nodes[0]
        return self.membership.members.get(stage0) == "done" or self.membership.phases.get(stage0) in (
            "finishing", "done")

    def _set_phase(self, phase: str) -> None:
        if phase != self.phase:
            self.phase = phase
            for p in ("training", "paused", "catching_up", "finishing"):
                self.metrics.node_phase.labels(p).set(float(p == phase))
            self._beat_now.set()  # the broker (and through it the cluster) should know at once

    async def _follow_cluster(self) -> None:
        """React to the broker's view of this cluster: pause, catch up and report ready, resume."""
        while True:
            await self.membership.changed.wait()
            self.membership.changed.clear()
            plan = self.membership.plan
            if plan is not None:
                self._follow_replacements(plan)
                if self.averager is not None:
                    self.averager.on_plan(plan)
            await self._react(self.membership.cluster_state(self.cluster))

    def _follow_replacements(self, plan: Plan) -> None:
        """A standby took over a lost node's stage: link to it instead (pipeline and rings)."""
        assert self.plan is not None
        renamed = {old: new for before, after in zip(self.plan.clusters, plan.clusters)
                   for old, new in zip(before.nodes, after.nodes) if old != new}
        if not renamed:
            return
        if self.name in renamed:  # this node was lost long enough to be replaced (a long freeze)
            self.failure = f"replaced by standby {renamed[self.name]}; restart to stand by"
            log.warning("%s: %s", self.name, self.failure)
            self._force.set()
            return
        self.plan = plan
        cluster = plan.clusters[self.cluster]
        self.stage_of = {n: i for i, n in enumerate(cluster.nodes)}
        for s, link in list(self.links.items()):
            if link.peer in renamed:
                link.close()
                peer = self.topology.node(cluster.nodes[s])
                self.links[s] = Outlink.connect(self.ctx, endpoint(peer.host, peer.pipeline_port), "pipeline",
                                                peer.name, self.metrics, self.limits, self.sock_opts,
                                                identity=self.name)
        if self.averager is not None:
            self.averager.rename(renamed)
        log.info("%s: %s", self.name, ", ".join(f"{new} replaces {old}" for old, new in renamed.items()))

    async def _react(self, state: dict[str, Any]) -> None:
        assert self.worker is not None
        generation = int(state.get("generation", 0))
        if generation > self.generation:
            await self._pause(generation, str(state.get("reason", "")))
        if generation != self.generation or self.phase in ("training", "finishing"):
            return  # an older generation: a restarted broker that has not heard from everyone yet
        if state.get("state") == "recovering" and self.ready < generation:
            await self._catch_up(bool(state.get("catchup")))
            self.ready = generation
            self._beat_now.set()
            log.info("%s: ready to resume (generation %d)", self.name, generation)
        elif state.get("state") == "training" and self.phase != "catching_up":
            trained = int(state.get("trained", 0))
            await self._in_compute(lambda w: w.resume(trained))
            self.metrics.pause_seconds.observe(time.monotonic() - (self._paused_since or time.monotonic()))
            self._paused_since = None
            self._set_phase("training")
            log.info("%s: training again (generation %d, from micro-batch %d)", self.name, generation, trained)

    async def _pause(self, generation: int, reason: str) -> None:
        """Drop the work in flight (kept: weights, optimizer, data cursor) and wait for the cluster."""
        worker = self.worker
        assert worker is not None
        log.warning("%s: cluster %d paused (generation %d): %s", self.name, self.cluster, generation, reason)
        self.generation = generation  # from now on messages of the old generation are dropped
        self._paused_since = self._paused_since or time.monotonic()
        self._set_phase("paused")
        self.metrics.pauses.inc()
        worker.pause()

        def reset(w: StageWorker) -> int:
            if self.averager is not None:
                self.averager.reset()
            return w.reset(generation)

        dropped = await self._in_compute(reset)
        self.metrics.dropped_micro_batches.inc(dropped)
        if dropped:
            log.info("%s: dropped %d micro-batch(es) in flight", self.name, dropped)

    async def _in_compute(self, fn: Any) -> Any:
        if self.averager is not None:
            return await self.averager.in_compute(fn)
        assert self.worker is not None
        box: list[Any] = []
        done = asyncio.Event()
        loop = asyncio.get_running_loop()

        def call(w: StageWorker) -> None:
            box.append(fn(w))
            loop.call_soon_threadsafe(done.set)

        if not self.worker.call(call):
            call(self.worker)
        await done.wait()
        return box[0]

    async def _catch_up(self, from_peers: bool) -> None:
        """Load this stage from live holders in another cluster when the broker says so; else keep the
        weights held (a survivor's, or a restarted node's checkpoint or seed)."""
        if not from_peers or self.averager is None:
            return
        self._set_phase("catching_up")
        try:
            tensors = await self.averager.fetch_catchup()
            loaded = await self._in_compute(lambda w: catchup_apply(w, tensors))
            log.info("%s: caught up from live peers (%d tensors)", self.name, loaded)
        except (CatchupError, TimeoutError) as err:
            log.warning("%s: catch-up from peers failed (%s); keeping the weights held", self.name, err)
        finally:
            self._set_phase("paused")

    async def _watch_paused(self) -> None:
        """Exit 1 after ``give_up_s`` paused (default: never); warn when a paused cluster waits long."""
        give_up = self.topology.timeouts.give_up_s
        warned = False
        while True:
            await asyncio.sleep(1.0)
            since = self._paused_since
            if since is None:
                warned = False
                continue
            waited = time.monotonic() - since
            if give_up is not None and waited > give_up:
                self.failure = f"cluster paused for {waited:.0f}s (give_up_s {give_up:g})"
                log.error("%s: %s; giving up", self.name, self.failure)
                self.metrics.peer_timeouts.labels("pipeline", "give_up").inc()
                self._force.set()
                return
            if not warned and waited > self.topology.timeouts.peer_s:
                warned = True
                log.warning("%s: cluster paused for %.0fs; waiting for its lost member (or a standby)",
                            self.name, waited)

