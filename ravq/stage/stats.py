"""A stage's counters: work done, compute and waiting time, staleness, loss.

``StageStats`` is what a node reports in its heartbeats and summary (``snapshot``).  Its ``record_*``
methods also feed the Prometheus metrics when the stage has them (``metrics`` None: counters only).
Durations are read off the stage's ``clock`` (``time.monotonic`` unless a test drives a fake one).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ravq.metrics import Metrics

LOSS_WINDOW = 10
STALENESS_WINDOW = 64
HISTORY = 100_000


def _mean(values: Any) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


@dataclass(kw_only=True, slots=True)
class StageStats:
    forwards: int = 0
    backwards: int = 0
    updates: int = 0
    samples: int = 0
    busy_s: float = 0.0
    """Forward and backward compute only: waits inside them (``wait_s``) are taken out."""
    wait_s: dict[str, float] = field(default_factory=dict)
    """Seconds waited instead of computing, by reason: "input" (no activations or gradients to work
    on), "credits" (stage 0 at ``max_inflight``), "averaging" (held back for an averaging round),
    "checkpoint" (writing one)."""
    forward_s: float = 0.0
    backward_s: float = 0.0
    forward_sq_s: float = 0.0
    """Sum of squared forward durations (with forward_s and forwards: their spread, for ``ravq simulate``)."""
    backward_sq_s: float = 0.0
    forward_step_sq_s: float = 0.0
    """Sum of squared differences of consecutive forward durations from the second on (the first warms
    up): the part of their spread that changes from one micro-batch to the next (slow drift cancels)."""
    forward_last_s: float | None = None
    staleness_sum: int = 0
    staleness_max: int = 0
    staleness_recent: deque[int] = field(default_factory=lambda: deque(maxlen=STALENESS_WINDOW))
    """The staleness of the latest backwards, in optimizer updates (``ravq status`` shows their mean)."""
    loss_last: float | None = None
    loss_first: float | None = None
    loss_sum: float = 0.0
    losses: int = 0
    started_at: float | None = None
    inflight: int = 0
    loss_head: list[float] = field(default_factory=list)
    """The first LOSS_WINDOW losses (for a steadier initial loss than one micro-batch)."""
    loss_tail: deque[float] = field(default_factory=lambda: deque(maxlen=LOSS_WINDOW))
    loss_history: list[float] = field(default_factory=list)
    """Every micro-batch's loss, in order (last stage only; written to the summary, not heartbeats)."""
    update_times: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    """Wall-clock time of the latest optimizer steps (summary only: shows how long a stage stalled)."""
    completed: list[int] = field(default_factory=list)
    """Stage 0: data index of each micro-batch finished, in order (the first HISTORY; summary only)."""
    recipe: dict[str, Any] = field(default_factory=dict)
    """What the training recipe reports (``ravq.stage.recipe``): lr, grad_norm, train_metrics, eval_loss,
    eval_loss_first, eval_version, eval_metrics; part of every snapshot."""
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)
    """Seconds, monotonic: ``started_at`` is on it, and ``snapshot``'s ``wall_s`` reads it (the worker's)."""
    metrics: Metrics | None = field(default=None, repr=False, compare=False)
    """The process's Prometheus metrics the ``record_*`` methods also feed; None: counters only."""

    def report_to(self, metrics: Metrics | None) -> None:
        """Feed ``metrics`` from now on (None: counters only)."""
        self.metrics = metrics

    def started(self) -> None:
        """The stage's first work begins now (``started_at``, once)."""
        if self.started_at is None:
            self.started_at = self.clock()

    def restore(self, trained: int) -> None:
        """Resuming from a checkpoint: ``trained`` micro-batches count as forwards and backwards done."""
        self.forwards = self.backwards = trained

    def record_forward(self, inflight: int) -> None:
        """A forward ran; ``inflight`` micro-batches are stashed after it."""
        self.forwards += 1
        self.inflight = inflight

    def record_inflight(self, inflight: int) -> None:
        """``inflight`` micro-batches are stashed now (a backward finished one, a pause dropped them)."""
        self.inflight = inflight

    def record_busy(self, kind: str, seconds: float) -> None:
        """Compute outside a forward or backward (``kind`` "step" or "eval") that counts as busy."""
        self.busy_s += seconds
        if self.metrics is not None:
            self.metrics.compute_seconds.labels(kind).observe(seconds)
            self.metrics.busy_seconds.inc(seconds)

    def record_recipe(self, fields: dict[str, Any]) -> None:
        """What the training recipe reports (``recipe``), updated."""
        self.recipe.update(fields)

    def snapshot(self) -> dict[str, Any]:
        wall = self.clock() - self.started_at if self.started_at is not None else 0.0
        return {
            "forwards": self.forwards, "backwards": self.backwards, "updates": self.updates,
            "samples": self.samples, "busy_s": self.busy_s, "wall_s": wall,
            "busy_fraction": self.busy_s / wall if wall > 0 else 0.0, "wait_s": dict(self.wait_s),
            "staleness_mean": self.staleness_sum / self.backwards if self.backwards else 0.0,
            "staleness_max": self.staleness_max, "staleness_updates": _mean(self.staleness_recent) or 0.0,
            "loss": self.loss_last, "loss_first": self.loss_first,
            "loss_initial": _mean(self.loss_head), "loss_recent": _mean(self.loss_tail),
            "inflight": self.inflight, "forward_s": self.forward_s, "backward_s": self.backward_s,
            "forward_sq_s": self.forward_sq_s, "backward_sq_s": self.backward_sq_s,
            "forward_step_sq_s": self.forward_step_sq_s, **self.recipe,
        }

    def record_compute(self, phase: str, seconds: float, inflight: int) -> None:
        """One forward or backward (``phase``) that computed for ``seconds``; ``inflight`` micro-batches
        are stashed after it."""
        self.busy_s += seconds
        if phase == "forward":
            self.forward_s += seconds
            self.forward_sq_s += seconds * seconds
            if self.forward_last_s is not None and self.forwards > 2:   # not the warm-up forward
                self.forward_step_sq_s += (seconds - self.forward_last_s) ** 2
            self.forward_last_s = seconds
        else:
            self.backward_s += seconds
            self.backward_sq_s += seconds * seconds
        if (metrics := self.metrics) is not None:
            metrics.compute_seconds.labels(phase).observe(seconds)
            metrics.busy_seconds.inc(seconds)
            metrics.inflight.set(inflight)

    def record_wait(self, reason: str, seconds: float) -> None:
        self.wait_s[reason] = self.wait_s.get(reason, 0.0) + seconds
        if (metrics := self.metrics) is not None:
            metrics.wait_seconds.labels(reason).inc(seconds)

    def record_loss(self, value: float) -> None:
        self.loss_last = value
        self.loss_first = value if self.loss_first is None else self.loss_first
        self.loss_sum += value
        self.losses += 1
        if len(self.loss_head) < LOSS_WINDOW:
            self.loss_head.append(value)
        self.loss_tail.append(value)
        self.loss_history.append(value)
        if (metrics := self.metrics) is not None:
            metrics.loss.set(value)
            metrics.losses.inc(value)

    def record_backward(self, samples: int) -> None:
        self.backwards += 1
        self.samples += samples
        if (metrics := self.metrics) is not None:  # ravq_samples_total: the throughput panels read it
            metrics.samples.inc(samples)

    def record_completed(self, index: int) -> None:
        """Stage 0 finished the micro-batch of data index ``index``."""
        if len(self.completed) < HISTORY:
            self.completed.append(index)

    def record_staleness(self, staleness: int) -> None:
        self.staleness_sum += staleness
        self.staleness_max = max(self.staleness_max, staleness)
        self.staleness_recent.append(staleness)
        if (metrics := self.metrics) is not None:
            metrics.staleness.observe(staleness)
            metrics.staleness_updates.set(sum(self.staleness_recent) / len(self.staleness_recent))

    def record_guard(self, report: dict[str, Any], cosine: float | None = None) -> None:
        """What the asynchrony guard reports (``ravq.stage.guard``) joins the snapshot; ``cosine``: the one it
        just sampled."""
        self.recipe.update(report)
        if (metrics := self.metrics) is not None:
            if cosine is not None:
                metrics.stale_gradient_cosine.set(cosine)
            metrics.asynchrony_warning.set(1 if report.get("asynchrony_warning") else 0)

    def record_update(self, version: int) -> None:
        self.updates += 1
        self.update_times.append(time.time())
        if (metrics := self.metrics) is not None:
            metrics.version.set(version)
