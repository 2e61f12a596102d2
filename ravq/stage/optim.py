"""Optimizers that know they are one of C clusters averaging their weights.

Data parallelism over C clusters that each run Adam and average weights is not Adam on the C clusters'
batches together.  Averaging the clusters' steps averages their first moments as the global optimizer
would, but each cluster divides by the second moment of its own, C times smaller, batch: where gradient
noise dominates that moment is up to C times larger, so every averaged step is up to sqrt(C) times
shorter than the global-batch step.  Averaging the optimizer state does not help (a mean of squares is
not the square of a mean).  On the demo task this alone cost ~10% more samples, at any sync_every.

``ClusterAdam`` keeps Adam's state as it is and corrects the second moment where it is used: with
``m`` and ``v`` the bias-corrected moments, ``v - m^2`` estimates the variance of one cluster's
gradient, and the global batch's is C times smaller, so the step divides by the square root of
``min(m^2, v) + max(v - m^2, 0) / C``.  Only local state is used; with C = 1 (one cluster, or the
others dropped) it is exactly ``torch.optim.Adam`` / ``AdamW``.  The node sets C from the plan
(``set_clusters``); a task opts in by returning it from ``make_optimizer``.

C is the noise the clusters' mix averages away, not a head count: with rounds paced by rate a round weighs
each cluster by the samples it trained since its last mix, and such a mix of C unequal shares averages away
less noise than a plain mean (``ravq.planner.pacing.effective_clusters``: 3.41 for shares 3:3:3:1), so the
node tells that, a real number >= 1.  The moments themselves are local: kept across rounds, neither reset nor
rescaled; with ``average_optimizer_state`` they are mixed like the weights, by the same samples weights.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch


def global_second_moment(m_hat: torch.Tensor, v_hat: torch.Tensor, clusters: float) -> torch.Tensor:
    """The second moment one optimizer would see on ``clusters`` clusters' batches together, from one
    cluster's bias-corrected moments (a new tensor; with one cluster a copy of ``v_hat``)."""
    if clusters <= 1:
        return v_hat.clone()
    mean_sq = m_hat.square()
    noise = (v_hat - mean_sq).clamp_(min=0).div_(clusters)
    return torch.minimum(mean_sq, v_hat).add_(noise)


def adam_moments(state: dict, p: torch.Tensor, *, lr: float, wd: float, decoupled: bool, beta1: float,
                 beta2: float, second: torch.Tensor | None = None
                 ) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bookkeeping every Adam-family step here shares, for one parameter with a gradient: its state made
    on first use, weight decay (decoupled: the weight shrinks; else added to the gradient), the step
    counted and both moments moved (the first with ``beta1``).  Returns the step, the gradient with weight
    decay, and the two moments.  ``second``: a gradient for the second moment alone (None: ``p.grad``)."""
    grad = p.grad
    sq = grad if second is None else second
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if wd:
        if decoupled:
            p.mul_(1 - lr * wd)
        else:
            grad = grad.add(p, alpha=wd)
            sq = grad if second is None else sq.add(p, alpha=wd)
    state["step"] += 1
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(sq, sq, value=1 - beta2)
    return float(state["step"]), grad, exp_avg, exp_avg_sq


def adam_denominator(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, bias1: float, bias2: float, eps: float,
                     clusters: float) -> torch.Tensor:
    """Adam's denominator, with the second moment of the global gradient when averaging divides away
    ``clusters`` clusters' noise; with one cluster Adam's own arithmetic, to the bit."""
    if clusters == 1:
        return (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(eps)
    return global_second_moment(exp_avg / bias1, exp_avg_sq / bias2, clusters).sqrt_().add_(eps)


class ClusterAdam(torch.optim.Optimizer):
    """Adam (``decoupled_weight_decay=True``: AdamW) whose step is the global batch's over ``clusters``
    clusters; see the module docstring.  State keys are Adam's (``step``, ``exp_avg``,
    ``exp_avg_sq``), so checkpoints and optimizer-state averaging treat it alike."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, decoupled_weight_decay: bool = False,
                 clusters: float = 1) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"ClusterAdam: lr, eps and weight_decay must be >= 0 "
                             f"(got {lr}, {eps}, {weight_decay})")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"ClusterAdam: betas must lie in [0, 1) (got {betas})")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "decoupled_weight_decay": decoupled_weight_decay})
        self.clusters = 1.0
        self.set_clusters(clusters)

    def set_clusters(self, clusters: float) -> None:
        """How many clusters' gradient noise the averaging divides away (>= 1; need not be whole)."""
        if not clusters >= 1:
            raise ValueError(f"ClusterAdam: clusters must be >= 1 (got {clusters})")
        self.clusters = float(clusters)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("ClusterAdam does not support sparse gradients")
                t, _, exp_avg, exp_avg_sq = adam_moments(
                    self.state[p], p, lr=lr, wd=wd, decoupled=group["decoupled_weight_decay"], beta1=beta1,
                    beta2=beta2)
                bias1 = 1 - beta1 ** t
                denom = adam_denominator(exp_avg, exp_avg_sq, bias1, 1 - beta2 ** t, eps, self.clusters)
                p.addcdiv_(exp_avg, denom, value=-lr / bias1)
        return loss


def set_clusters(optimizer: torch.optim.Optimizer, clusters: float) -> None:
    """Tell an optimizer how many clusters' noise its averaging divides away (a no-op for optimizers that
    don't ask): the live clusters, fewer in effect when rounds mix them by unequal samples."""
    setter = getattr(optimizer, "set_clusters", None)
    if callable(setter):
        setter(max(1, clusters))
