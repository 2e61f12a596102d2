"""A node's side of the broker protocol (ZeroMQ clone pattern): its sockets to the broker.

Subscribe first (to the global topic), then register: the reply is a snapshot in parts; then follow
the node's own cluster's topic too, and apply every published update to the broker's state as this node
holds it (``ravq.swarm.membership.MembershipState``, which this client is).  An update that shows a gap,
comes from another broker process or was dropped for its size makes the node fetch a snapshot of its
topics (one request at a time on the broker link).  Heartbeats (``ravq.net.protocol.Heartbeat``) are
sent without waiting and carry what the broker must know to rebuild its book after a restart (this
process's incarnation, its cluster generation and phase), so a slow or restarting broker never stalls
training.

With a backup broker (``broker.backup``, ZeroMQ's Binary Star: ``brokers.binarystar``) the node follows
both brokers' PUBs (only the active one publishes) and keeps a link to each; it talks to the one whose
updates it hears (each says ``by``: its role and term), and turns to the other once the one it talks to has
been silent for ``TURN_AFTER`` heartbeat intervals: its heartbeats there are its vote for a failover.  A
passive broker answers a request it does not serve with ``passive`` and the node turns back at once.  A
broker of an older term than the node has seen (an active one cut off from everyone while the other took
over, before it hears the other and turns passive) is neither followed nor asked.  A node registering
turns at once to the broker it hears publish while the one it asked is silent (restarted while the
primary is dead, it waited ``TURN_AFTER`` intervals for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import zmq.asyncio

from ravq.config import Plan, Topology
from ravq.metrics import Metrics
from ravq.net.clone import GLOBAL, TICK_INTERVALS, SnapshotParts
from ravq.net.options import SocketOptions, endpoint
from ravq.net.protocol import ReachRequest, Register, SnapshotRequest
from ravq.net.pubsub import Subscriber
from ravq.net.transport import Outlink
from ravq.net.wire import DecodeLimits, Message, MsgType
from ravq.swarm.membership import MembershipState
from ravq.swarm.report import NodeReport, Progress

log = logging.getLogger("ravq.swarm.membership")  # the lines it always logged


TURN_AFTER = 2.5
"""Heartbeat intervals of silence from the broker after which a node turns to the other one of a pair: past
the two after which a passive broker counts its peer lost (``brokers.pair.EXPIRY``), so the first
heartbeat there is a vote it accepts."""
BROKERS = ("primary", "backup")
"""The pair's brokers, as updates name their sender (``by``); a broker alone is the primary."""


class BrokerUnavailable(RuntimeError):
    pass


class BrokerPassive(TimeoutError):
    """The broker asked is the passive one of a pair: ask the other."""


class Membership(MembershipState):
    def __init__(self, ctx: zmq.asyncio.Context, topology: Topology, name: str, metrics: Metrics,
                 limits: DecodeLimits, opts: SocketOptions, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(name=name, metrics=metrics, clock=clock,
                         tick_s=TICK_INTERVALS * topology.timeouts.heartbeat_interval_s)
        self.topology = topology
        b = topology.broker
        self.sub = Subscriber.connect(ctx, endpoint(b.host, b.pub_port), metrics, limits, opts, [GLOBAL])
        self.links = [Outlink.connect(ctx, endpoint(b.host, b.router_port), "broker", "broker", metrics,
                                      limits, opts, identity=name)]
        """A link to each broker: the primary's, and the backup's when the topology names one."""
        if b.backup is not None:
            self.sub.sock.connect(endpoint(b.backup.host, b.backup.pub_port))
            self.links.append(Outlink.connect(ctx, endpoint(b.backup.host, b.backup.router_port), "broker",
                                              "broker", metrics, limits, opts, identity=name))
        self.on = 0
        """The broker this node talks to (0: the primary, 1: the backup)."""
        self.term = 0
        """The newest term of activity of a pair's broker this node has seen (``brokers.binarystar``)."""
        self._term_heard_at = clock()
        self._turned_at = clock()
        self.reach_ports: list[str] | None = None
        """The ports this node asked the broker to dial back (``wait_reach``); None before it asked."""
        self.report = NodeReport()
        """What every heartbeat tells the broker besides its progress and statistics."""
        self._asking = asyncio.Lock()
        """One snapshot request at a time on the link (following, polling and joining all ask)."""
        self._oversized = 0

    @property
    def link(self) -> Outlink:
        return self.links[self.on]

    def _turn(self, to: int, why: str, level: int = logging.WARNING) -> None:
        if to != self.on and to < len(self.links):
            log.log(level, "%s: turning to the %s broker (%s)", self.name, BROKERS[to], why)
            self.on, self._turned_at = to, self.clock()

    def _stale(self, meta: dict[str, Any]) -> bool:
        """Whether ``meta`` comes from a broker of an older term than the one this node heard within
        ``TURN_AFTER`` intervals (else its term is the one this node follows now: after both brokers
        restarted, terms start again)."""
        by = meta.get("by")
        term = by.get("term") if isinstance(by, dict) else None
        if not isinstance(term, int):
            return False
        now, after_s = self.clock(), TURN_AFTER * self.topology.timeouts.heartbeat_interval_s
        if term < self.term and now - self._term_heard_at < after_s:
            return True
        self.term, self._term_heard_at = term, now
        return False

    def _turn_if_silent(self) -> None:
        """The broker this node talks to has been silent for ``TURN_AFTER`` intervals: try the other."""
        after_s = TURN_AFTER * self.topology.timeouts.heartbeat_interval_s
        now = self.clock()
        if len(self.links) > 1 and now - self._heard_at > after_s and now - self._turned_at > after_s:
            self._turn(1 - self.on, f"no word from the {BROKERS[self.on]} for {now - self._heard_at:.1f}s")

    async def _request(self, kind: MsgType, meta: dict[str, Any], timeout_s: float, *,
                       hear: bool = False) -> list[dict[str, Any]]:
        """Send a REGISTER or SNAPSHOT_REQ and return the snapshot's parts (a part of an earlier snapshot, one
        whose request timed out, is passed over).  ``hear`` (before ``follow`` reads the PUBs): in a pair,
        ask the other broker at once when it is heard publishing while this one does not answer."""
        async with self._asking:
            await self.link.send(Message(type=kind, sender=self.name, meta=meta))
            parts = SnapshotParts()
            while True:
                try:
                    if hear and len(self.links) > 1:
                        reply = await self._reply_or_publisher(timeout_s)
                    else:
                        reply = await self.link.recv(timeout_s)
                except TimeoutError:
                    self._turn(1 - self.on, "no reply")
                    raise
                if reply is None:  # the other broker publishes: it is active, ask it
                    await self.link.send(Message(type=kind, sender=self.name, meta=meta))
                    parts = SnapshotParts()
                    continue
                if reply.type == MsgType.REPLY and reply.meta.get("passive") or self._stale(reply.meta):
                    self._turn(1 - self.on, f"the {BROKERS[self.on]} is passive", logging.INFO)
                    await asyncio.sleep(self.topology.timeouts.heartbeat_interval_s / 4)
                    raise BrokerPassive(f"the {BROKERS[1 - self.on]} broker is passive")
                if reply.type == MsgType.SNAPSHOT and (whole := parts.add(reply.meta)) is not None:
                    return whole

    async def _reply_or_publisher(self, timeout_s: float) -> Message | None:
        """The reply on the link to the broker asked, or None once the other broker of the pair is heard
        publishing (only the active one does; this node now talks to it).  A node that starts while the
        primary is dead asked it first and waited out ``TURN_AFTER`` intervals before it asked the backup
        (bench_failover: its cluster's rejoin took that much longer).  The updates read here precede the
        snapshot asked for, which holds them; TimeoutError after ``timeout_s``."""
        poller = zmq.asyncio.Poller()
        poller.register(self.link.sock, zmq.POLLIN)
        poller.register(self.sub.sock, zmq.POLLIN)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (remaining := deadline - loop.time()) > 0:
            ready = dict(await poller.poll(remaining * 1000))
            if self.link.sock in ready:
                return await self.link.recv(max(0.0, deadline - loop.time()))
            if self.sub.sock not in ready:
                continue
            async with asyncio.timeout_at(deadline):  # (one it cannot decode is skipped: wait no longer)
                msg = await self.sub.recv()
            by = msg.meta.get("by")
            if msg.type != MsgType.UPDATE or not isinstance(by, dict) or by.get("role") not in BROKERS:
                continue
            if not self._stale(msg.meta) and BROKERS.index(by["role"]) != self.on:
                self._turn(BROKERS.index(by["role"]), "it publishes", logging.INFO)
                return None
        raise TimeoutError(f"no reply from the {BROKERS[self.on]} broker within {timeout_s:.1f}s")

    async def _snapshot(self, *, mine: bool = False) -> None:
        """Ask for the broker's state (``mine``: only this node's topics) and apply it (TimeoutError after
        ``timeouts.request_s``)."""
        meta = SnapshotRequest(mine=mine).meta()
        self.apply_snapshot(await self._request(MsgType.SNAPSHOT_REQ, meta, self.topology.timeouts.request_s))
        self._follow_topics()

    def _follow_topics(self) -> bool:
        """Subscribe to this node's topics as the plan now places it (a standby that took a stage follows
        its new cluster's), and leave the others; True when it follows a topic it holds no number of (its
        state comes with a snapshot)."""
        wanted = self.topics()
        for topic in wanted - self.sub.topics:
            self.sub.subscribe(topic)
        for topic in self.sub.topics - wanted:
            self.sub.unsubscribe(topic)
        return not wanted <= self.seqs.keys()

    async def join(self) -> Plan:
        """Register with the broker, retrying until ``timeouts.connect_s``; return the plan."""
        t = self.topology.timeouts
        deadline = time.monotonic() + t.connect_s
        wait_s = t.request_s  # in a pair, a broker silent for TURN_AFTER intervals may be dead: try the other
        if len(self.links) > 1:
            wait_s = min(wait_s, TURN_AFTER * t.heartbeat_interval_s)
        while True:
            try:
                register = Register(incarnation=self.report.incarnation)
                parts = await self._request(MsgType.REGISTER, register.meta(), wait_s, hear=True)
                break
            except TimeoutError as err:
                if time.monotonic() > deadline:
                    raise BrokerUnavailable(
                        f"no answer from the broker at {self.topology.broker.host}:"
                        f"{self.topology.broker.router_port} within {t.connect_s:.0f}s") from None
                if not isinstance(err, BrokerPassive):  # a pair that is starting: no line per turn
                    log.info("%s: broker not answering yet; retrying", self.name)
        self.apply_snapshot(parts)
        self._follow_topics()
        assert self.plan is not None
        return self.plan

    async def wait_for(self, names: list[str], timeout_s: float) -> None:
        """Wait until every named node has registered: this node's cluster's as its topic shows them, or
        every node of the plan once the broker's ``start`` flag says so (``follow`` applies both as they
        come; polling whole snapshots, every node five times a second, was O(N^2) bytes at a start)."""
        deadline = time.monotonic() + timeout_s
        while True:
            missing = [n for n in names if self.members.get(n) not in ("up", "done")]
            if not missing or self.start.get("up"):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes never joined within {timeout_s:.0f}s: {', '.join(missing)}")
            await asyncio.sleep(0.2)

    async def wait_reach(self, names: list[str], ports: list[str], timeout_s: float,
                         others: Collection[str] = ()) -> dict[str, bool]:
        """Ask the broker to dial this node's ``ports`` back, and wait until it has a verdict for every
        named node (this one among them: its cluster's come on its topic, the others' with one whole
        snapshot once the broker's ``start`` flag says every node of the plan has one); returns node ->
        reachable.  ``others``: nodes it will link to without waiting for them (a rejoining node's peers,
        some of which may be gone): their verdicts, on other clusters' topics, come with one whole snapshot
        when this node lacks any (a restarted node behind NAT dialled its relayed ring peers directly)."""
        deadline = time.monotonic() + timeout_s
        self.reach_ports = ports
        while True:
            if self.name not in self.reach:
                await self._ask_reach(ports)
            missing = [n for n in names if n not in self.reach]
            if not missing:
                if any(n not in self.reach for n in others):
                    with contextlib.suppress(TimeoutError):
                        await self._snapshot()
                return {n: v == "reachable" for n, v in self.reach.items()}
            if time.monotonic() > deadline:
                raise TimeoutError(f"no reachability verdict within {timeout_s:.0f}s for: "
                                   f"{', '.join(missing)}")
            await asyncio.sleep(0.2)
            if self.start.get("reached"):
                with contextlib.suppress(TimeoutError):
                    await self._snapshot()

    async def poll_snapshot(self) -> Plan | None:
        """One snapshot (None if the broker does not answer in time); applies it and returns its plan."""
        try:
            await self._snapshot()
        except TimeoutError:
            return None
        return self.plan

    async def follow(self) -> None:
        """Apply published updates for as long as the node runs; on a gap (or an update dropped for its size,
        or another broker process) fetch a snapshot of this node's topics, until one arrives."""
        behind = False
        while True:
            msg = await self.sub.recv()
            if msg.type != MsgType.UPDATE:
                continue
            if self._stale(msg.meta):
                continue
            by = msg.meta.get("by")
            if isinstance(by, dict) and by.get("role") in BROKERS:  # the active broker: talk to it
                self._turn(BROKERS.index(by["role"]), "it publishes")
            try:
                behind |= not self.apply_update(msg.meta)
            except (KeyError, TypeError, ValueError):
                self.metrics.bad_messages.labels("broker", "bad_state").inc()
                behind = True
            if self.sub.oversized != self._oversized:
                self._oversized, behind = self.sub.oversized, True
            if behind or self._follow_topics():
                with contextlib.suppress(TimeoutError):
                    await self._snapshot(mine=True)
                    behind = False

    async def _ask_reach(self, ports: list[str]) -> None:
        request = ReachRequest(ports=ports)
        await self.link.send(Message(type=MsgType.REACH_REQ, sender=self.name, meta=request.meta()))

    async def heartbeat(self, progress: Progress, stats: dict[str, Any], *, done: bool) -> None:
        """A heartbeat; and the reachability request again while the broker's state has no verdict on this
        node after it asked: a restarted broker knows none, and a whole cluster that restarts with it waits at
        its first start for every member's verdict (it stayed ``starting`` until ``connect_s``)."""
        self._turn_if_silent()
        beat = self.report.heartbeat(progress, stats, done=done)
        await self.link.send(Message(type=MsgType.HEARTBEAT, sender=self.name, meta=beat.meta()))
        if self.reach_ports is not None and self.name not in self.reach:
            await self._ask_reach(self.reach_ports)

    def close(self) -> None:
        self.sub.close()
        for link in self.links:
            link.close()


async def beat_on_cadence(beat: Callable[[], Awaitable[None]], interval_s: float,
                          beat_now: asyncio.Event) -> None:
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
