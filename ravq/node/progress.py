"""A node's progress lines: one INFO line every ``training.log_every`` optimizer steps, so a person can
follow training in the journal (loss, samples/s, staleness, busy share, averaging waits)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from ravq.stage.pipeline import StageWorker

log = logging.getLogger("ravq.node")  # the node's own lines, as they always were


async def log_progress(name: str, worker: StageWorker, stats: Callable[[], dict[str, Any]], every: int,
                       steps: int) -> None:
    next_at, last_t, last_samples = every, time.monotonic(), 0
    while True:
        await asyncio.sleep(0.5)
        if worker.version < next_at:
            continue
        next_at = (worker.version // every + 1) * every
        st, now = stats(), time.monotonic()
        rate = (st["samples"] - last_samples) / max(now - last_t, 1e-9)
        last_t, last_samples = now, st["samples"]
        loss = f"loss {st['loss_recent']:.4f}" if st.get("loss_recent") is not None else "no loss (not last stage)"
        ring = (f"; averaging {st['allreduce_rounds']} rounds, {st['allreduce_aborts']} aborted, "
                f"{st['averaging_waits']} waits ({st['averaging_wait_seconds']:.1f}s)"
                if "allreduce_rounds" in st else "")
        log.info("%s: step %d, micro-batch %d/%d, %s, %.1f samples/s, staleness %.2f (max %d), busy %.0f%%, "
                 "%d in flight%s", name, worker.version, st["trained"], steps, loss,
                 rate, st["staleness_mean"], st["staleness_max"], 100 * st["busy_fraction"], st["inflight"], ring)
