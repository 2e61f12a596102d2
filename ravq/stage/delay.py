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
momentum, whose step has no second moment to inflate.  After the warm-up and without the look-ahead, an
Adam-family stage's stale step feeds the extrapolated gradient to its first moment and the raw one (kept for
the next update anyway) to its second (``raw_second_moment``, ``adam_step``): the first moment's look-ahead
stays, the noise it adds to the second moment (up to (1 + 1.5)^2 + 1.5^2 = 8.5x at ``s`` 0.75) goes.  With a
stated batch of 4 micro-batches per update a user's AdamW encoder at 3-4 stages ended 1.06-1.12x synchronous
training's loss with the inflated second moment and <= 1.02x with the raw one, and the tied GPT-2 of the zoo
kept its runs (docs/convergence.md, session 11).  Opened at once (no warm-up), the inflated second moment
stays: there it is the rescue.

Under a stated batch ``g_prev`` is the previous update's mean gradient and ``s`` the mean staleness, in
updates, of the micro-batches of recent updates (a micro-batch is 0 or 1 update stale; in steady state 3 of 4
micro-batches of an update share the previous update's version, ``s`` 0.75 on every stale stage at 4 per
update), so ``g - g_prev`` spans one update's drift, as with an update per micro-batch.  Measured against the
spread of each update's micro-batch gradients, that drift is 0-0.5 of ``|g - g_prev|^2`` on the zoo and user
tasks; the rest is micro-batch noise (docs/convergence.md).

Memory: the last gradient is a copy of the stage's gradients, kept only while the stage is stale.  An
update with no staleness (the last stage always, every stage during the asynchrony warm-up) keeps none and
frees what an earlier stale update kept, so the first stale update after it is handed its gradient as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from ravq.stage.optim import adam_denominator, adam_moments
from ravq.stage.pipenag import decoupled_decay, is_adam

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


def raw_second_moment(optimizer: torch.optim.Optimizer, lookahead: bool, warmup: bool) -> bool:
    """Whether a compensated stage's stale steps feed Adam's second moment the raw gradient (its first
    moment the extrapolated one): an Adam-family stage (without amsgrad or maximize) whose compensation runs
    after the asynchrony warm-up and without PipeNAG's look-ahead (a stated batch; module docstring).  Opened
    at once (no warm-up) the inflated second moment is kept: its shorter step is the rescue at the edge."""
    plain = all(not g.get("amsgrad") and not g.get("maximize") for g in optimizer.param_groups)
    return is_adam(optimizer) and plain and warmup and not lookahead


@torch.no_grad()
def adam_step(optimizer: torch.optim.Optimizer, second: dict[int, torch.Tensor]) -> None:
    """One step of an Adam-family optimizer (Adam, AdamW, ``ClusterAdam``: weight decay and clusters as it has
    them; Adam's own arithmetic) whose second moment follows ``second[id(p)]`` (``p.grad`` where absent) and
    whose first moment follows ``p.grad``."""
    clusters = getattr(optimizer, "clusters", 1)
    for group in optimizer.param_groups:
        lr, (beta1, beta2), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            t, _, exp_avg, exp_avg_sq = adam_moments(
                optimizer.state[p], p, lr=lr, wd=wd, decoupled=decoupled_decay(optimizer, group), beta1=beta1,
                beta2=beta2, second=second.get(id(p)))
            bias1 = 1 - beta1 ** t
            p.addcdiv_(exp_avg, adam_denominator(exp_avg, exp_avg_sq, bias1, 1 - beta2 ** t, eps, clusters),
                       value=-lr / bias1)


class GradientExtrapolation:
    """Keeps the gradient of the stage's last update and extrapolates the next one when it is stale."""

    def __init__(self, params: dict[str, nn.Parameter], factor: float, raw_second_moment: bool = False
                 ) -> None:
        self.params, self.factor = params, factor
        self.previous: dict[str, torch.Tensor] = {}
        """Each parameter's gradient at the last update, as the optimizer's sum was before extrapolation."""
        self.raw_second_moment = raw_second_moment
        """Stale steps feed Adam's second moment the raw gradient (``raw_second_moment`` the function)."""
        self.extrapolated = False
        """Whether the last ``apply`` extrapolated a gradient (then ``previous`` holds the raw ones)."""

    def apply(self, staleness: float) -> None:
        """Extrapolate every ``.grad`` in place by ``factor * staleness`` steps (none when either is 0),
        and remember the un-extrapolated gradients for the next update (only while ``staleness`` > 0)."""
        self.extrapolated = False
        if not self.factor:
            return
        if staleness <= 0:  # nothing stale: nothing to extrapolate, and no copy of the gradients kept
            self.previous.clear()
            return
        self.extrapolated = self.extrapolate(self.factor * min(staleness, MAX_UPDATES))

    @torch.no_grad()
    def extrapolate(self, step: float) -> bool:
        """Every ``.grad`` += ``step`` x its change since the last update, remembering the raw gradients;
        whether any was extrapolated (a parameter without a last gradient only starts one)."""
        done = False
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
            done = True
        return done

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's step on the gradients ``apply`` left; with ``raw_second_moment``, after an
        extrapolation, ``adam_step`` with the raw gradients (``previous``) for the second moment."""
        if self.raw_second_moment and self.extrapolated:
            raw = self.previous
            adam_step(optimizer, {id(p): raw[n] for n, p in self.params.items() if n in raw})
        else:
            optimizer.step()
        self.extrapolated = False  # the next step uses only what its own ``apply`` did

    def forget(self) -> None:
        """After weights were replaced (catch-up): the last gradient no longer says where the next one
        heads."""
        self.previous.clear()
