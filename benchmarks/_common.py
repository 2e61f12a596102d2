"""Shared bits of the benchmark scripts: the repo on sys.path, a sender/receiver process pair,
--json output and a plain-text table.

Convention: a benchmark prints whatever it likes for people, and with ``--json`` its LAST line of
output is one JSON object (so ``tail -n 1`` or a test can parse it).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Self

REPO = Path(__file__).resolve().parents[1]
TRIAL_TIMEOUT_S = 60.0

# A receiver binds, sends its endpoint on ``conn``, receives ``warmup + count`` messages and returns
# (seconds, process CPU seconds) for the last ``count``.  A sender connects, sends ``total`` messages,
# waits for a word on ``conn`` (the receiver has everything, so closing drops nothing, and ZeroMQ's
# I/O thread has done its writing), then sends its process CPU seconds since it began on ``conn``.
Receiver = Callable[[Connection, str, int, int, int], tuple[float, float]]
Sender = Callable[[Connection, str, int, int, str], None]


def use_repo_checkout() -> None:
    """Make ``import ravq`` work when the script is run from a checkout without ``pip install``."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def run_loop(coro: Coroutine[Any, Any, Any], loop: str = "uvloop") -> Any:
    """Run ``coro`` on uvloop (what ravq nodes use) or the default asyncio loop."""
    if loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    return asyncio.run(coro)


def _worker(conn: Connection, receive: Receiver, send: Sender) -> None:
    """A receiver or sender process: runs trials as the parent asks, until it sends None."""
    while (cmd := conn.recv()) is not None:
        role, mode, size, warmup, count, endpoint = cmd
        if role == "recv":
            conn.send(receive(conn, mode, size, warmup, count))
        else:
            send(conn, mode, size, warmup + count, endpoint)


def _expect(conn: Connection, what: str) -> Any:
    if not conn.poll(TRIAL_TIMEOUT_S + 10):
        raise TimeoutError(f"benchmark worker gave no {what} within {TRIAL_TIMEOUT_S + 10:.0f}s")
    return conn.recv()


class ProcessPair:
    """A receiver process and a sender process, kept for many trials (spawning costs ~1 s each)."""

    def __init__(self, receive: Receiver, send: Sender) -> None:
        spawn = mp.get_context("spawn")
        self._pipes = [spawn.Pipe() for _ in range(2)]
        self._procs = [spawn.Process(target=_worker, args=(child, receive, send), daemon=True)
                       for _, child in self._pipes]

    def __enter__(self) -> Self:
        for p in self._procs:
            p.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for conn, _ in self._pipes:
            try:
                conn.send(None)
            except OSError:  # the worker is already gone
                pass
        for p in self._procs:
            p.join(10)
            if p.is_alive():
                p.kill()

    def trial(self, mode: str, size: int, count: int, warmup: int) -> tuple[float, float, float]:
        """(payload bytes/s at the receiver, receiver CPU us/message, sender CPU us/message)."""
        receiver, sender = self._pipes[0][0], self._pipes[1][0]
        receiver.send(("recv", mode, size, warmup, count, ""))
        endpoint = _expect(receiver, "endpoint")
        sender.send(("send", mode, size, warmup, count, endpoint))
        elapsed, recv_cpu = _expect(receiver, "timing")
        sender.send("done")
        send_cpu = _expect(sender, "CPU time")
        return count * size / elapsed, 1e6 * recv_cpu / count, 1e6 * send_cpu / (warmup + count)


def timed(receive_one: Callable[[], Any], warmup: int, count: int) -> tuple[float, float]:
    """Receive ``warmup`` messages, then time ``count`` more: (seconds, process CPU seconds)."""
    for _ in range(warmup):
        receive_one()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(count):
        receive_one()
    return time.perf_counter() - t0, time.process_time() - c0


async def timed_async(receive_one: Callable[[], Awaitable[Any]], warmup: int,
                      count: int) -> tuple[float, float]:
    async with asyncio.timeout(TRIAL_TIMEOUT_S):
        for _ in range(warmup):
            await receive_one()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(count):
            await receive_one()
        return time.perf_counter() - t0, time.process_time() - c0


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def size_name(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A right-aligned plain-text table."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def emit_json(result: dict[str, Any]) -> None:
    """Print ``result`` as the last line of output."""
    sys.stdout.flush()
    print(json.dumps(result, sort_keys=True), flush=True)
