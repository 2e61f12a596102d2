"""Tasks for the recipe tests: decay groups by parameter name, a task LR lambda, training metrics."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ravq.stage.optim import ClusterAdam
from tests.models_for_tests import build_model, example_inputs, loss_fn, split_points, train_batches

__all__ = ["build_model", "example_inputs", "loss_fn", "lr_lambda", "make_optimizer", "metrics_fn", "split_points",
           "train_batches"]


def make_optimizer(named_params: Iterator[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    """AdamW with no decay on biases, as GPT training scripts do: the groups list biases first, so the
    optimizer numbers parameters in another order than the module does."""
    named = list(named_params)
    no_decay = [p for n, p in named if n.endswith("bias")]
    decay = [p for n, p in named if not n.endswith("bias")]
    return ClusterAdam([{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": 0.1}],
                       lr=0.02, decoupled_weight_decay=True)


def lr_lambda(step: int) -> float:
    return 1.0 / (1.0 + 0.1 * step)


def metrics_fn(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    return {"accuracy": (outputs.argmax(-1) == targets).float().mean()}
