"""The asynchrony guard: notices when a stale stage's updates stop behaving as synchronous ones would.

A stage whose micro-batches are stale takes each gradient at the weights its forward ran at (stashed, maybe
predicted), a few updates old, and applies it to the current weights.  Where one update's delay makes the
optimizer overshoot (Adam at its stability edge, docs/convergence.md) the run loses loss it may never win
back.  Two signals, both cheap:

- **A gradient spike on a stale update.**  The overshoot shows as a step whose gradient norm jumps far above
  the stage's recent ones (on the small GPT-2 of issue #25: 28-211x the median of the last 32 steps in the
  runs that stalled, at most 11x in the runs that trained well and 3x synchronously), and that spike is
  what fills Adam's second moment.  Every update of a stage that can be stale (all but the last) computes
  its gradient norm; a stale one above ``GUARD_SPIKE`` times the median of the last ``GUARD_HISTORY``
  warns.
- **Stale against fresh gradients.**  Every ``GUARD_EVERY`` stale backwards the stage takes one micro-batch
  a second time: its forward and backward at the stashed weights and at the current ones, on the same
  inputs, downstream gradients and random numbers (dropout), and records the cosine of the two weight
  gradients (two forwards and backwards in ``GUARD_EVERY``, 2%; the buffers are copied, so BatchNorm's
  running statistics are untouched).  A mean below ``GUARD_COSINE`` over ``GUARD_WINDOW`` samples warns.
  In the stalled runs above the cosine stayed at 0.92-1.0: the delay's harm there is the step, not the
  direction, so the spike is what catches it; the cosine is there for delays that turn the gradient.

A warning is logged once, with the remedy (``max_inflight: 1``, or a larger ``training.batch`` so that a
micro-batch is a fraction of an update stale), and reported in the stage's statistics (``ravq status``, the
demo's summary) and as ``ravq_asynchrony_warning``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping
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
GUARD_SPIKE = 20.0
"""A stale update whose gradient norm is this many times the recent median is an overshoot."""
GUARD_HISTORY = 32
"""Updates whose gradient norms make the median a spike is measured against."""
GUARD_MIN_HISTORY = 8
"""Updates seen before a spike can be judged (the first steps of a run move fast)."""

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
    """Watches a stage's stale updates (gradient spikes, sampled stale-against-fresh cosines) and says once
    when asynchrony hurts."""

    def __init__(self, where: str, *, every: int = GUARD_EVERY, window: int = GUARD_WINDOW,
                 threshold: float = GUARD_COSINE, spike: float = GUARD_SPIKE) -> None:
        self.where, self.every, self.threshold = where, every, threshold
        self.stale_backwards = 0
        self.cosines: deque[float] = deque(maxlen=window)
        self.spike = spike
        self.norms: deque[float] = deque(maxlen=GUARD_HISTORY)
        """Gradient norms of the stage's latest updates."""
        self.warned = False
        """Set once either signal fired (it stays set: the log line is once)."""
        self.reason: str | None = None

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
        cuda = sorted({x.device.index or 0 for x in inputs if x.is_cuda})  # their random streams too
        with torch.random.fork_rng(devices=cuda):
            seed = int(torch.randint(0, 2**62, ()))
            torch.manual_seed(seed)
            at_stale = gradients_at(module, stale, buffers, inputs, output_grads, autocast)
            torch.manual_seed(seed)
            at_fresh = gradients_at(module, fresh, buffers, inputs, output_grads, autocast)
        return self.record(cosine(at_stale, at_fresh))

    def record(self, value: float) -> float:
        """A sampled cosine; warns once when the window's mean is below the threshold."""
        self.cosines.append(value)
        if len(self.cosines) == self.cosines.maxlen and self.mean() < self.threshold:
            self._warn(f"a stale gradient and the same micro-batch's gradient at the current weights agree "
                       f"with cosine {self.mean():.2f} (mean of {len(self.cosines)} samples, below "
                       f"{self.threshold:.2f})")
        return value

    def observe_update(self, grads: Iterable[torch.Tensor], staleness: int) -> None:
        """An update of a stage that can be stale, about to apply ``grads``, ``staleness`` updates late at
        most; warns once when a stale one's norm is a spike against the recent updates."""
        norms = [torch.linalg.vector_norm(g.detach().float()) for g in grads]
        if not norms:
            return
        norm = float(torch.linalg.vector_norm(torch.stack(norms)))
        recent = sorted(self.norms)
        if staleness > 0 and len(recent) >= GUARD_MIN_HISTORY and recent[len(recent) // 2] > 0:
            ratio = norm / recent[len(recent) // 2]
            if ratio > self.spike:
                self._warn(f"a stale update's gradient norm jumped to {ratio:.0f}x the median of the last "
                           f"{len(recent)} updates (an overshoot of the delayed step)")
        self.norms.append(norm)

    def _warn(self, what: str) -> None:
        if self.warned:
            return
        self.warned, self.reason = True, what
        log.warning("%s: asynchrony hurts this run: %s; set training.max_inflight: 1 (synchronous), or a "
                    "larger training.batch so a micro-batch is a fraction of an update stale "
                    "(docs/convergence.md)", self.where, what)

    def mean(self) -> float:
        return sum(self.cosines) / len(self.cosines) if self.cosines else 1.0

    def report(self) -> dict[str, Any]:
        """What the stage's statistics carry (heartbeats, ``ravq status``, the summary)."""
        return {"stale_cosine": self.mean() if self.cosines else None, "asynchrony_warning": self.warned,
                "asynchrony_reason": self.reason}
