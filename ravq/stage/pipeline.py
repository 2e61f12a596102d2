"""The asynchronous stage: one stage's weights, forwards, backwards and updates, and its control surface.

No sockets here.  A ``StageWorker`` owns one stage's weights and optimizer and runs in the node's single
compute thread.  The event loop hands it arrivals with ``deliver``; it hands back what must be sent
through an ``emit`` callback.  Stage 0 reads the data (``ravq.stage.feed``) and holds the credits that
bound the micro-batches in flight (``max_inflight``), which bounds both stashed memory and staleness.
Its parts: ``ravq.stage.state`` holds what it is and what it keeps between micro-batches,
``ravq.stage.schedule`` picks the next work (backward before forward), ``ravq.stage.arrivals`` screens
what arrives, forwards run at stashed weights (``ravq.stage.stash``), messages' tensors are named and
checked as ``ravq.stage.tensors`` says, ``ravq.stage.stats`` counts the work, ``ravq.stage.recipe``
does the rest of training and ``ravq.stage.tied_step`` keeps tied copies equal.  Each part gets what
it uses when the worker builds it; none of them holds the worker.

Churn: a micro-batch is named by its index in stage 0's data, and every message carries the cluster
*generation* it belongs to.  When a member of the cluster is lost, every stage ``pause``s and
``reset``s: it drops the work in flight (stashes, partial parts; stage 0 gets its credits back and
re-queues the dropped micro-batches, which are trained again under the same index) and keeps its
weights and optimizer.  ``resume`` sets the count of finished micro-batches to stage 0's, so every
stage agrees on what is left.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ravq.codec.compress import Packed
from ravq.cut.split import StageSpec
from ravq.stage.arrivals import Arrivals
from ravq.stage.delay import compensates, has_momentum, raw_second_moment
from ravq.stage.feed import Batch, DataFeed, DataSource
from ravq.stage.passes import Passes
from ravq.stage.pipenag import uses_lookahead
from ravq.stage.recipe import Recipe, build_optimizer, expected_at
from ravq.stage.schedule import Scheduler
from ravq.stage.stash import GradientSum, WeightStash, fresh_buffers
from ravq.stage.state import Emit, OpTimer, Outbox, StagePlace, StageState
from ravq.stage.stats import StageStats
from ravq.stage.tensors import expected_forward, forward_sources
from ravq.stage.tied_stage import TiedStep
from ravq.stage.tied_step import TiedExchange
from ravq.stage.types import MicroBatch, StageOptions

if TYPE_CHECKING:
    from ravq.metrics import Metrics

UpdateHook = Callable[["StageWorker"], None]
"""Runs in the compute thread after each optimizer step (``subscribe_updates``)."""


class StageWorker:
    """One stage's torch state and schedule.  All methods but ``deliver``/``stop`` run in the
    compute thread."""

    def __init__(self, spec: StageSpec, num_stages: int,
                 optimizer_factory: Callable[..., torch.optim.Optimizer],
                 loss_fn: Callable[[Any, Any], torch.Tensor], options: StageOptions,
                 device: torch.device | str = "cpu", batches: Iterator[Batch] | DataSource | None = None,
                 cluster: int = 0, metrics: Metrics | None = None,
                 model_input_needs: dict[int, list[int]] | None = None,
                 input_specs: list[tuple[torch.Size, torch.dtype]] | None = None,
                 target_example: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.options, self.loss_fn = options, loss_fn
        self.clock = clock
        """Seconds, monotonic: every duration the stage counts (compute, waits, wall) is read off it."""
        needs = model_input_needs or {}
        self.place = place = StagePlace(spec=spec, num_stages=num_stages, cluster=cluster,
                                        device=torch.device(device), model_input_needs=needs)
        # the place's fields under the names callers use
        self.spec, self.num_stages, self.cluster, self.device = spec, num_stages, cluster, place.device
        self.is_first, self.is_last = place.is_first, place.is_last
        self.model_input_needs = place.model_input_needs
        self.module = spec.module.to(self.device)
        self.params: dict[str, nn.Parameter] = dict(self.module.named_parameters())
        self.buffers: dict[str, torch.Tensor] = dict(self.module.named_buffers())
        self.optimizer = build_optimizer(optimizer_factory, self.params)
        if not has_momentum(self.optimizer) and (options.predict_weights or options.extrapolate_gradients):
            # both forecast from the last update or gradient: only a momentum makes that say where the next go
            self.options = options = replace(options, predict_weights=0.0, extrapolate_gradients=0.0)
        assert not self.is_first or batches is not None, "stage 0 reads the data"
        self._feed = DataFeed(batches) if self.is_first and batches is not None else None
        expected = expected_forward(spec, num_stages, input_specs, target_example)
        self.state = StageState(expected_fwd=expected_at(options.recipe.precision, expected))
        self.stats = StageStats(clock=clock, metrics=metrics)
        stale = options.max_inflight > 1 and not options.synchronous  # else no gradient is ever stale
        lookahead = stale and uses_lookahead(options.stale_correction, self.optimizer, options.update_every)
        if options.extrapolate_gradients and stale and not compensates(
                self.optimizer, lookahead, options.inflight_warmup_steps > 0):
            # Adam under PipeNAG after the warm-up: compensation would only shorten its steps (stage.delay)
            self.options = options = replace(options, extrapolate_gradients=0.0)
        extrapolate = options.extrapolate_gradients * stale
        raw_v = raw_second_moment(self.optimizer, lookahead, options.inflight_warmup_steps > 0)
        self.forward_weights = WeightStash(self.params, extrapolate, lookahead, reuse_update=not spec.tied,
                                           raw_second_moment=raw_v)
        self._grads = GradientSum(self.params, options.update_every)
        self._sched = Scheduler(forward_sources(spec, num_stages), spec.consumer_stages,
                                4 * options.max_inflight + 4, clock,
                                eval_round=options.recipe.eval_count if options.recipe.eval_every else 0)
        self._timer = OpTimer(clock)
        self.outbox = Outbox(self.state, cluster, options.compress, options.int8_block)
        self._cluster_done: Callable[[], bool] = lambda: True
        self._update_hooks: list[UpdateHook] = []
        self.should_abort: Callable[[], bool] = lambda: False
        """Whether the process is giving up (set by ``run``); hooks that block check it."""
        every_name = dict(self.module.named_parameters(remove_duplicate=False))
        lag = 1 if options.synchronous else options.max_inflight  # 1: every forward sees every tied update
        self.recipe = Recipe(options, place=self.place, state=self.state, optimizer=self.optimizer,
                             params=self.params, buffers=self.buffers, grads=self._grads, loss_fn=loss_fn,
                             stats=self.stats, outbox=self.outbox, timer=self._timer, feed=self._feed,
                             step=self._step, submit=self._sched.submit)
        """LR schedule, precision, clipping, evaluation, metrics (``ravq.stage.recipe``)."""
        tied = TiedExchange(spec.index, spec.tied, every_name, lag) if spec.tied else None
        self.tied = tied
        """This stage's copies of tied weights (``ravq.stage.tied_step``), or None."""
        self.tied_step = None if self.tied is None else TiedStep(
            self.tied, optimizer=self.optimizer, params=self.params, outbox=self.outbox,
            submit=self._sched.submit, before_change=self.before_weight_change,
            changed=self.forward_weights.invalidate, waited=self.waited,
            should_abort=lambda: self.should_abort(), clock=clock,
            factor=self.recipe.step_applied, norms=self.recipe.exchange is not None,
            interrupted=lambda: self.should_abort() or self._sched.paused)
        self._arrivals = Arrivals(self.place, self.state, self._sched, self.recipe)
        self.passes = Passes(options, place=self.place, state=self.state, module=self.module,
                             buffers=self.buffers, weights=self.forward_weights, grads=self._grads,
                             loss_fn=loss_fn, recipe=self.recipe, stats=self.stats, outbox=self.outbox,
                             timer=self._timer, feed=self._feed, tied_step=self.tied_step)
        """A micro-batch's forward and backward (``ravq.stage.passes``)."""

    # ----------------------------------------------------------------- what the stage is and holds
    @property
    def version(self) -> int:
        """Optimizer steps applied to the weights (or the version of the copy they were loaded from)."""
        return self.state.version

    @property
    def trained(self) -> int:
        """Micro-batches finished (backward done here); set to stage 0's count at every resume."""
        return self.state.trained

    @property
    def generation(self) -> int:
        return self.state.generation

    @property
    def paused(self) -> bool:
        """No new micro-batch starts (set by ``pause`` and ``reset``, cleared by ``resume``)."""
        return self._sched.paused

    @property
    def metrics(self) -> Metrics | None:
        return self.stats.metrics

    @metrics.setter
    def metrics(self, metrics: Metrics | None) -> None:
        self.stats.report_to(metrics)

    def first_destinations(self) -> list[int]:
        """Stages stage 0 sends to: consumers of its outputs, of model inputs, and the last stage."""
        return self.place.first_destinations()

    # ----------------------------------------------------------------- set up by the node
    def subscribe_updates(self, fn: UpdateHook) -> Callable[[], None]:
        """Run ``fn(self)`` after each optimizer step, in the compute thread, after the subscribers before
        it; returns what unsubscribes it."""
        self._update_hooks.append(fn)
        return lambda: self._update_hooks.remove(fn)

    def join_cluster(self, *, generation: int, paused: bool, cluster_done: Callable[[], bool]) -> None:
        """Before ``run``: the cluster's generation and phase, and whether its stage 0 finished (later
        stages keep serving until then: a pause may ask for redos)."""
        self.state.set_generation(generation)
        self._sched.pause(paused)
        self._cluster_done = cluster_done

    def restore(self, *, version: int, trained: int, data_position: int) -> None:
        """Its checkpoint's weights and optimizer state loaded: its version, the micro-batches trained
        (counted towards ``steps``) and, on stage 0, its place in the data."""
        self.state.set_counts(version=version, trained=trained)
        self.stats.restore(trained)
        self.recipe.evaluator.resume_at(version)
        if self._feed is not None:
            self._feed.skip_to(data_position)

    def adopt_version(self, version: int) -> None:
        """Compute thread: the weights were replaced by a holder's copy of ``version`` (catch-up)."""
        self.state.set_counts(version=version)

    # ----------------------------------------------------------------- called from the event loop
    def deliver(self, kind: str, micro_batch: MicroBatch, source: int,
                tensors: dict[str, torch.Tensor | Packed], meta: dict[str, Any] | None = None) -> str | None:
        """An arrived message and its header ``meta`` (``ravq.stage.arrivals``): None if queued, else why
        not."""
        if kind == "tied":
            if self.tied_step is None:
                return "unexpected_tied"
            return self.tied_step.deliver(micro_batch, source, tensors)
        return self._arrivals.deliver(kind, micro_batch, source, tensors, meta or {})

    def submit(self, fn: Callable[[StageWorker], None]) -> None:
        """Run ``fn(self)`` in the compute thread before any further forward or backward."""
        self._sched.submit(lambda: fn(self))

    def call(self, fn: Callable[[StageWorker], None]) -> bool:
        """``submit`` if ``run`` is working (True); False if not: the caller runs ``fn`` itself."""
        return self._sched.call(lambda: fn(self))

    def run_pending(self) -> None:
        """Run control work submitted after ``run`` returned (e.g. the last averaging round's result)."""
        for fn in self._sched.take_control():
            fn()

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
            self._sched.pause()
            self.state.set_generation(generation)
            self.passes.drain()  # their input-gradients went upstream: those micro-batches may finish
            dropped = len(self.state.stash)
            self.state.stash.clear()
            self._sched.clear_parts()
            if self._feed is not None:
                self._feed.requeue_in_flight()
            self.stats.record_inflight(0)
            if self.tied is not None:
                self.tied.reset()
            self.recipe.forget_in_flight()
        return dropped

    def resume(self, trained: int) -> None:
        """Compute thread: train again, counting ``trained`` micro-batches as finished."""
        if self.tied_step is not None:  # the key holder's copy: the same start for every copy
            self.tied_step.restart()
        with self._sched.cond:
            self.state.set_counts(trained=trained)
            self._sched.pause(False)

    @property
    def trained_prefix(self) -> int:
        """Stage 0: data index below which every micro-batch is finished (a checkpoint's data_position)."""
        return 0 if self._feed is None else self._feed.trained_prefix()

    def before_weight_change(self) -> None:
        """Compute thread, before anything but the optimizer changes the weights in place (averaging,
        catch-up): forwards in flight keep the weights they ran at (``WeightStash.before_change``)."""
        self.forward_weights.before_change(bool(self.state.stash))

    def forget_weight_history(self) -> None:
        """After weights were replaced (catch-up): no cached forward weights, no last update to
        extrapolate."""
        self.forward_weights.forget()

    def queue_depths(self) -> dict[str, int]:
        return self._sched.depths()

    # ----------------------------------------------------------------- the compute thread
    def run(self, emit: Emit, should_abort: Callable[[], bool] = lambda: False) -> None:
        """Work until this stage has finished ``steps`` micro-batches (or was stopped and drained)."""
        self.should_abort = should_abort
        self.outbox.connect(emit)
        if self.tied_step is not None and not self.tied_step.exchange.announced:  # one start for every copy
            self.tied_step.restart()
        self._sched.running = True
        try:
            while (work := self._sched.next(self, should_abort)) is not None:
                self.stats.started()
                kind, arg = work
                if kind == "control":
                    arg()
                elif kind == "start":
                    self.passes.start(emit)
                elif kind == "bwd":
                    self.passes.backward(arg[0], arg[1], emit)
                elif kind == "weights":
                    self.passes.run_weights()
                elif kind == "eval":
                    self.recipe.evaluator.run(arg[0], arg[1])
                else:
                    self.passes.forward(arg[0], arg[1], emit)
            self._flush_update()
            if self.tied_step is not None:  # the copies end equal: every tied step it took part in is applied
                tied = self.tied_step.exchange
                self.tied_step.apply(wait=lambda: not tied.settled())
            self.recipe.finish()
        finally:
            with self._sched.cond:
                self._sched.running = False
                pending = self._sched.take_control()
            for fn in pending:  # submitted while run was ending: run them here rather than lose them
                fn()

    def waited(self, reason: str, seconds: float) -> None:
        """Count ``seconds`` the compute thread waited for ``reason`` (compute thread only; timed on
        ``clock``).  A wait inside a forward or backward (an update hook held back for an averaging
        round) is taken out of that phase's time, so ``busy_s`` stays compute."""
        self.stats.record_wait(reason, seconds)
        self._timer.waited(seconds)

    # ----------------------------------------------------------------- asked by the scheduler
    def may_start(self) -> bool:
        """Stage 0 holds a credit (fewer than ``max_inflight`` in flight, 1 while warming up) and has data
        left."""
        more = self._feed is not None and self._feed.has_more(self.options.steps)
        return (self.is_first and not self._sched.stopping and more
                and len(self.state.stash) < self.options.inflight_limit(self.version) and self.may_forward()
                and (not self.options.synchronous  # 1F1B's flush: this update's micro-batches only
                     or len(self._grads.versions) + len(self.state.stash) + self.passes.deferred
                     < self.options.update_every))

    def may_forward(self) -> bool:
        """Tied copies are no more than ``max_inflight - 1`` tied steps behind (``ravq.stage.tied_step``);
        synchronous (``training.schedule: sync``): no step of this stage waits for its global norm."""
        synced = not (self.options.synchronous and self.recipe.holding())
        return synced and (self.tied is None or not self.tied.behind())

    def has_deferred(self) -> bool:
        """Weight passes wait (``training.schedule: zero_bubble``)."""
        return self.passes.deferred > 0

    def finished(self) -> bool:
        """``steps`` micro-batches trained here (later stages: and stage 0 finished), or stopped and
        drained."""
        done = self.trained >= self.options.steps and (self.is_first or self._cluster_done())
        return (done or (self._sched.stopping and not self.state.stash)) and not self.recipe.unfinished()

    def idle_reason(self) -> str | None:
        """A wait now is for "credits" (stage 0 at ``max_inflight``) or "input"; None before training
        starts."""
        if self.stats.started_at is None:
            return None
        full = len(self.state.stash) >= self.options.inflight_limit(self.version)
        return "credits" if self.is_first and full else "input"

    def waited_idle(self, reason: str, seconds: float) -> None:
        self.waited(reason, seconds)
        self._timer.clear()  # between operations: nothing to take out

    # ----------------------------------------------------------------- updates
    def fresh_buffers(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """New storage for these buffers, so an averaging round's change never reaches forwards in flight
        (``ravq.stage.stash.fresh_buffers``)."""
        return fresh_buffers(self.module, self.buffers, names)

    def _step(self, versions: list[int] | None = None, skip: bool = False) -> None:  # skip: fp16 overflow
        for used in self._grads.take_versions() if versions is None else versions:
            staleness = self.version - used  # updates applied since this micro-batch's forward
            self.stats.record_staleness(staleness)
            self.forward_weights.record_staleness(staleness)
        self.recipe.before_step()
        if not skip:
            in_flight = bool(self.state.stash)
            self.forward_weights.step(self.optimizer, self.options.predict_weights, in_flight=in_flight)
        self.optimizer.zero_grad(set_to_none=True)
        self.state.count_step()
        if self.tied_step is not None:
            self.tied_step.apply(wait=self.tied_step.exchange.primary_behind)
        self.recipe.after_step()
        self.stats.record_update(self.version)
        for hook in list(self._update_hooks):
            hook(self)

    def _flush_update(self) -> None:
        self.passes.drain()
        if self._grads.versions:
            self._grads.finish()
            if self.tied_step is not None:
                self.tied_step.contribute()  # a last partial step: never clipped, as the stage's own
            self._step()

