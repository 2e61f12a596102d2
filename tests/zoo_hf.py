"""Tiny Hugging Face causal LMs (random weights, no download) as tasks: ``tests.zoo_hf:gpt2`` / ``:llama``.

Plain SGD, so averaging the weights of 2 clusters every step equals one process on both clusters' batches."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ravq.tasks.hf_causal_lm import make_task


def _sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.2)


gpt2 = make_task("gpt2", layers=3, hidden=32, heads=2, context=16, optimizer=_sgd)
llama = make_task("llama", layers=3, hidden=32, heads=2, context=16, optimizer=_sgd)
