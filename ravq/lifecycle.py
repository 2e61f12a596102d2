"""Process lifecycle helpers of the composition root: blocking work in a thread a stop need not wait
for, and the one real error of a TaskGroup."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def in_daemon_thread(fn: Callable[..., T], *args: Any) -> T:
    """``asyncio.to_thread`` in a daemon thread of its own: when the awaiting task is cancelled (a stop
    while the stage is traced) the process exits without waiting for ``fn`` (asyncio.run joins the
    default executor's threads)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as err:  # noqa: BLE001 (handed to the awaiting task, which raises it)
            result, error = None, err
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=getattr(fn, "__name__", "work"), daemon=True).start()
    return await future


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The one real error of a TaskGroup, so callers see e.g. a TimeoutError rather than a group."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for sub in e.exceptions:
                walk(sub)
        else:
            leaves.append(e)

    walk(group)
    return leaves[0] if len(leaves) == 1 else group


def process_age_s() -> float:
    """Seconds since this process began (exec, before Python and its imports), from /proc; 0.0 without it."""
    try:
        fields = open("/proc/self/stat").read().rpartition(")")[2].split()  # noqa: SIM115 (read at once)
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime: clock ticks after boot
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


class StartupTimes:
    """Where a node's start went, from the process's own start to each phase, for one log line:
    ``started in 3.9s (imports 2.8s, join 0.1s, build 0.7s, connect 0.3s)``."""

    def __init__(self) -> None:
        self.t0 = time.monotonic() - process_age_s()
        self.last, self.parts = self.t0, list[tuple[str, float]]()

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.parts.append((phase, now - self.last))
        self.last = now

    def line(self) -> str:
        parts = ", ".join(f"{phase} {s:.1f}s" for phase, s in self.parts)
        return f"started in {self.last - self.t0:.1f}s since the process began ({parts})"
