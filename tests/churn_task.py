"""tests.models_for_tests with the loss throttled to about 80 micro-batches/s (the last stage sleeps),
so a churn test's run lasts long enough for its kills and restarts whatever the machine's speed.
``CHURN_TASK_PAUSE_S`` in a last stage's environment sets another pause (tests/test_churn.py's swarms
train at 20/s; tests/test_lifecycle.py slows one cluster to 2/s).

``CHURN_TASK_UNTHROTTLED_IF`` names a file: once it exists, the loss no longer sleeps, so a test whose
faults are all over lets its swarm train the rest of its steps at full speed instead of waiting them out
(the step budget is sized for a loaded machine's slowest recoveries, most of it unused on a quiet one)."""

from __future__ import annotations

import os
import time

import torch

from tests.models_for_tests import build_model, example_inputs, make_optimizer, split_points, train_batches
from tests.models_for_tests import loss_fn as _loss_fn

__all__ = ["build_model", "example_inputs", "loss_fn", "make_optimizer", "split_points", "train_batches"]
PAUSE_S = float(os.environ.get("CHURN_TASK_PAUSE_S") or 1 / 80)
UNTHROTTLED_IF = os.environ.get("CHURN_TASK_UNTHROTTLED_IF")


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if not (UNTHROTTLED_IF and os.path.exists(UNTHROTTLED_IF)):
        time.sleep(PAUSE_S)
    return _loss_fn(outputs, targets)
