"""``ravq broker``'s entry point, and a broker of a Binary Star pair (``brokers.binarystar``).

Alone (no ``broker.backup`` in the topology) the process runs a ``Broker`` until SIGTERM.  In a pair it
starts passive (``Pair._passive``): it binds its own PUB (its Binary Star state to the peer) and ROUTER
(nodes' requests: their votes), follows the peer's state and, while the peer is active, every topic of
the peer's PUB into a ``Replica`` (a snapshot over a DEALER to the peer's ROUTER first and after every
gap).  Once the state machine says active it closes those sockets and runs a ``Broker`` on the same ports,
from the followed state (``Replica.restore``) when it was passive, from its state directory otherwise;
beside it the ``ActiveSide`` keeps telling the peer its state and hearing the peer's.  A broker that
turns passive while active (two actives met) stops its ``Broker`` and follows the other again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from brokers.binarystar import ACTIVE, PASSIVE, PRIMARY, STATES, TOPIC, BinaryStar
from brokers.replica import Replica, Restored
from brokers.run import Run, save_run, state_dir_for
from brokers.topology import BROKER, Broker
from ravq.config import BrokerConfig, ConfigError, Plan, Topology
from ravq.metrics import Metrics
from ravq.net.clone import GLOBAL, STANDBYS, TICKS, SnapshotParts
from ravq.net.options import SocketOptions, endpoint
from ravq.net.pubsub import Publisher, Subscriber
from ravq.net.transport import Inbox, Outlink
from ravq.net.wire import DecodeLimits, Message, MsgType
from ravq.tuning import BROKER_FILES_PER_NODE, SPARE_FILES, allow_open_files

log = logging.getLogger(__name__)

EXPIRY = 2.0
"""Heartbeat intervals without the peer's state after which a broker counts its peer lost (the guide's
two heartbeats); a node turns to the other broker after as long a silence (``ravq.node.membership``)."""
_VOTES = (MsgType.REGISTER, MsgType.HEARTBEAT, MsgType.SNAPSHOT_REQ, MsgType.REACH_REQ)


def as_backup(topology: Topology, env: dict[str, str]) -> Topology:
    """The topology as the backup's process serves it: ``broker`` is the backup's own address, ports and
    state directory (``broker-backup/`` beside the primary's default), ``broker.backup`` the primary's."""
    b, backup = topology.broker, topology.broker.backup
    if backup is None:
        raise ConfigError("--backup: the topology names no broker.backup")
    state_dir = backup.state_dir
    if state_dir is None:
        default = state_dir_for(None, topology.training.checkpoint_dir, env)
        state_dir = None if default is None else str(Path(default).with_name("broker-backup"))
    primary = backup.model_copy(update={"host": b.host, "bind_host": b.bind_host, "pub_port": b.pub_port,
                                        "router_port": b.router_port, "metrics_port": b.metrics_port,
                                        "state_dir": b.state_dir})
    own = BrokerConfig(host=backup.host, bind_host=backup.bind_host, pub_port=backup.pub_port,
                       router_port=backup.router_port, metrics_port=backup.metrics_port,
                       public_key=b.public_key, state_dir=state_dir, backup=primary)
    return topology.model_copy(update={"broker": own})


class Pair:
    def __init__(self, topology: Topology, plan: Plan, metrics: Metrics, opts: SocketOptions, *,
                 primary: bool, new_run: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        """``topology``: as this broker serves it (``as_backup`` for the backup): ``broker`` is this one,
        ``broker.backup`` its peer."""
        assert topology.broker.backup is not None
        self.topology, self.plan, self.metrics, self.opts = topology, plan, metrics, opts
        self.new_run, self.clock = new_run, clock
        self.interval_s = topology.timeouts.heartbeat_interval_s
        self.star = BinaryStar(primary=primary, expiry_s=EXPIRY * self.interval_s, now=clock())
        self.replica = Replica(clock)
        limits = topology.limits
        self.limits = DecodeLimits(max_header_bytes=limits.max_header_bytes, max_frames=limits.max_frames,
                                   max_tensor_bytes=opts.max_message_bytes)
        self.known = {n.name for n in topology.nodes}
        self.broker: Broker | None = None
        """The broker while this one is active."""
        self._stopping = False
        self._wake = asyncio.Event()
        """Set when this broker turns active or stops: the passive phase ends."""

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self.broker is not None:
            self.broker.stop()

    async def run(self) -> None:
        while not self._stopping:
            restored = await self._passive()
            if self._stopping:
                return
            side = ActiveSide(self, restored)
            self.broker = Broker(self.topology, self.plan, self.metrics, self.opts, new_run=self.new_run,
                                 pair=side)
            if restored is not None:  # a restart of this broker continues the run it took over
                save_run(self.broker.state_dir, self.broker.the_run)
            self.new_run = False
            self._gauges()
            await self.broker.run()
            self.broker = None
            self._gauges()
            self.replica = Replica(self.clock)

    def _gauges(self) -> None:
        self.metrics.broker_active.labels(self.star.role).set(1 if self.star.active else 0)

    def state_message(self) -> Message:
        meta = {"kind": "bstar", "state": self.star.state, "term": self.star.term, "seq": self.star.term}
        return Message(type=MsgType.UPDATE, sender=BROKER, meta=meta)

    def peer_message(self, msg: Message) -> bool:
        """A message from the peer's PUB; True when it was its Binary Star state."""
        if msg.meta.get("kind") != "bstar" or msg.meta.get("state") not in STATES:
            return False
        self.star.peer_said(str(msg.meta["state"]), int(msg.meta.get("term", 0)), self.clock())
        return True

    def public(self) -> dict[str, Any]:
        b = self.topology.broker
        assert b.backup is not None
        return {**self.star.public(self.clock()), "peer_address": f"{b.backup.host}:{b.backup.router_port}"}

    # ------------------------------------------------------------------ passive
    async def _passive(self) -> Restored | None:
        """Until this broker must serve (or stop): follow the peer, answer votes; what to serve from."""
        self._gauges()
        ctx = zmq.asyncio.Context()
        b = self.topology.broker
        assert b.backup is not None
        bind = b.bind_host or b.host
        pub = Publisher.bind(ctx, endpoint(bind, b.pub_port), self.metrics, self.opts)
        inbox = Inbox.bind(ctx, endpoint(bind, b.router_port), "broker", self.metrics, self.limits, self.opts,
                           one_shot_clients=True)
        peer_pub = endpoint(b.backup.host, b.backup.pub_port)
        # the peer's state on a socket of its own, read at once whatever a snapshot request waits for
        said = Subscriber.connect(ctx, peer_pub, self.metrics, self.limits, self.opts, [TOPIC])
        sub = Subscriber.connect(ctx, peer_pub, self.metrics, self.limits, self.opts, [GLOBAL, "c", STANDBYS])
        link = Outlink.connect(ctx, endpoint(b.backup.host, b.backup.router_port), "peer", BROKER,
                               self.metrics, self.limits, self.opts)
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._say_state(pub)), tg.create_task(self._hear(said)),
                         tg.create_task(self._follow(sub, link)), tg.create_task(self._votes(inbox))]
                if self.opts.monitor is not None:  # the Curve (ZAP handler) with CURVE
                    tasks.append(tg.create_task(self.opts.monitor.serve()))
                await self._wake.wait()
                for task in tasks:
                    task.cancel()
        finally:
            for sock in (pub, inbox, said, sub, link):
                sock.sock.setsockopt(zmq.LINGER, 0)
                sock.close()
            if self.opts.monitor is not None:  # its sockets are of this context; the broker's are its own
                self.opts.monitor.close()
            ctx.term()
        self._wake.clear()
        if self._stopping or self.star.changes[-1].before != PASSIVE:
            return None  # a first start, or a primary that heard nobody: the run from its state directory
        self.metrics.broker_failovers.labels(self.star.role).inc()
        base = Run(run_id="", explicit=self.new_run, base=self.plan, plan=self.plan, created_at=time.time())
        if self.replica.plan() is None:
            log.warning("taking over without the peer's state (never received): from the state directory")
            return None
        t = self.topology.timeouts
        standbys = [n.name for n in self.topology.nodes]
        return self.replica.restore(base, lost_s=t.lost_s, replace_s=t.replace_s, standbys=standbys,
                                    now=self.clock(), term=self.star.term)

    def _check_active(self) -> None:
        if self.star.active:
            self._wake.set()

    async def _say_state(self, pub: Publisher) -> None:
        while True:
            await pub.publish(self.state_message(), TOPIC)
            await asyncio.sleep(self.interval_s / TICKS)

    async def _hear(self, said: Subscriber) -> None:
        """The peer's state messages."""
        while True:
            self.peer_message(await said.recv())
            self._check_active()

    async def _follow(self, sub: Subscriber, link: Outlink) -> None:
        """The peer's updates into the replica while it is active (a whole snapshot first and on a gap; the
        updates that come meanwhile wait in the socket and are applied after it, the clone pattern's way)."""
        while True:
            msg = await sub.recv()
            if msg.type != MsgType.UPDATE or self.star.peer != ACTIVE or self.replica.apply_update(msg.meta):
                continue
            with contextlib.suppress(TimeoutError, KeyError, TypeError, ValueError):
                self.replica.apply_snapshot(await self._snapshot(link), self.clock())

    async def _snapshot(self, link: Outlink) -> list[dict[str, Any]]:
        await link.send(Message(type=MsgType.SNAPSHOT_REQ, sender=BROKER, meta={"mine": False}))
        parts = SnapshotParts()
        while True:
            reply = await link.recv(self.topology.timeouts.request_s)
            if reply.type == MsgType.SNAPSHOT and (whole := parts.add(reply.meta)) is not None:
                return whole

    async def _votes(self, inbox: Inbox) -> None:
        """Nodes' requests: each a vote (``BinaryStar.vote``); one this broker does not serve is answered
        ``passive`` when the node waits for a reply, so it turns to the other broker at once."""
        while True:
            identity, msg = await inbox.recv()
            if msg.type == MsgType.STATUS_REQ:
                meta = {"pair": self.public(), "run_id": self.replica.values.get("run", {}).get("run_id"),
                        "seq": self.replica.seq, "passive": True}
                status = Message(type=MsgType.STATUS, sender=BROKER, meta=meta)
                await inbox.reply(identity, status, msg.sender)
                continue
            if msg.type not in _VOTES or msg.sender not in self.known:
                continue
            self.star.vote(self.clock())
            self._check_active()
            if not self.star.active and msg.type in (MsgType.REGISTER, MsgType.SNAPSHOT_REQ):
                reply = Message(type=MsgType.REPLY, sender=BROKER, meta={"passive": True})
                await inbox.reply(identity, reply, msg.sender)


class ActiveSide:
    """What the active broker of a pair runs beside its own work (``brokers.binarystar.Pairing``)."""

    def __init__(self, pair: Pair, restored: Restored | None) -> None:
        self.pair, self.restored, self.role = pair, restored, pair.star.role
        self.by: dict[str, Any] = {"role": pair.star.role, "term": pair.star.term}

    async def serve(self, publish: Callable[[Message, str], Awaitable[None]],
                    stop: Callable[[], None]) -> None:
        """Tell the peer this broker's state ``TICKS`` times an interval and hear the peer's; ``stop`` the
        broker when this one turns passive (two actives met and the peer's term is newer)."""
        p = self.pair
        b = p.topology.broker
        assert b.backup is not None
        ctx = zmq.asyncio.Context()
        sub = Subscriber.connect(ctx, endpoint(b.backup.host, b.backup.pub_port), p.metrics, p.limits, p.opts,
                                 [TOPIC])
        loop = asyncio.get_running_loop()
        try:
            while p.star.active:
                await publish(p.state_message(), TOPIC)
                deadline = loop.time() + p.interval_s / TICKS
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(deadline):
                        while p.star.active:
                            p.peer_message(await sub.recv())
            log.warning("broker %s: passive now; stopping this broker's service", self.role)
            stop()
        finally:
            sub.sock.setsockopt(zmq.LINGER, 0)
            sub.close()
            ctx.term()

    def public(self) -> dict[str, Any]:
        return self.pair.public()


def run_broker(topology: Topology, plan: Plan, metrics: Metrics, opts: SocketOptions, *,
               new_run: bool = False, backup: bool = False) -> None:
    """Entry point: run until SIGTERM/SIGINT; ``backup``: as ``broker.backup`` (``topology`` as
    ``as_backup`` made it).  First the open files it may hold: two connections for every node."""
    nodes = len(topology.nodes)
    allow_open_files(BROKER_FILES_PER_NODE * nodes + SPARE_FILES, f"a broker of {nodes} nodes")
    if topology.broker.backup is None:
        broker = Broker(topology, plan, metrics, opts, new_run=new_run)
        metrics.broker_active.labels(PRIMARY).set(1)
        run, stop = broker.run, broker.stop
    else:
        pair = Pair(topology, plan, metrics, opts, primary=not backup, new_run=new_run)
        run, stop = pair.run, pair.stop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop)
        await run()

    asyncio.run(main())

