"""One process trained with a recipe (autocast, LR schedule, global-norm clipping): the reference the
pipeline's recipe must match in sync mode."""

from __future__ import annotations

from types import ModuleType

import torch

from ravq.cut.split import build_task_model
from ravq.stage.precision import autocast_for
from ravq.stage.recipe import build_optimizer
from ravq.stage.types import RecipeOptions


def train_one_process_recipe(task: ModuleType, recipe: RecipeOptions, *, steps: int, micro_batch: int = 4,
                             seed: int = 0, shards: int = 1) -> dict[str, torch.Tensor]:
    """The unsplit model, ``torch.nn.utils.clip_grad_norm_`` and ``LambdaLR``; with shards > 1 each step
    takes the mean of each shard's gradient clipped on its own (synchronous data parallelism where each
    cluster clips its own step, which averaging every step then averages)."""
    model = build_task_model(task, seed)
    opt = build_optimizer(task.make_optimizer, dict(model.named_parameters()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, recipe.lr_lambda) if recipe.lr_lambda else None
    streams = [task.train_batches(micro_batch, s, shards, seed) for s in range(shards)]
    for _ in range(steps):
        opt.zero_grad()
        losses = []
        for stream in streams:
            inputs, targets = next(stream)
            with autocast_for(recipe.precision, "cpu"):
                losses.append(task.loss_fn(model(*inputs), targets))
        if shards == 1:
            losses[0].backward()
            if recipe.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_grad_norm)
        else:
            _mean_of_clipped(model, losses, recipe.clip_grad_norm)
        opt.step()
        if sched is not None:
            sched.step()
    return model.state_dict()


def _mean_of_clipped(model: torch.nn.Module, losses: list[torch.Tensor], max_norm: float | None) -> None:
    """``.grad`` = the mean over ``losses`` of each one's gradient, clipped to ``max_norm`` on its own."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for loss in losses:
        for p in params:
            p.grad = None
        loss.backward(retain_graph=True)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        for t, p in zip(total, params):
            t.add_(p.grad)
    for t, p in zip(total, params):
        p.grad = t / len(losses)
