"""The broker's event-loop time split by step, without a profiler's per-call cost (``bench_broker_scale.py
--account DIR``): a few methods are wrapped to add their thread CPU time and calls to counters, written to
DIR/account-N.json when the broker stops.  Nested steps are counted in their callers too.

At 1,000 members (gather 5%, load 3.98; the wrappers' own cost included) the loop took 210 us a heartbeat:
recv_now 27, accept 39 (wire.decode 20, hop metrics 8), handle 76 (Book.heartbeat 28, flush 11), and 68
outside them (wake-ups, the silence and interval timers, Book.check 6); in-process, hot, decode and handle
take 4 and 18 us.  Nothing is called per heartbeat that should not be (0.04 publishes, no reply, no timer):
each step runs several times slower in the broker than in a hot loop."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from typing import Any

STEPS: dict[str, list[float]] = {}
_on = [False]


def _wrap(owner: type, name: str, label: str, is_async: bool) -> None:
    inner = getattr(owner, name)
    row = STEPS.setdefault(label, [0.0, 0])
    clock = time.thread_time

    if is_async:
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            if not _on[0]:
                return await inner(*args, **kwargs)
            t = clock()
            try:
                return await inner(*args, **kwargs)  # the handlers' awaits rarely wait
            finally:
                row[0] += clock() - t
                row[1] += 1
        setattr(owner, name, timed_async)
        return

    def timed(*args: Any, **kwargs: Any) -> Any:
        if not _on[0]:
            return inner(*args, **kwargs)
        t = clock()
        try:
            return inner(*args, **kwargs)
        finally:
            row[0] += clock() - t
            row[1] += 1
    setattr(owner, name, timed)


def install(out: str) -> Callable[[], None]:
    from brokers.book import Book
    from brokers.topology import Broker
    from ravq.net import transport
    from ravq.net.socket_io import HopMetrics, SocketIo
    from ravq.net.transport import Inbox

    _wrap(Broker, "_handle", "handle (decode of fields, book, publish)", True)
    _wrap(Broker, "_flush", "flush (publish)", True)
    _wrap(Broker, "_refresh", "refresh (keys)", False)
    _wrap(Book, "heartbeat", "book.heartbeat", False)
    _wrap(Book, "check", "book.check (per interval)", False)
    _wrap(Inbox, "_accept", "accept (decode, auth, hop metrics)", False)
    _wrap(HopMetrics, "received", "hop metrics received", False)
    _wrap(SocketIo, "recv_now", "recv_now (zmq recv NOBLOCK)", False)
    inner_decode = transport.decode
    row = STEPS.setdefault("wire.decode", [0.0, 0])

    def timed_decode(*args: Any) -> Any:
        t = time.thread_time()
        try:
            return inner_decode(*args)
        finally:
            row[0] += time.thread_time() - t
            row[1] += 1
    transport.decode = timed_decode
    start = [0.0]

    def on(*_: Any) -> None:
        for r in STEPS.values():
            r[0], r[1] = 0.0, 0
        start[0] = time.thread_time()
        _on[0] = True
    signal.signal(signal.SIGUSR1, on)

    def dump() -> None:
        _on[0] = False
        with open(out, "w") as f:
            json.dump({"loop_s": time.thread_time() - start[0], "steps": STEPS}, f)
    return dump
