"""The topology broker: holds the plan and membership, publishes every change (ZeroMQ clone pattern).

State = the plan plus the membership book (``brokers.book``): per node its state, incarnation and
phase, per cluster whether it trains, pauses or recovers.  It is published as keyed updates
(``ravq.net.clone``, ``brokers.keyed``): each change sends only the keys that changed, on their topic
(``g.`` for every node, ``c<i>.`` for cluster ``i``'s members), with the topic's next sequence number;
a node that sees a gap asks for a snapshot, in parts under the header limit.  Every ``TICK_INTERVALS``
a tick on ``g.`` carries its sequence number (and says the broker is alive); each interval the topics
updated in the last one are echoed.  A member silent for ``SILENT_AFTER`` intervals is published
once (``silent/<name>``, from a heap of deadlines: ``brokers.silence``) and cleared when it beats.  A
heartbeat costs O(1): its member, its cluster; the checks over every member run on a timer.  The data
plane never waits on the broker: nodes talk to it at start-up and send heartbeats without waiting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import zmq
import zmq.asyncio

from brokers.binarystar import PRIMARY, Pairing
from brokers.book import Book, Member
from brokers.gauges import Gauges
from brokers.keyed import KeyedState, member_value, out_items, plan_head, plan_items, start_flags, status_of
from brokers.reach import Reachability
from brokers.run import open_run, save_run, state_dir_for
from brokers.silence import Silences
from ravq.config import Plan, Topology
from ravq.metrics import Metrics
from ravq.net.clone import GLOBAL, SILENCES, SILENT_AFTER, TICK_INTERVALS, TICKS, budget, cluster_topic
from ravq.net.options import SocketOptions, endpoint
from ravq.net.protocol import Heartbeat, ReachRequest, Register, SnapshotRequest
from ravq.net.pubsub import Publisher
from ravq.net.relay import broker_relay
from ravq.net.transport import Inbox
from ravq.net.wire import DecodeLimits, Message, MsgType, WireError

log = logging.getLogger(__name__)

BROKER = "broker"

GATHER = 0.05
"""Of an interval, how long the broker lets messages queue after handling those queued: each wake-up of a busy
PC's loop starts with cold caches (``benchmarks/_account.py``); a beat is timed at most this late (<< 0.4,
``SILENT_AFTER``'s margin, and < 1/16, the grain silences are found at)."""
_NODE_MESSAGES: dict[MsgType, type[Register | Heartbeat | ReachRequest | SnapshotRequest]] = {
    MsgType.REGISTER: Register, MsgType.HEARTBEAT: Heartbeat, MsgType.REACH_REQ: ReachRequest,
    MsgType.SNAPSHOT_REQ: SnapshotRequest}
"""The node -> broker control messages with a typed body (``ravq.net.protocol``)."""


class Broker:
    def __init__(self, topology: Topology, plan: Plan, metrics: Metrics, opts: SocketOptions,
                 heartbeat_timeout_s: float | None = None, *, clock: Callable[[], float] = time.monotonic,
                 new_run: bool = False, pair: Pairing | None = None) -> None:
        self.topology, self.metrics, self.opts = topology, metrics, opts
        self.pair, self.by = pair, {"role": PRIMARY, "term": 0} if pair is None else pair.by
        """The Binary Star pair this broker is the active one of (``brokers.pair``; None: alone), and what
        its messages say of it (``by``: its role and term; a node follows no older term than it saw)."""
        restored = None if pair is None else pair.restored
        self.clock = clock
        """What heartbeats and silences are timed on (seconds; tests pass a virtual one)."""
        lim = topology.limits
        self.limits = DecodeLimits(max_header_bytes=lim.max_header_bytes, max_frames=lim.max_frames,
                                   max_tensor_bytes=opts.max_message_bytes)
        self.seq = 0 if restored is None else restored.seq
        self.heartbeat_timeout_s = heartbeat_timeout_s or topology.timeouts.lost_s
        self.known = {n.name for n in topology.nodes}
        self.incarnation = f"{time.time():.6f}"
        self.state_dir = state_dir_for(topology.broker.state_dir, topology.training.checkpoint_dir,
                                       os.environ)
        """Where the run survives this broker's restarts (``brokers.run.state_dir_for``)."""
        self.the_run = restored.run if restored else open_run(self.state_dir, plan, new_run=new_run)
        """The training run (``brokers.run``): continued from the state directory after a restart."""
        self.run_id = self.the_run.run_id
        """Names this training run; every checkpoint carries it, so no node loads another run's stage and
        `ravq export` never merges stages of different runs."""
        # Ring round ids start from the plan epoch, so epochs grow across broker restarts too (brokers.run).
        in_plan = {n for c in self.the_run.plan.clusters for n in c.nodes}
        self.book = restored.book if restored else Book(self.the_run.plan, lost_s=self.heartbeat_timeout_s,
                                                        now=clock(),
                         replace_s=topology.timeouts.replace_s,
                         standbys=[n.name for n in topology.nodes if n.name not in in_plan])
        self._stop = asyncio.Event()
        self.reach = Reachability(topology, metrics, opts.curve, restored.reach if restored else None)
        self._tg: asyncio.TaskGroup | None = None
        self.gauges = Gauges(metrics)
        self.keyed = KeyedState(budget(topology.limits.max_header_bytes), restored.seqs if restored else None)
        """The state as published: keys, topics, sequence numbers (``brokers.keyed``)."""
        interval_s = topology.timeouts.heartbeat_interval_s
        heard = self.members if self.the_run.created_at < float(self.incarnation) else ()  # brokers.silence
        self.silences = Silences(SILENT_AFTER * interval_s, heard, clock(),
                                 {n: m.last_seen for n, m in self.members.items()} if restored else None)
        self._published_plan: Plan | None = None
        self._unsaved = False
        self._snapshots = 0
        self._requests: dict[str, Any] = {}
        self._publishing, self._reading = asyncio.Lock(), asyncio.Lock()  # updates in order; one reader
        self.keyed.put("run", GLOBAL, {"run_id": self.run_id, "run_explicit": self.the_run.explicit})
        self._refresh(list(self.members), range(len(self.book.clusters)))
        self.keyed.flush()  # nobody listens yet: the first snapshot carries it
        self._ctx: zmq.asyncio.Context | None = None

    @property
    def plan(self) -> Plan:
        """The plan now: the book owns it (standbys take stages, the rings leave out clusters that do not
        train)."""
        return self.book.plan

    @property
    def members(self) -> dict[str, Member]:
        return self.book.members

    def _refresh(self, names: Iterable[str], clusters: Iterable[int]) -> None:
        """Put the keys of ``names`` and ``clusters`` (and the plan's, when the book holds another plan: then
        every member's, whose topic may have moved) into the published state; ``_flush`` sends what
        changed."""
        clusters = list(clusters)
        self._sync_plan(clusters)
        before, plan = self._published_plan, self.book.plan
        if plan is not before:
            self._published_plan = plan
            if before is not None and plan.clusters is before.clusters:  # the exclusions or epoch only
                for key, topic, value in [plan_head(plan), *out_items(plan, before)]:
                    self.keyed.put(key, topic, value)
            else:  # a stage changed hands: every cluster's key, and every member's topic, may have moved
                for key, topic, value in plan_items(plan, before):
                    self.keyed.put(key, topic, value)
                names = list(self.members)
        names = list(names)
        for name in names:
            topic, m = cluster_topic(self.book.cluster_of(name)), self.members.get(name)
            self.keyed.put(f"member/{name}", topic, None if m is None else member_value(m))
            self.keyed.put(f"reach/{name}", topic, self.reach.verdicts.get(name))
        for c in clusters:
            self.keyed.put(f"cluster/{c}", cluster_topic(c), self.book.clusters[c].public())
            if self.book.clusters[c].generation:  # clusters end at different steps: one more round
                self.keyed.put("disrupted", GLOBAL, True)
        self.gauges.show(self.book, names, clusters)

    async def _flush(self, pub: Publisher) -> None:
        """Publish the keys that changed, one update per topic (or more, each under the header limit); in
        the order of their numbers, whichever handler flushes meanwhile (a send may wait)."""
        async with self._publishing:
            for u in self.keyed.flush():
                self.seq += 1
                await pub.publish(Message(type=MsgType.UPDATE, sender=BROKER, meta={
                    "kind": "delta", "incarnation": self.incarnation, "topic": u.topic, "seq": u.seq,
                    "items": u.items, "more": u.more, "by": self.by}), u.topic)
        self.metrics.broker_seq.set(self.seq)
        if self.keyed.oversized:
            self.metrics.bad_messages.labels("pub", "header_too_large").inc(self.keyed.oversized)
            self.keyed.oversized = 0

    def _sync_plan(self, clusters: list[int] | None = None, *, save: bool = False) -> None:
        """The rings leave out the clusters that do not train (``Book.exclude_idle``, of ``clusters``); a
        plan the book changed is saved with the run, so its membership and epoch survive a restart of this
        broker: at once when a standby took a lost node's stage, else (the exclusions only: a restart starts
        them again, and its epoch from at least the time in milliseconds) with ``save``, once an interval,
        not a write and fsync of the whole plan per event."""
        self.book.exclude_idle(clusters)
        if self.book.plan is not self.the_run.plan:
            moved = self.book.plan.clusters is not self.the_run.plan.clusters
            self.the_run = dataclasses.replace(self.the_run, plan=self.book.plan)
            self._unsaved = not (moved or save)
            if not self._unsaved:
                save_run(self.state_dir, self.the_run)
        elif save and self._unsaved:
            self._unsaved = False
            save_run(self.state_dir, self.the_run)

    def _observe_recoveries(self) -> None:
        for seconds in self.book.recoveries:
            self.metrics.recovery_seconds.observe(seconds)
        self.book.recoveries.clear()

    async def _handle(self, inbox: Inbox, pub: Publisher, identity: bytes, msg: Message) -> None:
        if (count := self._requests.get(msg.type)) is None:  # a lookup less per heartbeat
            count = self._requests[msg.type] = self.metrics.broker_requests.labels(msg.type)
        count.inc()
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
            await self._answer(inbox, identity, node, msg.type, now, request)

    async def _register(self, inbox: Inbox, pub: Publisher, identity: bytes, node: str, register: Register,
                        now: float) -> None:
        c = self.book.cluster_of(node)
        self.book.register(node, register.incarnation, now)
        self.reach.forget(node)
        self.book.advance(c, now)
        log.info("node %s registered", node)
        self._beat(node, now)
        self._refresh([node], [] if c is None else [c])
        await self._flush(pub)
        await self._reply_snapshot(inbox, identity, node, mine=True)

    async def _heartbeat(self, pub: Publisher, node: str, beat: Heartbeat, now: float) -> None:
        """O(1): the book's member and cluster; what changed is published on the member's topic at once
        (the global topic's changes wait for the next tick: a start-up's thousands of heartbeats are a
        few updates to every node, not one each)."""
        c = self.book.cluster_of(node)
        changed = self.book.heartbeat(node, beat, now)  # its cluster moved along if the beat may move it
        self._beat(node, now)
        if changed:
            self._observe_recoveries()
            self._refresh([node], [] if c is None else [c])
            if any(t != GLOBAL for t in self.keyed.pending_topics()):
                await self._flush(pub)

    def _beat(self, node: str, now: float) -> None:
        if self.silences.beat(node, now):
            self.keyed.put(f"silent/{node}", SILENCES, None)

    def _reach_request(self, pub: Publisher, node: str, request: ReachRequest) -> None:
        if node not in self.known:
            self.metrics.bad_messages.labels("broker", "unknown_node").inc()
        elif self.reach.wants(node) and self._tg is not None and self._ctx is not None:
            self._tg.create_task(self._check_reach(pub, node, request.ports[:4]))

    async def _answer(self, inbox: Inbox, identity: bytes, node: str, kind: MsgType, now: float,
                      request: SnapshotRequest | None) -> None:
        """SNAPSHOT_REQ and STATUS_REQ."""
        if request is not None:
            if node in self.members and self.members[node].state == "up":  # a node polling at start is alive
                self.members[node].last_seen = now
                self._beat(node, now)
            await self._reply_snapshot(inbox, identity, node, mine=request.mine)
        elif kind == MsgType.STATUS_REQ:
            status = {"seq": self.seq, "plan": self.plan.model_dump(), "run_id": self.run_id,
                      "reach": self.reach.public(), "reach_tried": dict(self.reach.tried),
                      "clusters": [cs.public() for cs in self.book.clusters],
                      "members": {k: status_of(v, now) for k, v in self.members.items()},
                      "pair": None if self.pair is None else self.pair.public()}
            await inbox.reply(identity, Message(type=MsgType.STATUS, sender=BROKER, meta=status), node)
        else:
            self.metrics.bad_messages.labels("broker", "unexpected_type").inc()

    async def _check_reach(self, pub: Publisher, node: str, ports: list[str]) -> None:
        assert self._ctx is not None
        await self.reach.check(self._ctx, node, ports)
        self._refresh([node], [])
        await self._flush(pub)

    async def _reply_snapshot(self, inbox: Inbox, identity: bytes, node: str, *, mine: bool) -> None:
        """The state in parts, each under the header limit, with the sequence numbers of the topics the node
        follows (the global one and its cluster's); ``mine``: only those topics' keys."""
        topics = {GLOBAL, SILENCES, cluster_topic(self.book.cluster_of(node))}
        now = self.clock()  # the silences read on: cut afresh (the other topics' parts are kept)
        seqs, parts = self.keyed.snapshot(topics if mine else None, {SILENCES: self.silences.figures(now)})
        if node != BROKER:  # a node's topics' numbers (a passive broker, the pair's other, follows every one)
            seqs = {t: seqs.get(t, self.keyed.seqs.get(t, 0)) for t in topics}
        self._snapshots += 1
        for i, part in enumerate(parts):
            meta = {"seq": self.seq, "incarnation": self.incarnation, "snap": self._snapshots, "part": i,
                    "parts": len(parts), "by": self.by,
                    "scope": sorted(topics) if mine else None, "items": part, "seqs": seqs if i == 0 else {}}
            await inbox.reply(identity, Message(type=MsgType.SNAPSHOT, sender=BROKER, meta=meta), node)

    async def _serve(self, inbox: Inbox, pub: Publisher) -> None:
        """Handle the queued messages, then gather for ``GATHER`` of an interval (a wake-up per heartbeat was
        most of the broker's CPU); no gathering while behind (a queue never empty): the others' turn only."""
        ivl = self.topology.timeouts.heartbeat_interval_s
        while True:
            if await inbox.readable(ivl):
                await asyncio.sleep(GATHER * ivl if await self._drain(inbox, pub, ivl / 16) else 0)

    async def _drain(self, inbox: Inbox, pub: Publisher, budget_s: float) -> bool:
        """The messages queued, in order, for up to ``budget_s`` of this PC's time (whether none is left): one
        task at a time, and bounded, so a broker that falls behind still ticks (an endless queue held it)."""
        async with self._reading:
            end = time.monotonic() + budget_s
            while (got := inbox.recv_queued()) is not None:
                await self._handle(inbox, pub, *got)
                if time.monotonic() >= end:
                    return False
        return True

    async def _watch_heartbeats(self, pub: Publisher) -> None:
        """Each heartbeat interval: mark silent nodes lost and move clusters along (``Book.check``, over every
        member), publish what changed, set the gauges, and echo the topics updated in the last interval."""
        while True:
            await asyncio.sleep(self.topology.timeouts.heartbeat_interval_s)
            self._sync_plan(save=True)
            if changes := self.book.check(self.clock()):
                self._observe_recoveries()
                self._refresh(changes.names, changes.clusters)
            else:
                self._refresh((), ())  # the rings' exclusions follow the clusters' states
            self.keyed.put("start", GLOBAL, start_flags(self.book, self.reach.verdicts))
            await self._flush(pub)
            self.gauges.count(self.book)  # every gauge of the membership, once an interval
            for topic in self.keyed.echoes():
                await self._tick(pub, topic)

    async def _publish_silence(self, inbox: Inbox, pub: Publisher) -> None:
        """``TICKS`` times an interval: publish the global topic's changes (silences among them: members
        silent for ``SILENT_AFTER`` intervals, found by their deadlines); every ``TICK_INTERVALS`` a tick
        with its sequence number.  A node reads a member's silence as the published figure plus the time
        since, and one not published as the time since the broker's last message less the tick period: a
        live member never reads more silent than the network's delay, a dead one reaches
        ``Averager.hold_s`` (1.5 intervals) within a sixteenth of an interval of when it truly does."""
        interval_s = self.topology.timeouts.heartbeat_interval_s
        period, step, tick_s = interval_s / TICKS, interval_s / 16, TICK_INTERVALS * interval_s
        next_flush, next_tick = self.clock() + period, self.clock() + tick_s
        while True:
            deadline = self.silences.next_deadline()
            wake = next_flush if deadline is None else min(next_flush, max(deadline, self.clock() + step))
            await asyncio.sleep(max(0.0, wake - self.clock()))
            if (deadline := self.silences.next_deadline()) is not None and deadline <= self.clock() + 1e-6:
                await self._drain(inbox, pub, step)  # a beat queued while the loop was held (GC): not silent
            now = self.clock() + 1e-6  # a clock of coarser grain wakes a hair early
            silent = self.silences.due(now)
            for name in silent:
                self.keyed.put(f"silent/{name}", SILENCES, round(now - self.silences.last[name], 3))
            if silent:  # at once: a node reads the figure on from when it arrives
                await self._flush(pub)
            if now >= next_flush:
                next_flush = max(next_flush + period, now)
                await self._flush(pub)
            if now >= next_tick:
                next_tick = max(next_tick + tick_s, now)
                await self._tick(pub, GLOBAL)

    async def _tick(self, pub: Publisher, topic: str) -> None:
        async with self._publishing:  # after every update of the number it says
            seq = self.keyed.seqs[topic]
            meta = {"kind": "tick", "incarnation": self.incarnation, "topic": topic, "seq": seq,
                    "by": self.by}
            await pub.publish(Message(type=MsgType.UPDATE, sender=BROKER, meta=meta), topic)

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
                           one_shot_clients=True, peers_as="node")  # `ravq status` asks once and leaves
        relay = broker_relay(ctx, self.topology, self.known, self.metrics, self.opts, BROKER)
        log.info("broker up: pub %d, router %d, %d nodes in plan%s", b.pub_port, b.router_port,
                 sum(len(c.nodes) for c in self.plan.clusters),
                 f"; relaying on {b.relay_port}" if relay is not None else "")
        self._ctx = ctx
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                tg.create_task(self._serve(inbox, pub))
                tg.create_task(self._watch_heartbeats(pub))
                tg.create_task(self._publish_silence(inbox, pub))
                tg.create_task(self._until_stopped())
                if self.pair is not None:
                    tg.create_task(self.pair.serve(pub.publish, self.stop))
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


class _Stopped(Exception):
    """``stop`` was called."""
