"""A GPT-2 task starting from a pretrained checkpoint the test saved (``RAVQ_TEST_PRETRAINED``): the
model is built from the checkpoint's config and each stage reads its own tensors from the checkpoint."""

from __future__ import annotations

import os
from typing import Any

import torch

from ravq.tasks.hf_causal_lm import loss_fn, make_task

CONTEXT = 16
_base = make_task("gpt2", layers=3, hidden=32, heads=2, context=CONTEXT, lr=1e-3)
example_inputs, train_batches, split_points = _base.example_inputs, _base.train_batches, _base.split_points
pretrained = os.environ.get("RAVQ_TEST_PRETRAINED", "")
__all__ = ["build_model", "example_inputs", "loss_fn", "make_optimizer", "pretrained", "split_points", "train_batches"]


def build_model() -> torch.nn.Module:
    import transformers

    return transformers.GPT2LMHeadModel(transformers.AutoConfig.from_pretrained(pretrained))


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2)
