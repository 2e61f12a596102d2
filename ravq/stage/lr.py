"""Learning-rate schedules stepped by the cluster's optimizer step.

Every stage of a cluster applies its ``version``-th optimizer step at the same point of the data (the
``update_every`` backwards that make that step), so the schedule is a function of the version alone and
every stage scales its learning rates by the same factor at the same step, however far apart in time the
stages apply it.  The task's learning rates are kept in each parameter group's ``initial_lr`` (as
``torch.optim.lr_scheduler.LambdaLR`` keeps them); they are part of the optimizer's state dict, so a
checkpoint restores them and the factor is recomputed from the restored version: a resume is exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

LRLambda = Callable[[int], float]


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    """A schedule kind and its shape (``ravq.config.LRScheduleConfig`` with total_steps resolved)."""

    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1
    min_lr_ratio: float = 0.0


def lr_lambda(spec: ScheduleSpec, task_lambda: LRLambda | None = None) -> LRLambda:
    """The factor of optimizer step ``step`` (0 for the first step), as ``LambdaLR``'s ``lr_lambda``."""
    if spec.kind == "task":
        if task_lambda is None:
            raise ValueError("training.lr_schedule.kind: 'task' needs the task to define lr_lambda(step)")
        return task_lambda
    if spec.kind == "constant":
        return lambda step: 1.0
    warmup, total, floor = spec.warmup_steps, max(spec.total_steps, 1), spec.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if spec.kind == "warmup":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if spec.kind == "cosine":
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        if spec.kind == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        raise ValueError(f"training.lr_schedule.kind: unknown schedule {spec.kind!r}")

    return factor


class LRSchedule:
    """Sets every parameter group's ``lr`` to ``initial_lr x factor(version)`` before each step."""

    def __init__(self, optimizer: torch.optim.Optimizer, factor: LRLambda) -> None:
        self.optimizer, self.factor = optimizer, factor
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])

    def apply(self, version: int) -> float:
        """Set the learning rates of the step that makes version ``version + 1``; returns the factor."""
        f = float(self.factor(version))
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * f
        return f

    def current_lr(self) -> float:
        """The first parameter group's learning rate (what the metric shows)."""
        return float(self.optimizer.param_groups[0]["lr"])
