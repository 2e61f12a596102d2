"""Tasks for ``ravq check`` (tests/test_check.py): ``tiny`` trains, and each other one is broken in one way
the check must name with its fix.  All tiny (a few hundred parameters): the check runs in-process."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, BLOCKS = 8, 4
Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


class Net(nn.Module):
    """``BLOCKS`` Linear+tanh blocks and a head; ``split_points`` cut before any block but the first."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x).squeeze(-1)


def _batches(micro_batch: int, seed: int, width: int = WIDTH) -> Iterator[Batch]:
    gen = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(micro_batch, width, generator=gen)
        yield (x,), x.sum(-1)


def task(model: type[nn.Module] = Net, **overrides: Any) -> SimpleNamespace:
    """A working task around ``model``, with ``overrides`` replacing any of its functions."""
    base: dict[str, Any] = {
        "build_model": model,
        "example_inputs": lambda micro_batch: (torch.zeros(micro_batch, WIDTH),),
        "loss_fn": F.mse_loss,
        "train_batches": lambda micro_batch, shard, num_shards, seed: _batches(micro_batch, seed * 7 + shard),
        "eval_batches": lambda micro_batch, seed: _batches(micro_batch, 1000 + seed),
        "make_optimizer": lambda params: torch.optim.Adam(params, lr=1e-2),
        "split_points": lambda: [f"blocks.{i}" for i in range(1, BLOCKS)] + ["head"],
    }
    return SimpleNamespace(**{**base, **overrides})


tiny = task()


def _resumable(micro_batch: int, shard: int, num_shards: int, seed: int, start: int = 0) -> Iterator[Batch]:
    """A ``train_batches`` taking the data position (issue #41): the same batches from any start."""
    batches = _batches(micro_batch, seed * 7 + shard)
    for _ in range(start):
        next(batches)
    return batches


resumable = task(train_batches=_resumable)


def _no_data(micro_batch: int, shard: int, num_shards: int, seed: int, start: int = 0) -> Iterator[Batch]:
    raise ValueError("data: /nowhere holds no .txt")  # at the call, as ravq.tasks.text opens its data


no_data = task(
    train_batches=_no_data, eval_batches=lambda micro_batch, seed: _no_data(micro_batch, 0, 1, seed)
)


# ---------------------------------------------------------------- broken, one problem each
lacks_loss = SimpleNamespace(**{k: v for k, v in vars(task()).items() if k != "loss_fn"})
wrong_signature = task(train_batches=lambda micro_batch: _batches(micro_batch, 0))
wrong_shape = task(train_batches=lambda micro_batch, shard, num_shards, seed: _batches(micro_batch, seed,
                                                                                     WIDTH + 1))
eval_not_pairs = task(eval_batches=lambda micro_batch, seed: iter([torch.zeros(micro_batch, WIDTH)] * 3))
loss_not_scalar = task(loss_fn=lambda outputs, targets: (outputs - targets) ** 2)


def _restarts_elsewhere(micro_batch: int, shard: int, num_shards: int, seed: int,
                        start: int = 0) -> Iterator[Batch]:
    return _batches(micro_batch, seed + start)  # a restart at `start` reads another stream, not its position


wrong_start = task(train_batches=_restarts_elsewhere)


class Branchy(Net):
    """Python control flow on a tensor's value: torch's tracer cannot capture it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = torch.tanh(block(x))
            if i == 1 and x.sum() > 0:
                x = -x
        return self.head(x).squeeze(-1)


untraceable = task(Branchy)


class DynamicCache:
    """Stands for transformers' key/value cache: not a tensor."""


class Cached(Net):
    def forward(self, x: torch.Tensor) -> dict[str, Any]:  # type: ignore[override]
        return {"logits": super().forward(x), "past_key_values": DynamicCache()}


cache_output = task(Cached, loss_fn=lambda outputs, targets: F.mse_loss(outputs["logits"], targets))


class Counting(Net):
    """Python state in forward: the tracer freezes ``calls`` at its value while tracing."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x) * self.calls


python_state = task(Counting)


class EvalOnly(Net):
    """A module read only in evaluation mode, after the last block: training never gives the last stage its
    weights, so the last stage's eval graph reads what its training stage does not hold."""

    def __init__(self) -> None:
        super().__init__()
        self.calibrate = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y if self.training else self.calibrate(y.unsqueeze(-1)).squeeze(-1)


eval_only = task(EvalOnly)


class Unused(Net):
    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Linear(WIDTH, WIDTH)  # never called


unused = task(Unused)


class Scale(nn.Module):
    """A bare parameter in a module without ``reset_parameters``: only the constructor initialises it."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class Uninitialised(Net):
    def __init__(self) -> None:
        super().__init__()
        self.scale = Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.scale(x))


no_reset = task(Uninitialised)


class Normed(Net):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.drop(self.norm(x)))


batch_norm = task(Normed)
