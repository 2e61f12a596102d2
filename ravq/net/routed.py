"""Links that do not need the peer to be dialled: sending over this node's own ROUTER (issue #24).

A node behind NAT cannot be dialled, but it can dial out, and ZeroMQ lets either end of a connection bind.
So on a link between a reachable node and one behind NAT (``ravq.config.routes``), the node behind NAT
connects its bound ROUTER (the same socket, the same CURVE keys) to the reachable node's ROUTER,
naming the peer's routing id (``ZMQ_CONNECT_ROUTING_ID``); the reachable node knows it by the routing
id it presents (its name).  Both directions then use that one connection, each end sending on its
ROUTER to the other's routing id.  Two nodes behind NAT both dial a relay (``ravq.net.relay``) and send
to it ``[relay, destination, message...]``; the relay delivers ``[relay, source, message...]``.

``RoutedLink`` is such a link to one peer, with ``Outlink``'s face (``send``, ``recv`` for catch-up
replies, ``close``).  A ROUTER set up with ``me`` (``Inbox.bind``) refuses to send to a peer that is not
connected (EHOSTUNREACH) rather than dropping the message, so ``send`` waits until the peer is there
(it dials in, or this side's connection comes up), as a DEALER queues until connected; a full pipe to
the peer (its high-water mark) also waits.  Nothing is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import zmq

from ravq.config.routes import ACCEPT, DIAL, DIRECT, RELAY, Route
from ravq.metrics import Metrics
from ravq.net.options import SocketOptions, endpoint
from ravq.net.socket_io import HopMetrics
from ravq.net.transport import Context, Inbox, Outlink
from ravq.net.wire import DecodeLimits, Message, encode

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 0.02
"""Longest pause between two tries of a send the peer cannot take yet (not connected, or its pipe full)."""
MAX_REPLIES = 1024
"""Replies (catch-up, probe acknowledgements) held for a ``recv``; more are counted and dropped."""


class RoutedLink:
    """This node's link to ``peer`` over its ROUTER ``inbox``: straight to the peer's routing id
    (``accept``/``dial``) or through ``relay``."""

    def __init__(self, inbox: Inbox, peer: str, metrics: Metrics, relay: str | None = None,
                 dialled: str | None = None) -> None:
        self.inbox, self.peer, self.metrics, self.relay = inbox, peer, metrics, relay
        self.name = inbox.name
        self.dialled = dialled
        """The endpoint this link's connection dialled (None: the peer dials in, or a shared relay)."""
        self._prefix = [relay.encode(), relay_id(peer, inbox.name).encode()] if relay else [peer.encode()]
        self._hops = HopMetrics(metrics, inbox.name)
        self._lock = asyncio.Lock()
        self._replies: asyncio.Queue[Message] = asyncio.Queue(MAX_REPLIES)
        self.waits = 0
        """Sends that found the peer not connected or its pipe full (and waited)."""

    async def send(self, msg: Message) -> None:
        frames = encode(msg)
        t0 = time.perf_counter()
        if not self._lock.locked() and self._try([*self._prefix, *frames]):
            self._hops.sent(self.peer, msg, frames, t0)
            return
        async with self._lock:  # messages that had to wait go in order
            backoff = 0.0005
            self.waits += 1
            while not self._try([*self._prefix, *frames]):
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, MAX_BACKOFF_S)
        self._hops.sent(self.peer, msg, frames, t0)

    def _try(self, frames: list[object]) -> bool:
        try:
            return self.inbox.try_send(frames)
        except zmq.ZMQError as err:
            if err.errno != zmq.EHOSTUNREACH:
                raise
            return False

    def deliver(self, msg: Message) -> None:
        """A reply from the peer that arrived on the ROUTER (catch-up); ``recv`` returns it."""
        try:
            self._replies.put_nowait(msg)
        except asyncio.QueueFull:
            self.metrics.bad_messages.labels(self.name, "unread_reply").inc()

    async def recv(self, timeout_s: float) -> Message:
        try:
            async with asyncio.timeout(timeout_s):
                return await self._replies.get()
        except TimeoutError:
            raise TimeoutError(f"no reply from {self.peer} within {timeout_s:.1f}s") from None

    def close(self) -> None:
        """Nothing to close: the connection (if this end dialled it) stays with the ROUTER, which may link
        to the same peer again (libzmq aborts on a second connection with the same routing id)."""


def relay_id(node: str, socket: str) -> str:
    """A node's routing id at a relay: one per socket kind (a node's pipeline and ring ROUTERs both dial
    the relay, and one routing id can name one connection only)."""
    return f"{node}{RELAY_ID_SEP}{socket}"


RELAY_ID_SEP = "#"


def dial(inbox: Inbox, addr: str, peer: str, key_name: str, routing_id: str | None = None) -> None:
    """Connect ``inbox``'s ROUTER to ``peer``'s ROUTER at ``addr`` (``key_name``: whose CURVE key to
    pin: the peer's, or the broker's for the broker's relay; ``routing_id``: what this connection is
    called there, if not the socket's own)."""
    if peer in inbox.dialled:  # libzmq aborts the process on a second connection with one routing id
        raise ValueError(f"{inbox.name}: already dialled {peer}")
    sock, curve = inbox.sock, inbox.opts.curve if inbox.opts is not None else None
    if curve is not None:
        sock.curve_server = False  # this connection's side of the handshake; the bound side stays a server
        curve.make_client(sock, key_name)
    own = sock.getsockopt(zmq.ROUTING_ID)
    if routing_id is not None:  # options are read when a connection is made: set it for this one only
        sock.setsockopt(zmq.ROUTING_ID, routing_id.encode())
    sock.setsockopt(zmq.CONNECT_ROUTING_ID, peer.encode())
    sock.connect(addr)
    inbox.note_dialled(peer)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, own)
    if curve is not None:
        sock.curve_server = True


class Links:
    """Makes one node's links on one socket kind (pipeline or ring) along their routes, and keeps each
    relay dialled once whatever number of links go through it."""

    def __init__(self, *, ctx: Context, inbox: Inbox, me: str, socket: str, metrics: Metrics,
                 limits: DecodeLimits, opts: SocketOptions, port_of: Mapping[str, tuple[str, int]]) -> None:
        """``port_of``: peer -> (host, port) of its ROUTER for this socket kind."""
        self.ctx, self.inbox, self.me, self.socket = ctx, inbox, me, socket
        self.metrics, self.limits, self.opts, self.port_of = metrics, limits, opts, port_of
        self.relays_dialled: set[str] = set()
        self.routed: dict[str, RoutedLink] = {}
        """Links of this kind that go over the ROUTER, by peer (their catch-up replies arrive there)."""
        self.routes: dict[str, str] = {}
        """Each peer's route (``relay:NAME`` through a relay), for heartbeats and ``ravq status``."""

    def open(self, peer: str, route: Route, key_name: str | None = None) -> Outlink | RoutedLink:
        self.metrics.link_routes.labels(self.socket, peer).set(_ROUTE_CODE[route.kind])
        self.routes[peer] = f"relay:{route.relay.name}" if route.relay is not None else route.kind
        if route.kind == DIRECT:
            return Outlink.connect(
                self.ctx,
                endpoint(*self.port_of[peer]),
                self.socket,
                peer,
                self.metrics,
                self.limits,
                self.opts,
                identity=self.me,
            )
        link: RoutedLink
        if route.kind == ACCEPT:
            link = RoutedLink(self.inbox, peer, self.metrics)
        elif route.kind == DIAL:
            addr = endpoint(*self.port_of[peer])
            if peer not in self.inbox.dialled:  # else the connection made before is still there
                dial(self.inbox, addr, peer, key_name or peer)
            link = RoutedLink(self.inbox, peer, self.metrics, dialled=addr)
        else:
            assert route.kind == RELAY and route.relay is not None
            r = route.relay
            if r.name not in self.relays_dialled:
                dial(self.inbox, endpoint(r.host, r.port), r.name, r.name, relay_id(self.me, self.socket))
                self.relays_dialled.add(r.name)
            self.inbox.reach_through(peer, r.name)
            link = RoutedLink(self.inbox, peer, self.metrics, relay=r.name)
        self.routed[peer] = link
        return link

    def forget(self, peer: str) -> None:
        self.routed.pop(peer, None)
        self.routes.pop(peer, None)
        self.inbox.forget_relay_of(peer)


_ROUTE_CODE = {DIRECT: 0, ACCEPT: 1, DIAL: 2, RELAY: 3}
"""``ravq_link_route``'s value per route."""
