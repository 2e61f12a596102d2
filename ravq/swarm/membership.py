"""A node's side of the broker protocol (ZeroMQ clone pattern).

Subscribe first, then register and take a snapshot; every published state update carries the broker's full
state, so any update newer than the state held (or from a restarted broker: a new incarnation) is
applied as it is, and the broker re-publishes every heartbeat interval, so a missed update costs at
most one interval.  Between those, the broker publishes each member's silence four times an interval
(no state change), so that a live member never looks silent for much more than its heartbeat
interval.  Heartbeats are sent without waiting and carry what the broker must know to
rebuild its book after a restart (this process's incarnation, its cluster generation and phase), so
a slow or restarting broker never stalls training.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import zmq.asyncio

from ravq.config import Plan, Topology
from ravq.metrics import Metrics
from ravq.net.options import SocketOptions, endpoint
from ravq.net.protocol import ReachRequest, Register
from ravq.net.pubsub import Subscriber
from ravq.net.transport import Outlink
from ravq.net.wire import DecodeLimits, Message, MsgType
from ravq.swarm.report import NodeReport, Progress

log = logging.getLogger(__name__)


class BrokerUnavailable(RuntimeError):
    pass


class Membership:
    def __init__(self, ctx: zmq.asyncio.Context, topology: Topology, name: str, metrics: Metrics,
                 limits: DecodeLimits, opts: SocketOptions, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.topology, self.name, self.metrics = topology, name, metrics
        self.clock = clock
        """What silences are read on (seconds; tests pass a virtual one)."""
        b = topology.broker
        self.sub = Subscriber.connect(ctx, endpoint(b.host, b.pub_port), metrics, limits, opts)
        self.link = Outlink.connect(ctx, endpoint(b.host, b.router_port), "broker", "broker", metrics, limits,
                                    opts, identity=name)
        self.seq = -1
        self.incarnation: str | None = None
        self.plan: Plan | None = None
        self.run_id: str | None = None
        """The broker's run id (checkpoints carry it)."""
        self.run_explicit = False
        """The broker's run was started with --new-run (checkpoints of older runs are set aside)."""
        self.checkpoints: dict[str, Any] = {}
        """What each member reported of its stage's checkpoints of this run (``ravq.swarm.resume``)."""
        self.members: dict[str, str] = {}
        self.phases: dict[str, str] = {}
        self._silent: dict[str, Any] = {}
        self._silent_at = clock()
        self.clusters: list[dict[str, Any]] = []
        """Per cluster: state (starting, training, paused, recovering, done), generation, trained, catchup."""
        self.changed = asyncio.Event()
        self.reach: dict[str, str] = {}
        """The broker's reachability verdicts: node -> ``reachable`` or ``behind_nat`` (issue #24)."""
        self.reach_ports: list[str] | None = None
        """The ports this node asked the broker to dial back (``wait_reach``); None before it asked."""
        self.report = NodeReport()
        """What every heartbeat tells the broker besides its progress and statistics."""

    def _apply_state(self, meta: dict[str, Any]) -> None:
        state = meta.get("state") or {}
        self.plan = Plan.model_validate(state["plan"])
        members = dict(state.get("members", {}))
        for node, member_state in members.items():
            before = self.members.get(node)
            if node != self.name and member_state != before and (member_state == "lost" or before == "lost"):
                if member_state == "lost":
                    log.warning("%s: the broker reports %s lost (no heartbeat for its timeout)", self.name, node)
                else:
                    log.info("%s: %s is back (%s)", self.name, node, member_state)
        self.members = members
        run_id = state.get("run_id") if isinstance(state.get("run_id"), str) else self.run_id
        if self.run_id is not None and run_id != self.run_id:
            log.warning("%s: the broker now runs %s, not %s (it restarted without broker.state_dir?): this node "
                        "goes on with its run's weights; a restarted node will refuse them", self.name, run_id,
                        self.run_id)
        self.run_id = run_id
        self.run_explicit = bool(state.get("run_explicit"))
        checkpoints = state.get("checkpoints")
        self.checkpoints = dict(checkpoints) if isinstance(checkpoints, dict) else {}
        silent = state.get("silent_s")
        self._silent = dict(silent) if isinstance(silent, dict) else {}
        self._silent_at = self.clock()
        self.phases = dict(state.get("phases", {}))
        reach = state.get("reach")
        self.reach = {str(k): str(v) for k, v in reach.items()} if isinstance(reach, dict) else {}
        clusters = state.get("clusters")
        self.clusters = list(clusters) if isinstance(clusters, list) else []
        self.seq = int(meta["seq"])
        self.incarnation = meta.get("incarnation")
        self.changed.set()

    def _apply_silence(self, meta: dict[str, Any]) -> None:
        """A silence update of the broker whose state this node follows (one of another incarnation
        waits for that broker's full state)."""
        silent = meta.get("silent_s")
        if meta.get("incarnation") != self.incarnation or not isinstance(silent, dict):
            return
        if not all(isinstance(v, (int, float)) for v in silent.values()):
            self.metrics.bad_messages.labels("broker", "bad_state").inc()
            return
        self._silent = dict(silent)
        self._silent_at = self.clock()

    def silent_s(self, node: str) -> float:
        """Seconds since ``node``'s last heartbeat reached the broker, as of the broker's latest state
        (counted on from then: with the broker away, everyone looks silent)."""
        seen = self._silent.get(node)
        return (float(seen) if isinstance(seen, (int, float)) else 0.0) + self.clock() - self._silent_at

    def cluster_state(self, cluster: int) -> dict[str, Any]:
        """The broker's view of one cluster (``starting`` until the broker said otherwise)."""
        if 0 <= cluster < len(self.clusters) and isinstance(self.clusters[cluster], dict):
            return self.clusters[cluster]
        return {"state": "starting", "generation": 0, "trained": 0, "catchup": False, "reason": ""}

    def current_plan(self) -> Plan:
        """The broker's plan now (this node joined: it has one)."""
        assert self.plan is not None
        return self.plan

    def disrupted(self) -> bool:
        """Whether a cluster of the run was ever disrupted (its generation rose), as the broker last said."""
        return any(isinstance(c, dict) and c.get("generation", 0) > 0 for c in self.clusters)

    async def _request(self, kind: MsgType, timeout_s: float) -> Message:
        meta = Register(incarnation=self.report.incarnation).meta() if kind == MsgType.REGISTER else {}
        await self.link.send(Message(type=kind, sender=self.name, meta=meta))
        while True:
            reply = await self.link.recv(timeout_s)
            if reply.type == MsgType.SNAPSHOT:
                return reply

    async def join(self) -> Plan:
        """Register with the broker, retrying until ``timeouts.connect_s``; return the plan."""
        t = self.topology.timeouts
        deadline = time.monotonic() + t.connect_s
        while True:
            try:
                reply = await self._request(MsgType.REGISTER, t.request_s)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise BrokerUnavailable(
                        f"no answer from the broker at {self.topology.broker.host}:"
                        f"{self.topology.broker.router_port} within {t.connect_s:.0f}s") from None
                log.info("%s: broker not answering yet; retrying", self.name)
        self._apply_state(reply.meta)
        assert self.plan is not None
        return self.plan

    async def wait_for(self, names: list[str], timeout_s: float) -> None:
        """Wait until every named node has registered (polling snapshots)."""
        deadline = time.monotonic() + timeout_s
        while True:
            missing = [n for n in names if self.members.get(n) not in ("up", "done")]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes never joined within {timeout_s:.0f}s: {', '.join(missing)}")
            await asyncio.sleep(0.2)
            try:
                self._apply_state((await self._request(MsgType.SNAPSHOT_REQ, self.topology.timeouts.request_s)).meta)
            except TimeoutError:
                continue

    async def wait_reach(self, names: list[str], ports: list[str], timeout_s: float) -> dict[str, bool]:
        """Ask the broker to dial this node's ``ports`` back, and wait until it has a verdict for every
        named node (this one among them); returns node -> reachable."""
        deadline = time.monotonic() + timeout_s
        self.reach_ports = ports
        while True:
            if self.name not in self.reach:
                await self._ask_reach(ports)
            missing = [n for n in names if n not in self.reach]
            if not missing:
                return {n: v == "reachable" for n, v in self.reach.items()}
            if time.monotonic() > deadline:
                raise TimeoutError(f"no reachability verdict within {timeout_s:.0f}s for: {', '.join(missing)}")
            await asyncio.sleep(0.2)
            with contextlib.suppress(TimeoutError):
                self._apply_state((await self._request(MsgType.SNAPSHOT_REQ, self.topology.timeouts.request_s)).meta)

    async def poll_snapshot(self) -> Plan | None:
        """One snapshot (None if the broker does not answer in time); applies it and returns its plan."""
        try:
            self._apply_state((await self._request(MsgType.SNAPSHOT_REQ, self.topology.timeouts.request_s)).meta)
        except TimeoutError:
            return None
        return self.plan

    async def follow(self) -> None:
        """Apply published updates for as long as the node runs (each state update carries the full
        state; silence updates carry only how long each member has been silent)."""
        while True:
            msg = await self.sub.recv()
            if msg.type == MsgType.UPDATE and msg.meta.get("kind") == "silence":
                self._apply_silence(msg.meta)
                continue
            if msg.type != MsgType.UPDATE or not isinstance(msg.meta.get("state"), dict):
                continue
            seq, incarnation = int(msg.meta["seq"]), msg.meta.get("incarnation")
            if incarnation == self.incarnation and seq <= self.seq:
                continue
            if incarnation != self.incarnation:
                log.info("%s: broker %s (was %s): following its state", self.name, incarnation, self.incarnation)
            try:
                self._apply_state(msg.meta)
            except (KeyError, ValueError):
                self.metrics.bad_messages.labels("broker", "bad_state").inc()

    async def _ask_reach(self, ports: list[str]) -> None:
        await self.link.send(Message(type=MsgType.REACH_REQ, sender=self.name, meta=ReachRequest(ports=ports).meta()))

    async def heartbeat(self, progress: Progress, stats: dict[str, Any], *, done: bool) -> None:
        """A heartbeat; and the reachability request again while the broker's state has no verdict on this node
        after it asked: a restarted broker knows none, and a whole cluster that restarts with it waits at
        its first start for every member's verdict (it stayed ``starting`` until ``connect_s``)."""
        beat = self.report.heartbeat(progress, stats, done=done)
        await self.link.send(Message(type=MsgType.HEARTBEAT, sender=self.name, meta=beat.meta()))
        if self.reach_ports is not None and self.name not in self.reach:
            await self._ask_reach(self.reach_ports)

    def close(self) -> None:
        self.sub.close()
        self.link.close()


async def beat_on_cadence(beat: Callable[[], Awaitable[None]], interval_s: float, beat_now: asyncio.Event) -> None:
    """Call ``beat`` every ``interval_s`` on a fixed cadence, and once at once whenever ``beat_now`` is set
    (that extra beat does not move the cadence).  Sleeping a whole interval after each beat stretched the
    period by the beat's own time, which on a PC of a seventh of a core (statistics, encoding, CURVE, an
    event loop sharing the CPU with the compute thread) made the node read as silent to its ring peers
    (``Averager.hold_s``)."""
    loop = asyncio.get_running_loop()
    due, early = loop.time(), False
    while True:
        await beat()
        beat_now.clear()
        if not early:  # the regular beat: the next one is due an interval after it was
            due = max(due + interval_s, loop.time())
        early = False
        # (not asyncio.wait_for: on 3.11 it can swallow a cancellation that meets the event being set,
        # and the TaskGroup would then wait for this task forever)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(due):
                await beat_now.wait()
                early = True
