"""Delay compensation with the Adam family (``ravq.stage.delay.compensates``): under PipeNAG's look-ahead after
the asynchrony warm-up (the defaults with an update per micro-batch) an Adam stage goes without it and keeps no
last gradient; SGD with momentum keeps it, and so does Adam without the look-ahead or the warm-up.
In-process, no sockets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ravq.stage.delay import compensates
from ravq.stage.optim import ClusterAdam


def _p() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(2))]


@pytest.mark.parametrize(("make", "lookahead", "warmup", "expected"), [
    (lambda: torch.optim.Adam(_p()), True, True, False),
    (lambda: torch.optim.AdamW(_p()), True, True, False),
    (lambda: ClusterAdam(_p()), True, True, False),
    (lambda: torch.optim.Adam(_p()), False, True, True),  # a stated batch: no look-ahead
    (lambda: torch.optim.Adam(_p()), True, False, True),  # opened at once: the shorter step rescues the edge
    (lambda: torch.optim.SGD(_p(), lr=0.1, momentum=0.9), True, True, True),
    (lambda: torch.optim.SGD(_p(), lr=0.1, momentum=0.9), False, True, True),
    (lambda: torch.optim.SGD(_p(), lr=0.1), False, True, False),  # no momentum: neither forecast
])
def test_which_stages_compensate(make: object, lookahead: bool, warmup: bool, expected: bool) -> None:
    assert compensates(make(), lookahead, warmup) is expected  # type: ignore[operator]


def test_an_adam_stage_under_pipenag_keeps_no_last_gradient_and_an_sgd_stage_does() -> None:
    from benchmarks.zoo_tasks import TASKS
    from tests.pipeline_harness import make_workers

    def factors(optimizer: object, correction: str, update_every: int = 1, warmup: int = 20) -> list[float]:
        task = SimpleNamespace(**vars(TASKS["mlp_sgd"]))
        task.make_optimizer = optimizer
        workers = make_workers(task, 2, steps=4, max_inflight=2, predict_weights=2.0, extrapolate_gradients=2.0,
                               stale_correction=correction, update_every=update_every,
                               inflight_warmup_steps=warmup)
        return [w.forward_weights.extrapolation.factor for w in workers]

    def adam(ps: object) -> torch.optim.Optimizer:
        return torch.optim.Adam(ps, lr=1e-3)  # type: ignore[arg-type]

    def sgd(ps: object) -> torch.optim.Optimizer:
        return torch.optim.SGD(ps, lr=0.01, momentum=0.9)  # type: ignore[arg-type]

    assert factors(adam, "auto") == [0.0, 0.0]  # an update per micro-batch: PipeNAG
    assert factors(adam, "auto", update_every=2) == [2.0, 2.0]  # a stated batch: no PipeNAG
    assert factors(adam, "none") == [2.0, 2.0]
    assert factors(adam, "auto", warmup=0) == [2.0, 2.0]
    assert factors(sgd, "auto") == [2.0, 2.0]


def _quarter_ratios(stages: int) -> list[float]:
    """Loss over synchronous training's (``max_inflight`` 1) at each quarter of 120 micro-batches of 16, the
    last stage's mean of 10 micro-batches up to there, with the topology's default stale mechanisms."""
    from ravq.config import TrainingConfig
    from tests import user_encoder
    from tests.pipeline_harness import make_workers, run_in_order

    d = TrainingConfig()
    curves = []
    for inflight in (1, 2):
        workers = make_workers(user_encoder, stages, steps=120, max_inflight=inflight, micro_batch=16,
                               predict_weights=d.predict_weights, extrapolate_gradients=d.extrapolate_gradients,
                               inflight_warmup_steps=d.inflight_warmup_steps, stale_correction=d.stale_correction)
        run_in_order(workers)
        curves.append(workers[-1].stats.loss_history)
    sync, stale = curves
    return [sum(stale[at - 10:at]) / sum(sync[at - 10:at]) for at in (30, 60, 90, 120)]


def test_a_user_adamw_encoder_at_3_stages_trains_like_synchronous_training_with_the_defaults() -> None:
    """A user's AdamW encoder (tests/user_encoder.py), 3 stages, an update per micro-batch: with compensation
    on its Adam stages (the previous defaults) it lagged synchronous training by up to 1.126x (at three
    quarters; 1.37-1.50x at the end of 240 micro-batches with a cosine schedule); without it, at most 1.034x."""
    torch.set_num_threads(1)
    assert max(_quarter_ratios(3)) <= 1.06


def test_ravq_check_counts_no_last_gradient_for_an_adam_stage_under_pipenag() -> None:
    """The estimate holds compensation's stage copy on a stale Adam stage only where the stage keeps it: not
    under PipeNAG after the warm-up (an update per micro-batch), but with ``stale_correction: none``."""
    from benchmarks.zoo_tasks import TASKS
    from ravq.cut.meta import build_meta_model, to_meta
    from ravq.cut.split import candidate_cuts, even_cuts, split_model
    from ravq.preflight.memory import MemorySettings, estimate
    from ravq.preflight.report import Report

    def stash(optimizer: object, correction: str) -> int:
        task = SimpleNamespace(**vars(TASKS["mlp_sgd"]))
        task.make_optimizer = optimizer
        model = build_meta_model(task, 0).model
        example = to_meta(task.example_inputs(4))
        specs = split_model(model, example, even_cuts(candidate_cuts(model, task), 2))
        _, targets = next(task.train_batches(4, 0, 1, 0))
        settings = MemorySettings(micro_batch=4, max_inflight=2, predict_weights=2.0, extrapolate_gradients=2.0,
                                  stale_correction=correction, inflight_warmup_steps=20)
        report = Report(task="", cuts=[], stages=2, micro_batch=4, max_inflight=2)
        return estimate(specs, example, targets, task, settings, report, ["", ""])[0].stash

    def adam(ps: object) -> torch.optim.Optimizer:
        return torch.optim.Adam(ps, lr=1e-3)  # type: ignore[arg-type]

    def sgd(ps: object) -> torch.optim.Optimizer:
        return torch.optim.SGD(ps, lr=0.01, momentum=0.9)  # type: ignore[arg-type]

    one = stash(adam, "auto") // 2  # the stash copy and prediction's
    assert one > 0 and stash(adam, "auto") == 2 * one
    assert stash(adam, "none") == 3 * one and stash(sgd, "auto") == 3 * one
