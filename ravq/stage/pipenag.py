"""PipeNAG: Nesterov's look-ahead for a stage whose gradients arrive a fixed number of updates late.

Ajanthan et al., "Nesterov Method for Asynchronous Pipeline Parallel Optimization" (ICML 2025), train an
asynchronous pipeline (PipeDream's weight stashing, every stage a fixed delay behind) with Nesterov's
method whose look-ahead is adapted to the delay: the update moves along the momentum *and* the new
gradient (Nesterov), and the momentum is raised towards 0.99 with the delay, so that a stale gradient
is one of ~100 in the direction the weights take rather than most of one step.  Their implementation
is NAdamW (Dozat's Nesterov-Adam) with beta1 0.99, or, with "adaptive momentum", beta1 raised from the
user's value in proportion to the stage's delay.  Here, with ``s`` the stage's mean staleness:

- the momentum is ``gamma = beta + (MAX_MOMENTUM - beta) * s / (s + 1)`` (``delayed_momentum``: beta
  itself without staleness, halfway to 0.99 at one update late, the reference's rule on a first stage);
- Adam, AdamW and ``ClusterAdam`` take NAdam's step with that beta1 held constant
  (``(gamma * m_t / (1 - gamma^(t+1)) + (1 - gamma) * g / (1 - gamma^t)) / (sqrt(v_hat) + eps)``,
  weight decay and the cluster-corrected second moment as the optimizer has them);
- SGD with momentum takes Nesterov's step with ``gamma``, its gradient scaled by
  ``(1 - gamma) / (1 - beta)`` so that the steady step length (``lr * g / (1 - beta)``) stays the user's:
  raising the momentum alone would lengthen every step 2.5x at beta 0.9 and destabilise what it should
  steady.  On ``f = h x^2 / 2`` with one update of delay, heavy-ball SGD (momentum 0.9) diverges from
  ``lr * h = 0.15``; this step converges there (tests/test_pipenag.py).

An update with no staleness is the optimizer's own ``step()``, so ``max_inflight: 1`` (and the
asynchrony warm-up) trains exactly like one process.  Both steps keep the optimizer's own state (Adam's
``exp_avg``/``exp_avg_sq``/``step``, SGD's ``momentum_buffer``), so checkpoints, optimizer-state
averaging and the switch between stale and fresh updates need nothing of their own.  Other optimizers
(and Adam with amsgrad) are not supported: ``check_supported`` names them before training starts.  A tensor
tied across stages (``ravq.stage.tied_step``) is stepped apart, by the optimizer's own step.
"""

from __future__ import annotations

import torch

from ravq.stage.optim import ClusterAdam, adam_denominator, adam_moments

MAX_MOMENTUM = 0.99
"""The momentum a stage's look-ahead approaches as its delay grows (the paper's and its code's value)."""


def delayed_momentum(beta: float, staleness: float, ceiling: float = MAX_MOMENTUM) -> float:
    """The momentum of a stage ``staleness`` updates late whose optimizer's own momentum is ``beta``."""
    if staleness <= 0 or beta >= ceiling:
        return beta
    return beta + (ceiling - beta) * staleness / (staleness + 1.0)


def is_adam(optimizer: torch.optim.Optimizer) -> bool:
    """Adam, AdamW or ``ClusterAdam``: the Adam family whose steps ravq takes itself when a stage is stale."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, ClusterAdam))


def check_supported(optimizer: torch.optim.Optimizer) -> None:
    """Raise ValueError unless PipeNAG has a step for this optimizer (SGD with momentum; Adam, AdamW or
    ClusterAdam without amsgrad)."""
    name = type(optimizer).__name__
    for group in optimizer.param_groups:
        if isinstance(optimizer, torch.optim.SGD):
            if not group["momentum"] or group.get("maximize") or group["dampening"]:
                got = f"momentum {group['momentum']}, dampening {group['dampening']}"
                raise ValueError(f"stale_correction pipenag: needs SGD with momentum, no dampening and no "
                                 f"maximize (got {got})")
        elif is_adam(optimizer):
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError(f"stale_correction pipenag: {name} with amsgrad or maximize: not supported")
        else:
            raise ValueError(f"stale_correction pipenag: supports SGD with momentum, Adam, AdamW and "
                             f"ClusterAdam, not {name}")


def uses_lookahead(setting: str, optimizer: torch.optim.Optimizer, update_every: int) -> bool:
    """Whether a stage steps stale updates with PipeNAG: ``pipenag`` (ValueError for an optimizer it has no
    step for), or ``auto`` with an update per micro-batch (a micro-batch a whole update stale, where the zoo
    needed it: docs/convergence.md) and an optimizer it supports."""
    if setting == "pipenag":
        check_supported(optimizer)
        return True
    if setting != "auto" or update_every > 1:
        return False
    try:
        check_supported(optimizer)
    except ValueError:
        return False
    return True


def decoupled_decay(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """Whether this Adam-family group's weight decay shrinks the weights (AdamW) rather than joins the
    gradient."""
    return isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))


@torch.no_grad()
def nadam_step(optimizer: torch.optim.Optimizer, staleness: float) -> None:
    """One NAdam step (constant momentum ``delayed_momentum(beta1, staleness)``) on an Adam-family
    optimizer's parameters, gradients and state."""
    clusters = getattr(optimizer, "clusters", 1)
    for group in optimizer.param_groups:
        lr, (beta1, beta2), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
        gamma = delayed_momentum(beta1, staleness)
        for p in group["params"]:
            if p.grad is None:
                continue
            t, grad, exp_avg, exp_avg_sq = adam_moments(
                optimizer.state[p], p, lr=lr, wd=wd, decoupled=decoupled_decay(optimizer, group), beta1=gamma,
                beta2=beta2)
            denom = adam_denominator(exp_avg, exp_avg_sq, 1 - gamma ** t, 1 - beta2 ** t, eps, clusters)
            p.addcdiv_(grad, denom, value=-lr * (1 - gamma) / (1 - gamma ** t))
            p.addcdiv_(exp_avg, denom, value=-lr * gamma / (1 - gamma ** (t + 1)))


@torch.no_grad()
def nesterov_sgd_step(optimizer: torch.optim.SGD, staleness: float) -> None:
    """One Nesterov step with momentum ``delayed_momentum(momentum, staleness)``, the gradient scaled so
    the steady step length stays the optimizer's own (see the module docstring)."""
    for group in optimizer.param_groups:
        lr, beta, wd = float(group["lr"]), group["momentum"], group["weight_decay"]
        gamma = delayed_momentum(beta, staleness)
        scale = (1 - gamma) / (1 - beta)
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad if not wd else p.grad.add(p, alpha=wd)
            grad = grad * scale if scale != 1.0 else grad
            state = optimizer.state[p]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = grad.detach().clone()
            else:
                buf.mul_(gamma).add_(grad)
            p.add_(grad.add(buf, alpha=gamma), alpha=-lr)


def lookahead_step(optimizer: torch.optim.Optimizer, staleness: float) -> None:
    """The optimizer's step for gradients ``staleness`` updates late: its own ``step()`` when there is no
    staleness, else PipeNAG's (``nadam_step`` / ``nesterov_sgd_step``)."""
    if staleness <= 0:
        optimizer.step()
    elif isinstance(optimizer, torch.optim.SGD):
        nesterov_sgd_step(optimizer, staleness)
    else:
        nadam_step(optimizer, staleness)
