"""Point-to-point links over ZeroMQ: a bound ROUTER that hears many peers (``Inbox``), a DEALER to one
peer's ROUTER (``Outlink``), and one request/reply round trip (``request``).

Pipeline links, ring links and broker requests all use these.  Every socket is a ``zmq.asyncio`` socket
owned by the task that made it and closed with ``linger`` set.  Received messages are decoded and
validated here; a malformed one is counted and dropped and never reaches the caller.  Sends and
receives are counted per peer and message type (``ravq.net.socket_io``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import zmq
import zmq.asyncio

from ravq.metrics import Metrics
from ravq.net import listen
from ravq.net.options import SocketOptions
from ravq.net.socket_io import HopMetrics, SocketIo, configure
from ravq.net.wire import WIRE_REASONS, DecodeLimits, Message, WireError, decode, encode

log = logging.getLogger(__name__)

Context = zmq.asyncio.Context  # the type layers above ravq.net annotate a context with, never importing zmq


class Inbox:
    """A bound ROUTER: receives validated messages from many peers and can reply to each."""

    def __init__(self, sock: zmq.asyncio.Socket, name: str, metrics: Metrics, limits: DecodeLimits,
                 authenticated: bool = False, opts: SocketOptions | None = None, peers_as: str | None = None
                 ) -> None:
        self.sock, self.name, self.metrics, self.limits = sock, name, metrics, limits
        self.authenticated = authenticated
        """With CURVE, a message's ``sender`` must be the name ZAP bound to the key that sent it."""
        self.opts = opts
        self.relays: frozenset[str] = frozenset()
        """Routing ids of relays (``ravq.net.routed``): their messages carry the source node in a frame."""
        self.dialled: set[str] = set()
        """Routing ids of the connections this ROUTER dialled (peers, relays): their keys were pinned."""
        self.via_relay: dict[str, str] = {}
        """Peers this node reaches through a relay: replies to them go there."""
        self._io = SocketIo(sock)
        self._hops = HopMetrics(metrics, name, peers_as)
        for reason in (*WIRE_REASONS, "no_identity", *(("sender_mismatch",) if authenticated else ())):
            metrics.bad_messages.labels(name, reason)  # at 0 from the start: increase() sees the first

    @classmethod
    def bind(cls, ctx: zmq.asyncio.Context, addr: str, name: str, metrics: Metrics,
             limits: DecodeLimits, opts: SocketOptions, me: str = "", *, one_shot_clients: bool = False,
             authenticate: bool = True, peers_as: str | None = None) -> Inbox:
        """``me``: this process's name as its routing id, for the connections this ROUTER dials itself
        (``ravq.net.routed``: a node behind NAT dials out); it also refuses (EHOSTUNREACH) to send to a
        peer that is not connected instead of dropping silently.  ``one_shot_clients``: clients that
        connect for one request and leave (the broker's: ``ravq status``), so a closed connection is no
        dropped one.  ``authenticate`` (with CURVE): a message's sender must be its key's name.
        ``peers_as``: count every peer's messages under this one label (``HopMetrics``)."""
        sock = ctx.socket(zmq.ROUTER)
        configure(sock, opts)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if me:
            sock.setsockopt(zmq.ROUTING_ID, me.encode())
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if opts.curve is not None:
            opts.curve.make_server(sock, name, count_closed=not one_shot_clients)
        elif opts.monitor is not None:
            opts.monitor.watch(sock, name, count_closed=not one_shot_clients)
        listen.bind(sock, addr, name)
        authenticated = authenticate and opts.curve is not None
        return cls(sock, name, metrics, limits, authenticated=authenticated, opts=opts, peers_as=peers_as)

    def note_dialled(self, peer: str) -> None:
        """This ROUTER made a connection to ``peer`` (its key pinned); ``peer`` is its routing id there."""
        self.dialled.add(peer)

    def reach_through(self, peer: str, relay: str) -> None:
        """Reach ``peer`` through ``relay``: the relay's messages carry their source in a frame, and
        replies to ``peer`` go to the relay."""
        self.relays = self.relays | {relay}
        self.via_relay[peer] = relay

    def forget_relay_of(self, peer: str) -> None:
        self.via_relay.pop(peer, None)

    async def recv(self) -> tuple[bytes, Message]:
        """The next valid message and the identity of the peer that sent it."""
        while True:
            if (got := self._accept(await self._io.recv())) is not None:
                return got

    def recv_queued(self) -> tuple[bytes, Message] | None:
        """The next valid message already queued (None when none is): a receiver drains a burst without a
        coroutine and a look at the socket's state per message (a broker's thousands of heartbeats)."""
        while True:
            try:
                frames = self._io.recv_now()
            except zmq.Again:
                return None
            if (got := self._accept(frames)) is not None:
                return got

    def _accept(self, frames: list[Any]) -> tuple[bytes, Message] | None:
        """A received message decoded and checked (None: dropped and counted)."""
        if len(frames) < 2:
            self.metrics.bad_messages.labels(self.name, "no_identity").inc()
            return None
        identity = frames[0].bytes
        source: str | None = None
        if self.relays and identity.decode(errors="replace") in self.relays:
            if len(frames) < 3:  # relayed: [relay, source node, header, tensors...]
                self.metrics.bad_messages.labels(self.name, "no_source").inc()
                return None
            source, frames = frames[1].bytes.decode(errors="replace"), [frames[0], *frames[2:]]
        try:
            msg = decode(frames[1:], self.limits)
        except WireError as err:
            self.metrics.bad_messages.labels(self.name, err.reason).inc()
            log.debug("%s: dropped malformed message: %s", self.name, err)
            return None
        # With CURVE a direct sender is the key's name; a relayed one is the relay's key's name and the
        # source the relay stamped (it stamps its own authenticated peer, not what the sender claims).
        if source is not None and source != msg.sender:
            self.metrics.bad_messages.labels(self.name, "sender_mismatch").inc()
            return None
        expected = msg.sender if source is None else identity.decode(errors="replace")
        if self.authenticated and not self._authentic(identity, frames[1], expected):
            self.metrics.bad_messages.labels(self.name, "sender_mismatch").inc()
            return None
        self._hops.received(msg.sender, msg, frames[1:], latency=True)
        return (identity if source is None else source.encode()), msg

    def _authentic(self, identity: bytes, frame: Any, expected: str) -> bool:
        """Whether ``expected`` sent ``frame`` under CURVE.  On connections others made to this ROUTER,
        ZAP named the key (User-Id); on one this ROUTER dialled itself (``ravq.net.routed``) there is no
        ZAP, but the handshake pinned the peer's listed key, and the routing id is the one given at dial."""
        user = _user_id(frame)
        if user is not None:
            return user == expected
        return (
            identity.decode(errors="replace") in self.dialled
            and identity.decode(errors="replace") == expected
        )

    async def readable(self, timeout_s: float) -> bool:
        """Whether a message (perhaps a malformed one) arrives within ``timeout_s``."""
        return await self._io.readable(timeout_s)

    def queued(self) -> bool:
        """Whether a message (perhaps a malformed one) is queued: ``recv`` would not wait for it."""
        return self._io.queued()

    async def reply(self, identity: bytes, msg: Message, peer: str = "") -> None:
        """Send ``msg`` to the peer that sent ``identity``'s message; one gone meanwhile is skipped."""
        frames = encode(msg)
        t0 = time.perf_counter()
        relay = self.via_relay.get(peer) if peer else None
        prefix = [relay.encode(), f"{peer}#{self.name}".encode()] if relay else [identity]  # routed.relay_id
        try:
            await self._io.send([*prefix, *frames])
        except zmq.ZMQError as err:
            if err.errno != zmq.EHOSTUNREACH:
                raise
            self.metrics.bad_messages.labels(self.name, "reply_unroutable").inc()
            return
        self._hops.sent(peer or identity.decode(errors="replace"), msg, frames, t0)

    def try_send(self, frames: list[Any]) -> bool:
        """Queue a routed message (``[routing id, ...]``) if the socket takes it at once; raises
        ``zmq.ZMQError(EHOSTUNREACH)`` while that peer is not connected (``me`` set at bind)."""
        return self._io.send_now(frames)

    def close(self) -> None:
        self._io.close()


def _user_id(frame: Any) -> str | None:
    """The peer name ZAP bound to the CURVE key that sent ``frame`` (None without CURVE)."""
    try:
        return frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None


class Outlink:
    """A DEALER connected to one peer's ROUTER."""

    def __init__(self, sock: zmq.asyncio.Socket, name: str, peer: str, metrics: Metrics,
                 limits: DecodeLimits) -> None:
        self.sock, self.name, self.peer, self.metrics, self.limits = sock, name, peer, metrics, limits
        self._io = SocketIo(sock)
        self._hops = HopMetrics(metrics, name)

    @classmethod
    def connect(cls, ctx: zmq.asyncio.Context, addr: str, name: str, peer: str, metrics: Metrics,
                limits: DecodeLimits, opts: SocketOptions, identity: str = "") -> Outlink:
        sock = ctx.socket(zmq.DEALER)
        configure(sock, opts)
        if identity:
            sock.setsockopt(zmq.IDENTITY, identity.encode())
        if opts.curve is not None:
            opts.curve.make_client(sock, peer)
        sock.connect(addr)
        return cls(sock, name, peer, metrics, limits)

    async def send(self, msg: Message) -> None:
        frames = encode(msg)
        t0 = time.perf_counter()
        await self._io.send(frames)
        self._hops.sent(self.peer, msg, frames, t0)

    async def recv(self, timeout_s: float) -> Message:
        """A reply from the peer; raises TimeoutError.  Malformed replies are counted and skipped."""
        loop = asyncio.get_running_loop()  # the clock the waits below run on
        deadline = loop.time() + timeout_s
        while True:
            try:
                frames = self._io.recv_now()
            except zmq.Again:
                remaining = deadline - loop.time()
                if remaining <= 0 or not await self._io.readable(remaining):
                    raise TimeoutError(f"no reply from {self.peer} within {timeout_s:.1f}s") from None
                continue
            try:
                msg = decode(frames, self.limits)
            except WireError as err:
                self.metrics.bad_messages.labels(self.name, err.reason).inc()
                continue
            self._hops.received(self.peer, msg, frames)
            return msg

    def close(self) -> None:
        self._io.close()


async def request(ctx: zmq.asyncio.Context, addr: str, msg: Message, timeout_s: float, metrics: Metrics,
                  limits: DecodeLimits, opts: SocketOptions, peer: str = "broker") -> Message:
    """One request/reply round trip on a fresh DEALER (used for broker requests and CLI status)."""
    link = Outlink.connect(ctx, addr, "request", peer, metrics, limits, opts)
    try:
        await link.send(msg)
        return await link.recv(timeout_s)
    finally:
        link.sock.setsockopt(zmq.LINGER, 0)
        link.close()
