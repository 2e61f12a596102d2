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
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ravq.config import TrainingConfig
from ravq.stage.clip import NormExchange, clip_factor
from ravq.stage.evaluate import Evaluator
from ravq.stage.lr import LRSchedule, ScheduleSpec, lr_lambda
from ravq.stage.precision import LossScale, autocast_for
from ravq.stage.types import MicroBatch, Outbound, RecipeOptions

StageWorker = Any
"""``ravq.stage.pipeline.StageWorker`` (the pipeline imports this module, not the other way round)."""

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
    """The recipe a topology's training settings and the task's optional ``lr_lambda`` and ``metrics_fn`` make."""
    sched = training.lr_schedule
    total = sched.total_steps or -(-training.steps // training.update_every)
    if sched.kind != "task" and sched.warmup_steps >= total and sched.kind != "constant":
        raise ValueError(f"training.lr_schedule.warmup_steps: must be below the run's {total} optimizer steps, "
                         f"got {sched.warmup_steps}")
    task_lambda = getattr(task, "lr_lambda", None)
    factor = None
    if sched.kind != "constant":
        factor = lr_lambda(ScheduleSpec(sched.kind, sched.warmup_steps, total, sched.min_lr_ratio),
                           task_lambda if callable(task_lambda) else None)
    metrics_fn, eval_batches = getattr(task, "metrics_fn", None), getattr(task, "eval_batches", None)
    if training.eval_every and not callable(eval_batches):
        raise ValueError(f"training.eval_every: {training.eval_every} needs the task to define "
                         "eval_batches(micro_batch, seed)")
    return RecipeOptions(precision=training.precision, lr_lambda=factor, clip_grad_norm=training.clip_grad_norm,
                         metrics_fn=metrics_fn if callable(metrics_fn) else None, eval_every=training.eval_every,
                         eval_count=training.eval_batches, eval_batches=eval_batches if callable(eval_batches) else None,
                         seed=seed)


class Recipe:
    """One stage's recipe state; every method runs in the compute thread unless it says otherwise."""

    def __init__(self, worker: StageWorker) -> None:
        opts = worker.options.recipe
        self.precision, self.max_norm, self.metrics_fn = opts.precision, opts.clip_grad_norm, opts.metrics_fn
        self.device = worker.device
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"training.precision: must be fp32, bf16 or fp16, got {self.precision!r}")
        if self.precision != "fp32":  # activations arrive in whatever float dtype autocast gave their last op
            worker._expected_fwd = {src: {name: (shape, None if name[0] == "o" and dtype.is_floating_point else dtype)
                                          for name, (shape, dtype) in names.items()}
                                    for src, names in worker._expected_fwd.items()}
        self.lr = LRSchedule(worker.optimizer, opts.lr_lambda) if opts.lr_lambda is not None else None
        self.exchange: NormExchange | None = None
        if self.max_norm is not None or self.precision == "fp16":
            if not worker.is_first and not worker.spec.producer_stages:
                raise ValueError(f"training.clip_grad_norm/precision fp16: stage {worker.spec.index} sends no "
                                 "gradients back (it reads model inputs only), so its gradient norm cannot reach "
                                 "stage 0; cut the model elsewhere")
            self.exchange = NormExchange(worker.spec.index, worker.num_stages, 4 * worker.options.max_inflight + 8)
        self.loss_scale = LossScale() if self.precision == "fp16" and worker.is_last else None
        self.grad_norm: float | None = None
        """The global gradient norm of the last step applied here (before clipping)."""
        self.applied: deque[tuple[int, float]] = deque(maxlen=1024)
        """(step, clipping factor) of the steps applied here, newest last (every stage's agree)."""
        self._metric_sums: dict[str, float] = {}
        self._metric_count = 0
        self.train_metrics: dict[str, float] = {}
        """The task's ``metrics_fn`` averaged over the micro-batches of the last step (last stage)."""
        self.evaluator = Evaluator(opts.eval_every, opts.eval_count, opts.eval_batches, opts.seed)
        """Evaluation rounds (``ravq.stage.evaluate``); on once ``evaluator.module`` is set."""

    # ----------------------------------------------------------------- forwards and the loss
    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        with autocast_for(self.precision, self.device):
            yield

    def after_loss(self, worker: StageWorker, mb: MicroBatch, loss: torch.Tensor, out: Any,
                   targets: Any) -> torch.Tensor:
        """The last stage's loss, scaled for backward (fp16); records the task's training metrics."""
        if self.metrics_fn is not None:
            with torch.no_grad():
                for name, value in dict(self.metrics_fn(out, targets)).items():
                    self._metric_sums[name] = self._metric_sums.get(name, 0.0) + float(value)
            self._metric_count += 1
        if self.loss_scale is None:
            return loss
        assert self.exchange is not None
        with self.exchange.lock:
            self.exchange.scales[mb[1]] = self.loss_scale.scale
        return loss * self.loss_scale.scale

    # ----------------------------------------------------------------- backwards and steps
    def unscale(self, mb: MicroBatch, grads: dict[str, torch.Tensor | None]
                ) -> tuple[dict[str, torch.Tensor | None], float | None]:
        """fp16: the micro-batch's weight gradients divided by the loss scale its loss used."""
        if self.exchange is None or self.precision != "fp16":
            return grads, None
        scale = self.exchange.scale_of(mb[1])
        assert scale is not None, f"no loss scale for micro-batch {mb}"
        return {n: None if g is None else g / scale for n, g in grads.items()}, scale

    def backward_meta(self, worker: StageWorker, mb: MicroBatch, due: bool, scale: float | None) -> dict[str, Any]:
        """The fields of this micro-batch's backward messages; at the end of a step, holds its gradients
        and adds this stage's squared norm."""
        meta: dict[str, Any] = {} if scale is None else {"ls": scale}
        if self.exchange is not None and due:
            grads = {n: p.grad for n, p in worker.params.items()}
            for p in worker.params.values():
                p.grad = None
            meta.update(self.exchange.hold(mb[1], grads, worker._grads.take_versions()))
        return meta

    def step(self, worker: StageWorker) -> None:
        """A step's backwards are done here: step now, or (exchanging norms) when its global norm is known."""
        if self.exchange is None:
            worker._step()
        else:
            self.apply_ready(worker)

    def apply_ready(self, worker: StageWorker) -> None:
        """Apply every held step whose global norm is known, in order, scaled by the clipping factor."""
        assert self.exchange is not None
        for step, held, total_sq in self.exchange.ready():
            coef = clip_factor(total_sq, self.max_norm)
            self.applied.append((step, coef))
            finite = math.isfinite(total_sq)
            partial = {n: p.grad for n, p in worker.params.items()}  # the next step's backwards so far
            for n, p in worker.params.items():
                g = held.grads.get(n)
                p.grad = None if g is None else (g.mul_(coef) if coef != 1.0 else g)
            self.grad_norm = math.sqrt(total_sq) if finite else math.inf
            if worker.metrics is not None and finite:
                worker.metrics.grad_norm.set(self.grad_norm)
            worker._step(held.versions, skip=not finite)
            for n, p in worker.params.items():
                p.grad = partial[n]
            if self.loss_scale is not None:
                self.loss_scale.update(finite)
                if worker.metrics is not None:
                    worker.metrics.loss_scale.set(self.loss_scale.scale)

    def before_step(self, worker: StageWorker) -> None:
        """Set the step's learning rates (the schedule's factor of ``worker.version``); publish them and the
        step's training metrics."""
        if self.lr is not None:
            self.lr.apply(worker.version)
        lr = float(worker.optimizer.param_groups[0]["lr"])
        worker.stats.recipe["lr"] = lr
        if worker.metrics is not None:
            worker.metrics.learning_rate.set(lr)
        if self.grad_norm is not None:
            worker.stats.recipe["grad_norm"] = self.grad_norm if math.isfinite(self.grad_norm) else None
        if self._metric_count:
            self.train_metrics = {k: v / self._metric_count for k, v in self._metric_sums.items()}
            self._metric_sums, self._metric_count = {}, 0
            worker.stats.recipe["train_metrics"] = dict(self.train_metrics)
            if worker.metrics is not None:
                for name, value in self.train_metrics.items():
                    worker.metrics.train_metric.labels(name).set(value)

    def after_step(self, worker: StageWorker) -> None:
        """After the optimizer step that made ``worker.version``: stage 0 starts an evaluation round when due."""
        self.evaluator.after_step(worker, worker._emit)

    def unfinished(self, worker: StageWorker) -> bool:
        """Steps wait here for their global norm, or evaluation rounds are owed (the stage is not done)."""
        held = self.exchange is not None and bool(self.exchange.held)
        return held or self.evaluator.owed(worker.version)

    def screen(self, worker: StageWorker, kind: str, mb: MicroBatch, meta: dict[str, Any]) -> tuple[str, str | None]:
        """Event loop, the stage's lock held: (the queue an arrival goes to, None) to queue it, or (kind,
        why it is refused), or (kind, "") when the recipe took it (a tail of norms)."""
        if "eval" in meta or kind == "eval":
            if type(meta.get("eval")) is not int or kind == "bwd" or not self.evaluator.enabled:
                return kind, "unexpected_message"
            kind = "eval"
        if self.exchange is None:
            return kind, None
        bad = self.exchange.check(kind, meta)
        if bad is None and kind == "fwd" and meta.get("tail") is True:
            self.exchange.receive(kind, mb[1], meta)
            worker.submit(lambda w: w.recipe.on_norms(w, tail=True))
            return kind, ""
        return kind, bad

    def received(self, worker: StageWorker, kind: str, mb: MicroBatch, meta: dict[str, Any]) -> None:
        """Event loop: an arrival was queued; record its norms (and apply the steps they complete)."""
        if self.exchange is not None and self.exchange.receive("bwd" if kind == "bwd" else "fwd", mb[1], meta):
            worker.submit(lambda w: w.recipe.on_norms(w, tail=False))

    def forget_in_flight(self) -> None:
        """A pause dropped the work in flight: what arrived for it is void, and evaluation rounds it cut
        short are not waited for."""
        if self.exchange is not None:
            self.exchange.forget_received()
        self.evaluator.seen.clear()
        self.evaluator.rounds_done = 1 << 62

    # ----------------------------------------------------------------- messages
    def forward_meta(self) -> dict[str, Any]:
        return {} if self.exchange is None else {"norms": self.exchange.norms_meta()}

    def on_norms(self, worker: StageWorker, tail: bool) -> None:
        """Global norms arrived (control work): apply the steps they complete; relay a tail message.  The
        steps' time counts as busy (inside a backward it would have; waits in the update hook do not)."""
        t0, worker._waited_in_op = worker.clock(), 0.0
        self.apply_ready(worker)
        seconds = max(0.0, worker.clock() - t0 - worker._waited_in_op)
        worker._waited_in_op = 0.0
        worker.stats.busy_s += seconds
        if worker.metrics is not None:
            worker.metrics.compute_seconds.labels("step").observe(seconds)
            worker.metrics.busy_seconds.inc(seconds)
        if tail and not worker.is_last:
            self.send_tail(worker, worker.spec.consumer_stages)

    def send_tail(self, worker: StageWorker, dests: list[int]) -> None:
        """The norms of the last steps, on a message without tensors (nothing follows to carry them)."""
        meta = {**self.forward_meta(), "tail": True}
        for dest in dests:
            worker._emit(Outbound("fwd", dest, (worker.cluster, worker.data_position), worker.version, {},
                                worker.generation, meta))

    def finish(self, worker: StageWorker) -> None:
        """End of stage 0's run: send the norms its last forwards could not carry."""
        if self.exchange is not None and worker.is_first and not worker.is_last:
            self.send_tail(worker, worker._first_destinations())
