"""Delay compensation: a stale update extrapolates its gradient along the change since the stage's last
update.

With ``max_inflight`` above 1 a stage's gradient was taken at weights a few updates old (its staleness
``s``; weight stashing makes it the exact gradient *there*).  Adam with one step of delay is unstable
where synchronous Adam is not: on a tiny GPT-2 at lr 3e-3 (the trial in issue #25) the stale first
stage's loss spiked, the spike filled Adam's second moment, and the model sat at the unigram plateau
(ln 100) for the rest of the run, with weight prediction on or off.  A pure-PyTorch model of PipeDream
with one step of delay reproduces those losses to the bit, so this is asynchrony, not a defect of the
stash (docs/convergence.md).

The compensation is optimistic extrapolation (as in Optimistic Adam): the optimizer is handed
``g + k * s * (g - g_prev)`` instead of ``g``, where ``g_prev`` is the gradient of the stage's previous
update, ``k`` is ``training.extrapolate_gradients`` and ``s`` the stage's mean staleness over its recent
backwards (not the update's own: when two forwards share a version their staleness alternates 0, 1, and
extrapolating only the stale one from a gradient at the same weights did not help; the mean did).  The
difference of consecutive gradients says where the gradient is heading as the weights move, so the
stale gradient is carried forward towards
the weights it is applied to, and a growing oscillation is damped rather than fed.  An update with no
staleness is left alone, so ``max_inflight: 1`` still trains exactly like one process.

With the Adam family (Adam, AdamW, ``ClusterAdam``) the extrapolation acts twice.  In the first moment, a
running mean, ``k (g - g_prev)`` mostly telescopes: it adds about ``k (1 - beta1) (g - m)``, a small
look-ahead.  In the second moment it adds ``(1 + k)^2 + k^2`` (13 at k 2) times the gradient's noise
variance: where micro-batch noise dominates, ``v`` grows ~12x on the stale stages (measured on a user's AdamW
encoder, 3 stages) and every step there is ~3.5x shorter.  That shorter step is what rescues a model at its
stability edge while the loss falls fast (issue #25's GPT-2 opened at once: feeding ``v`` the raw gradient,
or no compensation under PipeNAG, left it at the unigram plateau), and it slows every model past that phase
or never at the edge (docs/convergence.md, "Delay compensation with Adam").  The asynchrony warm-up
(``inflight_warmup_steps``) covers that phase, and PipeNAG's look-ahead (NAdam with a raised momentum) is a
look-ahead of its own, so an Adam-family stage stepped by PipeNAG after a warm-up (the defaults with an
update per micro-batch) goes without compensation and keeps no last gradient (``compensates``).  Without
the look-ahead (a stated batch, ``stale_correction: none``) or the warm-up it keeps it, and so does SGD with
momentum, whose step has no second moment to inflate.

Memory: the last gradient is a copy of the stage's gradients, kept only while the stage is stale.  An
update with no staleness (the last stage always, every stage during the asynchrony warm-up) keeps none and
frees what an earlier stale update kept, so the first stale update after it is handed its gradient as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from ravq.stage.pipenag import is_adam

MAX_UPDATES = 1.0
"""The staleness the extrapolation is capped at: ``g - g_prev`` is one update's change, and carried
further (``k * s`` = 6 on the first of 4 stages) it multiplied the gradient's noise (variance by
``(1 + k s)^2 + (k s)^2``, 85x) until SGD with momentum diverged (the zoo's SGD MLP at 4 stages); Adam's
second moment absorbed it.  Capped at one update the same MLP trained (docs/convergence.md)."""


MOMENTUM_FREE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.Rprop, torch.optim.ASGD, torch.optim.Adafactor)
"""Optimizers whose step keeps no running mean of gradients (and say so by no ``momentum`` or ``betas``)."""


def has_momentum(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's steps follow a running mean of gradients (a momentum), which weight prediction
    and delay compensation rely on: the last update then says where the next ones go, and the difference of
    consecutive gradients is a drift the mean smooths.  False when the optimizer says it has none: every
    group's ``momentum`` 0 (SGD, RMSprop) or ``betas[0]`` 0 (the Adam family), or a kind in ``MOMENTUM_FREE``.
    Without a momentum the last update is one micro-batch's noisy step, so prediction extrapolates noise,
    and compensation's ``(1 + k)^2 + k^2`` times the gradient's noise goes into every step (SGD) or into
    the second moment that divides it (RMSprop), shrinking the signal's step: a residual MLP with plain SGD
    diverged with both on and trained with both off (docs/convergence.md, tasks written outside the
    repository).  An optimizer with neither key and of no known kind counts as having one (unchanged)."""
    if isinstance(optimizer, MOMENTUM_FREE):
        return False
    for group in optimizer.param_groups:
        if "betas" in group:
            if group["betas"][0] > 0:
                return True
        elif "momentum" in group:
            if group["momentum"] > 0:
                return True
        else:
            return True
    return False


def compensates(optimizer: torch.optim.Optimizer, lookahead: bool, warmup: bool) -> bool:
    """Whether delay compensation runs on a stage with this optimizer: it needs a momentum (``has_momentum``),
    and an Adam-family stage stepped by PipeNAG's look-ahead (``lookahead``) after the asynchrony warm-up
    (``warmup``) goes without it (module docstring).  SGD with momentum keeps it either way: its step has no
    second moment to inflate."""
    return has_momentum(optimizer) and not (lookahead and warmup and is_adam(optimizer))


class GradientExtrapolation:
    """Keeps the gradient of the stage's last update and extrapolates the next one when it is stale."""

    def __init__(self, params: dict[str, nn.Parameter], factor: float) -> None:
        self.params, self.factor = params, factor
        self.previous: dict[str, torch.Tensor] = {}
        """Each parameter's gradient at the last update, as the optimizer's sum was before extrapolation."""

    def apply(self, staleness: float) -> None:
        """Extrapolate every ``.grad`` in place by ``factor * staleness`` steps (none when either is 0),
        and remember the un-extrapolated gradients for the next update (only while ``staleness`` > 0)."""
        if not self.factor:
            return
        if staleness <= 0:  # nothing stale: nothing to extrapolate, and no copy of the gradients kept
            self.previous.clear()
            return
        step = self.factor * min(staleness, MAX_UPDATES)
        with torch.no_grad():
            for name, p in self.params.items():
                if p.grad is None:
                    continue
                before = self.previous.get(name)
                if before is None:
                    self.previous[name] = p.grad.detach().clone()
                    continue
                change = p.grad - before
                before.copy_(p.grad)  # the raw gradient, in the buffer of the one it replaces
                p.grad.add_(change, alpha=step)

    def forget(self) -> None:
        """After weights were replaced (catch-up): the last gradient no longer says where the next one
        heads."""
        self.previous.clear()
