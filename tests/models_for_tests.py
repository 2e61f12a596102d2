"""Small models and tasks shared by tests: skip connections across cuts, several stage inputs."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


class SkipNet(nn.Module):
    """Four linear blocks; block 0's output skips to blocks 2 and 3, model input ``y`` enters block 1."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3, self.l4 = (nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(self.l1(x))
        b = torch.tanh(self.l2(a)) * y
        c = torch.tanh(self.l3(b)) + a
        return self.head(torch.tanh(self.l4(c)) + a + b)


def build_model() -> nn.Module:
    return SkipNet()


def split_points() -> list[str]:
    return ["l2", "l3", "l4", "head"]


def example_inputs(micro_batch: int) -> tuple[torch.Tensor, ...]:
    return torch.zeros(micro_batch, 8), torch.zeros(micro_batch, 8)


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, targets)


def train_batches(micro_batch: int, shard: int, num_shards: int,
                  seed: int) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed * 7919 + shard)
    while True:
        x = torch.randn(micro_batch, 8, generator=gen)
        y = torch.randn(micro_batch, 8, generator=gen)
        yield (x, y), (x[:, 0] > y[:, 1]).long() + (x[:, 2] > 0.5).long()


def make_optimizer(params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)
