"""One process trained with a recipe (autocast, LR schedule, global-norm clipping): the reference the
pipeline's recipe must match in sync mode."""

from __future__ import annotations

from types import ModuleType

import torch

from ravq.stage.precision import autocast_for
from ravq.stage.recipe import build_optimizer
from ravq.stage.split import build_task_model
from ravq.stage.types import RecipeOptions


def train_one_process_recipe(task: ModuleType, recipe: RecipeOptions, *, steps: int, micro_batch: int = 4,
                             seed: int = 0, shards: int = 1) -> dict[str, torch.Tensor]:
    """The unsplit model, ``torch.nn.utils.clip_grad_norm_`` and ``LambdaLR``; with shards > 1 each step
    takes the mean of one micro-batch's loss per shard (synchronous data parallelism)."""
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
        torch.stack(losses).mean().backward()
        if recipe.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_grad_norm)
        opt.step()
        if sched is not None:
            sched.step()
    return model.state_dict()
