"""The CPU cost of a node's own communication: pipeline messages and averaging rounds.

A stage pays CPU time for every activation and gradient it sends and receives (packing, ZeroMQ,
CURVE, unpacking), and for its part of every averaging round; on a small CPU that is a real part of
its time.  Both are measured in CPU seconds over loopback TCP with the node's own socket options and
code, so other work on the machine does not disturb them; ``ravq.profile.measure`` turns them into
wall time at the compute measurement's CPU share.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass

import torch
import zmq

from ravq.average.mailbox import Mailbox, received_piece
from ravq.average.ring_compression import RingCompression
from ravq.average.rounds import average_segments
from ravq.average.segments import Segment
from ravq.codec import compress
from ravq.codec.compress import Format, Packed
from ravq.config import Topology
from ravq.metrics import Metrics
from ravq.net.security import socket_options_for
from ravq.net.transport import Inbox, Outlink
from ravq.net.wire import DecodeLimits, Message, MsgType
from ravq.node.ring_port import RingLinks
from ravq.profile.links import CHUNK_BYTES
from ravq.profile.session import zmq_session

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
            await outlink.send(
                Message(
                    type=MsgType.FORWARD,
                    sender=name,
                    micro_batch=(0, first + i),
                    version=0,
                    meta={"gen": 0},
                    tensors=plain,
                    packed=squeezed,
                )
            )
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
    limits = DecodeLimits(max_tensor_bytes=2 * largest)
    costs: list[list[float]] = []
    async with zmq_session(options) as (ctx, _):
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


RING_BYTES = (1 << 20, 64 << 20)
"""Smallest and largest float32 segment ``measure_ring`` averages (the model's parameters, clipped)."""


async def _serve_ring(inbox: Inbox, mailbox: Mailbox) -> None:
    while True:
        _, msg = await inbox.recv()
        piece = received_piece(msg.meta, msg.tensors, msg.packed)
        if msg.type == MsgType.RING_CHUNK and piece is not None:
            mailbox.deliver(msg.sender, msg.meta, piece)


async def _measure_ring(topology: Topology, name: str, nbytes: int, cpu_s: float, min_rounds: int,
                        size: int = 2) -> float:
    """CPU seconds per member per round (see ``measure_ring``), with ``size`` members, each sending to
    the next."""
    training = topology.training
    metrics = Metrics(name)
    options = dataclasses.replace(socket_options_for(topology, name, None, metrics), linger_ms=0,
                                  max_message_bytes=2 * training.ring_chunk_bytes + CHUNK_BYTES)
    limits = DecodeLimits(max_tensor_bytes=2 * training.ring_chunk_bytes)
    members = tuple(f"{name}.{i}" for i in range(size))
    numel = max(1, nbytes // 4)
    segment = Segment(ring_id=0, names=("profile",), numel=numel, ring=members)
    fmt = Format(training.compress.ring)
    async with zmq_session(options) as (ctx, group):
        # CURVE binds every connection to this node's name, not a member's: no sender check
        inboxes = {m: Inbox.bind(ctx, "tcp://127.0.0.1:*", name, metrics, limits, options, authenticate=False)
                   for m in members}
        addresses = {m: inbox.sock.getsockopt_string(zmq.LAST_ENDPOINT) for m, inbox in inboxes.items()}
        mailboxes = {m: Mailbox() for m in members}
        # both members are this node as far as CURVE knows (its own key pairs, as its ring uses them)
        outlinks = {
            m: {
                members[(i + 1) % size]: Outlink.connect(
                    ctx, addresses[members[(i + 1) % size]], name, name, metrics, limits, options
                )
            }
            for i, m in enumerate(members)
        }
        links = {m: RingLinks(m, outlinks[m]) for m in members}
        compression = {
            m: RingCompression(fmt, training.compress.int8_block) if fmt is not Format.NONE else None
            for m in members
        }
        flats = {m: torch.randn(numel) for m in members}
        readers = [group.create_task(_serve_ring(inboxes[m], mailboxes[m])) for m in members]

        async def one_round(round_id: int) -> None:
            results = await asyncio.gather(*(average_segments(
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
    ring of two: the node's own ring code (``ravq.average.rounds.average_segments``, compressed as
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
