"""What every ZeroMQ socket of a process is set up with: the shared options, the control-frame limit,
endpoint addresses.

Plain data without ZeroMQ, so the layers that must not import it (a stage's frame limits,
``ravq.stage.frames``) can read them; ``ravq.net.socket_io.configure`` applies them to a socket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

CONTROL_FRAME_BYTES = 1 << 20
"""ZMQ_MAXMSGSIZE of sockets that carry no tensors (broker, status) unless limits.max_message_bytes is set.
A node raises its data sockets' limit to what its stage can legitimately receive (ravq.stage.frames)."""


class SocketGuard(Protocol):
    """What sockets ask of ``SocketOptions.curve``: a ``ravq.net.security.Curve`` (named by this Protocol
    because this module stays free of ZeroMQ and of the modules that import it).  ``sock``: a ZeroMQ
    socket."""

    def make_server(self, sock: Any, name: str, *, count_closed: bool = True) -> None: ...

    def make_client(self, sock: Any, peer: str) -> None: ...


class SocketWatch(Protocol):
    """What sockets and their process ask of ``SocketOptions.monitor``: a
    ``ravq.net.connections.ConnectionMonitor`` (the Curve, with CURVE).  ``sock``: a ZeroMQ socket."""

    def watch(self, sock: Any, name: str, *, count_closed: bool = True) -> None: ...

    async def serve(self) -> None: ...

    def close(self) -> None: ...


@dataclass(kw_only=True, slots=True)
class SocketOptions:
    """Options shared by every socket of a process."""

    max_message_bytes: int = 1 << 30
    """ZMQ_MAXMSGSIZE: larger frames make ZeroMQ drop the connection."""
    hwm: int = 1000
    """High-water mark: a second guard behind credit-based flow control."""
    linger_ms: int = 1000
    """How long close() may wait to flush queued messages."""
    curve: SocketGuard | None = None
    """A ``ravq.net.security.Curve`` (keys and ZAP authenticator) or None for plaintext."""
    monitor: SocketWatch | None = None
    """A ``ravq.net.connections.ConnectionMonitor`` that counts failed and dropped connections of server
    sockets (the Curve, with CURVE); None: not watched."""
    copy_threshold_bytes: int = 64 << 10
    """Frames smaller than this are copied into ZeroMQ; larger ones are sent without a copy.

    A zero-copy frame is released through pyzmq's garbage-collector thread (a message to it and a GIL
    hand-off per frame), a copied one costs a malloc and a memcpy in the sending thread and a free in
    ZeroMQ's I/O thread.  With both counted, zero-copy is the cheaper at 64 KiB on loopback (a 64 KiB
    link moved ~9% more bytes/s than with copies below 128 KiB, on 2 cores); pyzmq's default is 64 KiB."""


CURVE_IO_THREADS = 2
"""ZeroMQ I/O threads of a node's context with CURVE: each frame is encrypted and decrypted there (libsodium,
plus libzmq's copies of it), and a ring member sends and receives at once, so with one thread its
encryption and decryption take turns on one core (benchmarks/bench_curve.py, docs/security.md)."""


def io_threads(opts: SocketOptions, cpus: int) -> int:
    """I/O threads for the context of a process whose sockets use ``opts``, with ``cpus`` CPUs to itself:
    one in plaintext (ZeroMQ's rule of thumb, a thread per GB/s, and a plaintext frame costs it little);
    with CURVE ``CURVE_IO_THREADS`` when the process has that many CPUs."""
    if cpus < 1:
        raise ValueError(f"cpus: must be at least 1, got {cpus}")
    return min(CURVE_IO_THREADS, cpus) if opts.curve is not None else 1


def endpoint(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"
