"""Shared test helpers: free loopback ports and a ZeroMQ context that must terminate cleanly."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
import zmq
import zmq.asyncio

CONTEXT_TERM_TIMEOUT_S = 5.0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "bench: runs a benchmark script in smoke mode (a few seconds)")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, close).

    Racy by nature: prefer binding ZeroMQ sockets to ``tcp://127.0.0.1:*`` and reading
    ``zmq.LAST_ENDPOINT`` when the code under test allows it; use this when a port must be known
    before the socket exists (another process, an HTTP server).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RecordingContext(zmq.asyncio.Context):
    """A zmq.asyncio context that remembers every socket it made."""

    recorded: list[zmq.asyncio.Socket] | None = None  # a class attribute, so pyzmq's __setattr__ allows it

    def socket(self, socket_type: int, **kwargs):  # type: ignore[override]
        sock = super().socket(socket_type, **kwargs)
        if self.recorded is None:
            self.recorded = []
        self.recorded.append(sock)
        return sock


def terminate(ctx: zmq.Context, timeout_s: float = CONTEXT_TERM_TIMEOUT_S) -> bool:
    """``ctx.term()`` in a thread; False if it has not returned within ``timeout_s``."""
    done = threading.Event()

    def term() -> None:
        ctx.term()
        done.set()

    threading.Thread(target=term, name="zmq-ctx-term", daemon=True).start()
    return done.wait(timeout_s)


@pytest.fixture
def zmq_ctx() -> Iterator[RecordingContext]:
    """A context for one test; the test fails if it leaves a socket open or the context hangs on term.

    Sockets are expected to be closed by the code that made them (``finally`` with linger set), so a
    leftover is a bug in that code, not in the test.
    """
    ctx = RecordingContext()
    yield ctx
    left_open = [s for s in (ctx.recorded or []) if not s.closed]
    kinds = ", ".join(zmq.SocketType(s.socket_type).name for s in left_open)
    for s in left_open:
        s.close(linger=0)
    terminated = terminate(ctx)
    if left_open:
        pytest.fail(f"{len(left_open)} socket(s) left open: {kinds}")
    if not terminated:
        pytest.fail(f"zmq context did not terminate within {CONTEXT_TERM_TIMEOUT_S}s (linger or open socket)")
