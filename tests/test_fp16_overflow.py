"""fp16 with a dynamic loss scale, overflow included, equals one process doing the same (in process).

One process: each micro-batch's loss times the scale, its weight gradients divided by it, a step skipped
(and the scale halved) when the global norm is not finite, GradScaler's rules (``LossScale``).  Two tasks
overflow at the first scale (2^16) at their first step, so the skip is exercised; the split model must
skip the same step on every stage and end with the same weights.  (Against a reference without loss
scaling these tasks differ by up to 1e-2: the reference's unscaled fp16 gradients underflow.)"""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch

from ravq.cut.split import build_task_model
from ravq.stage.clip import clip_factor, squared_norm
from ravq.stage.precision import LossScale, autocast_for
from ravq.stage.recipe import build_optimizer
from ravq.stage.types import RecipeOptions
from tests import zoo
from tests.pipeline_harness import make_workers, merged_state, run_workers

UPDATES = 6


def one_process_scaled(task: ModuleType, update_every: int, clip: float | None
                       ) -> tuple[dict[str, torch.Tensor], int]:
    """The unsplit model under fp16 autocast with a dynamic loss scale; (weights, steps skipped)."""
    model = build_task_model(task, 0)
    opt = build_optimizer(task.make_optimizer, dict(model.named_parameters()))
    stream = task.train_batches(4, 0, 1, 0)
    scale, params = LossScale(), dict(model.named_parameters())
    for _ in range(UPDATES):
        total: dict[str, torch.Tensor | None] = dict.fromkeys(params)
        for _ in range(update_every):
            inputs, targets = next(stream)
            with autocast_for("fp16", "cpu"):
                loss = task.loss_fn(model(*inputs), targets)
            for p in params.values():
                p.grad = None
            (loss * scale.scale).backward()
            for name, p in params.items():
                if p.grad is not None:
                    g = p.grad / scale.scale
                    g = g / update_every if update_every != 1 else g
                    prev = total[name]
                    total[name] = g if prev is None else prev + g
        sq = squared_norm(total)
        coef = clip_factor(sq, clip)
        for name, p in params.items():
            g = total[name]
            p.grad = None if g is None else g * coef
        if math.isfinite(sq):
            opt.step()
        scale.update(math.isfinite(sq))
    return model.state_dict(), scale.skipped


@pytest.mark.parametrize("clip", [None, 0.01], ids=["plain", "clipped"])
@pytest.mark.parametrize("update_every", [1, 2])
@pytest.mark.parametrize(("task", "stages"), [(zoo.structured, 2), (zoo.structured, 3), (zoo.batchnorm, 3)],
                         ids=["structured-2", "structured-3", "batchnorm-3"])
def test_fp16_with_an_overflow_equals_one_process(task: ModuleType, stages: int, update_every: int,
                                                 clip: float | None) -> None:
    want, skipped = one_process_scaled(task, update_every, clip)
    if task is zoo.batchnorm and clip is None:
        assert skipped == 0
    else:
        assert skipped == 1  # the overflow is exercised
    workers = make_workers(task, stages, steps=UPDATES * update_every, max_inflight=1, update_every=update_every,
                           recipe=RecipeOptions(precision="fp16", clip_grad_norm=clip))
    run_workers(workers)
    got = merged_state(workers)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5, msg=name)
    last = workers[-1].recipe.loss_scale
    assert last is not None and last.skipped == skipped
    assert all(w.version == UPDATES for w in workers)
