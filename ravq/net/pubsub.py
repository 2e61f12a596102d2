"""The topology's PUB/SUB sockets: the broker's ``Publisher`` and a node's ``Subscriber``.

Each update is one message after a topic frame, which ZeroMQ filters by prefix (``ravq.net.clone``);
received ones are decoded and validated, and a malformed one is counted and dropped.  One over the
header limit is counted, logged once and counted in ``oversized`` too: its reader fetches the state
another way (a snapshot, ``ravq.node.membership``).  Both count their messages per peer and type
(``ravq.net.socket_io``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import zmq
import zmq.asyncio

from ravq.metrics import Metrics
from ravq.net import listen
from ravq.net.options import SocketOptions
from ravq.net.socket_io import HopMetrics, SocketIo, configure
from ravq.net.wire import DecodeLimits, Message, WireError, decode, encode

log = logging.getLogger(__name__)


class Publisher:
    """The broker's PUB socket; each update is one message."""

    def __init__(self, sock: zmq.asyncio.Socket, metrics: Metrics) -> None:
        self.sock, self.metrics = sock, metrics
        self._io = SocketIo(sock)
        self._hops = HopMetrics(metrics, "pub")

    @classmethod
    def bind(cls, ctx: zmq.asyncio.Context, addr: str, metrics: Metrics, opts: SocketOptions) -> Publisher:
        sock = ctx.socket(zmq.PUB)
        configure(sock, opts)
        if opts.curve is not None:
            opts.curve.make_server(sock, "pub")
        elif opts.monitor is not None:
            opts.monitor.watch(sock, "pub")
        listen.bind(sock, addr, "pub")
        return cls(sock, metrics)

    async def publish(self, msg: Message, topic: str = "") -> None:
        """Send ``msg`` on ``topic`` (subscribers whose prefix it starts with receive it)."""
        frames = encode(msg)
        t0 = time.perf_counter()
        await self._io.send([topic.encode(), *frames])
        self._hops.sent("*", msg, frames, t0)

    def close(self) -> None:
        self._io.close()


class Subscriber:
    """A node's SUB socket on the broker's PUB."""

    def __init__(self, sock: zmq.asyncio.Socket, metrics: Metrics, limits: DecodeLimits) -> None:
        self.sock, self.metrics, self.limits = sock, metrics, limits
        self._io = SocketIo(sock)
        self._hops = HopMetrics(metrics, "sub")
        self.topics: set[str] = set()
        self.oversized = 0
        """Updates dropped for a header over ``limits.max_header_bytes`` (each counted and the first
        logged): the reader fetches the state another way."""

    @classmethod
    def connect(cls, ctx: zmq.asyncio.Context, addr: str, metrics: Metrics, limits: DecodeLimits,
                opts: SocketOptions, topics: Iterable[str] = ("",)) -> Subscriber:
        """A SUB on ``addr`` receiving the topics that start with one of ``topics`` (default: all)."""
        sock = ctx.socket(zmq.SUB)
        configure(sock, opts)
        if opts.curve is not None:
            opts.curve.make_client(sock, "broker")
        sock.connect(addr)
        sub = cls(sock, metrics, limits)
        for topic in topics:
            sub.subscribe(topic)
        return sub

    def subscribe(self, topic: str) -> None:
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.topics.add(topic)

    def unsubscribe(self, topic: str) -> None:
        self.sock.setsockopt(zmq.UNSUBSCRIBE, topic.encode())
        self.topics.discard(topic)

    async def recv(self) -> Message:
        while True:
            frames = (await self._io.recv())[1:]  # after the topic
            try:
                msg = decode(frames, self.limits)
            except WireError as err:
                self.metrics.bad_messages.labels("sub", err.reason).inc()
                if err.reason == "header_too_large":
                    if not self.oversized:
                        log.error("an update from the broker is over max_header_bytes (%d; %s): "
                                  "dropped and the state fetched another way (logged once; "
                                  "ravq_bad_messages_total{socket=sub,reason=header_too_large} counts them)",
                                  self.limits.max_header_bytes, err)
                    self.oversized += 1
                continue
            self._hops.received(msg.sender, msg, frames)
            return msg

    def close(self) -> None:
        self._io.close()
