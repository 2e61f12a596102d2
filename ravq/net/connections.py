"""Following the connections of a process's server sockets, to count the ones that fail.

``ConnectionMonitor`` watches every server socket (pipeline and ring ROUTERs, the broker's ROUTER and
PUB) through ZeroMQ's socket monitor and counts, in ``ravq_connections_dropped_total{socket,reason}``,
connections that fail their handshake (``handshake_failed``: garbage, a wrong protocol, a client
that gives up) and established ones that close (``closed``: a peer that went away, or one ZeroMQ
dropped for announcing a frame over ``limits.max_message_bytes``).  ``ravq.net.security.Curve`` is one
that also authenticates, and counts failed handshakes as authentication failures instead.

A socket that serves one-shot requests (the broker's ROUTER: ``ravq status``, the demo's live view)
sees clients come and go by design, so its closed connections are not counted there (``count_closed``);
its failed handshakes are.  Every series a watched socket can count is exported at 0 from the start,
so ``increase()`` sees its first event.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ravq.metrics import Metrics

log = logging.getLogger(__name__)

# Failed handshakes a server's monitor reports.  A ZAP denial also raises
# EVENT_HANDSHAKE_FAILED_AUTH; it is not counted again because the ZAP handler already counted it.
HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
_MONITORED = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | HANDSHAKE_FAILED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_MONITOR_STOPPED
)
MAX_WARNED = 256
"""Distinct (socket, reason, endpoint) a process logs at WARNING; later ones only at DEBUG."""


class ConnectionMonitor:
    """Watches the connections of a process's server sockets (ROUTERs, PUB) and counts those that fail.

    libzmq reports a garbage or broken greeting with a handshake-failed event only sometimes (under
    CURVE a connection that sends garbage is just accepted and disconnected), so connections are
    followed from EVENT_ACCEPTED (keyed by file descriptor) to their end: one that disconnects before
    a handshake succeeded failed it.  libzmq's handshake events carry no descriptor; with one I/O thread
    they come in order, and each settles the oldest pending connection (counts stay exact; which
    descriptor is marked may swap between two handshakes running at once, and so may the order of two
    handshakes' events on a CURVE node's two I/O threads: ``ravq.net.options.io_threads``).

    Lifecycle: ``watch`` server sockets as they are made, run ``serve()`` in the process's TaskGroup,
    ``close()`` after it ended and before the zmq context is terminated.
    """

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._monitors: list[tuple[zmq.asyncio.Socket, str]] = []
        self._unserved: list[tuple[zmq.asyncio.Socket, str]] = []  # (socket, "" for ZAP or server name)
        self._wakeup: asyncio.Event | None = None
        self._warned: set[tuple[str, str, str]] = set()
        self._closes_normal: set[str] = set()
        """Sockets whose closed connections are not counted (``watch(count_closed=False)``)."""

    def watch(self, sock: zmq.asyncio.Socket, name: str, *, count_closed: bool = True) -> None:
        """Follow the connections of server socket ``sock`` (before it binds).  ``count_closed``: count
        established connections that close (False where clients come and go by design)."""
        monitor = sock.get_monitor_socket(_MONITORED)
        monitor.linger = 0
        self._monitors.append((monitor, name))
        if not count_closed:
            self._closes_normal.add(name)
        self._zero(name)
        self._adopt(monitor, name)

    def _zero(self, socket: str) -> None:
        """Export the series ``socket`` may count at 0 (a counter born at its first event hides it)."""
        self.metrics.connections_dropped.labels(socket, "handshake_failed")
        if socket not in self._closes_normal:
            self.metrics.connections_dropped.labels(socket, "closed")

    async def serve(self) -> None:
        """Watch every server socket (and answer ZAP requests, for CURVE), until cancelled."""
        self._wakeup = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            while True:
                while self._unserved:
                    sock, server = self._unserved.pop()
                    tg.create_task(self._serve_one(sock, server))
                await self._wakeup.wait()
                self._wakeup.clear()

    def close(self) -> None:
        """Close the monitor sockets (after serve has ended)."""
        for sock, _ in self._monitors:
            sock.close(linger=0)
        self._monitors.clear()

    def _adopt(self, sock: zmq.asyncio.Socket, server: str) -> None:
        self._unserved.append((sock, server))
        if self._wakeup is not None:
            self._wakeup.set()

    async def _serve_one(self, sock: zmq.asyncio.Socket, server: str) -> None:
        await self._watch(sock, server)

    async def _watch(self, monitor: zmq.asyncio.Socket, server: str) -> None:
        book = Handshakes()
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            kind, value = event["event"], int(event["value"])
            where = event["endpoint"].decode(errors="replace")
            if kind == zmq.EVENT_MONITOR_STOPPED:
                return
            outcome = book.event(kind, value)
            if outcome == "failed":
                self._handshake_failed(server, where)
            elif outcome == "closed" and server not in self._closes_normal:
                self.metrics.connections_dropped.labels(server, "closed").inc()
                self._note(server, "closed", where, "a connection closed (peer gone, or dropped for a frame "
                                                    "over limits.max_message_bytes)", logging.INFO)

    def _handshake_failed(self, socket: str, where: str) -> None:
        self.metrics.connections_dropped.labels(socket, "handshake_failed").inc()
        self._note(socket, "handshake_failed", where, "refused a connection (handshake_failed)")

    def _note(self, socket: str, reason: str, where: str, what: str, level: int = logging.WARNING) -> None:
        key = (socket, reason, where)
        if key in self._warned or len(self._warned) >= MAX_WARNED:
            log.debug("%s: %s at %s", socket, what, where)
            return
        self._warned.add(key)
        log.log(level, "%s: %s at %s; further ones are only counted", socket, what, where)


class Handshakes:
    """Which accepted connections of one server socket settled their handshake, from its monitor's events.

    ``EVENT_ACCEPTED`` and ``EVENT_DISCONNECTED`` carry the connection's descriptor; the handshake events do
    not, so when several connections are accepted at once (a peer's link and the broker's reachability probe
    at a node's start) a success cannot be pinned on one of them.  It is kept as a credit of the pending
    connections instead: one of them that disconnects while a credit is left is taken for the one that
    succeeded (a normal close), and when there are as many credits as pending connections, all of them
    are established.  A connection that ends before its handshake with no credit left failed it."""

    def __init__(self) -> None:
        self.pending: dict[int, None] = {}  # accepted, handshake not settled (in order)
        self.established: set[int] = set()
        self.succeeded = 0  # handshakes that succeeded among ``pending``, not yet pinned on one

    def event(self, kind: int, value: int) -> str | None:
        """Book one monitor event; ``"failed"`` (a handshake failed, counted unless ZAP did), ``"closed"`` (an
        established connection closed), or None."""
        outcome = None
        if kind == zmq.EVENT_ACCEPTED:
            self.pending[value] = None
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.succeeded += 1
        elif kind & (HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_FAILED_AUTH):
            if len(self.pending) > self.succeeded:  # one of those not known to have succeeded
                self.pending.pop(next(iter(self.pending)))
            outcome = "failed" if kind & HANDSHAKE_FAILED else None
        elif kind == zmq.EVENT_DISCONNECTED:
            if value in self.pending:
                del self.pending[value]
                if self.succeeded:  # ended after a handshake that succeeded, as far as anyone can tell
                    self.succeeded -= 1
                    outcome = "closed"
                else:  # ended before its handshake did: garbage, or a client that gave up
                    outcome = "failed"
            elif value in self.established:
                self.established.discard(value)
                outcome = "closed"
        if self.pending and self.succeeded >= len(self.pending):
            self.established.update(self.pending)
            self.pending.clear()
            self.succeeded = 0
        return outcome
