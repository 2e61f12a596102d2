"""Reading or changing a stage from the event loop: work handed to its compute thread, awaited."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

from ravq.stage.pipeline import StageWorker


async def in_compute(worker: StageWorker, fn: Callable[[StageWorker], Any]) -> Any:
    """``fn(worker)``, run in the worker's compute thread (or in a helper thread once that has ended):
    the only thread that touches its tensors while it trains."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def call(w: StageWorker) -> None:
        try:
            future.set_result(fn(w))
        except Exception as err:  # noqa: BLE001 (handed to the awaiting coroutine, which raises it)
            future.set_exception(err)

    if not worker.call(call):
        await asyncio.to_thread(call, worker)
    return await asyncio.wrap_future(future)
