"""A stage's training recipe around its optimizer step: named-parameter optimizers, the learning-rate
schedule, mixed precision, global-norm clipping and training metrics (docs/training.md).

``Recipe`` is the one object ``ravq.stage.pipeline.StageWorker`` asks at the points of a micro-batch's
life where a recipe matters (autocast around forwards and the loss, the loss scale, the gradients at
the end of a step, the optimizer step itself, the fields its messages carry); the parts live in
``ravq.stage.lr``, ``ravq.stage.precision`` and ``ravq.stage.clip``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ravq.config import TrainingConfig
from ravq.stage.clip import Applied, NormExchange, clip_factor
from ravq.stage.evaluate import Evaluator, Scoring
from ravq.stage.feed import DataFeed
from ravq.stage.lr import LRSchedule, ScheduleSpec, lr_lambda
from ravq.stage.precision import LossScale, autocast_for
from ravq.stage.stash import GradientSum
from ravq.stage.state import OpTimer, Outbox, StagePlace, StageState
from ravq.stage.stats import StageStats
from ravq.stage.tensors import Expected
from ravq.stage.types import MicroBatch, RecipeOptions, StageOptions

Step = Callable[[list[int] | None, bool], None]
"""The stage's optimizer step (``StageWorker``): step(versions of its backwards or None: those summed,
skip: an fp16 overflow, no update)."""
Submit = Callable[[Callable[[], None]], None]
"""Runs work in the compute thread before any further forward or backward (``Scheduler.submit``)."""

log = logging.getLogger(__name__)


def build_optimizer(make_optimizer: Callable[..., torch.optim.Optimizer],
                    params: dict[str, nn.Parameter]) -> torch.optim.Optimizer:
    """The task's optimizer over ``params``: ``make_optimizer(named_params=[(name, parameter), ...])`` when
    its signature names ``named_params`` (so a task can build decay groups by name), else
    ``make_optimizer(parameters)``.  Names are the unsplit model's."""
    try:
        wants_names = "named_params" in inspect.signature(make_optimizer).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        wants_names = False
    if wants_names:
        return make_optimizer(named_params=list(params.items()))
    return make_optimizer(params.values())


def recipe_options(task: Any, training: TrainingConfig, seed: int = 0) -> RecipeOptions:
    """The recipe a topology's training settings and the task's optional ``lr_lambda`` and ``metrics_fn``
    make."""
    sched = training.lr_schedule
    total = sched.total_steps or -(-training.steps // training.update_every)
    if sched.kind != "task" and sched.warmup_steps >= total and sched.kind != "constant":
        raise ValueError(f"training.lr_schedule.warmup_steps: must be below the run's {total} optimizer "
                         f"steps, got {sched.warmup_steps}")
    task_lambda = getattr(task, "lr_lambda", None)
    factor = None
    if sched.kind != "constant":
        factor = lr_lambda(ScheduleSpec(sched.kind, sched.warmup_steps, total, sched.min_lr_ratio),
                           task_lambda if callable(task_lambda) else None)
    metrics_fn, eval_batches = getattr(task, "metrics_fn", None), getattr(task, "eval_batches", None)
    if training.eval_every and not callable(eval_batches):
        raise ValueError(f"training.eval_every: {training.eval_every} needs the task to define "
                         "eval_batches(micro_batch, seed)")
    return RecipeOptions(precision=training.precision, lr_lambda=factor,
                         clip_grad_norm=training.clip_grad_norm,
                         metrics_fn=metrics_fn if callable(metrics_fn) else None,
                         eval_every=training.eval_every, eval_count=training.eval_batches,
                         eval_batches=eval_batches if callable(eval_batches) else None, seed=seed)


def expected_at(precision: str, expected: dict[int, Expected]) -> dict[int, Expected]:
    """The forward tensors a stage expects under ``precision``: with autocast (bf16, fp16) activations
    arrive in whatever float dtype autocast gave their last op, so their dtype is not checked."""
    if precision == "fp32":
        return expected
    return {src: {name: (shape, None if name[0] == "o" and dtype is not None and dtype.is_floating_point
                         else dtype)
                  for name, (shape, dtype) in names.items()}
            for src, names in expected.items()}


class Recipe:
    """One stage's recipe state; every method runs in the compute thread unless it says otherwise."""

    def __init__(self, options: StageOptions, *, place: StagePlace, state: StageState,
                 optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter],
                 buffers: dict[str, torch.Tensor], grads: GradientSum,
                 loss_fn: Callable[[Any, Any], torch.Tensor],
                 stats: StageStats, outbox: Outbox, timer: OpTimer, feed: DataFeed | None, step: Step,
                 submit: Submit) -> None:
        opts = options.recipe
        self.precision, self.max_norm, self.metrics_fn = opts.precision, opts.clip_grad_norm, opts.metrics_fn
        self.device = place.device
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"training.precision: must be fp32, bf16 or fp16, got {self.precision!r}")
        self._place, self._state, self._optimizer = place, state, optimizer
        self._params, self._grads = params, grads
        self._stats, self._outbox, self._timer, self._feed = stats, outbox, timer, feed
        self._step, self._submit = step, submit
        self.lr = LRSchedule(optimizer, opts.lr_lambda) if opts.lr_lambda is not None else None
        self.exchange: NormExchange | None = None
        if self.max_norm is not None or self.precision == "fp16":
            if not place.is_first and not place.spec.producer_stages:
                raise ValueError(f"training.clip_grad_norm/precision fp16: stage {place.spec.index} sends no "
                                 "gradients back (it reads model inputs only), so its gradient norm cannot "
                                 "reach stage 0; cut the model elsewhere")
            self.exchange = NormExchange(place.spec.index, place.num_stages, 4 * options.max_inflight + 8)
        self._relay_norms = place.is_first and not place.is_last and options.max_inflight > 1
        self.loss_scale = LossScale() if self.precision == "fp16" and place.is_last else None
        self.grad_norm: float | None = None
        """The global gradient norm of the last step applied here (before clipping)."""
        self.applied: deque[tuple[int, float]] = deque(maxlen=1024)
        """(step, clipping factor) of the steps applied here, newest last (every stage's agree)."""
        self._by_step: OrderedDict[int, Applied] = OrderedDict()
        """The newest steps applied here, by name (for the tied steps that follow them)."""
        self._by_step_limit = 4 * options.max_inflight + 8
        self._metric_sums: dict[str, float] = {}
        self._metric_count = 0
        self.train_metrics: dict[str, float] = {}
        """The task's ``metrics_fn`` averaged over the micro-batches of the last step (last stage)."""
        scoring = Scoring(loss_fn=loss_fn, metrics_fn=self.metrics_fn, autocast=self.autocast,
                          forward_meta=self.forward_meta)
        self.evaluator = Evaluator(opts, place=place, state=state, params=params, buffers=buffers,
                                   scoring=scoring, stats=stats, outbox=outbox,
                                   micro_batch=options.micro_batch, clock=timer.clock)
        """Evaluation rounds (``ravq.stage.evaluate``); on once ``evaluator.attach`` gave it a module."""

    # ----------------------------------------------------------------- forwards and the loss
    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        with autocast_for(self.precision, self.device):
            yield

    def after_loss(self, mb: MicroBatch, loss: torch.Tensor, out: Any, targets: Any) -> torch.Tensor:
        """The last stage's loss, scaled for backward (fp16); records the task's training metrics."""
        if self.metrics_fn is not None:
            with torch.no_grad():
                for name, value in dict(self.metrics_fn(out, targets)).items():
                    self._metric_sums[name] = self._metric_sums.get(name, 0.0) + float(value)
            self._metric_count += 1
        if self.loss_scale is None:
            return loss
        assert self.exchange is not None
        self.exchange.set_scale(mb[1], self.loss_scale.scale)
        return loss * self.loss_scale.scale

    # ----------------------------------------------------------------- backwards and steps
    @property
    def scales_apart(self) -> bool:
        """fp16: each micro-batch's weight gradients are divided by its own loss scale (``unscale``), so they
        are taken apart rather than added to the sum by autograd."""
        return self.exchange is not None and self.precision == "fp16"

    def unscale(self, mb: MicroBatch, grads: dict[str, torch.Tensor | None]
                ) -> tuple[dict[str, torch.Tensor | None], float | None]:
        """fp16: the micro-batch's weight gradients divided by the loss scale its loss used."""
        if self.exchange is None or self.precision != "fp16":
            return grads, None
        scale = self.exchange.scale_of(mb[1])
        assert scale is not None, f"no loss scale for micro-batch {mb}"
        return {n: None if g is None else g / scale for n, g in grads.items()}, scale

    def backward_meta(self, mb: MicroBatch, due: bool, scale: float | None,
                      tied_sq: float = 0.0) -> dict[str, Any]:
        """The fields of this micro-batch's backward messages; at the end of a step, holds its gradients
        and adds this stage's squared norm (with ``tied_sq``: the tied weights it counts,
        ``TiedStep.contribute``)."""
        meta: dict[str, Any] = {} if scale is None else {"ls": scale}
        if self.exchange is not None and due:
            grads = {n: p.grad for n, p in self._params.items()}
            for p in self._params.values():
                p.grad = None
            meta.update(self.exchange.hold(mb[1], grads, self._grads.take_versions(), tied_sq))
        return meta

    def step(self, name: int) -> None:
        """The step named ``name`` has its backwards done here (its backward messages sent): step now, or
        (exchanging norms) once its global norm is known.  Stage 0 knows it now; with micro-batches in
        flight it also sends the norm on at once, on a message of its own, rather than only on its next
        forward (see ``send_tail``)."""
        if self.exchange is None:
            self._record(name, Applied())
            self._step(None, False)
            return
        if self._relay_norms:
            self.send_tail(self._place.first_destinations())
        self.apply_ready()

    def step_applied(self, step: int) -> Applied | None:
        """How this stage applied the step named ``step``, once it has (None before): its tied step is scaled,
        skipped and stepped at the same learning rates (``ravq.stage.tied_step``)."""
        return self._by_step.get(step)

    def apply_ready(self) -> None:
        """Apply every held step whose global norm is known, in order, scaled by the clipping factor."""
        assert self.exchange is not None
        params, metrics = self._params, self._stats.metrics
        for step, held, total_sq in self.exchange.ready():
            coef = clip_factor(total_sq, self.max_norm)
            self.applied.append((step, coef))
            finite = math.isfinite(total_sq)
            partial = {n: p.grad for n, p in params.items()}  # the next step's backwards so far
            for n, p in params.items():
                g = held.grads.get(n)
                p.grad = None if g is None else (g.mul_(coef) if coef != 1.0 else g)
            self.grad_norm = math.sqrt(total_sq) if finite else math.inf
            if metrics is not None and finite:
                metrics.grad_norm.set(self.grad_norm)
            self._record(step, Applied(coef, finite))
            self._step(held.versions, not finite)
            for n, p in params.items():
                p.grad = partial[n]
            if self.loss_scale is not None:
                self.loss_scale.update(finite)
                if metrics is not None:
                    metrics.loss_scale.set(self.loss_scale.scale)

    def _record(self, name: int, how: Applied) -> None:
        """How the step named ``name`` is applied, with the learning rates it runs at, before it runs (its
        tied step may run inside it)."""
        if self.lr is not None:
            self.lr.apply(self._state.version)  # what ``before_step`` sets again
        lrs = tuple(float(g["lr"]) for g in self._optimizer.param_groups)
        self._by_step[name] = replace(how, lrs=lrs)
        while len(self._by_step) > self._by_step_limit:
            self._by_step.popitem(last=False)

    def before_step(self) -> None:
        """Set the step's learning rates (the schedule's factor of the stage's version); publish them and
        the step's training metrics."""
        if self.lr is not None:
            self.lr.apply(self._state.version)
        lr = float(self._optimizer.param_groups[0]["lr"])
        report: dict[str, Any] = {"lr": lr}
        metrics = self._stats.metrics
        if metrics is not None:
            metrics.learning_rate.set(lr)
        if self.grad_norm is not None:
            report["grad_norm"] = self.grad_norm if math.isfinite(self.grad_norm) else None
        if self._metric_count:
            self.train_metrics = {k: v / self._metric_count for k, v in self._metric_sums.items()}
            self._metric_sums, self._metric_count = {}, 0
            report["train_metrics"] = dict(self.train_metrics)
            if metrics is not None:
                for name, value in self.train_metrics.items():
                    metrics.train_metric.labels(name).set(value)
        self._stats.record_recipe(report)

    def after_step(self) -> None:
        """After the optimizer step that made the stage's version: stage 0 starts an evaluation round
        when due."""
        self.evaluator.after_step()

    def holding(self) -> bool:
        """Steps wait here for their global norm (clipping)."""
        return self.exchange is not None and bool(self.exchange.held)

    def unfinished(self) -> bool:
        """Steps wait here for their global norm, or evaluation rounds are owed (the stage is not done)."""
        return self.holding() or self.evaluator.owed(self._state.version)

    def screen(self, kind: str, mb: MicroBatch, meta: dict[str, Any]) -> tuple[str, str | None]:
        """Event loop, the stage's lock held: (the queue an arrival goes to, None) to queue it, or (kind,
        why it is refused), or (kind, "") when the recipe took it (a tail of norms)."""
        if "eval" in meta or kind == "eval":
            if type(meta.get("eval")) is not int or kind == "bwd" or not self.evaluator.enabled:
                return kind, "unexpected_message"
            if "of" in meta and not (type(meta["of"]) is int and 1 <= meta["of"] <= self.evaluator.count):
                return kind, "bad_meta"
            kind = "eval"
        if self.exchange is None:
            return kind, None
        bad = self.exchange.check(kind, meta)
        if bad is None and kind == "fwd" and meta.get("tail") is True:
            self.exchange.receive(kind, mb[1], meta)
            self._submit(lambda: self.on_norms(tail=True))
            return kind, ""
        return kind, bad

    def received(self, kind: str, mb: MicroBatch, meta: dict[str, Any]) -> None:
        """Event loop: an arrival was queued; record its norms (and apply the steps they complete), or the
        size of its evaluation round (before the compute thread runs it)."""
        if kind == "eval" and "of" in meta:
            round_, size = meta["eval"], meta["of"]
            self._submit(lambda: self.evaluator.expect(round_, size))
        direction = "bwd" if kind == "bwd" else "fwd"
        if self.exchange is not None and self.exchange.receive(direction, mb[1], meta):
            self._submit(lambda: self.on_norms(tail=False))

    def forget_in_flight(self) -> None:
        """A pause dropped the work in flight: what arrived for it is void, evaluation rounds it cut short
        are not waited for, and the steps applied are forgotten (a re-queued micro-batch names a new step
        as an old one was named: the new count's tied step waits for the new step, ``step_applied``)."""
        if self.exchange is not None:
            self.exchange.forget_received()
        self.evaluator.forget_in_flight()
        self._by_step.clear()

    # ----------------------------------------------------------------- messages
    def forward_meta(self) -> dict[str, Any]:
        return {} if self.exchange is None else {"norms": self.exchange.norms_meta()}

    def on_norms(self, tail: bool) -> None:
        """Global norms arrived (control work): apply the steps they complete; relay a tail message.  The
        steps' time counts as busy (inside a backward it would have; waits in the update hook do not)."""
        t0 = self._timer.restart()
        self.apply_ready()
        self._stats.record_busy("step", self._timer.elapsed(t0))
        if tail and not self._place.is_last:
            self.send_tail(self._place.spec.consumer_stages)

    def send_tail(self, dests: list[int]) -> None:
        """The norms this stage knows, on a message without tensors: stage 0's after each step when
        micro-batches are in flight (``step``) and after its last step (nothing follows to carry them),
        relayed by each stage."""
        meta = {**self.forward_meta(), "tail": True}
        position = 0 if self._feed is None else self._feed.position
        for dest in dests:
            self._outbox.send("fwd", dest, position, {}, meta)

    def finish(self) -> None:
        """End of stage 0's run: send the norms its last forwards could not carry."""
        if self.exchange is not None and self._place.is_first and not self._place.is_last:
            self.send_tail(self._place.first_destinations())
