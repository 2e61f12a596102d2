"""PipeNAG's step (ravq.stage.pipenag): its arithmetic against torch's Nesterov SGD and NAdam, the optimizer's
own step without staleness, and a fixed delay on a quadratic.  Pure unit tests, no sockets."""

from __future__ import annotations

import pytest
import torch

from ravq.stage.optim import ClusterAdam
from ravq.stage.pipenag import (
    MAX_MOMENTUM,
    check_supported,
    delayed_momentum,
    lookahead_step,
    nadam_step,
    nesterov_sgd_step,
)
from ravq.stage.stash import WeightStash


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=gen)), torch.nn.Parameter(torch.randn(4, generator=gen))]


def _grads(params: list[torch.nn.Parameter], step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) + 0.3 * p.detach()


def _train(make, step_fn, steps: int = 6) -> list[torch.Tensor]:
    params = _params()
    opt = make(params)
    for k in range(steps):
        _grads(params, k)
        step_fn(opt)
    return [p.detach().clone() for p in params]


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_delayed_momentum_is_the_optimizers_without_delay_and_rises_towards_the_ceiling():
    assert delayed_momentum(0.9, 0) == 0.9
    assert delayed_momentum(0.9, 1) == pytest.approx((0.9 + MAX_MOMENTUM) / 2)
    assert 0.9 < delayed_momentum(0.9, 1) < delayed_momentum(0.9, 2) < delayed_momentum(0.9, 3) < MAX_MOMENTUM
    assert delayed_momentum(0.995, 2) == 0.995  # never lowered


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_sgd_step_without_delay_is_torch_nesterov(wd):
    ref = _train(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=wd),
                 lambda o: o.step())
    ours = _train(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=wd),
                  lambda o: nesterov_sgd_step(o, 0.0))
    _close(ours, ref)


@pytest.mark.parametrize(("cls", "wd"), [(torch.optim.Adam, 0.0), (torch.optim.Adam, 0.01), (torch.optim.AdamW, 0.01)])
def test_adam_step_without_delay_is_nadam_with_constant_momentum(cls, wd):
    decoupled = cls is torch.optim.AdamW
    # momentum_decay this large makes torch's NAdam momentum schedule constant at beta1 (Dozat's NAdam)
    ref = _train(lambda ps: torch.optim.NAdam(ps, lr=1e-2, momentum_decay=1e9, weight_decay=wd,
                                              decoupled_weight_decay=decoupled), lambda o: o.step())
    ours = _train(lambda ps: cls(ps, lr=1e-2, weight_decay=wd), lambda o: nadam_step(o, 0.0))
    _close(ours, ref)


def test_adam_step_with_delay_is_nadam_with_the_raised_momentum():
    gamma = delayed_momentum(0.9, 2)
    ref = _train(lambda ps: torch.optim.NAdam(ps, lr=1e-2, betas=(gamma, 0.999), momentum_decay=1e9),
                 lambda o: o.step())
    _close(_train(lambda ps: ClusterAdam(ps, lr=1e-2), lambda o: nadam_step(o, 2.0)), ref)


@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                                  lambda ps: torch.optim.Adam(ps, lr=1e-2),
                                  lambda ps: ClusterAdam(ps, lr=1e-2, clusters=3)])
def test_no_staleness_is_the_optimizers_own_step(make):
    _close(_train(make, lambda o: lookahead_step(o, 0.0)), _train(make, lambda o: o.step()))


def test_the_stash_steps_with_the_lookahead_only_when_stale():
    def run(lookahead: bool, staleness: int) -> list[torch.Tensor]:
        params = _params()
        stash = WeightStash({str(i): p for i, p in enumerate(params)}, lookahead=lookahead)
        opt = torch.optim.Adam(params, lr=1e-2)
        for k in range(5):
            _grads(params, k)
            stash.record_staleness(staleness)
            stash.step(opt, 0.0, in_flight=False)
        return [p.detach().clone() for p in params]

    _close(run(True, 0), run(False, 0))  # max_inflight 1 stays exact
    nadam = _train(lambda ps: torch.optim.Adam(ps, lr=1e-2), lambda o: nadam_step(o, 1.0), steps=5)
    _close(run(True, 1), nadam)
    assert not torch.allclose(run(True, 1)[0], run(False, 1)[0])


def _delayed_quadratic(lr: float, delay: int, lookahead: bool, steps: int = 400) -> float:
    """Minimise sum(h x^2 / 2) with SGD momentum 0.9, every gradient taken at the weights ``delay`` updates old
    (weight stashing's exact stale gradient); the largest |x| at the end."""
    h = torch.tensor([1.0, 0.1, 0.01])
    x = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([x], lr=lr, momentum=0.9)
    history = [x.detach().clone()] * (delay + 1)
    for _ in range(steps):
        x.grad = h * history[-1 - delay]
        lookahead_step(opt, delay) if lookahead else opt.step()
        history = (history + [x.detach().clone()])[-(delay + 1):]
        if not torch.isfinite(x).all():
            return float("inf")
    return float(x.detach().abs().max())


def test_a_fixed_delay_that_diverges_heavy_ball_converges_with_the_lookahead():
    assert _delayed_quadratic(0.15, 0, lookahead=False) < 1e-2  # synchronous: converges
    assert _delayed_quadratic(0.15, 1, lookahead=False) > 1e3  # one update late: diverges
    assert _delayed_quadratic(0.15, 1, lookahead=True) < 1e-3
    assert _delayed_quadratic(0.05, 2, lookahead=False) > 5 * _delayed_quadratic(0.05, 2, lookahead=True)


def test_unsupported_optimizers_are_named():
    params = _params()
    check_supported(torch.optim.AdamW(params))
    check_supported(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match="momentum"):
        check_supported(torch.optim.SGD(params, lr=0.1))
    with pytest.raises(ValueError, match="RMSprop"):
        check_supported(torch.optim.RMSprop(params))
    with pytest.raises(ValueError, match="amsgrad"):
        check_supported(torch.optim.Adam(params, amsgrad=True))


def test_a_stage_takes_the_lookahead_only_for_its_stale_updates():
    """Through the pipeline (in one thread, stage 0 one update stale once the pipeline opens): synchronous
    updates (the warm-up) are the optimizer's own, stale ones PipeNAG's."""
    pytest.importorskip("transformers")
    from tests import zoo_markov
    from tests.pipeline_harness import make_workers, run_in_order

    torch.set_num_threads(1)

    def losses(**kw: object) -> list[float]:
        workers = make_workers(zoo_markov.gpt2, 2, steps=24, max_inflight=2, micro_batch=4, **kw)
        run_in_order(workers)
        return list(workers[-1].stats.loss_history)

    plain = losses(inflight_warmup_steps=8)
    lookahead = losses(inflight_warmup_steps=8, stale_correction="pipenag")
    assert lookahead[:9] == plain[:9]  # synchronous, then the first stale update's loss is still the same
    assert lookahead[10:] != plain[10:]
    assert losses(inflight_warmup_steps=24, stale_correction="pipenag") == losses(inflight_warmup_steps=24)
