"""The feature matrix's task (tests/test_matrix.py), one task object per combination of its task-side
features, named by them: ``tests.matrix_task:lm`` plus ``_tied``, ``_pretrained``, ``_eval``,
``_metrics`` in that order (``tests.matrix_task:lm_tied_eval``).

A per-token language model small enough for a cell to train in a second: an embedding, three blocks
(cut points ``b1`` and ``b2``) and an output head, tied to the embedding or not.  The data is a
deterministic bigram chain with a little noise, so the loss falls fast from ln(VOCAB).  ``pretrained``
names the file in ``$RAVQ_MATRIX_PRETRAINED`` (the test writes it)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D_MODEL, SEQ = 16, 16, 8
FEATURES = ("tied", "pretrained", "eval", "metrics")
PRETRAINED_ENV = "RAVQ_MATRIX_PRETRAINED"


class MatrixLM(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.b0 = nn.Linear(D_MODEL, D_MODEL)
        self.b1 = nn.Linear(D_MODEL, D_MODEL)
        self.b2 = nn.Linear(D_MODEL, D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for block in (self.b0, self.b1, self.b2):
            h = h + torch.tanh(block(h))
        return self.head(h)


def _chain(gen: torch.Generator, micro_batch: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    start = torch.randint(0, VOCAB, (micro_batch, 1), generator=gen)
    tokens = (start * 5 + 3 * torch.arange(SEQ + 1)) % VOCAB  # next = current + 3 (mod VOCAB)
    noise = torch.rand(micro_batch, SEQ + 1, generator=gen) < 0.1
    tokens = torch.where(noise, torch.randint(0, VOCAB, tokens.shape, generator=gen), tokens)
    return (tokens[:, :-1],), tokens[:, 1:]


def train_batches(micro_batch: int, shard: int, num_shards: int,
                  seed: int) -> Iterator[tuple[tuple[torch.Tensor], torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed * 1009 + shard * 31 + num_shards)
    while True:
        yield _chain(gen, micro_batch)


def eval_batches(micro_batch: int, seed: int) -> Iterator[tuple[tuple[torch.Tensor], torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed * 1009 + 777_777)  # no training shard draws from it
    while True:
        yield _chain(gen, micro_batch)


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.reshape(-1, VOCAB).float(), targets.reshape(-1))


def metrics_fn(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"accuracy": (outputs.argmax(-1) == targets).float().mean()}


def make_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.3, momentum=0.5)  # linear in the gradient: averaging commutes


def pretrained() -> str:
    return os.environ[PRETRAINED_ENV]


def task(features: frozenset[str]) -> SimpleNamespace:
    """The task object with ``features`` (a subset of FEATURES)."""
    unknown = features - set(FEATURES)
    assert not unknown, unknown
    extra = {"pretrained": pretrained} if "pretrained" in features else {}
    if "eval" in features:
        extra["eval_batches"] = eval_batches
    if "metrics" in features:
        extra["metrics_fn"] = metrics_fn
    return SimpleNamespace(
        build_model=lambda: MatrixLM("tied" in features),
        example_inputs=lambda micro_batch: (torch.zeros(micro_batch, SEQ, dtype=torch.long),),
        loss_fn=loss_fn, train_batches=train_batches, make_optimizer=make_optimizer,
        split_points=lambda: ["b1", "b2"], **extra)


def name(features: Iterable[str]) -> str:
    """The attribute naming the task object with ``features``."""
    chosen = set(features)
    return "_".join(["lm", *(f for f in FEATURES if f in chosen)])


def __getattr__(attr: str) -> SimpleNamespace:
    parts = attr.split("_")
    if parts[0] != "lm" or not set(parts[1:]) <= set(FEATURES):
        raise AttributeError(attr)
    return task(frozenset(parts[1:]))
