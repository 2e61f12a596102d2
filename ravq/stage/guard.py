"""The asynchrony guard: notices when a stale stage's gradients stop pointing where fresh ones would.

A stage whose micro-batches are stale takes each gradient at the weights its forward ran at (stashed, maybe
predicted), a few updates old, and applies it to the current weights.  While training is stable the two
gradients of one micro-batch, at the stashed and at the current weights, nearly agree; where one update's
delay makes the optimizer overshoot (Adam at its stability edge, docs/convergence.md) they stop agreeing,
and that is when asynchrony costs the run loss it does not win back.

So every ``GUARD_EVERY`` stale backwards the stage takes one micro-batch a second time: its forward and
backward at the stashed weights and at the current ones, on the same inputs, the same gradients from
downstream and the same random numbers (dropout), and the cosine between the two weight gradients.  When the
mean of the last ``GUARD_WINDOW`` samples is below ``GUARD_COSINE`` the stage logs it once, with the remedy
(``max_inflight: 1``, or a larger ``training.batch`` so a micro-batch is a fraction of an update stale), and
reports it in its statistics (``ravq status``) and as ``ravq_asynchrony_warning``.  Its cost: two forwards
and backwards in ``GUARD_EVERY`` stale ones (2%), and nothing on a stage that is never stale (the last, and
every stage with ``max_inflight: 1``).  The recomputation copies the stage's buffers, so BatchNorm's running
statistics are not touched.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

log = logging.getLogger(__name__)

GUARD_EVERY = 100
"""Stale backwards between two samples."""
GUARD_WINDOW = 4
"""Samples whose mean cosine is compared with ``GUARD_COSINE``."""
GUARD_COSINE = 0.5
"""Below this mean cosine the stale and fresh gradients disagree: asynchrony hurts."""

Grads = Mapping[str, torch.Tensor | None]


def cosine(a: Grads, b: Grads) -> float:
    """Cosine between two sets of weight gradients taken as one vector (names with a gradient in both)."""
    dot = na = nb = 0.0
    for name, x in a.items():
        y = b.get(name)
        if x is None or y is None:
            continue
        x, y = x.detach().double(), y.detach().double()
        dot, na, nb = dot + float((x * y).sum()), na + float((x * x).sum()), nb + float((y * y).sum())
    return dot / (na * nb) ** 0.5 if na > 0 and nb > 0 else 1.0


def gradients_at(module: nn.Module, weights: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
                 inputs: list[torch.Tensor], output_grads: list[torch.Tensor | None],
                 autocast: Callable[[], Any]) -> dict[str, torch.Tensor | None]:
    """The weight gradients of ``module`` at ``weights`` on ``inputs``, its outputs weighted by
    ``output_grads`` (as a stage's backward weighs them); ``buffers`` are copied, never changed."""
    leaves = {n: w.detach().requires_grad_(w.requires_grad) for n, w in weights.items()}
    state = {**leaves, **{n: b.detach().clone() for n, b in buffers.items()}}
    with torch.enable_grad(), autocast():
        out = functional_call(module, state, tuple(x.detach() for x in inputs))
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    pairs = [(o, g) for o, g in zip(outs, output_grads) if g is not None and o.requires_grad]
    names = [n for n, w in leaves.items() if w.requires_grad]
    if not pairs or not names:
        return dict.fromkeys(names)
    got = torch.autograd.grad([o for o, _ in pairs], [leaves[n] for n in names], [g for _, g in pairs],
                              allow_unused=True)
    return dict(zip(names, got))


class AsynchronyGuard:
    """Samples the agreement of stale and fresh gradients on a stale stage and says once when it is low."""

    def __init__(self, where: str, *, every: int = GUARD_EVERY, window: int = GUARD_WINDOW,
                 threshold: float = GUARD_COSINE) -> None:
        self.where, self.every, self.threshold = where, every, threshold
        self.stale_backwards = 0
        self.cosines: deque[float] = deque(maxlen=window)
        self.warned = False
        """Set once the mean cosine fell below the threshold (it stays set: the log line is once)."""

    def due(self, staleness: int) -> bool:
        """Whether this backward, ``staleness`` updates late, is the one to sample."""
        if staleness <= 0 or self.every <= 0:
            return False
        self.stale_backwards += 1
        return self.stale_backwards % self.every == 0

    def sample(self, module: nn.Module, stale: Mapping[str, torch.Tensor], fresh: Mapping[str, torch.Tensor],
               buffers: Mapping[str, torch.Tensor], inputs: list[torch.Tensor],
               output_grads: list[torch.Tensor | None], autocast: Callable[[], Any]) -> float:
        """Both gradients of one micro-batch under the same random numbers; their cosine, recorded."""
        with torch.random.fork_rng(devices=[]):
            seed = int(torch.randint(0, 2**62, ()))
            torch.manual_seed(seed)
            at_stale = gradients_at(module, stale, buffers, inputs, output_grads, autocast)
            torch.manual_seed(seed)
            at_fresh = gradients_at(module, fresh, buffers, inputs, output_grads, autocast)
        return self.record(cosine(at_stale, at_fresh))

    def record(self, value: float) -> float:
        self.cosines.append(value)
        mean = self.mean()
        if not self.warned and len(self.cosines) == self.cosines.maxlen and mean < self.threshold:
            self.warned = True
            log.warning("%s: asynchrony hurts this run: a stale gradient and the same micro-batch's gradient "
                        "at the current weights agree with cosine %.2f (mean of %d samples, below %.2f); set "
                        "training.max_inflight: 1 (synchronous), or a larger training.batch so a micro-batch "
                        "is a fraction of an update stale (docs/convergence.md)",
                        self.where, mean, len(self.cosines), self.threshold)
        return value

    def mean(self) -> float:
        return sum(self.cosines) / len(self.cosines) if self.cosines else 1.0

    def report(self) -> dict[str, Any]:
        """What the stage's statistics carry (heartbeats, ``ravq status``, the summary)."""
        return {"stale_cosine": self.mean() if self.cosines else None, "asynchrony_warning": self.warned}
