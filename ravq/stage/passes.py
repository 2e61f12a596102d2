"""A micro-batch's forward and backward through one stage (compute thread).

``Passes`` runs the stage's module on what arrived, at the stashed weights of the current version
(``ravq.stage.stash``), hands the outputs or input-gradients to ``emit``, and on the backward sums the
weight gradients until the stage's update is due; the update itself (``StageWorker``'s step, through
the recipe: ``ravq.stage.recipe``) follows the backward that completes it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from ravq.codec.compress import Packed
from ravq.cut.split import model_output
from ravq.stage.feed import DataFeed
from ravq.stage.guard import AsynchronyGuard
from ravq.stage.recipe import Recipe
from ravq.stage.split import WeightPass
from ravq.stage.stash import GradientSum, Stashed, WeightStash
from ravq.stage.state import Emit, OpTimer, Outbox, StagePlace, StageState
from ravq.stage.stats import StageStats
from ravq.stage.tensors import (
    Parts,
    data_for,
    gather_inputs,
    input_grads,
    output_grads,
    targets_of,
    to_device,
)
from ravq.stage.tied_stage import TiedStep
from ravq.stage.types import MicroBatch, StageOptions


class Passes:
    """Forwards and backwards of one stage's micro-batches."""

    def __init__(self, options: StageOptions, *, place: StagePlace, state: StageState, module: nn.Module,
                 buffers: dict[str, torch.Tensor], weights: WeightStash, grads: GradientSum,
                 loss_fn: Callable[[Any, Any], torch.Tensor], recipe: Recipe, stats: StageStats,
                 outbox: Outbox, timer: OpTimer, feed: DataFeed | None, tied_step: TiedStep | None) -> None:
        self._predict, self._micro_batch = options.predict_weights, options.micro_batch
        self._place, self._state, self._module, self._buffers = place, state, module, buffers
        self._weights, self._grads, self._loss_fn, self._recipe = weights, grads, loss_fn, recipe
        self._stats, self._outbox, self._timer = stats, outbox, timer
        self._feed, self._tied_step = feed, tied_step
        self._update_every = options.update_every
        self._split = options.split_backward and not place.is_first and tied_step is None
        """``training.schedule: zero_bubble``: input-gradients first, weight passes deferred (stage 0 sends no
        input-gradient; a stage with tied copies contributes its step before its input-gradients)."""
        self._deferred: deque[tuple[MicroBatch, Stashed, WeightPass]] = deque()
        self._reuse = True
        """Weight passes reuse the input passes' work, until a graph shares a weight between split nodes."""
        self._raw_output: Any = None
        self.guard = AsynchronyGuard(f"cluster {place.cluster} stage {place.spec.index}")
        """Watches this stage's stale updates and says once when asynchrony hurts (``ravq.stage.guard``)."""

    def run_module(self, mb: MicroBatch, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Run the module on what the stage received and stash the micro-batch; returns its outputs as a
        tuple (the raw output, e.g. the unsplit model's ModelOutput, is kept for the last stage)."""
        spec, state = self._place.spec, self._state
        weights = self._weights.weights(state.version, self._predict)
        leaves = [x.detach().to(self._place.device).requires_grad_(x.is_floating_point() and ref.stage >= 0)
                  for x, ref in zip(inputs, spec.received)]
        with torch.enable_grad(), self._recipe.autocast():
            args = tuple(leaves[: len(spec.inputs)])
            out = functional_call(self._module, {**weights, **self._buffers}, args)
        self._raw_output = out if self._place.is_last else None
        outputs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        state.stash[mb] = Stashed(state.version, weights, leaves, outputs)
        self._stats.record_forward(len(state.stash))
        return outputs

    def pack(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | Packed]:
        """Activations or gradients as they leave this stage: compressed unless ``compress`` is none."""
        return self._outbox.pack(tensors)

    def start(self, emit: Emit) -> None:
        """Stage 0: the next micro-batch of its data (a dropped one first)."""
        assert self._feed is not None
        place = self._place
        index, (inputs, targets) = self._feed.take()
        mb = (place.cluster, index)
        if not place.is_last:
            self._feed.track(mb, (inputs, targets))
        inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        parts = {0: {f"x{i}": x for i, x in enumerate(inputs)}}
        if place.is_last:
            self._run_last(mb, gather_inputs(place.spec, parts), targets, emit)
            return
        data = {dest: data_for(dest, inputs, targets, place.model_input_needs, place.num_stages)
                for dest in place.first_destinations()}
        self._forward_and_send(mb, parts, data, emit)

    def forward(self, mb: MicroBatch, parts: Parts, emit: Emit) -> None:
        """A micro-batch whose parts all arrived: forward it (the last stage: and its backward)."""
        spec = self._place.spec
        if self._place.is_last:
            self._run_last(mb, gather_inputs(spec, parts), targets_of(parts[0]), emit)
            return
        self._forward_and_send(mb, parts, {dest: {} for dest in spec.consumer_stages}, emit)

    def _forward_and_send(self, mb: MicroBatch, parts: Parts, data: dict[int, dict[str, torch.Tensor]],
                          emit: Emit) -> None:
        """Forward, then send each stage in ``data`` the outputs it reads and its ``data`` (stage 0's
        model inputs and targets, never compressed)."""
        spec = self._place.spec
        t0 = self._timer.clock()
        outputs = self.run_module(mb, gather_inputs(spec, parts))
        self._account("forward", t0)
        for dest, extra in data.items():
            tensors = {f"o{i}": outputs[i].detach() for i, users in spec.consumers.items() if dest in users}
            emit(self._outbox.message("fwd", dest, mb, {**self.pack(tensors), **extra},
                                      self._recipe.forward_meta()))

    def _run_last(self, mb: MicroBatch, inputs: list[torch.Tensor], targets: Any, emit: Emit) -> None:
        t1, due = self._last_passes(mb, inputs, targets, emit)
        if due:  # after the passes' frames let go of the micro-batch (see ``backward``)
            self._updated(mb[1])
        self._account("backward", t1)

    def _last_passes(self, mb: MicroBatch, inputs: list[torch.Tensor], targets: Any,
                     emit: Emit) -> tuple[float, bool]:
        """The last stage's forward, loss and backward; when its backward began, and whether an update is
        due."""
        clock = self._timer.clock
        t0 = clock()
        self.run_module(mb, inputs)
        stash = self._state.stash[mb]
        out = model_output(self._place.spec, self._raw_output, stash.inputs)
        self._raw_output = None
        targets = to_device(targets, self._place.device)
        with torch.enable_grad(), self._recipe.autocast():
            loss = self._loss_fn(out, targets)
        self._account("forward", t0)
        self._stats.record_loss(float(loss.detach()))
        t1 = clock()
        root = self._recipe.after_loss(mb, loss, out, targets)
        return t1, self._backward_of(mb, stash, [root], [None], emit)

    def backward(self, mb: MicroBatch, parts: Parts, emit: Emit) -> None:
        """The gradients of a micro-batch's outputs all arrived: its backward, then the update it completes.

        The update runs once the backward's frames have let go of the micro-batch: its outputs' graph holds
        the weights its forward ran at (autograd's ``AccumulateGrad`` nodes keep their leaves), on a stale
        stage a stage-sized copy that the step would otherwise hold besides the live weights, their
        gradients and the copy it makes for the forwards still in flight (``WeightStash.before_change``)."""
        t0 = self._timer.clock()
        if self._backward(mb, parts, emit):
            self._updated(mb[1])
        self._account("backward", t0)

    def _backward(self, mb: MicroBatch, parts: Parts, emit: Emit) -> bool:
        stash = self._state.stash[mb]
        grads = output_grads(parts, stash.outputs, self._place.device)
        if self.guard.due(self._state.version - stash.version):
            self._sample_guard(stash, grads)
        pairs = [(o, g) for o, g in zip(stash.outputs, grads) if g is not None and o.requires_grad]
        return self._backward_of(mb, stash, [o for o, _ in pairs], [g for _, g in pairs], emit)

    def backward_from(self, mb: MicroBatch, stash: Stashed, roots: list[torch.Tensor],
                      root_grads: list[torch.Tensor | None], emit: Emit) -> None:
        """Backward of ``roots`` (weighted by ``root_grads``) at the stashed weights; the input-gradients
        to their producers; the update, when this backward completes one.  Split (``zero_bubble``): the
        input pass now and its weight pass deferred (``weights``), every one of them before the update.
        (The caller's ``stash`` and ``roots`` keep the micro-batch's weights through the update:
        ``backward`` steps after its frames let go of them.)"""
        if self._backward_of(mb, stash, roots, root_grads, emit):
            self._updated(mb[1])

    def _backward_of(self, mb: MicroBatch, stash: Stashed, roots: list[torch.Tensor],
                     root_grads: list[torch.Tensor | None], emit: Emit) -> bool:
        """``backward_from`` but the update; whether one is due (its weight passes drained)."""
        due = len(self._grads.versions) + len(self._deferred) + 1 >= self._update_every
        clips = self._recipe.exchange is not None  # the step's norm goes upstream on its input-gradients
        if not self._split or self._recipe.scales_apart or (due and clips):
            self.drain()
            return self._whole(mb, stash, roots, root_grads, emit)
        grad_of, weight_pass = stash.input_gradients(roots, root_grads, reuse=self._reuse)
        self._reuse = self._reuse and not weight_pass.shared
        self._deferred.append((mb, stash, weight_pass))
        self._sent(mb, stash, grad_of, False, None, emit)
        if due:
            self.drain()
        return due

    @property
    def deferred(self) -> int:
        """Weight passes waiting (``zero_bubble``)."""
        return len(self._deferred)

    def weights(self) -> MicroBatch:
        """The oldest deferred weight pass: its gradients added to the sum; returns its micro-batch."""
        mb, stash, weight_pass = self._deferred.popleft()
        stash.weights_into(weight_pass, self._weights.params)
        self._grads.summed(stash.version)
        return mb

    def run_weights(self) -> None:
        """One deferred weight pass, counted as backward time (the compute thread had nothing else)."""
        t0 = self._timer.clock()
        self.weights()
        self._account("backward", t0)

    def drain(self) -> None:
        """Every deferred weight pass (before an update, a partial last one, or a reset)."""
        while self._deferred:
            self.weights()

    def _whole(self, mb: MicroBatch, stash: Stashed, roots: list[torch.Tensor],
               root_grads: list[torch.Tensor | None], emit: Emit) -> bool:
        if self._recipe.scales_apart:
            weight_grads, grad_of = stash.gradients(roots, root_grads)
            weight_grads, scale = self._recipe.unscale(mb, weight_grads)
            due = self._grads.add(weight_grads, stash.version)
            del weight_grads
        else:  # autograd adds each weight's gradient to the sum: no second copy of the stage's gradients
            grad_of, scale = stash.gradients_into(roots, root_grads, self._weights.params), None
            due = self._grads.summed(stash.version)
        self._sent(mb, stash, grad_of, due, scale, emit)
        return due

    def _sent(self, mb: MicroBatch, stash: Stashed, grad_of: dict[int, torch.Tensor | None], due: bool,
              scale: float | None, emit: Emit) -> None:
        """The micro-batch's backward is done here: unstash it, send its input-gradients."""
        state, stats = self._state, self._stats
        del state.stash[mb]
        if self._feed is not None and self._feed.complete(mb):
            stats.record_completed(mb[1])
        stats.record_inflight(len(state.stash))
        tied_sq = 0.0
        if due and self._tied_step is not None:  # before the input-gradients: upstream holders need it first
            tied_sq = self._tied_step.contribute(mb[1])
        meta = self._recipe.backward_meta(mb, due, scale, tied_sq)
        for producer, tensors in input_grads(self._place.spec, stash.inputs, grad_of).items():
            emit(self._outbox.message("bwd", producer, mb, self.pack(tensors), meta))
        stats.record_backward(self._micro_batch)
        state.count_trained()

    def _updated(self, name: int) -> None:
        """The step named ``name`` (the micro-batch that completed it) is due."""
        if not self._place.is_last:  # the last stage is never stale
            self._observe_update()
        self._recipe.step(name)

    def _sample_guard(self, stash: Stashed, grads: list[torch.Tensor | None]) -> None:
        inputs = stash.inputs[: len(self._place.spec.inputs)]
        cos = self.guard.sample(self._module, stash.params, self._weights.params, self._buffers, inputs,
                                grads, self._recipe.autocast)
        self._stats.record_guard(self.guard.report(), cos)

    def _observe_update(self) -> None:
        staleness = max((self._state.version - v for v in self._grads.versions), default=0)
        warned = self.guard.warned
        self.guard.observe_update((p.grad for p in self._weights.params.values() if p.grad is not None),
                                  staleness)
        if self.guard.warned and not warned:
            self._stats.record_guard(self.guard.report())

    def _account(self, phase: str, t0: float) -> None:
        """Count the forward or backward (``phase``) begun at ``t0``, less what it waited."""
        self._stats.record_compute(phase, self._timer.elapsed(t0), len(self._state.stash))
