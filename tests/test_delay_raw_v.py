"""Delay compensation with a stated batch and the Adam family (``ravq.stage.delay.raw_second_moment``): a stale
step's first moment takes the extrapolated gradient, its second moment the raw one, so compensation's doubled
noise no longer shortens every stale step (docs/convergence.md, "A stated batch: Adam's second moment fed the
raw gradient").  In-process, no sockets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ravq.stage.delay import GradientExtrapolation, adam_step, raw_second_moment
from ravq.stage.optim import ClusterAdam


def _p() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(2))]


@pytest.mark.parametrize(("make", "lookahead", "warmup", "expected"), [
    (lambda: torch.optim.Adam(_p()), False, True, True),  # a stated batch, after the warm-up
    (lambda: torch.optim.AdamW(_p()), False, True, True),
    (lambda: ClusterAdam(_p()), False, True, True),
    (lambda: torch.optim.Adam(_p()), False, False, False),  # opened at once: the shorter step rescues the edge
    (lambda: torch.optim.Adam(_p()), True, True, False),  # PipeNAG's own step
    (lambda: torch.optim.Adam(_p(), amsgrad=True), False, True, False),
    (lambda: torch.optim.SGD(_p(), lr=0.1, momentum=0.9), False, True, False),  # no second moment
])
def test_which_stages_feed_the_raw_gradient(make: object, lookahead: bool, warmup: bool, expected: bool) -> None:
    assert raw_second_moment(make(), lookahead, warmup) is expected  # type: ignore[operator]


@pytest.mark.parametrize("kind", ["adam", "adam_l2", "adamw"])
def test_adam_step_is_the_optimizers_own_step_to_the_bit(kind: str) -> None:
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(5, 3))
    b.data.copy_(a.data)
    make = {"adam": lambda p: torch.optim.Adam(p, lr=1e-2), "adam_l2": lambda p: torch.optim.Adam(p, lr=1e-2,
            weight_decay=0.1), "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)}[kind]
    own, ours = make([a]), make([b])
    for _ in range(4):
        g = torch.randn(5, 3)
        a.grad, b.grad = g.clone(), g.clone()
        own.step()
        adam_step(ours, {})
    assert torch.equal(a.data, b.data)
    assert torch.equal(own.state[a]["exp_avg_sq"], ours.state[b]["exp_avg_sq"])


@pytest.mark.parametrize("raw", [True, False])
def test_a_stale_adam_step_feeds_the_second_moment_the_raw_gradient(raw: bool) -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.Adam([p], lr=1e-3)
    ext = GradientExtrapolation({"w": p}, factor=2.0, raw_second_moment=raw)
    g1, g2 = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([3.0, 1.0, -1.0])
    for g in (g1, g2):
        p.grad = g.clone()
        ext.apply(1.0)  # one update stale: the first keeps its gradient, the second is extrapolated
        ext.step(opt)
    beta1, beta2 = opt.param_groups[0]["betas"]
    handed = g2 + 2.0 * (g2 - g1)
    squared = g2 if raw else handed
    state = opt.state[p]
    assert torch.allclose(state["exp_avg"], beta1 * (1 - beta1) * g1 + (1 - beta1) * handed)
    assert torch.allclose(state["exp_avg_sq"], beta2 * (1 - beta2) * g1 ** 2 + (1 - beta2) * squared ** 2)


def test_a_stage_with_a_stated_batch_feeds_it_and_one_stepped_by_pipenag_does_not() -> None:
    from benchmarks.zoo_tasks import TASKS
    from tests.pipeline_harness import make_workers

    def flags(optimizer: object, update_every: int, warmup: int = 20) -> list[bool]:
        task = SimpleNamespace(**vars(TASKS["mlp_sgd"]))
        task.make_optimizer = optimizer
        workers = make_workers(task, 2, steps=4, max_inflight=2, predict_weights=2.0, extrapolate_gradients=2.0,
                               stale_correction="auto", update_every=update_every, inflight_warmup_steps=warmup)
        return [w.forward_weights.extrapolation.raw_second_moment for w in workers]

    def adam(ps: object) -> torch.optim.Optimizer:
        return torch.optim.Adam(ps, lr=1e-3)  # type: ignore[arg-type]

    def sgd(ps: object) -> torch.optim.Optimizer:
        return torch.optim.SGD(ps, lr=0.01, momentum=0.9)  # type: ignore[arg-type]

    assert flags(adam, 4) == [True, True]
    assert flags(adam, 1) == [False, False]  # PipeNAG, and no compensation there
    assert flags(adam, 4, warmup=0) == [False, False]
    assert flags(sgd, 4) == [False, False]


def test_a_user_adamw_encoder_with_a_stated_batch_at_3_stages_trains_like_synchronous_training() -> None:
    """The user's AdamW encoder (tests/user_encoder.py, with the cosine schedule its topology states), 3 stages,
    4 micro-batches of 16 per update, 240 micro-batches, the defaults: with compensation's extrapolated gradient
    in Adam's second moment it ended 1.064x synchronous training's loss; with the raw one 1.001x."""
    from ravq.config import TrainingConfig
    from ravq.config.batch import default_inflight
    from ravq.config.recipe import LRScheduleConfig
    from ravq.stage.recipe import recipe_options
    from tests import user_encoder
    from tests.pipeline_harness import make_workers, run_in_order

    torch.set_num_threads(1)
    d, steps, stages = TrainingConfig(), 240, 3
    recipe = recipe_options(user_encoder, TrainingConfig(steps=steps, update_every=4, lr_schedule=LRScheduleConfig(
        kind="cosine", warmup_steps=10)), 0)
    curves = []
    for inflight in (1, default_inflight(stages, 4)):
        workers = make_workers(user_encoder, stages, steps=steps, max_inflight=inflight, micro_batch=16,
                               update_every=4, recipe=recipe, predict_weights=d.predict_weights,
                               extrapolate_gradients=d.extrapolate_gradients,
                               inflight_warmup_steps=d.inflight_warmup_steps, stale_correction=d.stale_correction)
        run_in_order(workers)
        curves.append(workers[-1].stats.loss_history)
    sync, stale = curves
    ratios = [sum(stale[at - 10:at]) / sum(sync[at - 10:at]) for at in (60, 120, 180, 240)]
    assert max(ratios) <= 1.10 and ratios[-1] <= 1.03, ratios
