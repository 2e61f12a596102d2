"""What a stage's compute thread works on next, and the queues the event loop fills for it.

``Scheduler`` holds, behind one condition variable, the parts of micro-batches that arrived (a
micro-batch is ready once every stage that sends it a part has), control work submitted from other
threads (an averaging round's result, a pause's reset), and the stage's pause and stop flags.
``next`` picks the work in the pipeline's order: control work first, then a ready backward, then a
ready forward, then (stage 0, holding a credit) a new micro-batch; so a finished micro-batch never
waits behind a new one and its stashed weights are freed as soon as possible.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ravq.codec.compress import Packed
from ravq.stage.tensors import Expected, Parts, check_tensors
from ravq.stage.types import MicroBatch

WAIT_S = 0.5
"""Longest single wait for work: flags set without a notify (``should_abort``) are seen this soon."""


class Schedulable(Protocol):
    """What the scheduler asks of the stage it schedules (``ravq.stage.pipeline.StageWorker``)."""

    def may_start(self) -> bool:
        """Stage 0 holds a credit and has data left: it may start a micro-batch now."""

    def may_forward(self) -> bool:
        """Its weights are ready for a forward (tied copies not too far behind)."""

    def has_deferred(self) -> bool:
        """Weight passes of split backwards wait (``training.schedule: zero_bubble``)."""

    def finished(self) -> bool:
        """Nothing is left to do: ``steps`` micro-batches trained, or stopped with none in flight."""

    def idle_reason(self) -> str | None:
        """What waiting now waits for ("credits", "input"); None when it is not counted."""

    def waited_idle(self, reason: str, seconds: float) -> None:
        """Count ``seconds`` waited between operations for ``reason``."""


Control = Callable[[], None]
"""Work submitted to the compute thread (an averaging round's result, a pause's reset, norms)."""
Work = tuple[str, Any]
"""("control", fn), ("bwd" | "eval" | "fwd", (micro_batch, parts)), ("start" | "weights", None)."""


class Scheduler:
    """Arrived parts, control work and the pause and stop flags; ``put`` and ``pop_ready`` run with
    ``cond`` held (the caller looks at its stash under it), every other method takes it itself."""

    def __init__(self, forward_sources: list[int], backward_sources: list[int], limit: int,
                 clock: Callable[[], float] = time.monotonic, eval_round: int = 0) -> None:
        self.cond = threading.Condition()
        self.clock = clock
        """Seconds, monotonic: what an idle wait is timed on (the stage's clock)."""
        self.sources = {"fwd": forward_sources, "bwd": backward_sources, "eval": forward_sources}
        self.parts: dict[str, OrderedDict[MicroBatch, dict[int, dict[str, torch.Tensor | Packed]]]] = {
            "fwd": OrderedDict(), "bwd": OrderedDict(), "eval": OrderedDict()}
        self.limits = {"fwd": limit, "bwd": limit, "eval": limit + eval_round}
        """Micro-batches with parts waiting, per direction, beyond which a part of another micro-batch is
        refused.  Stage 0 sends an evaluation round (``eval_round`` micro-batches) at once, outside the
        credit window, so a stage fed by two sources may hold all of it half-arrived."""
        self.control: list[Control] = []
        self.paused = False
        self.stopping = False
        self.running = False
        """True while the compute thread runs the stage: control work submitted now runs there."""

    def put(self, kind: str, micro_batch: MicroBatch, source: int,
            tensors: dict[str, torch.Tensor | Packed], expected: Expected | None) -> str | None:
        """Queue ``source``'s part of ``micro_batch`` for ``kind`` ("fwd"/"bwd"), checked against
        ``expected`` (None: the stage expects no such micro-batch; a forward's tensors must be exactly
        those).  None if queued, else why it was refused."""
        parts = self.parts[kind]
        if source not in self.sources[kind]:
            return "unexpected_source"
        if source in parts.get(micro_batch, {}):
            return "duplicate"
        if expected is None:
            return "unexpected_micro_batch"
        reason = check_tensors(tensors, expected, exact=kind != "bwd")
        if reason is not None:
            return reason
        if micro_batch not in parts and len(parts) >= self.limits[kind]:
            return "queue_full"
        parts.setdefault(micro_batch, {})[source] = tensors
        self.cond.notify()
        return None

    def pop_ready(self, kind: str) -> tuple[MicroBatch, Parts] | None:
        """The oldest micro-batch of ``kind`` with every part in, taken off the queue."""
        want = len(self.sources[kind])
        for mb, got in self.parts[kind].items():
            if len(got) == want:
                return mb, self.parts[kind].pop(mb)
        return None

    def has_ready(self) -> bool:
        """Whether a micro-batch has every part in, in either direction."""
        with self.cond:
            return any(len(got) == len(self.sources[kind])
                       for kind in ("bwd", "fwd") for got in self.parts[kind].values())

    def next(self, stage: Schedulable, should_abort: Callable[[], bool]) -> Work | None:
        """Wait for the next work; None when there is none left (finished, stopped, or giving up)."""
        with self.cond:
            while True:
                if self.control:
                    return "control", self.control.pop(0)
                if should_abort():
                    return None
                if self.paused:
                    if self.stopping:
                        return None
                    self.cond.wait(timeout=WAIT_S)
                    continue
                for kind in ("bwd", "eval", "fwd"):  # eval micro-batches hold no credit: never park them
                    ready = self.pop_ready(kind) if kind != "fwd" or stage.may_forward() else None
                    if ready is not None:
                        return kind, ready
                if stage.may_start():
                    return "start", None
                if stage.has_deferred():  # a split backward's weight pass fills what would idle
                    return "weights", None
                if stage.finished():
                    return None
                self._idle(stage)

    def _idle(self, stage: Schedulable) -> None:
        reason = None if self.stopping else stage.idle_reason()
        t0 = self.clock()
        self.cond.wait(timeout=WAIT_S)
        if reason is not None:
            stage.waited_idle(reason, self.clock() - t0)

    def submit(self, fn: Control) -> None:
        with self.cond:
            self.control.append(fn)
            self.cond.notify()

    def call(self, fn: Control) -> bool:
        """``submit`` if the compute thread runs the stage (True); False if not."""
        with self.cond:
            if not self.running:
                return False
            self.submit(fn)
            return True

    def take_control(self) -> list[Control]:
        """All control work submitted so far, taken off the queue."""
        with self.cond:
            pending, self.control = self.control, []
        return pending

    def pause(self, paused: bool = True) -> None:
        """Start no new work but control work until ``pause(False)``."""
        with self.cond:
            self.paused = paused
            self.cond.notify()

    def stop(self) -> None:
        """Start no new micro-batch; ``next`` returns None once the stage finished what is in flight."""
        with self.cond:
            self.stopping = True
            self.cond.notify()

    def clear_parts(self) -> None:
        with self.cond:
            for parts in self.parts.values():
                parts.clear()

    def depths(self) -> dict[str, int]:
        with self.cond:
            return {"forward": len(self.parts["fwd"]), "backward": len(self.parts["bwd"])}
