"""Weight stashing (PipeDream), with optional weight prediction.

A forward runs on a snapshot of the weights of the current version, taken once per version and shared
by every micro-batch that used it (``WeightStash``): the live weights themselves until they are about to
change, then a copy for the micro-batches still in flight (none with one micro-batch in flight).  Each
micro-batch keeps that snapshot with its inputs and outputs (``Stashed``) until its backward, so the
gradient of micro-batch m is the gradient at exactly the weights its forward saw, however many updates
happen in between.  Stage 0's credits
bound the micro-batches in flight, so they bound the stashed memory too.  The gradients of the
weights are summed into the live parameters (``GradientSum``) until the stage's next update.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ravq.cut.modules import set_buffer
from ravq.stage.delay import GradientExtrapolation
from ravq.stage.pipenag import lookahead_step
from ravq.stage.split import WeightPass, input_pass

PREDICTION_WINDOW = 64
"""Backwards whose mean staleness sets how far ``predict_weights`` extrapolates."""


@dataclass(slots=True)
class Stashed:
    """One micro-batch between its forward and its backward."""

    version: int
    params: dict[str, torch.Tensor]
    """The weights its forward ran at (shared with every micro-batch of that version)."""
    inputs: list[torch.Tensor]
    """Leaves for everything the stage received (``StageSpec.received``), in that order."""
    outputs: tuple[torch.Tensor, ...]

    def gradients(self, roots: list[torch.Tensor], root_grads: list[torch.Tensor | None]
                  ) -> tuple[dict[str, torch.Tensor | None], dict[int, torch.Tensor | None]]:
        """Gradients of ``roots`` (weighted by ``root_grads``) at the stashed weights: for each weight
        that takes one (by name), and for each input that takes one (by ``id`` of the input leaf)."""
        names = [n for n, w in self.params.items() if w.requires_grad]
        weights = [self.params[n] for n in names]
        grad_inputs = [x for x in self.inputs if x.requires_grad]
        grads: tuple[torch.Tensor | None, ...]
        if roots:
            grads = torch.autograd.grad(roots, weights + grad_inputs, root_grads, allow_unused=True)
        else:
            grads = (None,) * (len(weights) + len(grad_inputs))
        return dict(zip(names, grads[: len(names)])), dict(zip(map(id, grad_inputs), grads[len(names):]))

    def gradients_into(self, roots: list[torch.Tensor], root_grads: list[torch.Tensor | None],
                       params: dict[str, nn.Parameter]) -> dict[int, torch.Tensor | None]:
        """Like ``gradients``, but each weight's gradient is added by autograd, in place and layer by layer,
        to the ``.grad`` of the parameter of its name in ``params``: the stage never holds a second copy of
        its gradients besides their sum.  The gradient of each input that takes one, by ``id``."""
        grad_inputs = [x for x in self.inputs if x.requires_grad]
        if not roots:
            return dict.fromkeys(map(id, grad_inputs))
        with self._summing_into(params) as weights:
            if weights + grad_inputs:
                torch.autograd.backward(roots, root_grads, inputs=weights + grad_inputs)
        return {id(x): x.grad for x in grad_inputs}

    def input_gradients(self, roots: list[torch.Tensor], root_grads: list[torch.Tensor | None], *,
                        reuse: bool = True) -> tuple[dict[int, torch.Tensor | None], WeightPass]:
        """The input pass of a split backward (``training.schedule: zero_bubble``): the gradient of each
        input that takes one, by ``id``, and its weight pass (``weights_into``), which starts where the
        weights' side leaves the inputs' (``ravq.stage.split``): nothing is computed twice; without ``reuse``
        it walks the whole graph again."""
        grad_inputs = [x for x in self.inputs if x.requires_grad]
        weights = [w for w in self.params.values() if w.requires_grad]
        grads, weight_pass = input_pass(roots, root_grads, grad_inputs, weights, reuse=reuse)
        return dict(zip(map(id, grad_inputs), grads)), weight_pass

    def weights_into(self, weight_pass: WeightPass, params: dict[str, nn.Parameter]) -> None:
        """The weight pass of a split backward: each weight's gradient added to the ``.grad`` of the parameter
        of its name in ``params``, as ``gradients_into`` adds it."""
        with self._summing_into(params):
            weight_pass.run()

    @contextmanager
    def _summing_into(self, params: dict[str, nn.Parameter]) -> Iterator[list[torch.Tensor]]:
        """The stashed weights that take a gradient, their ``.grad`` the live parameters' sums meanwhile."""
        names = [n for n, w in self.params.items() if w.requires_grad]
        weights = [self.params[n] for n in names]
        for name, w in zip(names, weights):  # the snapshot's leaves add into the live parameters' sums
            w.grad = params[name].grad
        try:
            yield weights
        finally:
            for name, w in zip(names, weights):
                params[name].grad, w.grad = w.grad, None


class WeightStash:
    """The weights of a stage's forwards, one snapshot per version, and what predicting them needs: the
    last update and the staleness of recent backwards."""

    def __init__(self, params: dict[str, nn.Parameter], extrapolate: float = 0.0, lookahead: bool = False, *,
                 reuse_update: bool = False, raw_second_moment: bool = False) -> None:
        self.params = params
        self.lookahead = lookahead
        """PipeNAG's step for stale updates (``stale_correction: pipenag``; ``ravq.stage.pipenag``)."""
        self.extrapolation = GradientExtrapolation(params, extrapolate, raw_second_moment)
        """Delay compensation of each update's gradient (``extrapolate_gradients``; ``ravq.stage.delay``)."""
        self.snapshot: tuple[int, dict[str, torch.Tensor]] | None = None
        self.aliased = False
        """Whether the snapshot's tensors are the live weights' storage (see ``before_change``)."""
        self.last_update: dict[str, torch.Tensor] | None = None
        """Each parameter's change in the last optimizer step (for ``predict_weights``); None when prediction
        is off or the next snapshot took its buffer (``reuse_update``)."""
        self.reuse_update = reuse_update
        """The next version's predicted snapshot is made in the last update's buffer (a stage without tied
        copies: nothing but a step changes its weights mid-version, so the update is not needed again)."""
        self.recent_staleness: deque[int] = deque(maxlen=PREDICTION_WINDOW)
        self.retired: list[dict[str, torch.Tensor]] = []
        """Handles on the storage of each copy ``before_change`` left to forwards in flight, reused once they
        finished (``_spare``)."""

    def weights(self, version: int, predict: float) -> dict[str, torch.Tensor]:
        """The weights of this version's forwards: one snapshot per version, shared and stashed.

        With ``predict`` (``predict_weights``) k the snapshot is extrapolated to where the weights will
        be when this forward's gradient is applied, ``s`` updates later (``s`` = the stage's recent mean
        staleness): w + k * s * (last update).  Optimizers with momentum (Adam, SGD with momentum) change
        direction slowly, so this lands near the weights the gradient is applied to, as in SpecTrain and
        PipeMare; k a little above 1 also looks ahead as Nesterov momentum does.  The gradient is still
        exactly the gradient at the stashed (predicted) weights.  With no staleness the prediction is
        off, so ``max_inflight: 1`` still trains exactly like one process.
        """
        if self.snapshot is None or self.snapshot[0] != version:
            ahead = self.prediction_steps(predict)
            with torch.no_grad():
                if ahead > 0 and self.last_update is not None:
                    last = self.last_update
                    if self.reuse_update:  # the update's buffer becomes the snapshot: one copy, not two
                        copies = {n: torch.add(p.detach(), last[n], alpha=ahead, out=last[n])
                                  for n, p in self.params.items()}
                        self.last_update = None
                    else:
                        copies = {n: torch.add(p.detach(), last[n], alpha=ahead)
                                  for n, p in self.params.items()}
                    copies = {n: c.requires_grad_(self.params[n].requires_grad) for n, c in copies.items()}
                    self.aliased = False
                else:  # the live weights' storage, until they are about to change (``before_change``);
                    # ``.data`` has a version counter of its own: the live weights' fresh storage moves on
                    copies = {n: p.data.requires_grad_(p.requires_grad) for n, p in self.params.items()}
                    self.aliased = True
            self.snapshot = (version, copies)
        return self.snapshot[1]

    def before_change(self, in_flight: bool) -> None:
        """Call before the live weights change in place (optimizer step, averaging, catch-up).  A snapshot
        that is the live weights and that forwards in flight still use keeps their storage, and the live
        weights move to fresh storage: a stash costs memory only while an update falls between a forward
        and its backward, so with one micro-batch in flight a stage never holds a second copy."""
        if not in_flight:
            self.retired.clear()  # nothing in flight: no snapshot uses them
        if self.snapshot is None or not self.aliased:
            return
        if in_flight:
            spare = self._spare()
            with torch.no_grad():
                kept = {}
                for n, p in self.params.items():
                    kept[n] = p.data  # a handle on the storage the snapshot keeps
                    p.data = p.data.clone() if spare is None else spare[n].copy_(p.data)
            self.retired.append(kept)
        else:
            self.snapshot = None
        self.aliased = False

    def _spare(self) -> dict[str, torch.Tensor] | None:
        """A retired copy whose storage no tensor uses but its handles (the forwards that ran at it finished),
        taken off ``retired``, or None; other such copies are let go.  The live weights move into it rather
        than into a fresh copy: the same memory each step, where glibc's heap, left to allocate and free a
        stage's worth of blocks each step among smaller ones, kept 1-2 stages of holes it could not reuse
        (docs/convergence.md, "Memory (session 11)")."""
        free = [c for c in self.retired if all(_only_handle(t) for t in c.values())]
        self.retired = [c for c in self.retired if all(c is not f for f in free)]
        return free[0] if free else None

    def prediction_steps(self, predict: float) -> float:
        """k x the mean staleness of the last PREDICTION_WINDOW backwards (0 when prediction is off)."""
        recent = self.recent_staleness
        if not predict or not recent:
            return 0.0
        return predict * sum(recent) / len(recent)

    def step(self, optimizer: torch.optim.Optimizer, predict: float, in_flight: bool) -> None:
        """``optimizer.step()``, keeping the update it made when the next forwards extrapolate along it; the
        gradient is first extrapolated by the mean recent staleness (two forwards may share a version)."""
        self.before_change(in_flight)
        # a new version: no forward takes this snapshot again (those in flight hold it in ``Stashed.params``),
        # so a copy of it is freed with the last of them rather than kept until the next forward
        self.snapshot = None
        if self.recent_staleness:
            self.extrapolation.apply(sum(self.recent_staleness) / len(self.recent_staleness))
        if self.prediction_steps(predict) > 0:
            with torch.no_grad():  # the weights before the step, then the change, in one buffer
                last = self.last_update or {n: torch.empty_like(p) for n, p in self.params.items()}
                for n, p in self.params.items():
                    last[n].copy_(p.detach())
                self._optimizer_step(optimizer)
                for n, p in self.params.items():
                    last[n].sub_(p.detach()).neg_()
                self.last_update = last
        else:
            self._optimizer_step(optimizer)
            self.last_update = None

    def _optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        recent = self.recent_staleness
        if self.lookahead and recent:
            lookahead_step(optimizer, sum(recent) / len(recent))
        else:  # the optimizer's step (Adam's second moment perhaps fed the raw gradient: ravq.stage.delay)
            self.extrapolation.step(optimizer)

    def record_staleness(self, staleness: int) -> None:
        """A backward's staleness (updates between its forward and its update), for ``prediction_steps``."""
        self.recent_staleness.append(staleness)

    def invalidate(self) -> None:
        """The live weights changed outside an optimizer step (a tied step): the next forward takes a new
        snapshot."""
        self.snapshot = None

    def forget(self) -> None:
        """After weights were replaced (catch-up): no cached snapshot, no last update to extrapolate."""
        self.snapshot = None
        self.aliased = False
        self.last_update = None
        self.retired.clear()
        self.recent_staleness.clear()
        self.extrapolation.forget()


def _only_handle(t: torch.Tensor) -> bool:
    """Whether no tensor but ``t`` uses its storage (``t``'s reference and the one ``untyped_storage`` makes);
    False where torch cannot say."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)  # noqa: SLF001 - no public way to ask
    return use_count is not None and use_count(t.untyped_storage()._cdata) == 2  # noqa: SLF001


class GradientSum:
    """The weight gradients of the backwards since the last update, summed into the live parameters
    (scaled by 1 / ``update_every``), and the version each of those backwards' forward used."""

    def __init__(self, params: dict[str, nn.Parameter], update_every: int) -> None:
        self.params, self.update_every = params, update_every
        self.versions: list[int] = []
        self._unscaled = False
        """The ``.grad`` sums hold backwards added by ``summed``, not yet scaled by 1 / ``update_every``."""

    def summed(self, version: int) -> bool:
        """One backward's gradients (taken at the weights of ``version``) were added to the parameters'
        ``.grad`` unscaled (``Stashed.gradients_into``); whether an update is due (the sum is then scaled)."""
        self.versions.append(version)
        self._unscaled = True
        due = len(self.versions) >= self.update_every
        if due:
            self.finish()
        return due

    def finish(self) -> None:
        """Scale what ``summed`` added by 1 / ``update_every``, as ``add`` scales each backward (before an
        update reads the sum; also a last partial one)."""
        if self._unscaled and self.update_every != 1:
            with torch.no_grad():
                for p in self.params.values():
                    if p.grad is not None:
                        p.grad.mul_(1.0 / self.update_every)
        self._unscaled = False

    def add(self, grads: dict[str, torch.Tensor | None], version: int) -> bool:
        """Add one backward's gradients (taken at the weights of ``version``) apart from autograd (fp16: each
        divided by its own loss scale first); whether an update is due."""
        scale = 1.0 / self.update_every
        for name, g in grads.items():
            if g is None:
                continue
            g = g * scale if scale != 1.0 else g
            p = self.params[name]
            p.grad = g if p.grad is None else p.grad.add_(g)
        self.versions.append(version)
        return len(self.versions) >= self.update_every

    def take_versions(self) -> list[int]:
        """The versions of the backwards summed since the last update (the update takes them)."""
        versions, self.versions = self.versions, []
        return versions


def fresh_buffers(module: nn.Module, buffers: dict[str, torch.Tensor],
                  names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Give these buffers of ``module`` new storage (a copy, also put in ``buffers``) and return them, so
    that changing them in place (an averaging round's delta) never reaches the forwards in flight:
    autograd saved the old tensors (BatchNorm saves its running statistics) and checks they are
    unchanged at backward."""
    fresh = {}
    for name in names:
        copy = buffers[name].detach().clone()
        set_buffer(module, name, copy)
        buffers[name] = fresh[name] = copy
    return fresh
