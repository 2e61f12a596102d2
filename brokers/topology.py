"""The topology broker: holds the plan and membership, publishes every change (ZeroMQ clone pattern).

State = the plan plus the membership book (``brokers.book``): per node its state, incarnation and
phase, per cluster whether it trains, pauses or recovers.  Every change increments a sequence number
and is published on PUB with the full state, and the full state is re-published every heartbeat
interval, so a node that missed updates (or saw this broker restart) catches up within one.  The data
plane never waits on the broker: nodes talk to it at start-up and send heartbeats without waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import zmq
import zmq.asyncio

from brokers.book import CLUSTER_STATES, NODE_STATES, PHASES, Book, Member
from brokers.reach import Reachability
from brokers.run import open_run, save_run, state_dir_for
from ravq.config import Plan, RelayConfig, Topology
from ravq.metrics import Metrics
from ravq.net.options import SocketOptions, endpoint
from ravq.net.protocol import Heartbeat, ReachRequest, Register
from ravq.net.pubsub import Publisher
from ravq.net.relay import Relay
from ravq.net.transport import Inbox
from ravq.net.wire import DecodeLimits, Message, MsgType, WireError

log = logging.getLogger(__name__)

BROKER = "broker"
SILENCE_UPDATES = 4
"""Silence updates per heartbeat interval (``Broker._publish_silence``): a live member never reads more
silent than its heartbeat interval plus a quarter of it (and the network's delay)."""

_NODE_MESSAGES: dict[MsgType, type[Register | Heartbeat | ReachRequest]] = {
    MsgType.REGISTER: Register, MsgType.HEARTBEAT: Heartbeat, MsgType.REACH_REQ: ReachRequest}
"""The node -> broker control messages with a typed body (``ravq.net.protocol``)."""


class Broker:
    def __init__(self, topology: Topology, plan: Plan, metrics: Metrics, opts: SocketOptions,
                 heartbeat_timeout_s: float | None = None, *, clock: Callable[[], float] = time.monotonic,
                 new_run: bool = False) -> None:
        self.topology, self.metrics, self.opts = topology, metrics, opts
        self.clock = clock
        """What heartbeats and silences are timed on (seconds; tests pass a virtual one)."""
        self.limits = DecodeLimits(max_header_bytes=topology.limits.max_header_bytes,
                                   max_frames=topology.limits.max_frames,
                                   max_tensor_bytes=opts.max_message_bytes)
        self.seq = 0
        self.heartbeat_timeout_s = heartbeat_timeout_s or topology.timeouts.lost_s
        self.known = {n.name for n in topology.nodes}
        self.incarnation = f"{time.time():.6f}"
        self.state_dir = state_dir_for(topology.broker.state_dir, topology.training.checkpoint_dir,
                                       os.environ)
        """Where the run survives this broker's restarts (``brokers.run.state_dir_for``)."""
        self.the_run = open_run(self.state_dir, plan, new_run=new_run)
        """The training run (``brokers.run``): continued from the state directory after a restart."""
        self.run_id = self.the_run.run_id
        """Names this training run; every checkpoint carries it, so no node loads another run's stage and
        `ravq export` never merges stages of different runs."""
        # Ring round ids start from the plan epoch, so epochs grow across broker restarts too (brokers.run).
        in_plan = {n for c in self.the_run.plan.clusters for n in c.nodes}
        self.book = Book(self.the_run.plan, lost_s=self.heartbeat_timeout_s, now=clock(),
                         replace_s=topology.timeouts.replace_s,
                         standbys=[n.name for n in topology.nodes if n.name not in in_plan])
        self._stop = asyncio.Event()
        self.reach = Reachability(topology, metrics, opts.curve)
        self._tg: asyncio.TaskGroup | None = None
        self._shown_members: dict[str, str] = {}
        self._shown_clusters: dict[int, str] = {}
        """The states the per-member and per-cluster gauges show (``_show_changes``)."""
        self._ctx: zmq.asyncio.Context | None = None

    @property
    def plan(self) -> Plan:
        """The plan now: the book owns it (standbys take stages, the rings leave out clusters that do not
        train)."""
        return self.book.plan

    @property
    def members(self) -> dict[str, Member]:
        return self.book.members

    def state(self) -> dict[str, Any]:
        return {"plan": self.plan.model_dump(), "run_id": self.run_id, "run_explicit": self.the_run.explicit,
                **self.book.public(), "silent_s": self.silence(), "reach": self.reach.public()}

    def silence(self) -> dict[str, float]:
        """Seconds since each member's last heartbeat reached this broker."""
        now = self.clock()
        return {n: round(now - m.last_seen, 3) for n, m in self.members.items()}

    async def _publish(self, pub: Publisher, kind: str, data: dict[str, Any]) -> None:
        """Publish the full state (every update carries it, so one update is enough to catch up)."""
        self._sync_plan()
        self.seq += 1
        self.metrics.broker_seq.set(self.seq)
        await pub.publish(Message(type=MsgType.UPDATE, sender=BROKER, meta={
            "seq": self.seq, "incarnation": self.incarnation, "kind": kind, "state": self.state(), **data}))
        self._show_changes(self.members, range(len(self.book.clusters)))

    def _sync_plan(self) -> None:
        """The rings leave out the clusters that do not train (``Book.exclude_idle``); a plan the book
        changed (that, or a standby took a lost node's stage) is saved with the run: its membership and
        epoch survive a restart of this broker."""
        self.book.exclude_idle()
        if self.book.plan is not self.the_run.plan:
            self.the_run = dataclasses.replace(self.the_run, plan=self.book.plan)
            save_run(self.state_dir, self.the_run)

    def _count_members(self) -> None:
        """Every gauge of the membership: the aggregates (nodes by state and phase, what paused clusters wait
        for) and the per-member and per-cluster ones that changed; once per heartbeat interval, on the timer
        that visits every member anyway."""
        self._show_changes(self.members, range(len(self.book.clusters)))
        states = Counter(m.state for m in self.members.values())
        phases = Counter(m.said.phase for m in self.members.values() if m.state == "up")
        for state in NODE_STATES:
            self.metrics.broker_nodes.labels(state).set(states[state])
        for phase in PHASES:
            self.metrics.broker_phases.labels(phase).set(phases[phase])
        self.metrics.cluster_waiting_for.clear()
        for (c, member), why in waiting_for(self.book).items():
            self.metrics.cluster_waiting_for.labels(str(c), member, why).set(1)

    def _show_changes(self, names: Iterable[str], clusters: Iterable[int]) -> None:
        """The per-member and per-cluster gauges of those that may have changed, set only when their
        state did (a heartbeat touches one member and one cluster, never every series)."""
        for name in names:
            state = self.members[name].state
            if self._shown_members.get(name) != state:
                for s in NODE_STATES:
                    self.metrics.broker_member_state.labels(name, s).set(float(state == s))
                self._shown_members[name] = state
        for c in clusters:
            state = self.book.clusters[c].state
            if self._shown_clusters.get(c) != state:
                for s in CLUSTER_STATES:
                    self.metrics.cluster_state.labels(str(c), s).set(float(state == s))
                self._shown_clusters[c] = state

    def _observe_recoveries(self) -> None:
        for seconds in self.book.recoveries:
            self.metrics.recovery_seconds.observe(seconds)
        self.book.recoveries.clear()

    async def _handle(self, inbox: Inbox, pub: Publisher, identity: bytes, msg: Message) -> None:
        self.metrics.broker_requests.labels(msg.type).inc()
        node = msg.sender
        if msg.type in (MsgType.REGISTER, MsgType.HEARTBEAT) and node not in self.known:
            self.metrics.bad_messages.labels("broker", "unknown_node").inc()
            return
        now = self.clock()
        decoder = _NODE_MESSAGES.get(msg.type)
        try:
            request = decoder.from_meta(msg.meta) if decoder is not None else None
        except WireError as err:  # a control message of another shape: dropped, never guessed at
            self.metrics.bad_messages.labels("broker", err.reason).inc()
            return
        if isinstance(request, Register):
            await self._register(inbox, pub, identity, node, request, now)
        elif isinstance(request, Heartbeat):
            await self._heartbeat(pub, node, request, now)
        elif isinstance(request, ReachRequest):
            self._reach_request(pub, node, request)
        else:
            await self._answer(inbox, identity, node, msg.type, now)

    async def _register(self, inbox: Inbox, pub: Publisher, identity: bytes, node: str, register: Register,
                        now: float) -> None:
        self.book.register(node, register.incarnation, now)
        self.reach.forget(node)
        self.book.advance(self.book.cluster_of(node), now)
        log.info("node %s registered", node)
        await self._publish(pub, "member", {"node": node, "member_state": "up"})
        await self._reply_snapshot(inbox, identity, node)

    async def _heartbeat(self, pub: Publisher, node: str, beat: Heartbeat, now: float) -> None:
        if self.book.heartbeat(node, beat, now) | self.book.advance(self.book.cluster_of(node), now):
            self._observe_recoveries()
            await self._publish(pub, "member", {"node": node, "member_state": self.members[node].state})

    def _reach_request(self, pub: Publisher, node: str, request: ReachRequest) -> None:
        if node not in self.known:
            self.metrics.bad_messages.labels("broker", "unknown_node").inc()
        elif self.reach.wants(node) and self._tg is not None and self._ctx is not None:
            self._tg.create_task(self._check_reach(pub, node, request.ports[:4]))

    async def _answer(self, inbox: Inbox, identity: bytes, node: str, kind: MsgType, now: float) -> None:
        """SNAPSHOT_REQ and STATUS_REQ."""
        if kind == MsgType.SNAPSHOT_REQ:
            if node in self.members and self.members[node].state == "up":  # a node polling at start is alive
                self.members[node].last_seen = now
            await self._reply_snapshot(inbox, identity, node)
        elif kind == MsgType.STATUS_REQ:
            status = {"seq": self.seq, "plan": self.plan.model_dump(), "run_id": self.run_id,
                      "reach": self.reach.public(), "reach_tried": dict(self.reach.tried),
                      "clusters": [cs.public() for cs in self.book.clusters],
                      "members": {k: _public(v, now) for k, v in self.members.items()}}
            await inbox.reply(identity, Message(type=MsgType.STATUS, sender=BROKER, meta=status), node)
        else:
            self.metrics.bad_messages.labels("broker", "unexpected_type").inc()

    async def _check_reach(self, pub: Publisher, node: str, ports: list[str]) -> None:
        assert self._ctx is not None
        await self.reach.check(self._ctx, node, ports)
        await self._publish(pub, "reach", {"node": node})

    async def _reply_snapshot(self, inbox: Inbox, identity: bytes, node: str) -> None:
        self._sync_plan()
        reply = Message(type=MsgType.SNAPSHOT, sender=BROKER,
                        meta={"seq": self.seq, "incarnation": self.incarnation, "state": self.state()})
        await inbox.reply(identity, reply, node)

    async def _serve(self, inbox: Inbox, pub: Publisher) -> None:
        while True:
            identity, msg = await inbox.recv()
            await self._handle(inbox, pub, identity, msg)

    async def _watch_heartbeats(self, pub: Publisher) -> None:
        """Mark silent nodes lost, move clusters along, and re-publish the full state every heartbeat
        interval: a node that missed updates (or a restart of this broker) catches up within one."""
        while True:
            await asyncio.sleep(self.topology.timeouts.heartbeat_interval_s)
            self.book.check(self.clock())
            self._observe_recoveries()
            self._count_members()
            await self._publish(pub, "tick", {})

    async def _publish_silence(self, pub: Publisher) -> None:
        """A small update, ``SILENCE_UPDATES`` times per heartbeat interval, with each member's silence
        and no state change (the sequence number stays).  A node reads a ring member's silence as the
        last published figure plus the time since; with the full state published once an interval
        only, a live member whose heartbeat arrived just after a publication read up to two intervals
        silent, above the 1.5 at which a stage stops holding back for a round (``Averager.hold_s``):
        fast clusters among six trained past rounds of slow ones and skipped rounds (issue #14)."""
        period = self.topology.timeouts.heartbeat_interval_s / SILENCE_UPDATES
        while True:
            await asyncio.sleep(period)
            await pub.publish(Message(type=MsgType.UPDATE, sender=BROKER, meta={
                "seq": self.seq, "incarnation": self.incarnation, "kind": "silence",
                "silent_s": self.silence()}))

    async def _until_stopped(self) -> None:
        await self._stop.wait()
        raise _Stopped

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        ctx = zmq.asyncio.Context()
        b = self.topology.broker
        bind = b.bind_host or b.host
        pub = Publisher.bind(ctx, endpoint(bind, b.pub_port), self.metrics, self.opts)
        inbox = Inbox.bind(ctx, endpoint(bind, b.router_port), "broker", self.metrics, self.limits, self.opts,
                           one_shot_clients=True)  # `ravq status` connects, asks once and leaves
        relay = self._relay(ctx)
        log.info("broker up: pub %d, router %d, %d nodes in plan%s", b.pub_port, b.router_port,
                 sum(len(c.nodes) for c in self.plan.clusters),
                 f"; relaying on {b.relay_port}" if relay is not None else "")
        self._ctx = ctx
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                tg.create_task(self._serve(inbox, pub))
                tg.create_task(self._watch_heartbeats(pub))
                tg.create_task(self._publish_silence(pub))
                tg.create_task(self._until_stopped())
                if relay is not None:
                    tg.create_task(relay.serve())
                if self.opts.monitor is not None:  # the Curve (ZAP handler) with CURVE
                    tg.create_task(self.opts.monitor.serve())
        except* _Stopped:
            pass
        finally:
            inbox.close()
            pub.close()
            if relay is not None:
                relay.close()
            if self.opts.monitor is not None:
                self.opts.monitor.close()
            ctx.term()
            log.info("broker stopped")


    def _relay(self, ctx: zmq.asyncio.Context) -> Relay | None:
        """The relay this PC runs by default for nodes behind NAT (``broker.relay_port``)."""
        b = self.topology.broker
        if b.relay_port is None:
            return None
        opts = dataclasses.replace(self.opts, max_message_bytes=self.topology.limits.max_message_bytes
                                   or RelayConfig.model_fields["queue_bytes"].default)
        return Relay(ctx, endpoint(b.bind_host or b.host, b.relay_port), self.known, self.metrics, opts,
                     name=BROKER, queue_bytes=RelayConfig.model_fields["queue_bytes"].default)


class _Stopped(Exception):
    pass


def waiting_for(book: Book) -> dict[tuple[int, str], str]:
    """(cluster, member) -> why, for each member a cluster that does not train waits for: the members
    that are not up (lost, missing, ...) or, once all are, those not yet ready (what they do now)."""
    waiting: dict[tuple[int, str], str] = {}
    for c, (cs, cluster) in enumerate(zip(book.clusters, book.plan.clusters)):
        if cs.state not in ("paused", "recovering"):
            continue
        members = {n: book.members[n] for n in cluster.nodes if n in book.members}
        down = {n: m.state for n, m in members.items() if m.state != "up"}
        waiting |= {(c, n): why for n, why in (down or {n: m.said.phase for n, m in members.items()
                                                       if m.said.ready < cs.generation}).items()}
    return waiting


def _public(m: Member, now: float) -> dict[str, Any]:
    return {"state": m.state, "phase": m.said.phase, "generation": m.said.generation,
            "age_s": round(now - m.last_seen, 3),
            "stats": m.stats}


def run_broker(topology: Topology, plan: Plan, metrics: Metrics, opts: SocketOptions, *,
               new_run: bool = False) -> None:
    """Entry point: run until SIGTERM/SIGINT."""
    broker = Broker(topology, plan, metrics, opts, new_run=new_run)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, broker.stop)
        await broker.run()

    asyncio.run(main())
