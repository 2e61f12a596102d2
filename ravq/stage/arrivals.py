"""What a stage does with an arrived FORWARD, BACKWARD or eval message (``StageWorker.deliver``).

Runs in the event loop with the stage's lock held: the recipe screens its header fields
(``ravq.stage.recipe``), the tensors are checked against what the stage expects for that micro-batch
(``ravq.stage.tensors``), and the accepted parts are queued for the compute thread (``ravq.stage.schedule``).
"""

from __future__ import annotations

from typing import Any

import torch

from ravq.codec.compress import Packed
from ravq.stage.tensors import expected_backward
from ravq.stage.types import MicroBatch


def deliver(worker: Any, kind: str, micro_batch: MicroBatch, source: int,
            tensors: dict[str, torch.Tensor | Packed], meta: dict[str, Any]) -> str | None:
    """None if queued, else why the message is refused."""
    with worker._sched.cond:
        kind, verdict = worker.recipe.screen(worker, kind, micro_batch, meta)
        if verdict is not None:
            return verdict or None  # "": the recipe took it
        if kind != "bwd":
            known = (kind == "eval" or micro_batch not in worker._stash) and micro_batch[0] == worker.cluster
            expected = worker._expected_fwd.get(source, {}) if known else None
        else:
            stash = worker._stash.get(micro_batch)
            expected = None if stash is None else expected_backward(worker.spec, stash.outputs, source)
        reason = worker._sched.put(kind, micro_batch, source, tensors, expected)
        if reason is None:
            worker.recipe.received(worker, kind, micro_batch, meta)
        return reason
