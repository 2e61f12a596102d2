"""Evaluation over the pipeline: eval-mode stage graphs run on held-out micro-batches between training
micro-batches, without touching weights, stashes or credits.

Why a second graph: the stages are graphs traced from the model in training mode, and tracing bakes
the mode in (dropout is a ``dropout(x, p, train=True)`` call, BatchNorm a batch-statistics op), so
``stage.module.eval()`` changes nothing.  ``eval_stage_modules`` traces a freshly built model in eval mode
with the same cuts and points its parameters and buffers at the training stage's tensors (no second
copy of the weights); a forward passes the stage's live weights and buffers by name anyway.

The round: every ``training.eval_every`` optimizer steps stage 0 takes the first ``eval_batches``
micro-batches of the task's ``eval_batches(micro_batch, seed)`` (the same held-out data every round, so
rounds compare) and sends them down the pipeline as FORWARD messages marked ``eval`` (their own queue,
ids ``round x eval_batches + j``).  Each stage runs them, when they arrive, at its current weights, with
no autograd; the last stage averages the loss and the task's ``metrics_fn`` over the round.  With
``max_inflight: 1`` every stage is at stage 0's version when the round reaches it (a stage applies the
step before the forward that follows it), so the round evaluates exactly the model of that version; with
micro-batches in flight a later stage may be a step or so behind or ahead, as its training forwards are.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from ravq.cut.materialize import materialize
from ravq.cut.meta import build_meta_model, retarget_device, to_meta
from ravq.cut.split import build_task_model, model_output
from ravq.stage.tensors import Parts, data_for, gather_inputs, targets_of, to_device
from ravq.stage.types import MicroBatch, Outbound

log = logging.getLogger(__name__)
StageWorker = Any
"""``ravq.stage.pipeline.StageWorker`` (it imports this module, not the other way round)."""


def eval_stage_module(task: Any, seed: int, example_args: tuple[Any, ...], cuts: list[str], stage: int,
                      train_module: nn.Module) -> nn.Module:
    """Stage ``stage``'s graph traced in eval mode from a fresh copy of the task's model (on ``meta``: torch's
    tracer leaves its split markers on a model it traced, so the training model cannot be traced again),
    its parameters and buffers then pointed at ``train_module``'s tensors (no second copy of the weights)."""
    try:
        model, meta = build_meta_model(task, seed).model, True
    except Exception:  # noqa: BLE001 - a model that cannot be built on meta is traced with real weights
        model, meta = build_task_model(task, seed), False
    model.eval()
    if cuts:
        # imported here: torch's pipelining, export and dynamo take seconds to import (ravq.cut.split)
        from ravq.cut.trace import split_pipe

        pipe = split_pipe(model, to_meta(example_args) if meta else example_args, cuts)
        module = pipe.get_stage_module(stage)
    else:
        module = model
    live = {**dict(train_module.named_parameters()), **dict(train_module.named_buffers())}
    for name, _ in [*module.named_parameters(), *module.named_buffers()]:
        owner, _, leaf = name.rpartition(".")
        sub = module.get_submodule(owner) if owner else module
        table = sub._parameters if leaf in sub._parameters else sub._buffers
        assert name in live, f"eval graph has {name}, which the training stage lacks"
        table[leaf] = live[name]
    if meta:  # the weights are the training stage's (no second copy); real values for anything else
        materialize(module, task, seed)
        retarget_device(module, "meta", next(iter(train_module.parameters()), torch.empty(0)).device)
    return module


def attach(worker: StageWorker, module: nn.Module) -> None:
    """Evaluate with ``module`` (this stage's from ``eval_stage_modules``), on the stage's device."""
    worker.recipe.evaluator.module = module.to(worker.device)


class Evaluator:
    """One stage's side of evaluation (compute thread only)."""

    def __init__(self, every: int, count: int, batches: Callable[[int, int], Any] | None, seed: int) -> None:
        self.every, self.count, self.batches, self.seed = every, count, batches, seed
        self.module: nn.Module | None = None
        """This stage's eval-mode graph (``eval_stage_modules``); None: evaluation is off."""
        self.seen: dict[int, int] = {}
        """Round -> eval micro-batches this stage has run of it."""
        self.rounds_done = 0
        self._loss_sum: dict[int, float] = {}
        self._metric_sums: dict[int, dict[str, float]] = {}
        self.history: list[tuple[int, float]] = []
        """Last stage: (version evaluated, mean loss) of every finished round."""
        self.metrics: dict[str, float] = {}
        """Last stage: the task's metrics_fn averaged over the latest round."""

    @property
    def enabled(self) -> bool:
        return self.module is not None and self.every > 0

    def owed(self, version: int) -> bool:
        """Rounds up to ``version`` that this stage has not finished (it is not done until they are)."""
        return self.enabled and self.rounds_done < version // self.every

    def after_step(self, worker: StageWorker, emit: Callable[[Outbound], None]) -> None:
        """Stage 0, after each optimizer step: start a round every ``every`` steps."""
        if not (self.enabled and worker.is_first and worker.version % self.every == 0):
            return
        if self.batches is None:
            return
        round_ = worker.version // self.every
        for j, (inputs, targets) in enumerate(itertools.islice(self.batches(worker.options.micro_batch, self.seed),
                                                               self.count)):
            mb = (worker.cluster, round_ * self.count + j)
            inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
            parts: Parts = {0: {f"x{i}": x for i, x in enumerate(inputs)}}
            if worker.is_last:
                self.run(worker, mb, parts, emit, targets=targets)
                continue
            data = {dest: data_for(dest, inputs, targets, worker.model_input_needs, worker.num_stages)
                    for dest in worker._first_destinations()}
            self._forward_and_send(worker, mb, parts, data, emit)

    def run(self, worker: StageWorker, mb: MicroBatch, parts: Parts, emit: Callable[[Outbound], None],
            targets: Any = None) -> None:
        """An eval micro-batch arrived (or stage 0 made one): forward it, send it on or score it."""
        if worker.is_last:
            inputs = gather_inputs(worker.spec, parts)
            out = self._forward(worker, inputs)
            targets = to_device(targets_of(parts[0]) if targets is None else targets, worker.device)
            full = model_output(worker.spec, out, inputs)  # what the unsplit model returns
            with torch.no_grad(), worker.recipe.autocast():
                loss = float(worker.loss_fn(full, targets))
                scores = dict(worker.recipe.metrics_fn(full, targets)) if worker.recipe.metrics_fn else {}
            round_ = mb[1] // self.count
            self._loss_sum[round_] = self._loss_sum.get(round_, 0.0) + loss
            sums = self._metric_sums.setdefault(round_, {})
            for name, value in scores.items():
                sums[name] = sums.get(name, 0.0) + float(value)
            self._count(worker, round_)
            return
        self._forward_and_send(worker, mb, parts, {dest: {} for dest in worker.spec.consumer_stages}, emit)

    def _forward(self, worker: StageWorker, inputs: list[torch.Tensor]) -> Any:
        assert self.module is not None
        names = {n for n, _ in [*self.module.named_parameters(), *self.module.named_buffers()]}
        weights = {n: t for n, t in {**worker.params, **worker.buffers}.items() if n in names}
        args = tuple(x.to(worker.device) for x in inputs[: len(worker.spec.inputs)])
        t0 = worker.clock()
        with torch.no_grad(), worker.recipe.autocast():
            out = functional_call(self.module, weights, args)
        seconds = worker.clock() - t0  # busy, not waiting (the forward/backward statistics stay training's)
        worker.stats.busy_s += seconds
        if worker.metrics is not None:
            worker.metrics.compute_seconds.labels("eval").observe(seconds)
            worker.metrics.busy_seconds.inc(seconds)
        return out

    def _forward_and_send(self, worker: StageWorker, mb: MicroBatch, parts: Parts,
                          data: dict[int, dict[str, torch.Tensor]], emit: Callable[[Outbound], None]) -> None:
        out = self._forward(worker, gather_inputs(worker.spec, parts))
        outputs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        round_ = mb[1] // self.count
        for dest, extra in data.items():
            tensors = {f"o{i}": outputs[i] for i, users in worker.spec.consumers.items() if dest in users}
            emit(Outbound("eval", dest, mb, worker.version, {**worker._pack(tensors), **extra}, worker.generation,
                          {**worker.recipe.forward_meta(), "eval": round_}))
        self._count(worker, round_)

    def _count(self, worker: StageWorker, round_: int) -> None:
        self.seen[round_] = self.seen.get(round_, 0) + 1
        if self.seen[round_] < self.count:
            return
        del self.seen[round_]
        self.rounds_done += 1
        if not worker.is_last:
            return
        loss = self._loss_sum.pop(round_) / self.count
        self.metrics = {k: v / self.count for k, v in self._metric_sums.pop(round_, {}).items()}
        self.history.append((round_ * self.every, loss))
        worker.stats.recipe.update({"eval_loss": loss, "eval_loss_first": self.history[0][1],
                                    "eval_version": round_ * self.every, "eval_metrics": dict(self.metrics),
                                    "eval_history": [list(h) for h in self.history[-64:]]})
        if worker.metrics is not None:
            worker.metrics.eval_loss.set(loss)
            worker.metrics.evaluations.inc()
            for name, value in self.metrics.items():
                worker.metrics.eval_metric.labels(name).set(value)
        log.info("stage %d: eval at step %d: loss %.4f %s", worker.spec.index, round_ * self.every, loss,
                 " ".join(f"{k} {v:.4f}" for k, v in self.metrics.items()))
