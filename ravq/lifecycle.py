"""Process lifecycle helpers of the composition root: blocking work in a thread a stop need not wait
for, and the one real error of a TaskGroup."""

from __future__ import annotations

import asyncio
import contextlib
import threading
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
