"""SkipNet with plain SGD (no momentum): averaging weights each step equals averaging gradients."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from tests.models_for_tests import build_model, example_inputs, loss_fn, split_points, train_batches

__all__ = ["build_model", "example_inputs", "loss_fn", "make_optimizer", "split_points", "train_batches"]


def make_optimizer(params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.2)
