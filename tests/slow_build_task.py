"""tests.tasks_for_tests whose ``build_model`` blocks for ten minutes once ``RAVQ_TEST_BUILD_MARKER`` names a
file (written first): a node stopped while it builds its stage (the tracer's place) must not wait for it."""

from __future__ import annotations

import os
import time
from pathlib import Path

from torch import nn

from tests.tasks_for_tests import build_model as _build_model
from tests.tasks_for_tests import example_inputs, loss_fn, make_optimizer, train_batches

__all__ = ["build_model", "example_inputs", "loss_fn", "make_optimizer", "train_batches"]


def build_model() -> nn.Module:
    marker = os.environ.get("RAVQ_TEST_BUILD_MARKER")
    if marker:
        Path(marker).write_text("building")
        time.sleep(600)
    return _build_model()
