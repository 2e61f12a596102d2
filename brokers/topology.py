"""The topology broker: holds the plan and membership, publishes every change (ZeroMQ clone pattern).

State = the plan plus, per node, its membership state and its latest heartbeat statistics.  Every
change increments a sequence number and is published on PUB; a node that registers (or notices a
gap in sequence numbers) asks the ROUTER for a snapshot and applies later updates on top.  The data
plane never waits on the broker: nodes talk to it at start-up and send heartbeats without waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from ravq.config import Plan, Topology
from ravq.metrics import Metrics
from ravq.transport import Inbox, Publisher, SocketOptions, endpoint
from ravq.wire import DecodeLimits, Message, MsgType

log = logging.getLogger(__name__)

BROKER = "broker"


@dataclass(kw_only=True, slots=True)
class Member:
    state: str = "up"  # up | lost | done
    last_seen: float = field(default_factory=time.monotonic)
    stats: dict[str, Any] = field(default_factory=dict)

    def public(self) -> dict[str, Any]:
        return {"state": self.state, "age_s": round(time.monotonic() - self.last_seen, 3), "stats": self.stats}


class Broker:
    def __init__(self, topology: Topology, plan: Plan, metrics: Metrics, opts: SocketOptions,
                 heartbeat_timeout_s: float | None = None) -> None:
        self.topology, self.plan, self.metrics, self.opts = topology, plan, metrics, opts
        self.limits = DecodeLimits(max_header_bytes=topology.limits.max_header_bytes,
                                   max_frames=topology.limits.max_frames,
                                   max_tensor_bytes=opts.max_message_bytes)
        self.members: dict[str, Member] = {}
        self.seq = 0
        self.heartbeat_timeout_s = heartbeat_timeout_s or 10 * topology.timeouts.heartbeat_interval_s
        self.known = {n.name for n in topology.nodes}
        self.incarnation = f"{time.time():.6f}"
        self.run_id = time.strftime("%Y%m%d-%H%M%S-", time.gmtime()) + secrets.token_hex(3)
        """Names this training run; nodes that start fresh write it into their checkpoints, so `ravq
        export` never merges stages of different runs.  A resumed stage keeps its checkpoint's."""
        self._stop = asyncio.Event()

    def state(self) -> dict[str, Any]:
        return {"plan": self.plan.model_dump(), "run_id": self.run_id,
                "members": {k: v.state for k, v in self.members.items()}}

    async def _publish(self, pub: Publisher, kind: str, data: dict[str, Any]) -> None:
        self.seq += 1
        self.metrics.broker_seq.set(self.seq)
        await pub.publish(Message(type=MsgType.UPDATE, sender=BROKER, meta={
            "seq": self.seq, "incarnation": self.incarnation, "kind": kind, "state": self.state(), **data}))
        self._count_members()

    def _count_members(self) -> None:
        for state in ("up", "lost", "done"):
            self.metrics.broker_nodes.labels(state).set(sum(m.state == state for m in self.members.values()))

    async def _handle(self, inbox: Inbox, pub: Publisher, identity: bytes, msg: Message) -> None:
        self.metrics.broker_requests.labels(msg.type).inc()
        node = msg.sender
        if msg.type in (MsgType.REGISTER, MsgType.HEARTBEAT) and node not in self.known:
            self.metrics.bad_messages.labels("broker", "unknown_node").inc()
            return
        if msg.type == MsgType.REGISTER:
            fresh = node not in self.members or self.members[node].state != "up"
            self.members[node] = Member()
            self._set_excluded(self._cluster_of(node), False)
            log.info("node %s registered", node)
            if fresh:
                await self._publish(pub, "member", {"node": node, "member_state": "up"})
            await self._reply_snapshot(inbox, identity, node)
        elif msg.type == MsgType.HEARTBEAT:
            if node not in self.members:  # e.g. after a broker restart: heartbeats rebuild membership
                self.members[node] = Member(state="new")
            member = self.members[node]
            member.last_seen = time.monotonic()
            member.stats = msg.meta.get("stats", {}) if isinstance(msg.meta.get("stats"), dict) else {}
            new_state = "done" if msg.meta.get("done") else "up"
            if member.state != new_state:
                was_lost = member.state == "lost"
                member.state = new_state
                if was_lost:
                    log.info("node %s is back", node)
                    self._set_excluded(self._cluster_of(node), False)
                await self._publish(pub, "member", {"node": node, "member_state": new_state})
        elif msg.type == MsgType.SNAPSHOT_REQ:
            if node in self.members:  # a node polling while it starts up is alive
                self.members[node].last_seen = time.monotonic()
            await self._reply_snapshot(inbox, identity, node)
        elif msg.type == MsgType.STATUS_REQ:
            status = {"seq": self.seq, "plan": self.plan.model_dump(), "run_id": self.run_id,
                      "members": {k: v.public() for k, v in self.members.items()}}
            await inbox.reply(identity, Message(type=MsgType.STATUS, sender=BROKER, meta=status), node)
        else:
            self.metrics.bad_messages.labels("broker", "unexpected_type").inc()

    async def _reply_snapshot(self, inbox: Inbox, identity: bytes, node: str) -> None:
        reply = Message(type=MsgType.SNAPSHOT, sender=BROKER, meta={"seq": self.seq, "incarnation": self.incarnation,
                                                                       "state": self.state()})
        await inbox.reply(identity, reply, node)

    async def _serve(self, inbox: Inbox, pub: Publisher) -> None:
        while True:
            identity, msg = await inbox.recv()
            await self._handle(inbox, pub, identity, msg)

    async def _watch_heartbeats(self, pub: Publisher) -> None:
        """Mark silent nodes lost (failure handling builds on this)."""
        while True:
            await asyncio.sleep(self.topology.timeouts.heartbeat_interval_s)
            now = time.monotonic()
            for name, member in self.members.items():
                if member.state == "up" and now - member.last_seen > self.heartbeat_timeout_s:
                    member.state = "lost"
                    self._set_excluded(self._cluster_of(name), True)
                    log.warning("node %s missed heartbeats for %.1fs: lost", name, now - member.last_seen)
                    await self._publish(pub, "member", {"node": name, "member_state": "lost"})

    def _cluster_of(self, node: str) -> int | None:
        try:
            return self.plan.locate(node)[0]
        except KeyError:
            return None

    def _set_excluded(self, cluster: int | None, excluded: bool) -> None:
        """Drop a cluster with a lost member from the rings until all its members are up again."""
        if cluster is None:
            return
        current = set(self.plan.excluded)
        if excluded:
            current.add(cluster)
        elif all(self.members.get(n, Member(state="lost")).state != "lost"
                 for n in self.plan.clusters[cluster].nodes):
            current.discard(cluster)
        if current != set(self.plan.excluded):
            self.plan = self.plan.model_copy(update={"excluded": sorted(current), "epoch": self.plan.epoch + 1})
            log.info("rings now exclude clusters %s", sorted(current) or "none")

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
        inbox = Inbox.bind(ctx, endpoint(bind, b.router_port), "broker", self.metrics, self.limits, self.opts)
        log.info("broker up: pub %d, router %d, %d nodes in plan", b.pub_port, b.router_port,
                 sum(len(c.nodes) for c in self.plan.clusters))
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._serve(inbox, pub))
                tg.create_task(self._watch_heartbeats(pub))
                tg.create_task(self._until_stopped())
                if self.opts.monitor is not None:  # the Curve (ZAP handler) with CURVE
                    tg.create_task(self.opts.monitor.serve())
        except* _Stopped:
            pass
        finally:
            inbox.close()
            pub.close()
            if self.opts.monitor is not None:
                self.opts.monitor.close()
            ctx.term()
            log.info("broker stopped")


class _Stopped(Exception):
    pass


def run_broker(topology: Topology, plan: Plan, metrics: Metrics, opts: SocketOptions) -> None:
    """Entry point: run until SIGTERM/SIGINT."""
    broker = Broker(topology, plan, metrics, opts)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, broker.stop)
        await broker.run()

    asyncio.run(main())
