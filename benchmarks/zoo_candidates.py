"""Stale-gradient candidates the zoo compares before any of them goes into ravq (issue #39).

``raw_second_moment``: delay compensation as ravq has it (``ravq.stage.delay``: the optimizer is handed
``g + k s (g - g_prev)``), but an Adam-family stage's second moment is fed the raw gradient ``g``, its first
moment (and NAdam's gradient term, under PipeNAG) the extrapolated one.  Under Adam ``k (g - g_prev)`` mostly
telescopes inside the first moment's running mean, so compensation's main effect is on the second moment:
where micro-batch noise dominates, ``(1 + k)^2 + k^2`` times the noise's variance, a shorter step on every
stale stage.  This candidate keeps the first effect and drops the second.

Applied by wrapping each worker's ``WeightStash._optimizer_step``: after ``GradientExtrapolation.apply`` the
extrapolation's ``previous`` holds each parameter's raw gradient of this update (absent on the first stale
update and on fresh ones, where ``.grad`` is raw anyway).
"""

from __future__ import annotations

import torch

from ravq.stage.optim import adam_denominator, adam_moments
from ravq.stage.pipeline import StageWorker
from ravq.stage.pipenag import decoupled_decay, delayed_momentum, is_adam


@torch.no_grad()
def split_adam_step(optimizer: torch.optim.Optimizer, raw: dict[int, torch.Tensor], staleness: float,
                    lookahead: bool) -> None:
    """One Adam (``lookahead``: PipeNAG's NAdam) step whose first moment follows ``p.grad`` and whose second
    moment follows ``raw[id(p)]`` (``p.grad`` where absent); weight decay and clusters as the optimizer has
    them."""
    clusters = getattr(optimizer, "clusters", 1)
    for group in optimizer.param_groups:
        lr, (beta1, beta2), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
        gamma = delayed_momentum(beta1, staleness) if lookahead else beta1
        decoupled = decoupled_decay(optimizer, group)
        for p in group["params"]:
            if p.grad is None:
                continue
            t, grad, exp_avg, exp_avg_sq = adam_moments(optimizer.state[p], p, lr=lr, wd=wd, decoupled=decoupled,
                                                        beta1=gamma, beta2=beta2, second=raw.get(id(p)))
            denom = adam_denominator(exp_avg, exp_avg_sq, 1 - gamma ** t, 1 - beta2 ** t, eps, clusters)
            if lookahead:
                p.addcdiv_(grad, denom, value=-lr * (1 - gamma) / (1 - gamma ** t))
                p.addcdiv_(exp_avg, denom, value=-lr * gamma / (1 - gamma ** (t + 1)))
            else:
                p.addcdiv_(exp_avg, denom, value=-lr / (1 - gamma ** t))


def raw_second_moment(workers: list[StageWorker]) -> None:
    """Make every Adam-family stage's stale updates take ``split_adam_step`` (see the module docstring)."""
    for worker in workers:
        stash, optimizer = worker.forward_weights, worker.optimizer
        if not is_adam(optimizer) or not stash.extrapolation.factor:
            continue
        own = stash._optimizer_step
        names = {id(p): n for n, p in stash.params.items()}

        def step(opt: torch.optim.Optimizer, stash=stash, own=own, names=names) -> None:
            recent = stash.recent_staleness
            staleness = sum(recent) / len(recent) if recent else 0.0
            previous = stash.extrapolation.previous
            if staleness <= 0 or not previous:  # nothing was extrapolated: the step as it was
                own(opt)
                return
            raw = {i: previous[n] for i, n in names.items() if n in previous}
            split_adam_step(opt, raw, staleness, stash.lookahead)

        stash._optimizer_step = step

