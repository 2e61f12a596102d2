"""Run asyncio code on a virtual clock: tests of cadences, silences and timeouts that never read the wall.

``looptime``'s event loop moves its clock only when every task waits: it then jumps straight to the next
timer, so ``asyncio.sleep(30)`` returns at once with ``loop.time()`` exactly 30 s later, and a busy
machine cannot stretch or squeeze what a test sees.  Only for code whose waits are the loop's own
(sleeps, ``asyncio.timeout``, events, in-memory queues): a wait on a real socket or thread lets the clock
jump past it.  Production code that reads a clock outside the loop takes a ``clock`` argument, and the
tests pass ``loop.time``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import looptime

T = TypeVar("T")


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on a looptime loop whose clock starts at 0."""
    with asyncio.Runner(loop_factory=lambda: looptime.new_event_loop(start=0.0)) as runner:
        return runner.run(main)


def now() -> float:
    """The running loop's (virtual) time."""
    return asyncio.get_running_loop().time()
