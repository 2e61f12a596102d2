"""A node's side of the broker protocol (ZeroMQ clone pattern).

Subscribe first, then register and take a snapshot; apply published updates whose sequence number
follows the snapshot's; on a gap, or when the broker restarted (new incarnation), take a fresh
snapshot.  Heartbeats are sent without waiting, so a slow or restarting broker never stalls training.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import zmq.asyncio

from ravq.config import Plan, Topology
from ravq.metrics import Metrics
from ravq.transport import Outlink, SocketOptions, Subscriber, endpoint
from ravq.wire import DecodeLimits, Message, MsgType

log = logging.getLogger(__name__)


class BrokerUnavailable(RuntimeError):
    pass


class Membership:
    def __init__(self, ctx: zmq.asyncio.Context, topology: Topology, name: str, metrics: Metrics,
                 limits: DecodeLimits, opts: SocketOptions) -> None:
        self.topology, self.name, self.metrics = topology, name, metrics
        b = topology.broker
        self.sub = Subscriber.connect(ctx, endpoint(b.host, b.pub_port), metrics, limits, opts)
        self.link = Outlink.connect(ctx, endpoint(b.host, b.router_port), "broker", "broker", metrics, limits,
                                    opts, identity=name)
        self.seq = -1
        self.incarnation: str | None = None
        self.plan: Plan | None = None
        self.run_id: str | None = None
        """The broker's run id (checkpoints carry it)."""
        self.members: dict[str, str] = {}
        self.changed = asyncio.Event()

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
        self.run_id = state.get("run_id") if isinstance(state.get("run_id"), str) else self.run_id
        self.seq = int(meta["seq"])
        self.incarnation = meta.get("incarnation")
        self.changed.set()

    async def _request(self, kind: MsgType, timeout_s: float) -> Message:
        await self.link.send(Message(type=kind, sender=self.name))
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

    async def follow(self) -> None:
        """Apply published updates for as long as the node runs."""
        while True:
            msg = await self.sub.recv()
            if msg.type != MsgType.UPDATE:
                continue
            seq, incarnation = int(msg.meta["seq"]), msg.meta.get("incarnation")
            if incarnation == self.incarnation and seq <= self.seq:
                continue
            if incarnation == self.incarnation and seq == self.seq + 1:
                self._apply_state(msg.meta)
                continue
            log.info("%s: update %d after %d (broker %s): taking a snapshot", self.name, seq, self.seq,
                     "restarted" if incarnation != self.incarnation else "gap")
            try:
                await self.link.send(Message(type=MsgType.SNAPSHOT_REQ, sender=self.name))
            except Exception:
                log.debug("snapshot request failed", exc_info=True)
            # the reply arrives on the DEALER; read it without blocking updates for long
            try:
                reply = await self.link.recv(self.topology.timeouts.request_s)
                if reply.type == MsgType.SNAPSHOT:
                    self._apply_state(reply.meta)
            except TimeoutError:
                self.metrics.peer_timeouts.labels("broker", "snapshot").inc()

    async def heartbeat(self, stats: dict[str, Any], done: bool) -> None:
        await self.link.send(Message(type=MsgType.HEARTBEAT, sender=self.name, meta={"stats": stats, "done": done}))

    def close(self) -> None:
        self.sub.close()
        self.link.close()
