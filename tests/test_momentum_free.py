"""Weight prediction and delay compensation forecast from the last update and gradient, which says where the
next ones go only when the optimizer keeps a momentum; a stage whose optimizer has none (SGD without momentum,
RMSprop, Adagrad, ...) trains without them (``ravq.stage.delay.has_momentum``).  In-process, no sockets."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from ravq.stage.delay import has_momentum
from ravq.stage.optim import ClusterAdam


def _p() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(2))]


class _Custom(torch.optim.Optimizer):
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.1})


@pytest.mark.parametrize(("make", "expected"), [
    (lambda: torch.optim.SGD(_p(), lr=0.1), False),
    (lambda: torch.optim.SGD(_p(), lr=0.1, momentum=0.9), True),
    (lambda: torch.optim.RMSprop(_p(), lr=0.1), False),
    (lambda: torch.optim.RMSprop(_p(), lr=0.1, momentum=0.5), True),
    (lambda: torch.optim.Adam(_p()), True),
    (lambda: torch.optim.AdamW(_p(), betas=(0.0, 0.99)), False),
    (lambda: ClusterAdam(_p(), lr=1e-3), True),
    (lambda: torch.optim.Adagrad(_p()), False),
    (lambda: torch.optim.Adadelta(_p()), False),
    (lambda: _Custom(_p()), True),  # unknown: as before
])
def test_which_optimizers_keep_a_momentum(make: object, expected: bool) -> None:
    assert has_momentum(make()) is expected  # type: ignore[operator]


def _mlp_task(optimizer: object) -> SimpleNamespace:
    from benchmarks.zoo_tasks import TASKS

    task = SimpleNamespace(**vars(TASKS["mlp_sgd"]))
    task.make_optimizer = optimizer
    return task


def test_a_stage_without_momentum_drops_both_forecasts_and_one_with_keeps_them() -> None:
    from tests.pipeline_harness import make_workers

    def options(optimizer: object) -> list[tuple[float, float]]:
        workers = make_workers(_mlp_task(optimizer), 2, steps=4, max_inflight=2, predict_weights=2.0,
                               extrapolate_gradients=2.0)
        return [(w.options.predict_weights, w.options.extrapolate_gradients) for w in workers]

    assert options(lambda ps: torch.optim.RMSprop(ps, lr=1e-3)) == [(0.0, 0.0)] * 2
    assert options(lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)) == [(2.0, 2.0)] * 2


def test_plain_sgd_at_4_stages_trains_like_synchronous_training_with_the_defaults() -> None:
    """The zoo's residual MLP with SGD without momentum (lr 0.05), 4 stages, 2 in flight: with prediction
    and compensation it ended at 3.2x synchronous training's loss; without them (what its stages now do)
    at 0.92x."""
    from tests.pipeline_harness import final_loss_with_defaults

    torch.set_num_threads(1)
    task = _mlp_task(lambda ps: torch.optim.SGD(ps, lr=0.05))
    sync, stale = final_loss_with_defaults(task, 4, 1), final_loss_with_defaults(task, 4, 2)
    assert math.isfinite(stale) and stale < 1.2 * sync


def test_ravq_check_counts_no_forecast_copy_for_an_optimizer_without_momentum() -> None:
    """The estimate holds a stage copy each for prediction and compensation on a stale stage only when the
    stage's optimizer keeps a momentum, as the stage does."""
    from ravq.cut.meta import build_meta_model, to_meta
    from ravq.cut.split import candidate_cuts, even_cuts, split_model
    from ravq.preflight.memory import MemorySettings, estimate
    from ravq.preflight.report import Report

    def stash(optimizer: object) -> int:
        task = _mlp_task(optimizer)
        model = build_meta_model(task, 0).model
        example = to_meta(task.example_inputs(4))
        specs = split_model(model, example, even_cuts(candidate_cuts(model, task), 2))
        _, targets = next(task.train_batches(4, 0, 1, 0))
        settings = MemorySettings(micro_batch=4, max_inflight=2, predict_weights=2.0, extrapolate_gradients=2.0)
        report = Report(task="", cuts=[], stages=2, micro_batch=4, max_inflight=2)
        return estimate(specs, example, targets, task, settings, report, ["", ""])[0].stash

    with_momentum = stash(lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9))
    without = stash(lambda ps: torch.optim.RMSprop(ps, lr=1e-3))
    assert without > 0 and with_momentum == 3 * without  # the stash copy, then + prediction's + compensation's
