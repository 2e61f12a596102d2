"""ZeroMQ sockets: pipeline and ring links (DEALER -> ROUTER), broker requests, topology PUB/SUB.

Every socket is a ``zmq.asyncio`` socket owned by the task that made it and closed with ``linger``
set.  Received messages are decoded and validated here; a malformed one is counted and dropped and
never reaches the caller.  Sends and receives are counted per peer and message type.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from ravq.metrics import Metrics
from ravq.wire import DecodeLimits, Message, WireError, decode, encode

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class SocketOptions:
    """Options shared by every socket of a process."""

    max_message_bytes: int = 1 << 30
    """ZMQ_MAXMSGSIZE: larger frames make ZeroMQ drop the connection."""
    hwm: int = 1000
    """High-water mark: a second guard behind credit-based flow control."""
    linger_ms: int = 1000
    """How long close() may wait to flush queued messages."""
    curve: Any = None
    """A ``ravq.security.Curve`` (keys and ZAP authenticator) or None for plaintext."""


def endpoint(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def _nbytes(frames: list[Any]) -> int:
    return sum(len(memoryview(f)) for f in frames)


class _HopMetrics:
    """One socket's per-(peer, type) metric children, looked up once.

    ``labels()`` costs more than the increment itself (about 1.8 us against 0.5 us), and every message
    pays it several times; on a 64 KiB pipeline message that is a visible share of the link's time.
    """

    def __init__(self, metrics: Metrics, socket: str) -> None:
        self.metrics, self.socket = metrics, socket
        self._sent: dict[tuple[str, str], tuple[Any, Any, Any]] = {}
        self._received: dict[tuple[str, str], tuple[Any, Any, Any]] = {}

    def sent(self, peer: str, msg: Message, frames: list[Any], t0: float) -> None:
        key = (peer, msg.type)
        if (children := self._sent.get(key)) is None:
            m, labels = self.metrics, (self.socket, peer, msg.type)
            children = self._sent[key] = (m.send_seconds.labels(*labels), m.messages_sent.labels(*labels),
                                          m.bytes_sent.labels(*labels))
        children[0].observe(time.perf_counter() - t0)
        children[1].inc()
        children[2].inc(_nbytes(frames))

    def received(self, peer: str, msg: Message, frames: list[Any], latency: bool = False) -> None:
        """Count a decoded message; with ``latency``, observe sender timestamp -> now."""
        key = (peer, msg.type)
        if (children := self._received.get(key)) is None:
            m, labels = self.metrics, (self.socket, peer, msg.type)
            children = self._received[key] = (m.messages_received.labels(*labels),
                                              m.bytes_received.labels(*labels),
                                              m.receive_seconds.labels(*labels))
        children[0].inc()
        children[1].inc(_nbytes(frames))
        if latency:
            children[2].observe(max(0.0, time.time() - msg.sent_at))


async def _recv_frames(sock: zmq.asyncio.Socket) -> list[Any]:
    """The next multipart message, without copies.

    A message already queued is taken with DONTWAIT, pyzmq's short-circuit: its general path (a
    Future registered with the loop, socket events polled) costs about 15 us more per message, a
    third of a 64 KiB message's time on loopback.
    """
    try:
        return await sock.recv_multipart(zmq.DONTWAIT, copy=False)
    except zmq.Again:
        return await sock.recv_multipart(copy=False)


def _configure(sock: zmq.asyncio.Socket, opts: SocketOptions) -> None:
    sock.setsockopt(zmq.LINGER, opts.linger_ms)
    sock.setsockopt(zmq.MAXMSGSIZE, opts.max_message_bytes)
    sock.setsockopt(zmq.SNDHWM, opts.hwm)
    sock.setsockopt(zmq.RCVHWM, opts.hwm)


class Inbox:
    """A bound ROUTER: receives validated messages from many peers and can reply to each."""

    def __init__(self, sock: zmq.asyncio.Socket, name: str, metrics: Metrics, limits: DecodeLimits,
                 authenticated: bool = False) -> None:
        self.sock, self.name, self.metrics, self.limits = sock, name, metrics, limits
        self.authenticated = authenticated
        """With CURVE, a message's ``sender`` must be the name ZAP bound to the key that sent it."""
        self._hops = _HopMetrics(metrics, name)

    @classmethod
    def bind(cls, ctx: zmq.asyncio.Context, addr: str, name: str, metrics: Metrics,
             limits: DecodeLimits, opts: SocketOptions) -> Inbox:
        sock = ctx.socket(zmq.ROUTER)
        _configure(sock, opts)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if opts.curve is not None:
            opts.curve.make_server(sock, name)
        sock.bind(addr)
        return cls(sock, name, metrics, limits, authenticated=opts.curve is not None)

    async def recv(self) -> tuple[bytes, Message]:
        """The next valid message and the identity of the peer that sent it."""
        while True:
            frames = await _recv_frames(self.sock)
            if len(frames) < 2:
                self.metrics.bad_messages.labels(self.name, "no_identity").inc()
                continue
            identity = frames[0].bytes
            try:
                msg = decode(frames[1:], self.limits)
            except WireError as err:
                self.metrics.bad_messages.labels(self.name, err.reason).inc()
                log.debug("%s: dropped malformed message: %s", self.name, err)
                continue
            if self.authenticated and _user_id(frames[1]) != msg.sender:
                self.metrics.bad_messages.labels(self.name, "sender_mismatch").inc()
                continue
            self._hops.received(msg.sender, msg, frames[1:], latency=True)
            return identity, msg

    async def reply(self, identity: bytes, msg: Message, peer: str = "") -> None:
        frames = encode(msg)
        t0 = time.perf_counter()
        await self.sock.send_multipart([identity, *frames], copy=False)
        self._hops.sent(peer or identity.decode(errors="replace"), msg, frames, t0)

    def close(self) -> None:
        self.sock.close()


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
        self._hops = _HopMetrics(metrics, name)

    @classmethod
    def connect(cls, ctx: zmq.asyncio.Context, addr: str, name: str, peer: str, metrics: Metrics,
                limits: DecodeLimits, opts: SocketOptions, identity: str = "") -> Outlink:
        sock = ctx.socket(zmq.DEALER)
        _configure(sock, opts)
        if identity:
            sock.setsockopt(zmq.IDENTITY, identity.encode())
        if opts.curve is not None:
            opts.curve.make_client(sock, peer)
        sock.connect(addr)
        return cls(sock, name, peer, metrics, limits)

    async def send(self, msg: Message) -> None:
        frames = encode(msg)
        t0 = time.perf_counter()
        await self.sock.send_multipart(frames, copy=False)
        self._hops.sent(self.peer, msg, frames, t0)

    async def recv(self, timeout_s: float) -> Message:
        """A reply from the peer; raises TimeoutError.  Malformed replies are counted and skipped."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await self.sock.poll(remaining * 1000):
                raise TimeoutError(f"no reply from {self.peer} within {timeout_s:.1f}s")
            frames = await self.sock.recv_multipart(copy=False)
            try:
                msg = decode(frames, self.limits)
            except WireError as err:
                self.metrics.bad_messages.labels(self.name, err.reason).inc()
                continue
            self._hops.received(self.peer, msg, frames)
            return msg

    def close(self) -> None:
        self.sock.close()


class Publisher:
    """The broker's PUB socket; each update is one message."""

    def __init__(self, sock: zmq.asyncio.Socket, metrics: Metrics) -> None:
        self.sock, self.metrics = sock, metrics
        self._hops = _HopMetrics(metrics, "pub")

    @classmethod
    def bind(cls, ctx: zmq.asyncio.Context, addr: str, metrics: Metrics, opts: SocketOptions) -> Publisher:
        sock = ctx.socket(zmq.PUB)
        _configure(sock, opts)
        if opts.curve is not None:
            opts.curve.make_server(sock, "pub")
        sock.bind(addr)
        return cls(sock, metrics)

    async def publish(self, msg: Message) -> None:
        frames = encode(msg)
        t0 = time.perf_counter()
        await self.sock.send_multipart(frames, copy=False)
        self._hops.sent("*", msg, frames, t0)

    def close(self) -> None:
        self.sock.close()


class Subscriber:
    """A node's SUB socket on the broker's PUB."""

    def __init__(self, sock: zmq.asyncio.Socket, metrics: Metrics, limits: DecodeLimits) -> None:
        self.sock, self.metrics, self.limits = sock, metrics, limits
        self._hops = _HopMetrics(metrics, "sub")

    @classmethod
    def connect(cls, ctx: zmq.asyncio.Context, addr: str, metrics: Metrics, limits: DecodeLimits,
                opts: SocketOptions) -> Subscriber:
        sock = ctx.socket(zmq.SUB)
        _configure(sock, opts)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        if opts.curve is not None:
            opts.curve.make_client(sock, "broker")
        sock.connect(addr)
        return cls(sock, metrics, limits)

    async def recv(self) -> Message:
        while True:
            frames = await _recv_frames(self.sock)
            try:
                msg = decode(frames, self.limits)
            except WireError as err:
                self.metrics.bad_messages.labels("sub", err.reason).inc()
                continue
            self._hops.received(msg.sender, msg, frames)
            return msg

    def close(self) -> None:
        self.sock.close()


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


def install_uvloop() -> None:
    """Use uvloop for the process's event loop when it is available."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; kept for odd platforms
        log.warning("uvloop not available; using the default asyncio loop")
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
