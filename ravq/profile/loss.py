"""What only the loss-computing stage does: the task's loss on the model's output, its backward to
that output, and the task's training metrics (``metrics_fn``) when it has any.

The compute profile times whole training steps, loss included, and the planner spread that time over
the model's FLOPs, so every stage paid a share of the loss and the last stage too little of it.  On
issue #14's testbed the stages that computed the loss took 5-13 ms of CPU more per micro-batch than
their profile said and the others -4 to +3 (docs/testbed.md, item 10).  ``measure_loss`` times that
work alone; ``ravq profile`` takes it out of the FLOP/s (``flops_without_loss``) and the planner and
the simulator charge it to the stage holding the last block (``NodeProfile.loss_s``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ravq.cut.meta import build_meta_model
from ravq.cut.split import build_task_model
from ravq.profile.compute import usable_memory_bytes

log = logging.getLogger(__name__)


def _output_like(task: Any, micro_batch: int, inputs: tuple[torch.Tensor, ...], device: str) -> Any:
    """A real tensor (random, requiring grad where floating) shaped as the model's output, found by
    running the model on ``meta`` (no weights are made, so any model size works), or, for a model that
    cannot run there (a ``.item()`` in its forward), the real model when it fits in half the memory."""
    model = build_meta_model(task, 0).model
    try:
        with torch.no_grad():
            out = model(*(x.to("meta") for x in inputs))
    except (RuntimeError, NotImplementedError):
        if (
            4 * sum(p.numel() * p.element_size() for p in model.parameters())
            > usable_memory_bytes(device) // 2
        ):
            raise
        real_model = build_task_model(task, 0).to(device)
        with torch.no_grad():
            out = real_model(*(x.to(device) for x in inputs))
        del real_model

    def real(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.is_floating_point():
            return torch.randn(t.shape, dtype=t.dtype, device=device).requires_grad_(True)
        return torch.zeros(t.shape, dtype=t.dtype, device=device)
    return pytree.tree_map(real, out)


def measure_loss(task: Any, micro_batch: int, device: str = "cpu", *, cpu_s: float = 0.2,
                 min_steps: int = 8) -> float:
    """CPU seconds per micro-batch of the loss stage's extra work: ``loss_fn`` forward and backward on an
    output shaped as the model's, on a real micro-batch's targets, the loss read back as a float, and
    ``metrics_fn`` (no grad) when the task defines one, as ``ravq.stage.pipeline`` runs them.  0.0
    when the model's output cannot be made here (the profile then charges no loss)."""
    inputs, targets = next(iter(task.train_batches(micro_batch, 0, 1, 0)))
    inputs = tuple(inputs if isinstance(inputs, (tuple, list)) else (inputs,))
    targets = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, targets)
    try:
        out = _output_like(task, micro_batch, inputs, device)
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
        log.warning(
            "profile: the model's output could not be shaped on meta (%s); the loss is not timed", err
        )
        return 0.0
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    metrics_fn = getattr(task, "metrics_fn", None)

    def step() -> None:
        for t in leaves:
            t.grad = None
        loss = task.loss_fn(out, targets)
        loss.backward()
        float(loss.detach())
        if callable(metrics_fn):
            with torch.no_grad():
                for value in dict(metrics_fn(out, targets)).values():
                    float(value)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    try:
        step()  # first calls and allocations are not counted
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
        log.warning(
            "profile: the task's loss could not be timed on an output shaped as the model's (%s)", err
        )
        return 0.0
    count, cpu0 = 0, time.process_time()
    while time.process_time() - cpu0 < cpu_s or count < min_steps:
        step()
        count += 1
    return (time.process_time() - cpu0) / count


def flops_without_loss(flops: float, step_flops: float, loss_s: float) -> float:
    """The training FLOP/s of the model's blocks alone: a step of ``step_flops`` FLOPs took
    step_flops / flops seconds, ``loss_s`` of them the loss (which the loss stage is charged apart)."""
    if loss_s <= 0 or step_flops <= 0 or flops <= 0:
        return flops
    step_s = step_flops / flops
    if loss_s >= 0.5 * step_s:  # a loss dearer than half a step says the timing is off: keep the figure
        log.warning("profile: the loss took %.3g s of a %.3g s step; FLOP/s kept as measured", loss_s, step_s)
        return flops
    return step_flops / (step_s - loss_s)
