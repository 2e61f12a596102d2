"""Connections a server socket refuses are counted: raw garbage (with and without CURVE), and a peer
announcing a frame over limits.max_message_bytes, which ZeroMQ drops before allocating it."""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import time
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from ravq.metrics import Metrics
from ravq.net.connections import ConnectionMonitor
from ravq.net.options import CONTROL_FRAME_BYTES, SocketOptions
from ravq.net.security import Curve, keygen
from ravq.net.transport import Inbox
from ravq.net.wire import DecodeLimits
from ravq.stage.frames import derived_max_message_bytes, largest_inbound_frame

GARBAGE = 24


def _garbage(port: int, rng: random.Random) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 300))))
        time.sleep(0.01)


def _huge_frame(port: int) -> None:
    """A valid ZMTP 3.0 NULL greeting and handshake, then a frame header announcing 1 GiB."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        greeting = b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31
        s.sendall(greeting)
        ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        s.sendall(bytes([0x04, len(ready)]) + ready)  # command frame, short size
        s.recv(64 + 2 + 28)  # the server's greeting and READY: the handshake is done
        time.sleep(0.05)
        s.sendall(bytes([0x02]) + struct.pack(">Q", 1 << 30))  # long data frame of 1 GiB, then nothing
        time.sleep(0.3)


def _value(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def _watch(monitor: ConnectionMonitor, inbox: Inbox, attack, until) -> None:
    port = int(inbox.sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
    async with asyncio.TaskGroup() as tg:
        serving = tg.create_task(monitor.serve())
        await asyncio.to_thread(attack, port)
        deadline = time.monotonic() + 10
        while not until() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        serving.cancel()


@pytest.mark.parametrize("curve", [False, True], ids=["plaintext", "curve"])
def test_every_garbage_connection_is_counted(tmp_path: Path, curve: bool) -> None:
    metrics = Metrics("n1")
    ctx = zmq.asyncio.Context()
    if curve:
        public = keygen("n1", tmp_path)
        _, secret = (k.decode() for k in zmq.curve_keypair())
        from ravq.net.security import load_secret
        public, secret = load_secret("n1", tmp_path)
        monitor: ConnectionMonitor = Curve(name="n1", public=public, secret=secret, peers={"n1": public},
                                           metrics=metrics)
        opts = SocketOptions(curve=monitor, monitor=monitor, linger_ms=0)
        counted = lambda: _value(metrics, "ravq_auth_failures_total", socket="pipeline",
                                 reason="handshake_failed")
    else:
        monitor = ConnectionMonitor(metrics)
        opts = SocketOptions(monitor=monitor, linger_ms=0)
        counted = lambda: _value(metrics, "ravq_connections_dropped_total", socket="pipeline",
                                 reason="handshake_failed")
    inbox = Inbox.bind(ctx, "tcp://127.0.0.1:*", "pipeline", metrics, DecodeLimits(), opts)
    rng = random.Random(13)
    try:
        asyncio.run(_watch(monitor, inbox, lambda port: [_garbage(port, rng) for _ in range(GARBAGE)],
                           lambda: counted() >= GARBAGE))
    finally:
        inbox.close()
        monitor.close()
        ctx.term()
    assert counted() == GARBAGE


def test_a_frame_over_the_limit_is_dropped_and_counted() -> None:
    metrics = Metrics("n1")
    ctx = zmq.asyncio.Context()
    monitor = ConnectionMonitor(metrics)
    inbox = Inbox.bind(ctx, "tcp://127.0.0.1:*", "pipeline", metrics, DecodeLimits(),
                       SocketOptions(monitor=monitor, linger_ms=0, max_message_bytes=CONTROL_FRAME_BYTES))
    closed = lambda: _value(metrics, "ravq_connections_dropped_total", socket="pipeline",
                            reason="closed")
    try:
        asyncio.run(_watch(monitor, inbox, lambda port: [_huge_frame(port) for _ in range(3)], lambda: closed() >= 3))
    finally:
        inbox.close()
        monitor.close()
        ctx.term()
    assert closed() == 3


def test_the_default_limit_follows_the_model() -> None:
    from ravq.cut.split import build_task_model, candidate_cuts, even_cuts, split_model, stage_input_specs
    from tests import models_for_tests as task

    micro_batch = 64
    model = build_task_model(task, 0)
    example = task.example_inputs(micro_batch)
    specs = split_model(model, example, even_cuts(candidate_cuts(model, task), 3))
    in_specs = stage_input_specs(specs, example)
    _, targets = next(task.train_batches(micro_batch, 0, 1, 0))
    for stage in range(3):
        largest = largest_inbound_frame(specs, in_specs, stage, targets)
        frames = [shape.numel() * dtype.itemsize for shape, dtype in in_specs[stage]]
        assert largest >= max(frames) > 0
    assert derived_max_message_bytes(10 << 20) == 20 << 20
    assert derived_max_message_bytes(1000) == CONTROL_FRAME_BYTES
    assert derived_max_message_bytes(1000, ring_piece_bytes=4 << 20) == 8 << 20


def test_a_probe_that_closes_beside_a_pending_link_is_no_failed_handshake() -> None:
    """A node's start: its upstream peer's link and the broker's reachability probe are accepted together; the
    probe's handshake succeeds (the event names no connection) and it closes while the link's handshake is
    still under way. That is a normal close, not a refused connection; the link settles with its own success."""
    from ravq.net.connections import Handshakes

    book = Handshakes()
    link, probe = 7, 8
    assert book.event(zmq.EVENT_ACCEPTED, link) is None
    assert book.event(zmq.EVENT_ACCEPTED, probe) is None
    assert book.event(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0) is None  # the probe's
    assert book.event(zmq.EVENT_DISCONNECTED, probe) == "closed"
    assert book.event(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0) is None  # the link's
    assert book.established == {link} and not book.pending
    assert book.event(zmq.EVENT_DISCONNECTED, link) == "closed"


def test_connections_that_end_before_their_handshake_failed_it() -> None:
    from ravq.net.connections import Handshakes

    book = Handshakes()
    for fd in (3, 4):
        book.event(zmq.EVENT_ACCEPTED, fd)
    assert book.event(zmq.EVENT_DISCONNECTED, 3) == "failed"  # no handshake succeeded: garbage
    assert book.event(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0) is None
    assert book.established == {4}
    book.event(zmq.EVENT_ACCEPTED, 5)
    assert book.event(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, 1) == "failed"
    assert book.event(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 1) is None  # counted by the ZAP handler, not here
    assert not book.pending
    assert book.event(zmq.EVENT_DISCONNECTED, 5) is None  # already booked as failed
