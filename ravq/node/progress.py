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

TOTALS = {"pauses": ("ravq_pauses_total", {}), "bytes_sent": ("ravq_bytes_sent_total", {}),
          "bytes_received": ("ravq_bytes_received_total", {}),
          "bad_messages": ("ravq_bad_messages_total", {}),
          "ring_bytes_sent": ("ravq_bytes_sent_total", {"socket": "ring"}),
          "payload_wire_bytes_sent": ("ravq_payload_wire_bytes_total", {"direction": "sent"}),
          "payload_logical_bytes_sent": ("ravq_payload_logical_bytes_total", {"direction": "sent"})}
"""The metric totals a node's statistics carry (``ravq.node.root.Node.stats``), read in one pass."""


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
        recent = st.get("loss_recent")
        loss = f"loss {recent:.4f}" if recent is not None else "no loss (not last stage)"
        ring = (f"; averaging {st['allreduce_rounds']} rounds, {st['allreduce_aborts']} aborted, "
                f"{st['averaging_waits']} waits ({st['averaging_wait_seconds']:.1f}s)"
                if "allreduce_rounds" in st else "")
        log.info("%s: step %d, micro-batch %d/%d, %s, %.1f samples/s, staleness %.2f (max %d), "
                 "busy %.0f%%, %d in flight%s", name, worker.version, st["trained"], steps, loss, rate,
                 st["staleness_mean"], st["staleness_max"], 100 * st["busy_fraction"], st["inflight"], ring)
