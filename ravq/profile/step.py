"""The training step a PC's compute is timed on: the task's whole model when it fits, else its largest block.

``measure_compute`` times forward, backward and optimizer step on one real micro-batch.  A model that
fits in half of the PC's usable memory (weights, gradients and two optimizer states: Adam's) is timed
whole, as before; a larger one (the models ravq exists for) is timed on its largest block, the one a
PC of the swarm is most likely to hold: its inputs are made by running the blocks before it one at a
time (each given real weights, run without gradients, then dropped), so profiling never holds more
than one block.  Weights follow the materialisation rule (``ravq.cut.materialize``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ravq.cut.materialize import materialize
from ravq.cut.meta import build_meta_model, example_args, retarget_device
from ravq.cut.split import StageSpec, build_task_model, candidate_cuts, model_output, split_model

log = logging.getLogger(__name__)

Step = Callable[[], torch.Tensor]
"""Runs one forward and returns the scalar to call backward on."""


def training_step_target(task: Any, micro_batch: int, device: str,
                         budget_bytes: int) -> tuple[list[nn.Parameter], Step]:
    """The parameters to update and the forward to time, for the whole model or its largest block."""
    params, forward, _ = timed_step(task, micro_batch, device, budget_bytes)
    return params, forward


def timed_step(task: Any, micro_batch: int, device: str,
               budget_bytes: int) -> tuple[list[nn.Parameter], Step, bool]:
    """``training_step_target``, and whether the forward timed computes the task's loss (the whole model,
    or a largest block that is the last)."""
    meta = build_meta_model(task, 0).model
    need = 4 * sum(p.numel() * p.element_size() for p in meta.parameters())
    inputs, targets = next(iter(task.train_batches(micro_batch, 0, 1, 0)))
    inputs = tuple(x.to(device) for x in (inputs if isinstance(inputs, (tuple, list)) else (inputs,)))
    targets = targets.to(device)
    if need <= budget_bytes:
        model = build_task_model(task, 0).to(device)
        return list(model.parameters()), lambda: task.loss_fn(model(*inputs), targets), True
    specs = split_model(meta, example_args(task, micro_batch), candidate_cuts(meta, task))
    biggest = max(specs, key=lambda s: sum(p.numel() for p in s.module.parameters()))
    log.info("profile: the model (%.0f MB with gradients and optimizer state) is timed on its largest block, "
             "%d of %d", need / 1e6, biggest.index, len(specs))
    outputs = _outputs_before(specs, biggest.index, inputs, task, device)
    module = _real(biggest, task, device)
    received = [inputs[r.index] if r.stage < 0 else outputs[r.stage][r.index] for r in biggest.received]
    received = [t.detach().requires_grad_(t.is_floating_point() and r.stage >= 0)
                for t, r in zip(received, biggest.received)]
    last = biggest.index == len(specs) - 1

    def forward() -> torch.Tensor:
        raw = module(*received[: len(biggest.inputs)])
        if last:
            return task.loss_fn(model_output(biggest, raw, received), targets)
        outs = raw if isinstance(raw, (tuple, list)) else (raw,)
        return sum((o.float().sum() for o in outs if o.requires_grad), torch.zeros((), device=device))

    return [p for p in module.parameters() if p.requires_grad], forward, last


def _real(spec: StageSpec, task: Any, device: str) -> nn.Module:
    materialize(spec.module, task, 0)
    retarget_device(spec.module, "meta", device)
    return spec.module.to(device)


def _outputs_before(specs: list[StageSpec], stop: int, inputs: tuple[torch.Tensor, ...], task: Any,
                    device: str) -> dict[int, tuple[torch.Tensor, ...]]:
    outputs: dict[int, tuple[torch.Tensor, ...]] = {}
    for spec in specs[:stop]:
        module = _real(spec, task, device)
        got = [inputs[r.index] if r.stage < 0 else outputs[r.stage][r.index] for r in spec.inputs]
        with torch.no_grad():
            raw = module(*got)
        outputs[spec.index] = tuple(raw) if isinstance(raw, (tuple, list)) else (raw,)
        module.to("meta")  # its weights are not needed again
    return outputs
