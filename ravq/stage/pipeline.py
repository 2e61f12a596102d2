"""The asynchronous stage: one stage's weights, forwards, backwards and updates, and its control surface.

No sockets here.  A ``StageWorker`` owns one stage's weights and optimizer and runs in the node's single compute
thread.  The event loop hands it arrivals with ``deliver``; it hands back what must be sent through an ``emit``
callback.  Stage 0 reads the data and holds the credits that bound the micro-batches in flight (``max_inflight``),
which bounds both stashed memory and staleness.  Its parts: ``ravq.stage.schedule`` picks the next work (backward
before forward), forwards run at stashed weights (``ravq.stage.stash``), messages' tensors are named and checked as
``ravq.stage.tensors`` says, ``ravq.stage.stats`` counts the work, ``ravq.stage.recipe`` does the rest of training.

Churn: a micro-batch is named by its index in stage 0's data, and every message carries the cluster
*generation* it belongs to.  When a member of the cluster is lost, every stage ``pause``s and
``reset``s: it drops the work in flight (stashes, partial parts; stage 0 gets its credits back and
re-queues the dropped micro-batches, which are trained again under the same index) and keeps its
weights and optimizer.  ``resume`` sets the count of finished micro-batches to stage 0's, so every
stage agrees on what is left.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from ravq.codec import compress
from ravq.codec.compress import Packed
from ravq.cut.split import StageSpec, model_output
from ravq.stage.arrivals import deliver
from ravq.stage.recipe import Recipe, build_optimizer
from ravq.stage.schedule import Scheduler
from ravq.stage.stash import GradientSum, Stashed, WeightStash, fresh_buffers
from ravq.stage.stats import StageStats
from ravq.stage.tensors import (
    Parts,
    data_for,
    expected_forward,
    forward_sources,
    gather_inputs,
    input_grads,
    output_grads,
    targets_of,
    to_device,
)
from ravq.stage.tied_step import TiedExchange, apply_tied, deliver_tied, send_tied
from ravq.stage.types import MicroBatch, Outbound, StageOptions

Emit = Callable[[Outbound], None]


class StageWorker:
    """One stage's torch state and schedule.  All methods but ``deliver``/``stop`` run in the
    compute thread."""

    def __init__(self, spec: StageSpec, num_stages: int, optimizer_factory: Callable[..., torch.optim.Optimizer],
                 loss_fn: Callable[[Any, Any], torch.Tensor], options: StageOptions,
                 device: torch.device | str = "cpu", batches: Iterator[Any] | None = None,
                 cluster: int = 0, metrics: Any = None, model_input_needs: dict[int, list[int]] | None = None,
                 input_specs: list[tuple[torch.Size, torch.dtype]] | None = None,
                 target_example: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.spec, self.num_stages, self.options = spec, num_stages, options
        self.clock = clock
        """Seconds, monotonic: every duration the stage counts (compute, waits, wall) is read off it."""
        self.device = torch.device(device)
        self.module = spec.module.to(self.device)
        self.params: dict[str, nn.Parameter] = dict(self.module.named_parameters())
        self.buffers: dict[str, torch.Tensor] = dict(self.module.named_buffers())
        self.optimizer = build_optimizer(optimizer_factory, self.params)
        self.loss_fn, self.batches, self.cluster, self.metrics = loss_fn, batches, cluster, metrics
        self.is_first, self.is_last = spec.index == 0, spec.index == num_stages - 1
        self.model_input_needs = model_input_needs or {}
        assert not self.is_first or batches is not None, "stage 0 reads the data"
        self.version = 0
        self.data_position = 0  # micro-batches stage 0 has taken from its iterator
        self.trained = 0
        """Micro-batches finished (backward done here); set to stage 0's count at every resume."""
        self.generation = 0
        self.cluster_done: Callable[[], bool] = lambda: True
        """Whether stage 0 finished (later stages keep serving until then: a pause may ask for redos)."""
        self._requeue: deque[tuple[int, Any]] = deque()
        """Stage 0: dropped micro-batches (index, batch), trained again before new data."""
        self._inflight_data: dict[MicroBatch, Any] = {}
        """Stage 0: the batch of each micro-batch in flight, to re-queue it if the pause drops it."""
        self.stats = StageStats(clock=clock)
        self.forward_weights = WeightStash(self.params, options.extrapolate_gradients * (options.max_inflight > 1))
        self._stash: dict[MicroBatch, Stashed] = {}
        self._grads = GradientSum(self.params, options.update_every)
        self._fwd_sources = forward_sources(spec, num_stages)
        self._expected_fwd = expected_forward(spec, num_stages, input_specs, target_example)
        self._sched = Scheduler(self._fwd_sources, spec.consumer_stages, 4 * options.max_inflight + 4, clock)
        self.on_update: Callable[[StageWorker], None] | None = None
        self._waited_in_op = 0.0
        """Seconds of the current forward or backward spent waiting (``waited``), not computing."""
        self.should_abort: Callable[[], bool] = lambda: False
        """Whether the process is giving up (set by ``run``); hooks that block check it."""
        self._raw_output: Any = None
        self.tied = TiedExchange(spec.index, spec.tied, dict(self.module.named_parameters(remove_duplicate=False)),
                                 options.max_inflight) if spec.tied else None  # copies of tied weights (tied_step)
        self._emit: Emit = lambda out: None
        self.recipe = Recipe(self)  # LR schedule, precision, clipping, evaluation, metrics (ravq.stage.recipe)

    @property
    def paused(self) -> bool:
        """No new micro-batch starts (set by ``pause`` and ``reset``, cleared by ``resume``)."""
        return self._sched.paused

    @paused.setter
    def paused(self, paused: bool) -> None:
        self._sched.paused = paused

    @property
    def _last_update(self) -> dict[str, torch.Tensor] | None:
        return self.forward_weights.last_update

    @property
    def _recent_staleness(self) -> deque[int]:
        return self.forward_weights.recent_staleness

    # ----------------------------------------------------------------- called from the event loop
    def deliver(self, kind: str, micro_batch: MicroBatch, source: int,
                tensors: dict[str, torch.Tensor | Packed], meta: dict[str, Any] | None = None) -> str | None:
        """An arrived message and its header ``meta`` (``ravq.stage.arrivals``): None if queued, else why not."""
        if kind == "tied":
            return deliver_tied(self, micro_batch, source, tensors)
        return deliver(self, kind, micro_batch, source, tensors, meta or {})

    def submit(self, fn: Callable[[StageWorker], None]) -> None:
        """Run ``fn(self)`` in the compute thread before any further forward or backward."""
        self._sched.submit(fn)

    def call(self, fn: Callable[[StageWorker], None]) -> bool:
        """``submit`` if ``run`` is working (True); False if not: the caller runs ``fn`` itself."""
        return self._sched.call(fn)

    def run_pending(self) -> None:
        """Run control work submitted after ``run`` returned (e.g. the last averaging round's result)."""
        for fn in self._sched.take_control():
            fn(self)

    def stop(self) -> None:
        """Stop taking new micro-batches; run() returns once in-flight work is done or on ``abort``."""
        self._sched.stop()

    def pause(self) -> None:
        """Start no new micro-batch until ``resume`` (called from the event loop; ``reset`` follows)."""
        self._sched.pause()

    def reset(self, generation: int) -> int:
        """Compute thread: drop all work in flight, keep weights and optimizer; returns how many
        micro-batches stage 0 re-queued (or this stage dropped)."""
        with self._sched.cond:
            self.paused = True
            self.generation = generation
            dropped = len(self._stash)
            self._stash.clear()
            self._sched.clear_parts()
            if self.is_first:
                again = sorted((mb[1], batch) for mb, batch in self._inflight_data.items())
                self._requeue = deque(sorted([*again, *self._requeue], key=lambda item: item[0]))
                self._inflight_data.clear()
            self.stats.inflight = 0
            if self.tied is not None:
                self.tied.reset()
            self.recipe.forget_in_flight()
        return dropped

    def resume(self, trained: int) -> None:
        """Compute thread: train again, counting ``trained`` micro-batches as finished."""
        if self.tied is not None:  # the key holder's copy: the same start for every copy
            self.tied.restart(self.optimizer, lambda *a: send_tied(self, *a))
        with self._sched.cond:
            self.trained = trained
            self._sched.pause(False)

    @property
    def trained_prefix(self) -> int:
        """Stage 0: data index below which every micro-batch is finished (a checkpoint's data_position)."""
        pending = [mb[1] for mb in self._inflight_data] + [i for i, _ in self._requeue]
        return min(pending, default=self.data_position)

    def before_weight_change(self) -> None:
        """Compute thread, before anything but the optimizer changes the weights in place (averaging,
        catch-up): forwards in flight keep the weights they ran at (``WeightStash.before_change``)."""
        self.forward_weights.before_change(bool(self._stash))

    def forget_weight_history(self) -> None:
        """After weights were replaced (catch-up): no cached forward weights, no last update to extrapolate."""
        self.forward_weights.forget()

    def queue_depths(self) -> dict[str, int]:
        return self._sched.depths()

    # ----------------------------------------------------------------- the compute thread
    def run(self, emit: Emit, should_abort: Callable[[], bool] = lambda: False) -> None:
        """Work until this stage has finished ``steps`` micro-batches (or was stopped and drained)."""
        self.should_abort, self._emit = should_abort, emit
        if self.tied is not None and not self.tied.announced:  # one start for every copy, whatever was loaded
            self.tied.restart(self.optimizer, lambda *a: send_tied(self, *a))
        self._sched.running = True
        try:
            while (work := self._sched.next(self, should_abort)) is not None:
                if self.stats.started_at is None:
                    self.stats.started_at = self.clock()
                kind, arg = work
                if kind == "control":
                    arg(self)
                elif kind == "start":
                    self._run_first_forward(emit)
                elif kind == "bwd":
                    self._run_backward(arg[0], arg[1], emit)
                elif kind == "eval":
                    self.recipe.evaluator.run(self, arg[0], arg[1], emit)
                else:
                    self._run_forward(arg[0], arg[1], emit)
            self._flush_update()
            if self.tied is not None:  # the copies end equal: every tied step this stage took part in is applied
                apply_tied(self, wait=lambda: not self.tied.settled())  # type: ignore[union-attr]
            self.recipe.finish(self)
        finally:
            with self._sched.cond:
                self._sched.running = False
                pending = self._sched.take_control()
            for fn in pending:  # submitted while run was ending: run them here rather than lose them
                fn(self)

    def waited(self, reason: str, seconds: float) -> None:
        """Count ``seconds`` the compute thread waited for ``reason`` (compute thread only; timed on
        ``clock``).  A wait inside a forward or backward (an update hook held back for an averaging
        round) is taken out of that phase's time, so ``busy_s`` stays compute."""
        self.stats.record_wait(reason, seconds, self.metrics)
        self._waited_in_op += seconds

    # ----------------------------------------------------------------- asked by the scheduler
    def may_start(self) -> bool:
        """Stage 0 holds a credit (fewer than ``max_inflight`` in flight, 1 while warming up) and has data left."""
        more = bool(self._requeue) or self.data_position < self.options.steps
        return (self.is_first and not self._sched.stopping and more
                and len(self._stash) < self.options.inflight_limit(self.version) and self.may_forward())

    def may_forward(self) -> bool:
        """Tied copies are no more than ``max_inflight - 1`` tied steps behind (``ravq.stage.tied_step``)."""
        return self.tied is None or not self.tied.behind()

    def finished(self) -> bool:
        """``steps`` micro-batches trained here (later stages: and stage 0 finished), or stopped and drained."""
        done = self.trained >= self.options.steps and (self.is_first or self.cluster_done())
        return (done or (self._sched.stopping and not self._stash)) and not self.recipe.unfinished(self)

    def idle_reason(self) -> str | None:
        """A wait now is for "credits" (stage 0 at ``max_inflight``) or "input"; None before training starts."""
        if self.stats.started_at is None:
            return None
        full = len(self._stash) >= self.options.inflight_limit(self.version)
        return "credits" if self.is_first and full else "input"

    def waited_idle(self, reason: str, seconds: float) -> None:
        self.waited(reason, seconds)
        self._waited_in_op = 0.0  # between operations: nothing to take out

    # ----------------------------------------------------------------- forward / backward
    def _forward(self, mb: MicroBatch, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Run the module on what the stage received; returns its outputs as a tuple (the raw output,
        e.g. the unsplit model's ModelOutput, is kept in ``self._raw_output`` for the last stage)."""
        weights = self.forward_weights.weights(self.version, self.options.predict_weights)
        leaves = [x.detach().to(self.device).requires_grad_(x.is_floating_point() and ref.stage >= 0)
                  for x, ref in zip(inputs, self.spec.received)]
        with torch.enable_grad(), self.recipe.autocast():
            out = functional_call(self.module, {**weights, **self.buffers}, tuple(leaves[: len(self.spec.inputs)]))
        self._raw_output = out if self.is_last else None
        outputs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        self._stash[mb] = Stashed(self.version, weights, leaves, outputs)
        self.stats.forwards += 1
        self.stats.inflight = len(self._stash)
        return outputs

    def fresh_buffers(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """New storage for these buffers, so an averaging round's change never reaches forwards in flight
        (``ravq.stage.stash.fresh_buffers``)."""
        return fresh_buffers(self.module, self.buffers, names)

    def _pack(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | Packed]:
        """Activations or gradients as they leave this stage: compressed unless ``compress`` is none."""
        fmt, block = self.options.compress, self.options.int8_block
        return {name: compress.pack(t, fmt, block) for name, t in tensors.items()}

    def _run_first_forward(self, emit: Emit) -> None:
        assert self.batches is not None
        if self._requeue:
            index, (inputs, targets) = self._requeue.popleft()
        else:
            inputs, targets = next(self.batches)
            index = self.data_position
            self.data_position += 1
        mb = (self.cluster, index)
        if not self.is_last:
            self._inflight_data[mb] = (inputs, targets)
        inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        parts = {0: {f"x{i}": x for i, x in enumerate(inputs)}}
        if self.is_last:
            self._run_last(mb, gather_inputs(self.spec, parts), targets, emit)
            return
        data = {dest: data_for(dest, inputs, targets, self.model_input_needs, self.num_stages)
                for dest in self._first_destinations()}
        self._forward_and_send(mb, parts, data, emit)

    def _first_destinations(self) -> list[int]:
        """Stages stage 0 sends to: consumers of its outputs, of model inputs, and the last stage."""
        return sorted(set(self.spec.consumer_stages) | {self.num_stages - 1} | set(self.model_input_needs))

    def _run_forward(self, mb: MicroBatch, parts: Parts, emit: Emit) -> None:
        if self.is_last:
            self._run_last(mb, gather_inputs(self.spec, parts), targets_of(parts[0]), emit)
            return
        self._forward_and_send(mb, parts, {dest: {} for dest in self.spec.consumer_stages}, emit)

    def _forward_and_send(self, mb: MicroBatch, parts: Parts, data: dict[int, dict[str, torch.Tensor]],
                          emit: Emit) -> None:
        """Forward, then send each stage in ``data`` the outputs it reads and its ``data`` (stage 0's
        model inputs and targets, never compressed)."""
        t0 = self.clock()
        outputs = self._forward(mb, gather_inputs(self.spec, parts))
        self._account("forward", t0)
        for dest, extra in data.items():
            tensors = {f"o{i}": outputs[i].detach() for i, users in self.spec.consumers.items() if dest in users}
            emit(Outbound("fwd", dest, mb, self.version, {**self._pack(tensors), **extra}, self.generation,
                          self.recipe.forward_meta()))

    def _run_last(self, mb: MicroBatch, inputs: list[torch.Tensor], targets: Any, emit: Emit) -> None:
        t0 = self.clock()
        self._forward(mb, inputs)
        stash = self._stash[mb]
        out = model_output(self.spec, self._raw_output, stash.inputs)
        self._raw_output = None
        targets = to_device(targets, self.device)
        with torch.enable_grad(), self.recipe.autocast():
            loss = self.loss_fn(out, targets)
        self._account("forward", t0)
        self.stats.record_loss(float(loss.detach()), self.metrics)
        t1 = self.clock()
        self._backward_from(mb, stash, [self.recipe.after_loss(self, mb, loss, out, targets)], [None], emit)
        self._account("backward", t1)

    def _run_backward(self, mb: MicroBatch, parts: Parts, emit: Emit) -> None:
        t0 = self.clock()
        stash = self._stash[mb]
        grads = output_grads(parts, stash.outputs, self.device)
        pairs = [(o, g) for o, g in zip(stash.outputs, grads) if g is not None and o.requires_grad]
        self._backward_from(mb, stash, [o for o, _ in pairs], [g for _, g in pairs], emit)
        self._account("backward", t0)

    def _backward_from(self, mb: MicroBatch, stash: Stashed, roots: list[torch.Tensor],
                       root_grads: list[torch.Tensor | None], emit: Emit) -> None:
        weight_grads, grad_of = stash.gradients(roots, root_grads)
        weight_grads, scale = self.recipe.unscale(mb, weight_grads)
        del self._stash[mb]
        if self._inflight_data.pop(mb, None) is not None:
            self.stats.record_completed(mb[1])
        self.stats.inflight = len(self._stash)
        due = self._grads.add(weight_grads, stash.version)
        if due and self.tied is not None:  # before the input-gradients: upstream holders need it first
            self.tied.contribute(lambda *a: send_tied(self, *a))
        meta = self.recipe.backward_meta(self, mb, due, scale)
        for producer, tensors in input_grads(self.spec, stash.inputs, grad_of).items():
            emit(Outbound("bwd", producer, mb, self.version, self._pack(tensors), self.generation, meta))
        self.stats.record_backward(self.options.micro_batch, self.metrics)
        self.trained += 1
        if due:
            self.recipe.step(self)

    def _step(self, versions: list[int] | None = None, skip: bool = False) -> None:  # skip: fp16 overflow
        for used in self._grads.take_versions() if versions is None else versions:
            staleness = self.version - used  # updates applied since this micro-batch's forward
            self.stats.record_staleness(staleness, self.metrics)
            self.forward_weights.recent_staleness.append(staleness)
        self.recipe.before_step(self)
        if not skip:
            self.forward_weights.step(self.optimizer, self.options.predict_weights, in_flight=bool(self._stash))
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        if self.tied is not None:
            apply_tied(self, wait=lambda: self.tied.primary_behind())  # type: ignore[union-attr]
        self.recipe.after_step(self)
        self.stats.record_update(self.version, self.metrics)
        if self.on_update is not None:
            self.on_update(self)

    def _flush_update(self) -> None:
        if self._grads.versions:
            if self.tied is not None:
                self.tied.contribute(lambda *a: send_tied(self, *a))
            self._step()

    def _account(self, phase: str, t0: float) -> None:
        """Count the forward or backward (``phase``) begun at ``t0``, less what it waited (``waited``)."""
        dt = max(0.0, self.clock() - t0 - self._waited_in_op)
        self._waited_in_op = 0.0
        self.stats.record_compute(phase, dt, self.metrics, len(self._stash))
