"""tests.models_for_tests with the loss throttled to about 80 micro-batches/s (the last stage sleeps),
so a churn test's run lasts long enough for its kills and restarts whatever the machine's speed.
``CHURN_TASK_PAUSE_S`` in a last stage's environment slows its cluster down further."""

from __future__ import annotations

import os
import time

import torch

from tests.models_for_tests import build_model, example_inputs, make_optimizer, split_points, train_batches
from tests.models_for_tests import loss_fn as _loss_fn

__all__ = ["build_model", "example_inputs", "loss_fn", "make_optimizer", "split_points", "train_batches"]
PAUSE_S = float(os.environ.get("CHURN_TASK_PAUSE_S") or 1 / 80)


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    time.sleep(PAUSE_S)
    return _loss_fn(outputs, targets)
