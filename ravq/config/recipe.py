"""The training recipe a topology sets beside the pipeline: learning-rate schedule (see docs/training.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ravq.config.base import UserModel


class LRScheduleConfig(UserModel):
    """The factor each optimizer step multiplies the task's learning rates by, stepped by the cluster's
    optimizer step (a stage's ``version``), the same on every stage (ravq.stage.lr)."""

    kind: Literal["constant", "warmup", "cosine", "linear", "task"] = "constant"
    """constant: 1.  warmup: linear from 1/(warmup_steps+1) to 1 over warmup_steps, then 1.  cosine: warmup,
    then a half cosine from 1 down to min_lr_ratio at total_steps.  linear: warmup, then linear down to
    min_lr_ratio at total_steps.  task: the task's ``lr_lambda(step)``."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warmup (warmup, cosine, linear)."""
    total_steps: int | None = Field(None, ge=1)
    """Optimizer steps the decay spans; default: the run's, ceil(training.steps / update_every)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Where cosine and linear decay end, as a fraction of the task's learning rate."""

    @model_validator(mode="after")
    def _warmup_inside(self) -> LRScheduleConfig:
        if self.total_steps is not None and self.warmup_steps >= self.total_steps:
            raise ValueError(f"lr_schedule.warmup_steps: must be below total_steps ({self.total_steps}), "
                             f"got {self.warmup_steps}")
        return self
