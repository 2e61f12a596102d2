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


class DropoutBatchNormNet(nn.Module):
    """Dropout and BatchNorm in every stage: eval mode changes what each stage computes."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.bn1, self.l2, self.bn2 = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 16), nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(torch.relu(self.bn1(self.l1(x))))
        x = self.drop(torch.relu(self.bn2(self.l2(x))))
        return self.head(x)


def _classes(micro_batch: int, seed: int) -> Iterator[tuple[tuple[torch.Tensor], torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(micro_batch, 8, generator=gen)
        yield (x,), (x[:, 0] > x[:, 1]).long() + (x[:, 2] > 0.5).long()


class _DropoutTask:
    """A task object (not a module): eval_batches are held out by seed."""

    build_model = staticmethod(DropoutBatchNormNet)
    example_inputs = staticmethod(lambda mb: (torch.zeros(mb, 8),))
    loss_fn = staticmethod(torch.nn.functional.cross_entropy)
    metrics_fn = staticmethod(metrics_fn)

    @staticmethod
    def train_batches(micro_batch: int, shard: int, num_shards: int, seed: int) -> Iterator[Any]:
        return _classes(micro_batch, seed * 7919 + shard)

    @staticmethod
    def eval_batches(micro_batch: int, seed: int) -> Iterator[Any]:
        return _classes(micro_batch, 10_000_019 + seed)

    @staticmethod
    def split_points() -> list[str]:
        return ["l2", "head"]

    @staticmethod
    def make_optimizer(params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1)


dropout_bn = _DropoutTask()
