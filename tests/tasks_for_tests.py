"""A tiny task for tests: a two-block MLP learning a fixed linear map.

Offers the task interface of docs/design.md as plain functions so a topology can name it
(``tasks_for_tests``, with ``tests/`` on ``sys.path``).  ``incomplete`` is an object lacking most of
the interface, for the "task lacks functions" error (``tasks_for_tests:incomplete``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from types import SimpleNamespace

import torch
from torch import nn

IN_FEATURES = 8
OUT_FEATURES = 4


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(IN_FEATURES, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, OUT_FEATURES),
    )


def example_inputs(micro_batch: int) -> torch.Tensor:
    return torch.zeros(micro_batch, IN_FEATURES)


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(outputs, targets)


def train_batches(
    micro_batch: int, shard: int, num_shards: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless batches; each shard draws from its own generator, the target map is shared."""
    weight = torch.randn(IN_FEATURES, OUT_FEATURES, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed * num_shards + shard + 1)
    while True:
        inputs = torch.randn(micro_batch, IN_FEATURES, generator=gen)
        yield inputs, inputs @ weight


def make_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


incomplete = SimpleNamespace(build_model=build_model, loss_fn=loss_fn)
"""Lacks example_inputs, train_batches and make_optimizer."""


def _charlm_without_metrics() -> SimpleNamespace:
    from ravq.tasks import charlm

    names = ("build_model", "split_points", "example_inputs", "loss_fn", "train_batches", "eval_batches",
             "make_optimizer")
    return SimpleNamespace(**{name: getattr(charlm, name) for name in names})


charlm_without_metrics = _charlm_without_metrics()
"""The demo's task (``ravq.tasks.charlm``) without ``metrics_fn``: a user's first task usually has none."""
