"""A relay: forwards frames between two nodes that are both behind NAT (issue #24).

Neither node can be dialled, so both dial the relay's ROUTER (``ravq.net.routed``: their own ROUTER
connects with the relay's name as routing id, CURVE with the relay's listed key), once per socket kind,
as ``node#pipeline`` or ``node#ring``.  A node sends ``[destination#kind, header, tensors...]``; the
relay hands ``[source, header, tensors...]`` to the destination's connection of the same kind.
``source`` is the routing id of the connection the frames came on, checked
under CURVE against the key ZAP admitted it with, never a name the sender typed: a relay cannot be
used to pose as another node.  The relay never decodes a message: it moves ZeroMQ's own frames
(``copy=False``: no copies beyond ZeroMQ's) and only counts their bytes.

It is not an open proxy: ZAP admits only keys listed in the topology, and only nodes of the topology
may be a source or a destination.  Anything else is counted in ``ravq_relay_dropped_total{reason}``
and dropped: ``unknown_source``, ``spoofed_source`` (routing id and key disagree),
``unknown_destination``, ``malformed`` (too few frames) and ``queue_full``.

Memory is bounded: per destination at most ``queue_bytes`` wait in the relay (a destination not
connected yet, or slower than its senders), plus what ZeroMQ buffers per connection: ``hwm`` messages
each way, each at most ``max_message_bytes`` (frames over it make ZeroMQ drop the connection).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

import zmq
import zmq.asyncio

from ravq.config import RelayConfig, Topology
from ravq.metrics import HopCount, Metrics
from ravq.net import listen
from ravq.net.options import SocketOptions, endpoint
from ravq.net.socket_io import SocketIo, configure

log = logging.getLogger(__name__)

SEP = "#"
"""``node#socket``: a node's routing id at the relay, one per socket kind (``ravq.net.routed.relay_id``)."""
SOCKETS = ("pipeline", "ring", "probe")
"""The socket kinds whose traffic a relay carries."""
RELAY_HWM = 16
"""ZeroMQ's queue per connection, in messages, each way (the relay's own queue is bounded in bytes)."""
MAX_BACKOFF_S = 0.02
HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 1000, 5000
"""ZMTP heartbeats on every relay connection: one silent for 5 s is closed (its routing id is free again)."""


class _Queue:
    """Messages waiting for one destination, bounded in bytes."""

    __slots__ = ("bytes", "items", "ready")

    def __init__(self) -> None:
        self.items: collections.deque[tuple[str, list[Any], int]] = collections.deque()
        self.bytes = 0
        self.ready = asyncio.Event()


class Relay:
    """One relay's ROUTER and its forwarding (``serve``); ``close`` after serve ended."""

    def __init__(self, ctx: zmq.asyncio.Context, addr: str, nodes: Iterable[str], metrics: Metrics,
                 opts: SocketOptions, *, name: str, queue_bytes: int) -> None:
        self.name, self.metrics, self.queue_bytes = name, metrics, queue_bytes
        self.nodes = frozenset(nodes)
        sock = ctx.socket(zmq.ROUTER)
        configure(sock, opts)
        for option in (zmq.SNDHWM, zmq.RCVHWM):
            sock.setsockopt(option, RELAY_HWM)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a destination not connected yet: keep it queued
        # No ROUTER_HANDOVER: a connection that holds a routing id keeps it, so no other listed key can take
        # over a node's traffic by presenting its routing id.  A node that restarts gets its id back once
        # the old connection is gone: at once when its process died (the kernel closes the socket), within
        # the heartbeat timeout when the old path went silent (a router that rebooted, a NAT mapping lost).
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sock.setsockopt(zmq.ROUTING_ID, name.encode())
        self.authenticated = opts.curve is not None
        if opts.curve is not None:
            opts.curve.make_server(sock, "relay")
        elif opts.monitor is not None:
            opts.monitor.watch(sock, "relay")
        listen.bind(sock, addr, "relay")
        self.sock = sock
        self._io = SocketIo(sock)
        self.queues = {f"{n}{SEP}{k}": _Queue() for n in self.nodes for k in SOCKETS}
        """By destination connection: ``node#socket`` (``ravq.net.routed.relay_id``)."""
        self._counts: dict[tuple[str, str], tuple[HopCount, HopCount]] = {}
        self.forwarded_bytes = 0

    async def serve(self) -> None:
        """Read and forward until cancelled: one reader, one writer per destination node."""
        async with asyncio.TaskGroup() as tg:
            for dest in sorted(self.queues):
                tg.create_task(self._write(dest))
            tg.create_task(self._read())

    async def _read(self) -> None:
        while True:
            frames = await self._io.recv()
            self.accept(frames)

    def accept(self, frames: list[Any]) -> bool:
        """Queue one received message (``[source, destination, message...]``) or count and drop it."""
        if len(frames) < 3:
            return self._drop("malformed")
        source, _, kind = bytes(frames[0].bytes).decode(errors="replace").partition(SEP)
        dest = bytes(frames[1].bytes).decode(errors="replace")
        if source not in self.nodes or kind not in SOCKETS:
            return self._drop("unknown_source")
        if self.authenticated and _user_id(frames[2]) != source:
            return self._drop("spoofed_source")
        q = self.queues.get(dest)
        if q is None or not dest.endswith(SEP + kind) or dest.partition(SEP)[0] == source:
            return self._drop("unknown_destination")
        body = frames[2:]
        size = sum(len(memoryview(f)) for f in body)
        if q.bytes + size > self.queue_bytes:
            return self._drop("queue_full")
        q.items.append((source, body, size))
        q.bytes += size
        self.metrics.relay_queued_bytes.labels(dest).set(q.bytes)
        q.ready.set()
        return True

    def _drop(self, reason: str) -> bool:
        self.metrics.relay_dropped.labels(reason).inc()
        return False

    async def _write(self, dest: str) -> None:
        q, dest_id = self.queues[dest], dest.encode()
        while True:
            if not q.items:
                q.ready.clear()
                await q.ready.wait()
                continue
            source, body, size = q.items[0]
            backoff = 0.0005
            while not self._try([dest_id, source.encode(), *body]):
                await asyncio.sleep(backoff)  # not connected yet, or its pipe is full
                backoff = min(2 * backoff, MAX_BACKOFF_S)
            q.items.popleft()
            q.bytes -= size
            self.metrics.relay_queued_bytes.labels(dest).set(q.bytes)
            self._count(source, dest.partition(SEP)[0], size)

    def _try(self, frames: list[Any]) -> bool:
        try:
            return self._io.send_now(frames)
        except zmq.ZMQError as err:
            if err.errno != zmq.EHOSTUNREACH:
                raise
            return False

    def _count(self, source: str, dest: str, size: int) -> None:
        key = (source, dest)
        if (series := self._counts.get(key)) is None:
            series = self._counts[key] = (self.metrics.relayed_bytes.labels(source, dest),
                                          self.metrics.relayed_messages.labels(source, dest))
        series[0].inc(size)
        series[1].inc()
        self.forwarded_bytes += size

    def queued_bytes(self) -> int:
        return sum(q.bytes for q in self.queues.values())

    def close(self) -> None:
        self._io.close(0)


def broker_relay(ctx: zmq.asyncio.Context, topology: Topology, nodes: Iterable[str], metrics: Metrics,
                 opts: SocketOptions, name: str) -> Relay | None:
    """The relay the broker's PC runs by default for nodes behind NAT (``broker.relay_port``; None: none)."""
    b = topology.broker
    if b.relay_port is None:
        return None
    queue_bytes = RelayConfig.model_fields["queue_bytes"].default
    opts = dataclasses.replace(opts, max_message_bytes=topology.limits.max_message_bytes or queue_bytes)
    return Relay(ctx, endpoint(b.bind_host or b.host, b.relay_port), nodes, metrics, opts, name=name,
                 queue_bytes=queue_bytes)


def _user_id(frame: Any) -> str | None:
    try:
        return frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None
