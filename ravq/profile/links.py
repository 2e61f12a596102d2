"""Measuring the links of a node: bandwidth and latency to every peer of the topology.

``ravq profile`` serves probes on the node's pipeline port while it probes each peer of the topology in
turn, so running it on every PC at about the same time measures every link.  A link's bandwidth is the
rate at which the peer takes a stream of 1 MiB PROBE messages (first send to last acknowledgement, less
the round trip measured just before), sized to last ``stream_s`` and the median of several repeats;
latency is half the median round trip of small probes.

Streams that run at once disturb each other even on different links: a node whose uplink is full of
its own stream delays and drops the TCP acknowledgements of the stream it receives, which then runs
well below its link's rate (on 100 Mbit/s shaped links, 57 Mbit/s was measured that way).  So every
node takes part in at most one measurement at a time, as sender or receiver (``LinkGate``): a prober
holds its own gate, then asks the peer to hold its gate for it (``reserve``); a busy peer declines
at once and the prober retries after a random pause, so nobody waits while holding a peer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import zmq.asyncio

from ravq.config import Topology
from ravq.config.routes import DIRECT, declared_reach, relays, route
from ravq.metrics import Metrics
from ravq.net.options import SocketOptions, endpoint
from ravq.net.routed import Links, RoutedLink
from ravq.net.security import socket_options_for
from ravq.net.transport import Inbox, Outlink
from ravq.net.wire import DecodeLimits, Message, MsgType
from ravq.profile.session import zmq_session

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
_LIMITS = DecodeLimits()
_OPTIONS = SocketOptions(linger_ms=0)


@dataclass(kw_only=True, slots=True)
class ProbeConfig:
    stream_s: float = 0.5
    """How long one bandwidth measurement should stream (its size follows a first rough rate)."""
    repeats: int = 3
    """Bandwidth measurements per link; the median is kept."""
    pings: int = 5
    """Round trips timed per link for its latency."""
    reply_timeout_s: float = 30.0
    """Longest wait for one acknowledgement once the peer has answered."""
    max_stream_bytes: int = 256 << 20
    reserve_timeout_s: float = 600.0
    """Longest wait for a link to be free at both ends; then it is measured anyway, with a warning."""


@dataclass(kw_only=True, slots=True)
class Link:
    bandwidth_bytes_per_s: float
    latency_s: float


class LinkGate:
    """This node's part in at most one measurement at a time, as the sender or as the receiver.

    Held by the local prober (``hold``) or granted to a peer at once or not at all (``try_hold``); a
    peer's hold lapses ``lease_s`` after its last message, so a prober that died frees it.
    """

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self.clock = clock
        """Seconds, monotonic: what leases and ``hold``'s timeout are timed on."""
        self._holder: str | None = None
        self._expires = 0.0
        self._freed = asyncio.Event()

    @property
    def holder(self) -> str | None:
        if self._holder is not None and self.clock() >= self._expires:
            log.warning("profile: %s went silent while measuring; its reservation lapsed", self._holder)
            self._holder = None
        return self._holder

    def try_hold(self, holder: str, lease_s: float | None = None) -> bool:
        if self.holder not in (None, holder):
            return False
        self._holder, self._expires = holder, self.clock() + (self.lease_s if lease_s is None else lease_s)
        return True

    def renew(self, holder: str) -> None:
        if self._holder == holder:
            self._expires = self.clock() + self.lease_s

    def release(self, holder: str) -> None:
        if self._holder == holder:
            self._holder = None
            self._freed.set()

    async def hold(self, holder: str, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the gate to be free and take it."""
        deadline = self.clock() + timeout_s
        while not self.try_hold(holder, math.inf):  # held until released: this process is alive
            remaining = deadline - self.clock()
            if remaining <= 0:
                return False
            self._freed.clear()
            try:  # a lapsed lease frees the gate without a release: look again now and then
                await asyncio.wait_for(self._freed.wait(), min(remaining, 0.5))
            except TimeoutError:
                pass
        return True


async def serve_probes(ctx: zmq.asyncio.Context, bind_addr: str, name: str, *, stop: asyncio.Event,
                       finished: set[str] | None = None, metrics: Metrics | None = None,
                       options: SocketOptions = _OPTIONS, limits: DecodeLimits = _LIMITS,
                       gate: LinkGate | None = None, bound: Inbox | None = None,
                       routed: Mapping[str, RoutedLink] | None = None) -> None:
    """Acknowledge every PROBE on a ROUTER bound at ``bind_addr`` (or ``bound``, closed here too) until
    ``stop`` is set; the names of peers that say they are done with us are added to ``finished``.  A
    ``reserve`` is granted when ``gate`` (always, without one) lets the peer hold this node, and a
    ``release`` ends that.  Replies to this node's own probes on ``routed`` links go to those links."""
    inbox = (
        bound
        if bound is not None
        else Inbox.bind(ctx, bind_addr, "probe", metrics or Metrics(name), limits, options)
    )
    try:
        while not stop.is_set():
            if not await inbox.readable(0.1):
                continue
            identity, msg = await inbox.recv()
            if msg.type is not MsgType.PROBE:
                continue
            if "kind" not in msg.meta and routed is not None and msg.sender in routed:
                routed[msg.sender].deliver(msg)  # a reply to our own probe, over this ROUTER (issue #24)
                continue
            kind, holder = msg.meta.get("kind"), f"from {msg.sender}"
            meta: dict[str, Any] = {"ack": msg.meta.get("seq")}
            if kind == "done" and finished is not None:
                finished.add(msg.sender)
            if gate is not None:
                if kind == "reserve":
                    meta["granted"] = gate.try_hold(holder)
                elif kind in ("release", "done"):
                    gate.release(holder)
                else:
                    gate.renew(holder)
            await inbox.reply(identity, Message(type=MsgType.PROBE, sender=name, meta=meta), peer=msg.sender)
    finally:
        inbox.close()


class ProbeLink(Protocol):
    """What a ``ProbeClient`` sends on and hears from (``ravq.net.transport.Outlink``)."""

    async def send(self, msg: Message) -> None: ...

    async def recv(self, timeout_s: float) -> Message: ...

    def close(self) -> None: ...


class ProbeClient:
    """Measures one link: round trips for latency, acknowledged streams for bandwidth, timed on ``clock``."""

    def __init__(self, link: ProbeLink, name: str, peer: str, config: ProbeConfig,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.link, self.name, self.peer, self.config, self.clock = link, name, peer, config, clock
        self._seq = 0
        self._payload = torch.zeros(CHUNK_BYTES, dtype=torch.uint8)

    @classmethod
    def connect(cls, ctx: zmq.asyncio.Context, addr: str, name: str, peer: str, config: ProbeConfig,
                metrics: Metrics | None = None, options: SocketOptions = _OPTIONS,
                limits: DecodeLimits = _LIMITS) -> ProbeClient:
        """A client whose DEALER connects to the probe ROUTER at ``addr``."""
        link = Outlink.connect(ctx, addr, "probe", peer, metrics or Metrics(name), limits, options)
        return cls(link, name, peer, config)

    def close(self) -> None:
        self.link.close()

    async def _send(self, kind: str, nbytes: int = 0) -> int:
        self._seq += 1
        tensors = {"payload": self._payload[:nbytes]} if nbytes else {}
        await self.link.send(
            Message(
                type=MsgType.PROBE, sender=self.name, meta={"kind": kind, "seq": self._seq}, tensors=tensors
            )
        )
        return self._seq

    async def _ack(self, seqs: set[int], timeout_s: float) -> int:
        return int((await self._reply(seqs, timeout_s)).meta["ack"])

    async def _reply(self, seqs: set[int], timeout_s: float) -> Message:
        while True:
            reply = await self.link.recv(timeout_s)
            if reply.meta.get("ack") in seqs:
                return reply

    async def reserve(self, gate: LinkGate) -> bool:
        """Hold this node's gate and the peer's; False if that took longer than ``reserve_timeout_s``.
        A peer that does not know reservations (no ``granted`` in its answer) counts as granting."""
        deadline = self.clock() + self.config.reserve_timeout_s
        mine = f"to {self.peer}"
        while await gate.hold(mine, deadline - self.clock()):
            try:
                reply = await self._reply({await self._send("reserve")}, self.config.reply_timeout_s)
            except BaseException:
                gate.release(mine)
                raise
            if reply.meta.get("granted", True):
                return True
            gate.release(mine)
            await asyncio.sleep(random.uniform(0.02, 0.2))  # both sides back off differently
        return False

    async def release(self, gate: LinkGate) -> None:
        gate.release(f"to {self.peer}")
        await self._send("release")  # acknowledged like any probe; the answer is not waited for

    async def wait_ready(self, timeout_s: float) -> bool:
        """Whether the peer answers within ``timeout_s`` (it may not have started yet)."""
        deadline = self.clock() + timeout_s
        while self.clock() < deadline:
            seq = await self._send("ping")
            try:
                await self._ack({seq}, min(1.0, max(0.01, deadline - self.clock())))
                return True
            except TimeoutError:
                continue
        return False

    async def latency_s(self) -> float:
        rtts = []
        for _ in range(self.config.pings):
            t0 = self.clock()
            await self._ack({await self._send("ping")}, self.config.reply_timeout_s)
            rtts.append(self.clock() - t0)
        return statistics.median(rtts) / 2

    async def stream_rate(self, total_bytes: int, round_trip_s: float = 0.0) -> float:
        """Bytes/s at which the peer takes ``total_bytes`` sent back to back in messages of at most 1 MiB.

        Timed from the first send to the last acknowledgement, less one round trip (``round_trip_s``):
        the last byte leaves after total/rate seconds and its acknowledgement comes back a round trip
        later.  Timing from the first acknowledgement instead overstates the rate whenever that one is
        late (a receiver on a small CPU quota, throttled when the first message lands, acknowledges the
        first few together): a 20 Mbit/s upload once read 31 Mbit/s that way.  A late acknowledgement
        can only make this estimate lower, never higher than the link."""
        chunk = min(CHUNK_BYTES, max(1, total_bytes // 4))
        count = max(2, total_bytes // chunk)
        start = self.clock()
        pending = {await self._send("data", chunk) for _ in range(count)}
        while pending:
            pending.discard(await self._ack(pending, self.config.reply_timeout_s))
        elapsed = self.clock() - start - round_trip_s
        return count * chunk / max(elapsed, 1e-9)

    async def measure(self) -> Link:
        latency = await self.latency_s()
        rough = await self.stream_rate(1 << 20, 2 * latency)
        size = int(min(self.config.max_stream_bytes, max(1 << 20, rough * self.config.stream_s)))
        rates = [await self.stream_rate(size, 2 * latency) for _ in range(self.config.repeats)]
        return Link(bandwidth_bytes_per_s=statistics.median(rates), latency_s=latency)

    async def done(self) -> None:
        try:
            await self._ack({await self._send("done")}, 2.0)
        except TimeoutError:
            pass


async def measure_links(
    ctx: zmq.asyncio.Context,
    name: str,
    peers: Mapping[str, str | ProbeLink],
    *,
    wait_s: float,
    config: ProbeConfig,
    metrics: Metrics | None = None,
    options: SocketOptions = _OPTIONS,
    gate: LinkGate | None = None,
) -> dict[str, Link]:
    """Measure the link to each peer (name -> probe address, or a link made already) in turn; a peer
    silent for ``wait_s`` is skipped with a warning.  With ``gate`` (the one ``serve_probes`` uses) each
    measurement waits until neither end takes part in another."""
    links: dict[str, Link] = {}
    deadline = time.monotonic() + wait_s
    for peer, addr in sorted(peers.items()):
        client = (ProbeClient(addr, name, peer, config) if not isinstance(addr, str)
                  else ProbeClient.connect(ctx, addr, name, peer, config, metrics, options))
        try:
            if not await client.wait_ready(max(0.0, deadline - time.monotonic())):
                log.warning(
                    "profile: %s did not answer probes within %.0f s; link not measured", peer, wait_s
                )
                continue
            reserved = gate is None or await client.reserve(gate)
            if not reserved:
                log.warning("profile: %s -> %s stayed busy for %.0f s; measuring it while other streams run",
                            name, peer, config.reserve_timeout_s)
            try:
                links[peer] = await client.measure()
            finally:
                if gate is not None and reserved:
                    await client.release(gate)
            await client.done()
            log.info("profile: link %s -> %s: %.3g MB/s, %.3g ms", name, peer,
                     links[peer].bandwidth_bytes_per_s / 1e6, links[peer].latency_s * 1e3)
        except TimeoutError as err:
            log.warning("profile: link to %s lost while measuring: %s", peer, err)
        finally:
            if isinstance(addr, str):  # a routed link stays: the peer may still probe us over it
                client.close()
    return links


async def profile_links(
    topology: Topology, name: str, *, wait_s: float, config: ProbeConfig
) -> dict[str, Link]:
    """Serve probes on this node's pipeline port while measuring every peer; keep serving until every
    peer said it is done with us (or ``wait_s`` ran out).  Sockets use CURVE when the topology asks."""
    me = topology.node(name)
    peers = {n.name: endpoint(n.host, n.pipeline_port) for n in topology.nodes if n.name != name}
    metrics = Metrics(name)
    # probes stream CHUNK_BYTES tensors: more than a control socket's default frame limit
    options = dataclasses.replace(socket_options_for(topology, name, None, metrics), linger_ms=0,
                                  max_message_bytes=topology.limits.max_message_bytes or 2 * CHUNK_BYTES)
    stop, finished = asyncio.Event(), set[str]()
    gate = LinkGate(lease_s=config.reply_timeout_s)
    async with zmq_session(options) as (ctx, group):
        bind_addr = endpoint(me.bind_host or me.host, me.pipeline_port)
        inbox = Inbox.bind(ctx, bind_addr, "probe", metrics, _LIMITS, options, me=name)
        probe_links, routed = _probe_links(ctx, topology, name, inbox, metrics, options)
        serving = serve_probes(ctx, "", name, stop=stop, finished=finished, metrics=metrics, options=options,
                               gate=gate, bound=inbox, routed=routed)
        group.create_task(serving)
        try:
            links = await measure_links(ctx, name, probe_links, wait_s=wait_s, config=config, metrics=metrics,
                                        options=options, gate=gate)
            deadline = time.monotonic() + wait_s
            while set(peers) - finished and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        finally:
            stop.set()
    return links


def _probe_links(ctx: zmq.asyncio.Context, topology: Topology, name: str, inbox: Inbox, metrics: Metrics,
                 options: SocketOptions) -> tuple[dict[str, str | ProbeLink], dict[str, RoutedLink]]:
    """Each peer's probe address (both reachable), or a link over this node's probe ROUTER where one
    end is declared behind NAT (``ravq.config.routes``; through a relay when both are).  Opened at once:
    a node behind NAT dials its peers before anyone probes it, so their probes reach it too."""
    factory = Links(
        ctx=ctx,
        inbox=inbox,
        me=name,
        socket="probe",
        metrics=metrics,
        limits=_LIMITS,
        opts=options,
        port_of={n.name: (n.host, n.pipeline_port) for n in topology.nodes},
    )
    reach, points = declared_reach(topology), relays(topology)
    out: dict[str, str | ProbeLink] = {}
    for node in topology.nodes:
        if node.name == name:
            continue
        r = route(name, node.name, reach, points)
        out[node.name] = (endpoint(node.host, node.pipeline_port) if r.kind == DIRECT
                          else factory.open(node.name, r))
    return out, factory.routed
