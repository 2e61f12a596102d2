"""Stale-gradient candidates the zoo compares before any of them goes into ravq (issue #39).

``raw_second_moment``: delay compensation as ravq has it (``ravq.stage.delay``: the optimizer is handed
``g + k s (g - g_prev)``), but an Adam-family stage's second moment is fed the raw gradient ``g``, its first
moment (and NAdam's gradient term, under PipeNAG) the extrapolated one.  Under Adam ``k (g - g_prev)`` mostly
telescopes inside the first moment's running mean, so compensation's main effect is on the second moment:
where micro-batch noise dominates, ``(1 + k)^2 + k^2`` times the noise's variance, a shorter step on every
stale stage.  This candidate keeps the first effect and drops the second.

Applied by wrapping each worker's ``WeightStash._optimizer_step``: after ``GradientExtrapolation.apply`` the
extrapolation's ``previous`` holds each parameter's raw gradient of this update (absent on the first stale
update and on fresh ones, where ``.grad`` is raw anyway).  Since session 11 ravq does the same on its own
after the warm-up (``ravq.stage.delay.raw_second_moment``).

``drift_scaled``: with a stated batch, compensation's step ``k s`` scaled by the fraction of ``|g - g_prev|^2``
that is drift rather than micro-batch noise (``DriftMeter``), measured from how each update's sum grows over its
micro-batches, with no copy of any gradient.  Not chosen (docs/convergence.md, session 11): it cut the noise on
the encoder but also the look-ahead the residual MLP needed right after the warm-up, and on SGD it cost runs.
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



DRIFT_DECAY = 0.9
"""Exponential mean over updates of the estimates ``drift_scaled`` forms (about the last 10 updates)."""


class DriftMeter:
    """How much of ``g - g_prev`` (one update's change of a stage's mean gradient) is drift rather than
    micro-batch noise, for a stage that sums ``update_every`` > 1 micro-batches per update.

    The noise comes from the sum itself: with ``S_i`` the sum after its i-th micro-batch, ``E|S_i|^2 = i^2 a
    + i b`` (``a`` the mean gradient's square, ``b`` one micro-batch's noise variance), so a least-squares
    fit over i = 1..U gives the update mean's noise variance as a fraction ``f = (b / U) / (a + b / U)`` of
    its square, with no copy of any gradient.  Two independent noisy means one update apart differ by
    ``E|g - g_prev|^2 = |d|^2 + 2 sigma^2``, so the drift's fraction of that difference is ``1 - 2 sigma^2 /
    E|g - g_prev|^2`` with ``sigma^2 = f |g|^2``: 0 where the difference is all noise."""

    def __init__(self, update_every: int) -> None:
        self.update_every = update_every
        self.sums = [0.0] * update_every
        """Exponential mean of ``|S_i|^2`` for each i, unscaled sums."""
        self.current: list[float] = []
        self.weight = 0.0
        self.noise = self.diff = 0.0
        """Exponential means of ``f |g|^2`` and ``|g - g_prev|^2`` over stale updates."""

    def summed(self, params: dict[str, torch.nn.Parameter], unscale: float) -> None:
        sq = sum(float(p.grad.double().square().sum()) for p in params.values() if p.grad is not None)
        self.current.append(sq * unscale * unscale)

    def updated(self) -> None:
        """An update read the sum: fold its ``|S_i|^2`` into the means (a partial last one is left out)."""
        if len(self.current) == self.update_every:
            self.weight = DRIFT_DECAY * self.weight + (1 - DRIFT_DECAY)
            self.sums = [DRIFT_DECAY * m + (1 - DRIFT_DECAY) * x for m, x in zip(self.sums, self.current)]
        self.current = []

    def noise_fraction(self) -> float | None:
        """``f``: the update mean's noise variance over its square, from the fit (None before any update)."""
        if not self.weight:
            return None
        ms = [m / self.weight for m in self.sums]
        i = [float(k + 1) for k in range(self.update_every)]
        s4, s3, s2 = sum(x ** 4 for x in i), sum(x ** 3 for x in i), sum(x ** 2 for x in i)
        y2, y1 = sum(x * x * m for x, m in zip(i, ms)), sum(x * m for x, m in zip(i, ms))
        det = s4 * s2 - s3 * s3
        a, b = max(0.0, (y2 * s2 - s3 * y1) / det), max(0.0, (s4 * y1 - s3 * y2) / det)
        u = self.update_every
        return 1.0 if a + b / u <= 0 else (b / u) / (a + b / u)

    def drift_fraction(self, grad_sq: float, diff_sq: float) -> float:
        """Fold one stale update's ``|g|^2`` and ``|g - g_prev|^2`` in; the drift's fraction of the difference."""
        f = self.noise_fraction()
        if f is None:
            return 1.0
        self.noise = DRIFT_DECAY * self.noise + (1 - DRIFT_DECAY) * f * grad_sq
        self.diff = DRIFT_DECAY * self.diff + (1 - DRIFT_DECAY) * diff_sq
        return max(0.0, 1.0 - 2.0 * self.noise / self.diff) if self.diff > 0 else 0.0


def drift_scaled(workers: list[StageWorker], log: list | None = None) -> None:
    """Delay compensation's step ``k s`` scaled by ``DriftMeter.drift_fraction`` on every stage that sums more
    than one micro-batch per update (with one, nothing to measure the noise by: unchanged)."""
    for worker in workers:
        grads, ext = worker._grads, worker.forward_weights.extrapolation
        if grads.update_every < 2 or not ext.factor:
            continue
        meter = DriftMeter(grads.update_every)
        own_summed, own_add = grads.summed, grads.add

        def summed(version: int, grads=grads, meter=meter, own=own_summed) -> bool:
            meter.summed(grads.params, 1.0)  # .grad holds the unscaled sum, this backward's included
            return own(version)

        def add(g: dict, version: int, grads=grads, meter=meter, own=own_add) -> bool:
            due = own(g, version)
            meter.summed(grads.params, float(grads.update_every))  # .grad holds the sum / U
            return due

        def apply(staleness: float, ext=ext, meter=meter, index=worker.spec.index) -> None:
            meter.updated()  # every update comes here (WeightStash.step), stale or not
            if staleness <= 0:
                ext.previous.clear()
                return
            with torch.no_grad():
                grad_sq = diff_sq = 0.0
                have = False
                for name, p in ext.params.items():
                    before = ext.previous.get(name)
                    if p.grad is None or before is None:
                        continue
                    have = True
                    grad_sq += float(p.grad.double().square().sum())
                    diff_sq += float((p.grad.double() - before.double()).square().sum())
                rho = meter.drift_fraction(grad_sq, diff_sq) if have else 1.0
                if log is not None and have:
                    log.append((index, staleness, rho))
                ext.extrapolate(ext.factor * min(staleness, 1.0) * rho)

        grads.summed, grads.add, ext.apply = summed, add, apply


def update_staleness(workers: list[StageWorker]) -> None:
    """With a stated batch, compensation extrapolates by the mean staleness of the update's own micro-batches
    (0.75 at 4 per update in steady state) instead of the mean of the last 64 backwards, which after the
    warm-up still holds the warm-up's zeros for 64 backwards (16 updates at 4 per update).  Not chosen (session
    11): on gpt2_tied at 4 stages the longer extrapolation right after the warm-up ended 1.033-1.038x, against
    1.021-1.024x (docs/convergence.md)."""
    for worker in workers:
        stash, grads = worker.forward_weights, worker._grads
        ext = stash.extrapolation
        if grads.update_every < 2 or not ext.factor:
            continue
        mine: list[int] = []
        own_record, own_apply = stash.record_staleness, ext.apply

        def record(staleness: int, own=own_record, mine=mine) -> None:
            mine.append(staleness)
            own(staleness)

        def apply(staleness: float, own=own_apply, mine=mine) -> None:
            s = sum(mine) / len(mine) if mine else staleness
            mine.clear()
            own(s)

        stash.record_staleness, ext.apply = record, apply
