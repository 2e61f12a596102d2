"""What a stage does with an arrived FORWARD, BACKWARD or eval message (``StageWorker.deliver``).

Runs in the event loop with the stage's lock held: the recipe screens its header fields
(``ravq.stage.recipe``), the tensors are checked against what the stage expects for that micro-batch
(``ravq.stage.tensors``), and the accepted parts are queued for the compute thread (``ravq.stage.schedule``).
"""

from __future__ import annotations

from typing import Any

import torch

from ravq.codec.compress import Packed
from ravq.stage.recipe import Recipe
from ravq.stage.schedule import Scheduler
from ravq.stage.state import StagePlace, StageState
from ravq.stage.tensors import expected_backward
from ravq.stage.types import MicroBatch


class Arrivals:
    """The stage's door for FORWARD, BACKWARD and eval messages (event loop)."""

    def __init__(self, place: StagePlace, state: StageState, sched: Scheduler, recipe: Recipe) -> None:
        self._place, self._state, self._sched, self._recipe = place, state, sched, recipe

    def deliver(self, kind: str, micro_batch: MicroBatch, source: int,
                tensors: dict[str, torch.Tensor | Packed], meta: dict[str, Any]) -> str | None:
        """None if queued, else why the message is refused."""
        state = self._state
        with self._sched.cond:
            kind, verdict = self._recipe.screen(kind, micro_batch, meta)
            if verdict is not None:
                return verdict or None  # "": the recipe took it
            if kind != "bwd":
                fresh = kind == "eval" or micro_batch not in state.stash
                known = fresh and micro_batch[0] == self._place.cluster
                expected = state.expected_fwd.get(source, {}) if known else None
            else:
                stash = state.stash.get(micro_batch)
                spec = self._place.spec
                expected = None if stash is None else expected_backward(spec, stash.outputs, source)
            reason = self._sched.put(kind, micro_batch, source, tensors, expected)
            if reason is None:
                self._recipe.received(kind, micro_batch, meta)
            return reason
