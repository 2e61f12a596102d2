"""The topology's PUB/SUB sockets: the broker's ``Publisher`` and a node's ``Subscriber``.

Each update is one message; received ones are decoded and validated, and a malformed one is counted
and dropped.  Both count their messages per peer and type (``ravq.net.socket_io``).
"""

from __future__ import annotations

import time

import zmq
import zmq.asyncio

from ravq.metrics import Metrics
from ravq.net import listen
from ravq.net.options import SocketOptions
from ravq.net.socket_io import HopMetrics, SocketIo, configure
from ravq.net.wire import DecodeLimits, Message, WireError, decode, encode


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

    async def publish(self, msg: Message) -> None:
        frames = encode(msg)
        t0 = time.perf_counter()
        await self._io.send(frames)
        self._hops.sent("*", msg, frames, t0)

    def close(self) -> None:
        self._io.close()


class Subscriber:
    """A node's SUB socket on the broker's PUB."""

    def __init__(self, sock: zmq.asyncio.Socket, metrics: Metrics, limits: DecodeLimits) -> None:
        self.sock, self.metrics, self.limits = sock, metrics, limits
        self._io = SocketIo(sock)
        self._hops = HopMetrics(metrics, "sub")

    @classmethod
    def connect(cls, ctx: zmq.asyncio.Context, addr: str, metrics: Metrics, limits: DecodeLimits,
                opts: SocketOptions) -> Subscriber:
        sock = ctx.socket(zmq.SUB)
        configure(sock, opts)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        if opts.curve is not None:
            opts.curve.make_client(sock, "broker")
        sock.connect(addr)
        return cls(sock, metrics, limits)

    async def recv(self) -> Message:
        while True:
            frames = await self._io.recv()
            try:
                msg = decode(frames, self.limits)
            except WireError as err:
                self.metrics.bad_messages.labels("sub", err.reason).inc()
                continue
            self._hops.received(msg.sender, msg, frames)
            return msg

    def close(self) -> None:
        self._io.close()
