"""A node's side of the broker protocol (ZeroMQ clone pattern): its sockets to the broker.

Subscribe first, then register and take a snapshot; from then on every published update is applied to
the broker's state as this node holds it (``ravq.swarm.membership.MembershipState``, which this client
is).  Heartbeats (``ravq.net.protocol.Heartbeat``) are sent without waiting and carry what the broker
must know to rebuild its book after a restart (this process's incarnation, its cluster generation and
phase), so a slow or restarting broker never stalls training.
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
from ravq.swarm.membership import MembershipState
from ravq.swarm.report import NodeReport, Progress

log = logging.getLogger("ravq.swarm.membership")  # the lines it always logged


class BrokerUnavailable(RuntimeError):
    pass


class Membership(MembershipState):
    def __init__(self, ctx: zmq.asyncio.Context, topology: Topology, name: str, metrics: Metrics,
                 limits: DecodeLimits, opts: SocketOptions, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(name=name, metrics=metrics, clock=clock)
        self.topology = topology
        b = topology.broker
        self.sub = Subscriber.connect(ctx, endpoint(b.host, b.pub_port), metrics, limits, opts)
        self.link = Outlink.connect(ctx, endpoint(b.host, b.router_port), "broker", "broker", metrics, limits,
                                    opts, identity=name)
        self.reach_ports: list[str] | None = None
        """The ports this node asked the broker to dial back (``wait_reach``); None before it asked."""
        self.report = NodeReport()
        """What every heartbeat tells the broker besides its progress and statistics."""

    async def _request(self, kind: MsgType, timeout_s: float) -> Message:
        meta = Register(incarnation=self.report.incarnation).meta() if kind == MsgType.REGISTER else {}
        await self.link.send(Message(type=kind, sender=self.name, meta=meta))
        while True:
            reply = await self.link.recv(timeout_s)
            if reply.type == MsgType.SNAPSHOT:
                return reply

    async def _snapshot(self) -> None:
        """Ask for the broker's full state and apply it (TimeoutError after ``timeouts.request_s``)."""
        self.apply_state((await self._request(MsgType.SNAPSHOT_REQ, self.topology.timeouts.request_s)).meta)

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
        self.apply_state(reply.meta)
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
                await self._snapshot()
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
                raise TimeoutError(f"no reachability verdict within {timeout_s:.0f}s for: "
                                   f"{', '.join(missing)}")
            await asyncio.sleep(0.2)
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
        """Apply published updates for as long as the node runs (each state update carries the full
        state; silence updates carry only how long each member has been silent)."""
        while True:
            msg = await self.sub.recv()
            if msg.type == MsgType.UPDATE and msg.meta.get("kind") == "silence":
                self.apply_silence(msg.meta)
                continue
            if msg.type != MsgType.UPDATE or not isinstance(msg.meta.get("state"), dict):
                continue
            if not self.is_news(msg.meta):
                continue
            try:
                self.apply_state(msg.meta)
            except (KeyError, ValueError):
                self.metrics.bad_messages.labels("broker", "bad_state").inc()

    async def _ask_reach(self, ports: list[str]) -> None:
        request = ReachRequest(ports=ports)
        await self.link.send(Message(type=MsgType.REACH_REQ, sender=self.name, meta=request.meta()))

    async def heartbeat(self, progress: Progress, stats: dict[str, Any], *, done: bool) -> None:
        """A heartbeat; and the reachability request again while the broker's state has no verdict on this
        node after it asked: a restarted broker knows none, and a whole cluster that restarts with it waits at
        its first start for every member's verdict (it stayed ``starting`` until ``connect_s``)."""
        beat = self.report.heartbeat(progress, stats, done=done)
        await self.link.send(Message(type=MsgType.HEARTBEAT, sender=self.name, meta=beat.meta()))
        if self.reach_ports is not None and self.name not in self.reach:
            await self._ask_reach(self.reach_ports)

    def close(self) -> None:
        self.sub.close()
        self.link.close()


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
