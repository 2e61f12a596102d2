"""``tests.big_task``'s transformer with Adam, for bench_check_memory.py: every part of a stage's memory
(weights, gradients, optimizer state, weight snapshots, activations) is there.  Its size comes from
``RAVQ_BIG_D_MODEL`` and ``RAVQ_BIG_LAYERS`` (tests/big_task.py)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tests.big_task import build_model, example_inputs, loss_fn, split_points, train_batches

__all__ = ["build_model", "example_inputs", "loss_fn", "make_optimizer", "split_points", "train_batches"]


def make_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-4)
