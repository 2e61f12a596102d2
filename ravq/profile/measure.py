"""Measuring a node for the planner: compute, usable memory, and bandwidth and latency to every peer.

``ravq profile`` on a node measures FLOP/s (matmuls, and training steps of the task's own model: its
forward + backward FLOPs, counted with the same ``FlopCounterMode`` as the model profile, over the time
of forward, backward and optimizer step), usable memory, and its links: it serves probes on its
pipeline port while it probes each peer of the topology in turn, so running it on every PC at about
the same time measures every link.  A link's bandwidth is the rate at which the
peer takes a stream of 1 MiB PROBE messages (first send to last acknowledgement, less the round trip
measured just before), sized to last ``stream_s`` and the median of several repeats; latency is half
the median round trip of small probes.

Streams that run at once disturb each other even on different links: a node whose uplink is full of
its own stream delays and drops the TCP acknowledgements of the stream it receives, which then runs
well below its link's rate (on 100 Mbit/s shaped links, 57 Mbit/s was measured that way).  So every
node takes part in at most one measurement at a time, as sender or receiver (``LinkGate``): a prober
holds its own gate, then asks the peer to hold its gate for it (``reserve``); a busy peer declines
at once and the prober retries after a random pause, so nobody waits while holding a peer.  The result is ``profile-NAME.json``; ``load_profiles`` reads them
back as planner ``NodeProfile``s with the topology's overrides applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import random
import statistics
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
import zmq
import zmq.asyncio
from torch.utils.flop_counter import FlopCounterMode

from ravq.average import ring as allreduce
from ravq.net import compress
from ravq.average.averager import RingLinks
from ravq.net.compress import Format, Packed
from ravq.config import ConfigError, Topology, load_topology, resolve_task_module
from ravq.metrics import Metrics
from ravq.planner import NodeProfile, PlanError, cut_plan, make_plan, topology_clusters, training_settings
from ravq.planner.types import size_text
from ravq.average.ring_compression import RingCompression
from ravq.net.security import socket_options_for
from ravq.net.transport import Inbox, Outlink, SocketOptions, endpoint
from ravq.net.wire import DecodeLimits, Message, MsgType

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
_LIMITS = DecodeLimits()
_OPTIONS = SocketOptions(linger_ms=0)
MEMORY_HEADROOM = 0.1
"""Share of the available memory left to the operating system and the node's own runtime."""


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


@dataclass(kw_only=True, slots=True)
class Measurement:
    name: str
    device: str
    flops: float
    """FLOP/s the planner uses: training steps of the task's model (matmul FLOP/s without a task)."""
    matmul_flops: float
    model_flops: float | None
    memory_bytes: int
    bandwidth_bytes_per_s: dict[str, float] = field(default_factory=dict)
    latency_s: dict[str, float] = field(default_factory=dict)
    flops_windows: list[float] = field(default_factory=list)
    """The model FLOP/s of each measurement window (``measure_compute``)."""
    flops_spread: float | None = None
    """(max - min) / flops over those windows: how far to trust ``flops`` (None: not measured)."""
    cpu_share: float | None = None
    """CPU seconds per wall second the compute measurement got (see ``ComputeSample.cpu_share``)."""
    message_s: list[list[float]] = field(default_factory=list)
    """[tensor bytes, seconds] of one pipeline message at this PC's compute speed: the CPU seconds of
    ``message_cpu_s`` over ``cpu_share`` (``measure_messages``); the planner's ``NodeProfile.message_s``."""
    message_cpu_s: list[list[float]] = field(default_factory=list)
    """[tensor bytes, CPU seconds] of one message, packed, sent, received and unpacked, as measured."""
    ring_s: list[float] = field(default_factory=list)
    """[parameter bytes, seconds] of this node's part of one averaging round in a ring of two at this
    PC's compute speed: ``ring_cpu_s`` over ``cpu_share`` (``measure_ring``); the planner's
    ``NodeProfile.ring_s_per_byte``.  Empty: not measured."""
    ring_cpu_s: list[float] = field(default_factory=list)
    """[parameter bytes, CPU seconds] of that round as measured."""


# ------------------------------------------------------------------ compute and memory


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def measure_matmul_flops(device: str = "cpu", seconds: float = 1.0, size: int = 1024) -> float:
    """Achieved FLOP/s of square float32 matmuls."""
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    a @ b
    _sync(device)
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or count < 2:
        a @ b
        count += 1
        _sync(device)
    return 2 * size ** 3 * count / (time.perf_counter() - t0)


def _training_step(task: Any, micro_batch: int, device: str, optimizer: bool) -> tuple[Callable[[], None], float]:
    """One training step of the task's whole model on one real micro-batch, and its forward + backward
    FLOPs (counted as the block profile counts them)."""
    torch.manual_seed(0)
    model = task.build_model().to(device)
    inputs, targets = next(iter(task.train_batches(micro_batch, 0, 1, 0)))
    inputs = tuple(x.to(device) for x in (inputs if isinstance(inputs, (tuple, list)) else (inputs,)))
    targets = targets.to(device)
    update = task.make_optimizer(model.parameters()) if optimizer else None

    def forward_backward() -> None:
        model.zero_grad(set_to_none=True)
        task.loss_fn(model(*inputs), targets).backward()

    def step() -> None:
        forward_backward()
        if update is not None:
            update.step()
        _sync(device)

    with FlopCounterMode(display=False) as counter:
        forward_backward()
    _sync(device)
    return step, float(counter.get_total_flops())


def _timed_steps(step: Callable[[], None], seconds: float, min_steps: int = 2) -> tuple[int, float]:
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or count < min_steps:
        step()
        count += 1
    return count, time.perf_counter() - t0


def measure_model_flops(task: Any, micro_batch: int, device: str = "cpu", seconds: float = 1.5,
                        optimizer: bool = True) -> float:
    """Achieved FLOP/s of training the task's whole model on one real micro-batch: the forward + backward
    FLOPs (counted as the block profile counts them) over the time of forward, backward and, with
    ``optimizer``, the task's optimizer step, which every stage also runs per micro-batch (it counts no
    FLOPs but takes time: about a tenth of a step for the demo's model on a CPU)."""
    step, flops = _training_step(task, micro_batch, device, optimizer)
    count, elapsed = _timed_steps(step, seconds)
    return flops * count / elapsed


WINDOW_STEPS = 4
"""Training steps a compute window holds at least (``measure_compute``)."""


@dataclass(kw_only=True, slots=True)
class ComputeSample:
    """Training FLOP/s measured over several windows, and how much the windows disagree."""

    flops: float
    """The median window's FLOP/s: one window disturbed by other work does not move it."""
    window_flops: list[float]
    spread: float
    """(max - min) / flops over the windows: 0.05 means the windows were within 5% of each other."""
    cpu_share: float
    """CPU seconds this process got per wall second over the windows: 1.0 for a core to itself, less
    under a CPU quota or when other work shares the core (then the figure holds only while it does)."""


def measure_compute(task: Any, micro_batch: int, device: str = "cpu", *, window_s: float = 1.2,
                    windows: int = 5, warmup_s: float = 0.3, window_steps: int = WINDOW_STEPS) -> ComputeSample:
    """``measure_model_flops`` done so that two runs on the same PC agree: a warm-up (first calls,
    allocator, lazy initialisation) that is not counted, then ``windows`` windows of ``window_s`` and
    at least ``window_steps`` training steps each, and the median window kept.  On a slow PC a step
    takes most of a second: windows of two steps (the earlier minimum) were within 9-20% of each other
    on the testbed's 0.14-core PCs, and their profiles moved ~10% from run to run.

    One short sample misjudges a PC whose CPU time comes in slices (a cgroup quota runs a process for
    its share of every 100 ms period, then stops it; another process may take the core for a while):
    a single 1.5 s sample judged one PC 2.2x off.  Windows of a second or more hold several such
    periods, the median ignores a window that other work disturbed, and the spread says how far to
    trust the figure."""
    step, flops = _training_step(task, micro_batch, device, optimizer=True)
    _timed_steps(step, warmup_s)
    rates = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(max(1, windows)):
        count, elapsed = _timed_steps(step, window_s, window_steps)
        rates.append(flops * count / elapsed)
    share = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    middle = statistics.median(rates)
    return ComputeSample(flops=middle, window_flops=rates, spread=(max(rates) - min(rates)) / middle,
                         cpu_share=share)


def usable_memory_bytes(device: str = "cpu", meminfo: str = "/proc/meminfo",
                        cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int:
    """Free device memory (cuda) or MemAvailable (otherwise), less MEMORY_HEADROOM.  On a CPU the memory
    cgroup's limit less its usage caps it when lower (a container or a systemd MemoryMax= limit)."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free * (1 - MEMORY_HEADROOM))
    available = None
    for line in Path(meminfo).read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    if available is None:
        raise RuntimeError(f"{meminfo} has no MemAvailable line")
    limited = cgroup_memory_free(cgroup_root, proc_cgroup)
    return int(min(available, limited if limited is not None else available) * (1 - MEMORY_HEADROOM))


def cgroup_memory_free(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """Limit less usage of this process's memory cgroup (v1 ``memory.limit_in_bytes`` or v2
    ``memory.max``), or None when it has no limit or no such file can be read."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            group, limit_file, usage_file = Path(cgroup_root, "memory", path.lstrip("/")), "memory.limit_in_bytes", \
                "memory.usage_in_bytes"
        elif controllers == "":
            group, limit_file, usage_file = Path(cgroup_root, path.lstrip("/")), "memory.max", "memory.current"
        else:
            continue
        try:
            limit_text = (group / limit_file).read_text().strip()
            usage = int((group / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= 1 << 60:  # v1 reports "no limit" as a huge number
            continue
        return max(0, int(limit_text) - usage)
    return None


@contextlib.asynccontextmanager
async def _zmq_session(options: SocketOptions) -> AsyncIterator[tuple[zmq.asyncio.Context, asyncio.TaskGroup]]:
    """A zmq context and the process's TaskGroup, with CURVE's ZAP requests answered in it (when the
    options have a monitor); on the way out the ZAP task is cancelled, the monitor closed and the
    context destroyed."""
    ctx = zmq.asyncio.Context()
    try:
        async with asyncio.TaskGroup() as group:
            zap = group.create_task(options.monitor.serve()) if options.monitor else None
            try:
                yield ctx, group
            finally:
                if zap is not None:
                    zap.cancel()
    finally:
        if options.monitor:
            options.monitor.close()
        ctx.destroy(linger=0)


# ------------------------------------------------------------------ messages


MESSAGE_SIZES = (16 << 10, 256 << 10, 1 << 20, 4 << 20)
"""Float32 tensor bytes at which ``measure_messages`` times a message; the planner interpolates."""


@dataclass(kw_only=True, slots=True)
class MessageConfig:
    sizes: tuple[int, ...] = MESSAGE_SIZES
    cpu_s: float = 0.15
    """CPU seconds spent timing each size (at least ``min_messages`` messages)."""
    min_messages: int = 8
    window: int = 4
    """Messages sent before they are received, as a pipeline keeps several in flight."""


async def _message_cpu_s(inbox: Inbox, outlink: Outlink, name: str, tensor: torch.Tensor, fmt: Format,
                         block: int, config: MessageConfig) -> float:
    """CPU seconds of this process (every thread: ours, ZeroMQ's I/O and CURVE) per message of ``tensor``."""
    async def batch(count: int, first: int) -> None:
        for i in range(count):
            packed = compress.pack(tensor, fmt, block)
            plain, squeezed = ({}, {"o0": packed}) if isinstance(packed, Packed) else ({"o0": packed}, {})
            await outlink.send(Message(type=MsgType.FORWARD, sender=name, micro_batch=(0, first + i), version=0,
                                       meta={"gen": 0}, tensors=plain, packed=squeezed))
        for _ in range(count):
            _, msg = await inbox.recv()
            got: torch.Tensor | Packed = msg.packed["o0"] if "o0" in msg.packed else msg.tensors["o0"]
            compress.unpack(got, tensor.dtype).to(tensor.device)

    await batch(2, 0)  # connection, allocator and first-call costs are not counted
    count, cpu0 = 0, time.process_time()
    while time.process_time() - cpu0 < config.cpu_s or count < config.min_messages:
        await batch(config.window, count)
        count += config.window
    return (time.process_time() - cpu0) / count


async def _measure_messages(topology: Topology, name: str, config: MessageConfig) -> list[list[float]]:
    me, training = topology.node(name), topology.training
    metrics = Metrics(name)
    largest = max(config.sizes)
    options = dataclasses.replace(socket_options_for(topology, name, None, metrics), linger_ms=0,
                                  max_message_bytes=2 * largest + CHUNK_BYTES)
    limits = dataclasses.replace(_LIMITS, max_tensor_bytes=2 * largest)
    costs: list[list[float]] = []
    async with _zmq_session(options) as (ctx, _):
        inbox = Inbox.bind(ctx, "tcp://127.0.0.1:*", name, metrics, limits, options)
        address = inbox.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        outlink = Outlink.connect(ctx, address, name, name, metrics, limits, options)
        try:
            fmt = Format(training.compress.pipeline)
            for size in sorted(config.sizes):
                tensor = torch.randn(max(1, size // 4), device=me.device)
                costs.append([size, await _message_cpu_s(inbox, outlink, name, tensor, fmt,
                                                         training.compress.int8_block, config)])
        finally:
            outlink.close()
            inbox.close()
    return costs


def measure_messages(topology: Topology, name: str, config: MessageConfig | None = None) -> list[list[float]]:
    """[tensor bytes, CPU seconds] per pipeline message for a few tensor sizes: a float32 tensor packed
    as ``training.compress.pipeline`` packs it, sent as a FORWARD message over loopback TCP with this
    node's socket options (CURVE when the topology asks), received, decoded and unpacked, several in
    flight.  A stage pays that for each activation and gradient it sends and receives (half at each
    end); on a small CPU it is a real part of a stage's time: on a PC of a seventh of a core (issue #14's
    testbed, int8 and CURVE) a 256 KiB tensor took 0.57 ms of CPU, 4.2 ms of wall time, and 1 MiB 1.16 ms,
    8.5 ms, per message.  CPU seconds, so other work on the
    machine does not disturb the figure; ``measure_node`` turns them into wall time at the compute
    measurement's CPU share."""
    return asyncio.run(_measure_messages(topology, name, config or MessageConfig()))


# ------------------------------------------------------------------ averaging rounds

RING_BYTES = (1 << 20, 64 << 20)
"""Smallest and largest float32 segment ``measure_ring`` averages (the model's parameters, clipped)."""


async def _serve_ring(inbox: Inbox, mailbox: allreduce.Mailbox) -> None:
    while True:
        _, msg = await inbox.recv()
        piece = allreduce.received_piece(msg.meta, msg.tensors, msg.packed)
        if msg.type == MsgType.RING_CHUNK and piece is not None:
            mailbox.deliver(msg.sender, msg.meta, piece)


async def _measure_ring(topology: Topology, name: str, nbytes: int, cpu_s: float, min_rounds: int,
                        size: int = 2) -> float:
    """CPU seconds per member per round (see ``measure_ring``), with ``size`` members, each sending to the next."""
    training = topology.training
    metrics = Metrics(name)
    options = dataclasses.replace(socket_options_for(topology, name, None, metrics), linger_ms=0,
                                  max_message_bytes=2 * training.ring_chunk_bytes + CHUNK_BYTES)
    limits = dataclasses.replace(_LIMITS, max_tensor_bytes=2 * training.ring_chunk_bytes)
    members = tuple(f"{name}.{i}" for i in range(size))
    numel = max(1, nbytes // 4)
    segment = allreduce.Segment(ring_id=0, names=("profile",), numel=numel, ring=members)
    fmt = Format(training.compress.ring)
    async with _zmq_session(options) as (ctx, group):
        inboxes = {m: Inbox.bind(ctx, "tcp://127.0.0.1:*", name, metrics, limits, options) for m in members}
        for inbox in inboxes.values():  # CURVE binds every connection to this node's name, not a member's
            inbox.authenticated = False
        addresses = {m: inbox.sock.getsockopt_string(zmq.LAST_ENDPOINT) for m, inbox in inboxes.items()}
        mailboxes = {m: allreduce.Mailbox() for m in members}
        # both members are this node as far as CURVE knows (its own key pairs, as its ring uses them)
        outlinks = {m: {members[(i + 1) % size]: Outlink.connect(ctx, addresses[members[(i + 1) % size]], name, name,
                                                                 metrics, limits, options)}
                    for i, m in enumerate(members)}
        links = {m: RingLinks(m, outlinks[m]) for m in members}
        compression = {m: RingCompression(fmt, training.compress.int8_block) if fmt is not Format.NONE else None
                       for m in members}
        flats = {m: torch.randn(numel) for m in members}
        readers = [group.create_task(_serve_ring(inboxes[m], mailboxes[m])) for m in members]

        async def one_round(round_id: int) -> None:
            results = await asyncio.gather(*(allreduce.average_segments(
                {0: flats[m]}, [segment], me=m, round_id=round_id, link=links[m], mailbox=mailboxes[m],
                piece_bytes=training.ring_chunk_bytes, timeout_s=30.0, compression=compression[m])
                for m in members))
            for result in results:
                if result.aborted:
                    raise RuntimeError(f"profile: a loopback averaging round aborted: {result.aborted}")
        try:
            await one_round(0)  # connections, allocator and first-call costs are not counted
            rounds, cpu0 = 0, time.process_time()
            while time.process_time() - cpu0 < cpu_s or rounds < min_rounds:
                rounds += 1
                await one_round(rounds)
            return (time.process_time() - cpu0) / rounds / size
        finally:
            for task in readers:
                task.cancel()
            for links_of in outlinks.values():
                for link in links_of.values():
                    link.close()
            for inbox in inboxes.values():
                inbox.close()


def measure_ring(topology: Topology, name: str, nbytes: int, *, cpu_s: float = 0.3,
                 min_rounds: int = 3) -> float:
    """CPU seconds of one node's part in one averaging round of a float32 segment of ``nbytes`` in a
    ring of two: the node's own ring code (``allreduce.average_segments``, compressed as
    ``training.compress.ring`` asks, error feedback included) over loopback TCP with its socket options
    (CURVE when on), both members in this process, half of all its threads' CPU time.  A member of a
    ring of C sends and receives 2(C-1)/C of the segment, so in a ring of two the whole segment once:
    the planner scales this per parameter byte by 2(C-1)/C (``NodeProfile.ring_s_per_byte``).

    The scaling holds: the demo's model (1.27 MB, int8, CURVE) cost a member 3.34 ms of CPU per round in
    a ring of two, and 3.28 and 3.68 ms per 2(C-1)/C in rings of three and six (``_measure_ring``'s
    ``size``).  The rounds share the PC's CPU with the compute thread; but they are not all of what
    does: on the testbed's PCs of a quarter of a core, six one-stage clusters averaging every 2 steps,
    the event loop and ZeroMQ's I/O thread took 0.027 cores of the process's 0.243 (per-thread CPU
    from /proc, issue #14), about 20 ms of CPU per round, of which this accounts for about 6 ms."""
    return asyncio.run(_measure_ring(topology, name, nbytes, cpu_s, min_rounds))


# ------------------------------------------------------------------ links


class LinkGate:
    """This node's part in at most one measurement at a time, as the sender or as the receiver.

    Held by the local prober (``hold``) or granted to a peer at once or not at all (``try_hold``); a
    peer's hold lapses ``lease_s`` after its last message, so a prober that died frees it.
    """

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._holder: str | None = None
        self._expires = 0.0
        self._freed = asyncio.Event()

    @property
    def holder(self) -> str | None:
        if self._holder is not None and time.monotonic() >= self._expires:
            log.warning("profile: %s went silent while measuring; its reservation lapsed", self._holder)
            self._holder = None
        return self._holder

    def try_hold(self, holder: str, lease_s: float | None = None) -> bool:
        if self.holder not in (None, holder):
            return False
        self._holder, self._expires = holder, time.monotonic() + (self.lease_s if lease_s is None else lease_s)
        return True

    def renew(self, holder: str) -> None:
        if self._holder == holder:
            self._expires = time.monotonic() + self.lease_s

    def release(self, holder: str) -> None:
        if self._holder == holder:
            self._holder = None
            self._freed.set()

    async def hold(self, holder: str, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the gate to be free and take it."""
        deadline = time.monotonic() + timeout_s
        while not self.try_hold(holder, math.inf):  # held until released: this process is alive
            remaining = deadline - time.monotonic()
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
                       gate: LinkGate | None = None) -> None:
    """Acknowledge every PROBE on a ROUTER bound at ``bind_addr`` until ``stop`` is set; the names of
    peers that say they are done with us are added to ``finished``.  A ``reserve`` is granted when
    ``gate`` (always, without one) lets the peer hold this node, and a ``release`` ends that."""
    inbox = Inbox.bind(ctx, bind_addr, "probe", metrics or Metrics(name), limits, options)
    try:
        while not stop.is_set():
            if not await inbox.readable(0.1):
                continue
            identity, msg = await inbox.recv()
            if msg.type is not MsgType.PROBE:
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


class ProbeClient:
    """Measures one link: round trips for latency, acknowledged streams for bandwidth."""

    def __init__(self, ctx: zmq.asyncio.Context, addr: str, name: str, peer: str, config: ProbeConfig,
                 metrics: Metrics | None = None, options: SocketOptions = _OPTIONS,
                 limits: DecodeLimits = _LIMITS) -> None:
        self.name, self.peer, self.config = name, peer, config
        self.link = Outlink.connect(ctx, addr, "probe", peer, metrics or Metrics(name), limits, options)
        self._seq = 0
        self._payload = torch.zeros(CHUNK_BYTES, dtype=torch.uint8)

    def close(self) -> None:
        self.link.close()

    async def _send(self, kind: str, nbytes: int = 0) -> int:
        self._seq += 1
        tensors = {"payload": self._payload[:nbytes]} if nbytes else {}
        await self.link.send(Message(type=MsgType.PROBE, sender=self.name, meta={"kind": kind, "seq": self._seq},
                                     tensors=tensors))
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
        deadline = time.monotonic() + self.config.reserve_timeout_s
        mine = f"to {self.peer}"
        while await gate.hold(mine, deadline - time.monotonic()):
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
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            seq = await self._send("ping")
            try:
                await self._ack({seq}, min(1.0, max(0.01, deadline - time.monotonic())))
                return True
            except TimeoutError:
                continue
        return False

    async def latency_s(self) -> float:
        rtts = []
        for _ in range(self.config.pings):
            t0 = time.perf_counter()
            await self._ack({await self._send("ping")}, self.config.reply_timeout_s)
            rtts.append(time.perf_counter() - t0)
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
        start = time.perf_counter()
        pending = {await self._send("data", chunk) for _ in range(count)}
        while pending:
            pending.discard(await self._ack(pending, self.config.reply_timeout_s))
        elapsed = time.perf_counter() - start - round_trip_s
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


async def measure_links(ctx: zmq.asyncio.Context, name: str, peers: dict[str, str], *, wait_s: float,
                        config: ProbeConfig, metrics: Metrics | None = None,
                        options: SocketOptions = _OPTIONS, gate: LinkGate | None = None) -> dict[str, Link]:
    """Measure the link to each peer (name -> probe address) in turn; a peer silent for ``wait_s`` is
    skipped with a warning.  With ``gate`` (the one ``serve_probes`` uses) each measurement waits
    until neither end takes part in another."""
    links: dict[str, Link] = {}
    deadline = time.monotonic() + wait_s
    for peer, addr in sorted(peers.items()):
        client = ProbeClient(ctx, addr, name, peer, config, metrics, options)
        try:
            if not await client.wait_ready(max(0.0, deadline - time.monotonic())):
                log.warning("profile: %s did not answer probes within %.0f s; link not measured", peer, wait_s)
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
            client.close()
    return links


async def profile_links(topology: Topology, name: str, *, wait_s: float, config: ProbeConfig) -> dict[str, Link]:
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
    async with _zmq_session(options) as (ctx, group):
        group.create_task(serve_probes(ctx, endpoint(me.bind_host or me.host, me.pipeline_port), name,
                                       stop=stop, finished=finished, metrics=metrics, options=options, gate=gate))
        try:
            links = await measure_links(ctx, name, peers, wait_s=wait_s, config=config, metrics=metrics,
                                        options=options, gate=gate)
            deadline = time.monotonic() + wait_s
            while set(peers) - finished and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        finally:
            stop.set()
    return links


# ------------------------------------------------------------------ profiles on disk


def profile_path(out_dir: str | Path, name: str) -> Path:
    return Path(out_dir) / f"profile-{name}.json"


def save_profile(measurement: Measurement, out_dir: str | Path) -> Path:
    path = profile_path(out_dir, measurement.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {f: getattr(measurement, f) for f in Measurement.__dataclass_fields__}
    path.write_text(json.dumps({"version": 1, **data}, indent=2, sort_keys=True))
    return path


def load_profile(path: str | Path) -> Measurement:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        data.pop("version", None)
        return Measurement(**data)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no profile (run `ravq profile` on that node)") from None
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(f"{path}: not a ravq profile: {err}") from None


def load_profiles(topology: Topology, profiles_dir: str | Path) -> list[NodeProfile]:
    """Planner profiles of every topology node; the topology's overrides win over measurements.  A node
    without a profile file is accepted when its overrides give memory, flops and bandwidth."""
    names = [n.name for n in topology.nodes]
    profiles = []
    for node in topology.nodes:
        path = profile_path(profiles_dir, node.name)
        overridden = None not in (node.memory_bytes, node.flops, node.bandwidth_bytes_per_s)
        m = load_profile(path) if path.exists() or not overridden else None
        bandwidth = dict(m.bandwidth_bytes_per_s) if m else {}
        if node.bandwidth_bytes_per_s is not None:
            bandwidth = {peer: node.bandwidth_bytes_per_s for peer in names if peer != node.name}
        flops = node.flops if node.flops is not None else m.flops if m else 0.0
        memory = node.memory_bytes if node.memory_bytes is not None else m.memory_bytes if m else 0
        profiles.append(NodeProfile(name=node.name, flops=flops, memory_bytes=memory, bandwidth_bytes_per_s=bandwidth,
                                    latency_s=dict(m.latency_s) if m else {},
                                    message_s=message_table(m) if m else (),
                                    ring_s_per_byte=m.ring_s[1] / m.ring_s[0] if m and m.ring_s else 0.0))
    return profiles


def message_table(measurement: Measurement) -> tuple[tuple[int, float], ...]:
    """The planner's ``NodeProfile.message_s`` from a profile (empty for profiles made before it)."""
    return tuple((int(size), float(seconds)) for size, seconds in measurement.message_s)


# ------------------------------------------------------------------ entry points


def measure_node(topology: Topology, name: str, *, wait_s: float, config: ProbeConfig | None = None,
                 compute_s: float = 6.0, windows: int = 5, messages: MessageConfig | None = None) -> Measurement:
    """Links, then compute over ``windows`` windows totalling ``compute_s`` (see ``measure_compute``), the
    CPU cost of pipeline messages (``measure_messages``) and of averaging rounds (``measure_ring``), memory.

    Links come first: this node serves probes until every peer has measured its link to it, so the
    compute that follows starts on every PC at about the same moment, once the whole deployment is up.
    PCs that share a host (nodes of one machine, the testbed's emulated PCs) then measure while the
    others compute too, as they will train.  Measured before the links, the slowest PCs (a seventh of
    a core: torch alone takes them tens of seconds to import) computed while the faster ones had
    finished and sat waiting, and read up to 15% faster than they trained (issue #14, compute_bound)."""
    me = topology.node(name)
    task = resolve_task_module(topology.task)
    links = asyncio.run(profile_links(topology, name, wait_s=wait_s, config=config or ProbeConfig()))
    matmul = measure_matmul_flops(me.device, seconds=0.5)
    try:
        sample: ComputeSample | None = measure_compute(task, topology.training.micro_batch, me.device,
                                                       window_s=compute_s / windows, windows=windows)
    except (RuntimeError, ValueError, TypeError) as err:  # a model that cannot run here: matmuls only
        log.warning("profile: forward + backward of the task's model failed (%s); using matmul FLOP/s", err)
        sample = None
    message_cpu = measure_messages(topology, name, messages)
    ring_bytes = min(max(model_param_bytes(task), RING_BYTES[0]), RING_BYTES[1])
    ring_cpu = measure_ring(topology, name, ring_bytes)
    share = sample.cpu_share if sample and sample.cpu_share > 0 else 1.0
    return Measurement(
        name=name, device=me.device, flops=sample.flops if sample else matmul, matmul_flops=matmul,
        model_flops=sample.flops if sample else None, memory_bytes=usable_memory_bytes(me.device),
        bandwidth_bytes_per_s={p: link.bandwidth_bytes_per_s for p, link in links.items()},
        latency_s={p: link.latency_s for p, link in links.items()},
        flops_windows=sample.window_flops if sample else [], flops_spread=sample.spread if sample else None,
        cpu_share=sample.cpu_share if sample else None,
        message_s=[[size, cpu / share] for size, cpu in message_cpu], message_cpu_s=message_cpu,
        ring_s=[ring_bytes, ring_cpu / share], ring_cpu_s=[ring_bytes, ring_cpu])


def model_param_bytes(task: Any) -> int:
    """Float32 bytes of the task's model's parameters (0 when it cannot be built here)."""
    try:
        return sum(4 * p.numel() for p in task.build_model().parameters())
    except (RuntimeError, ValueError, TypeError) as err:
        log.warning("profile: the task's model could not be built (%s)", err)
        return 0


def compute_confidence(measurement: Measurement) -> str:
    """How sure the compute figure is, in words a user can act on."""
    if measurement.flops_spread is None:
        return "from matmuls only (the task's model did not run)"
    n, spread = len(measurement.flops_windows), measurement.flops_spread
    verdict = "steady" if spread <= 0.1 else "unsteady: other work on this PC? profile again when it is idle"
    cpu = "" if measurement.cpu_share is None else f"; it got {measurement.cpu_share:.2f} CPU seconds per second"
    return f"median of {n} windows, which were within {spread:.0%} of each other ({verdict}){cpu}"


def profile_main(topology_path: str, name: str, out_dir: str = ".", peers_wait_s: float = 120.0) -> int:
    """`ravq profile`: measure this node and write profile-NAME.json; 0 when every link was measured,
    1 when some peer never answered, 2 on a configuration error."""
    try:
        topology = load_topology(topology_path)
        topology.node(name)
        measurement = measure_node(topology, name, wait_s=peers_wait_s)
    except ValueError as err:  # ConfigError, or CURVE keys that do not match the topology
        print(f"error: {err}")
        return 2
    path = save_profile(measurement, out_dir)
    missing = sorted({n.name for n in topology.nodes} - {name} - set(measurement.bandwidth_bytes_per_s))
    print(f"{name}: {measurement.flops / 1e9:.3g} GFLOP/s (matmul {measurement.matmul_flops / 1e9:.3g}), "
          f"{measurement.memory_bytes / (1 << 30):.3g} GiB usable")
    print(f"  compute: {compute_confidence(measurement)}")
    if measurement.message_s:
        print("  pipeline messages (CPU time at this speed): " + ", ".join(
            f"{size_text(size)} {seconds * 1e3:.3g} ms" for size, seconds in measurement.message_s))
    if measurement.ring_s:
        nbytes, seconds = measurement.ring_s
        print(f"  averaging: {seconds * 1e3:.3g} ms per round of {size_text(int(nbytes))} in a ring of two "
              f"({measurement.ring_cpu_s[1] * 1e3:.3g} ms of CPU)")
    for peer in sorted(measurement.bandwidth_bytes_per_s):
        print(f"  -> {peer}: {measurement.bandwidth_bytes_per_s[peer] * 8 / 1e6:.4g} Mbit/s, "
              f"{measurement.latency_s[peer] * 1e3:.3g} ms")
    if missing:
        print(f"  not measured (no answer within {peers_wait_s:.0f} s): {', '.join(missing)}")
    print(f"wrote {path}")
    return 1 if missing else 0


def plan_main(topology_path: str, profiles_dir: str, out_path: str) -> int:
    """`ravq plan`: plan from the profiles; print the explanation and write the plan YAML.  Returns 0, or 1
    when no plan fits, 2 on a configuration error.  With clusters fixed in the topology only the cuts
    are planned."""
    from ravq.profile.blocks import profile_blocks  # torch tracing: only needed here

    try:
        topology = load_topology(topology_path)
        nodes = load_profiles(topology, profiles_dir)
        task = resolve_task_module(topology.task)
    except ConfigError as err:
        print(f"error: {err}")
        return 2
    training = topology.training
    blocks = profile_blocks(task, training.micro_batch, max_inflight=training.max_inflight or 1)
    settings = training_settings(training)
    try:
        if all(n.cluster is not None for n in topology.nodes):
            plan, explanation = cut_plan(topology_clusters(topology), nodes, blocks, **settings)
        else:
            plan, explanation = make_plan(nodes, blocks, **settings)
    except PlanError as err:
        print(f"error: {err}")
        return 1
    print(explanation.format())
    from ravq.checks import override_warnings

    for warning in override_warnings(topology, plan, nodes):
        log.warning("%s", warning)
        print(f"warning: {warning}")
    Path(out_path).write_text(yaml.safe_dump({"plan": plan.model_dump(mode="json")}, sort_keys=False))
    print(f"wrote {out_path}")
    return 0
