"""Evaluation over the pipeline: eval-mode stage graphs run on held-out micro-batches between training
micro-batches, without touching weights, stashes or credits.

Why a second graph: the stages are graphs traced from the model in training mode, and tracing bakes
the mode in (dropout is a ``dropout(x, p, train=True)`` call, BatchNorm a batch-statistics op), so
``stage.module.eval()`` changes nothing.  ``eval_stage_module`` traces a freshly built model in eval mode
with the same cuts, settles its ties as the training split does (a tied weight under the names the
training stage holds it by, ``ravq.cut.tied``) and points its parameters and buffers, every alias of a tie
included, at the training stage's tensors (no second copy of the weights); a forward passes the stage's
live weights and buffers by name anyway.

The round: every ``training.eval_every`` optimizer steps stage 0 takes the first ``eval_batches``
micro-batches of the task's ``eval_batches(micro_batch, seed)`` (the same held-out data every round, so
rounds compare; fewer if it ends sooner) and sends them down the pipeline as FORWARD messages marked ``eval``
(their own queue, ids ``round x eval_batches + j``); the round's last one also carries its size (``of``),
which each stage passes on, so every stage ends the round after as many as stage 0 sent.  Each stage runs
them, when they arrive, at its current weights, with no autograd; the last stage averages the loss and the
task's ``metrics_fn`` over the round.  With ``max_inflight: 1`` every stage is at stage 0's version when
the round reaches it (a stage applies the step before the forward that follows it), so the round evaluates
exactly the model of that version; with micro-batches in flight a later stage may be a step or so behind or
ahead, as its training forwards are.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from ravq.cut.materialize import materialize
from ravq.cut.meta import build_meta_model, retarget_device, to_meta
from ravq.cut.modules import replace_tensor
from ravq.cut.split import build_task_model, model_output
from ravq.cut.tied import settle_ties, tie_groups
from ravq.stage.state import Outbox, StagePlace, StageState
from ravq.stage.stats import StageStats
from ravq.stage.tensors import Parts, data_for, gather_inputs, targets_of, to_device
from ravq.stage.types import MicroBatch, RecipeOptions

log = logging.getLogger(__name__)


def eval_stage_module(task: Any, seed: int, example_args: tuple[Any, ...], cuts: list[str], stage: int,
                      train_module: nn.Module) -> nn.Module:
    """Stage ``stage``'s graph traced in eval mode from a fresh copy of the task's model (on ``meta``: torch's
    tracer leaves its split markers on a model it traced, so the training model cannot be traced again),
    its parameters and buffers then pointed at ``train_module``'s tensors (no second copy of the weights).
    A model without ``cuts`` is its own stage: its ties stay ties."""
    try:
        model, meta = build_meta_model(task, seed).model, True
    except Exception:  # noqa: BLE001 - a model that cannot be built on meta is traced with real weights
        model, meta = build_task_model(task, seed), False
    model.eval()
    if cuts:
        # imported here: torch's pipelining, export and dynamo take seconds to import (ravq.cut.split)
        from ravq.cut.trace import split_pipe

        groups = tie_groups(model)
        pipe = split_pipe(model, to_meta(example_args) if meta else example_args, cuts)
        modules = [pipe.get_stage_module(s) for s in range(len(cuts) + 1)]
        settle_ties(model, modules, groups)  # a tie under the names the training stage holds, no strays
        module = modules[stage]
    else:
        module = model
    # every name, a tie's aliases too: uncut, GPT-2's lm_head.weight must stay transformer.wte.weight
    live = {**dict(train_module.named_parameters(remove_duplicate=False)),
            **dict(train_module.named_buffers(remove_duplicate=False))}
    for name, _ in [*module.named_parameters(remove_duplicate=False),
                    *module.named_buffers(remove_duplicate=False)]:
        assert name in live, f"eval graph has {name}, which the training stage lacks"
        replace_tensor(module, name, live[name])
    if meta:  # the weights are the training stage's (no second copy); real values for anything else
        materialize(module, task, seed)
        retarget_device(module, "meta", next(iter(train_module.parameters()), torch.empty(0)).device)
    return module


@dataclass(frozen=True, kw_only=True, slots=True)
class Scoring:
    """How the last stage scores an eval micro-batch, and the recipe's part of every eval message."""

    loss_fn: Callable[[Any, Any], torch.Tensor]
    metrics_fn: Callable[[Any, Any], Any] | None
    """The task's ``metrics_fn(outputs, targets)``, averaged over a round; None: loss only."""
    autocast: Callable[[], AbstractContextManager[None]]
    forward_meta: Callable[[], dict[str, Any]]


class Evaluator:
    """One stage's side of evaluation (compute thread only)."""

    def __init__(self, options: RecipeOptions, *, place: StagePlace, state: StageState,
                 params: dict[str, nn.Parameter], buffers: dict[str, torch.Tensor], scoring: Scoring,
                 stats: StageStats, outbox: Outbox, micro_batch: int,
                 clock: Callable[[], float]) -> None:
        self.every, self.count, self.batches = options.eval_every, options.eval_count, options.eval_batches
        self.seed, self._micro_batch = options.seed, micro_batch
        self._place, self._state, self._scoring = place, state, scoring
        self._params, self._buffers = params, buffers
        self._stats, self._outbox, self._clock = stats, outbox, clock
        self.module: nn.Module | None = None
        """This stage's eval-mode graph (``attach``); None: evaluation is off."""
        self.seen: dict[int, int] = {}
        """Round -> eval micro-batches this stage has run of it."""
        self.sizes: dict[int, int] = {}
        """Round -> its micro-batches (at most ``count``: what the task's iterator gave), once known: stage 0
        knows it when the iterator ends, the others from the messages (``expect``)."""
        self.rounds_done = 0
        self._loss_sum: dict[int, float] = {}
        self._metric_sums: dict[int, dict[str, float]] = {}
        self.history: list[tuple[int, float]] = []
        """Last stage: (version evaluated, mean loss) of every finished round."""
        self.metrics: dict[str, float] = {}
        """Last stage: the task's metrics_fn averaged over the latest round."""

    def attach(self, module: nn.Module) -> None:
        """Evaluate with ``module`` (this stage's from ``eval_stage_module``), on the stage's device.  Stage 0
        refuses a held-out set without a micro-batch now, rather than at the first round."""
        held_out = self.batches if self._place.is_first and self.every > 0 else None
        if held_out is not None and next(iter(held_out(self._micro_batch, self.seed)), None) is None:
            raise ValueError("training.eval_every: the task's eval_batches(micro_batch, seed) yields no "
                             "micro-batch; give it held-out data or set eval_every: 0")
        self.module = module.to(self._place.device)

    @property
    def enabled(self) -> bool:
        return self.module is not None and self.every > 0

    def owed(self, version: int) -> bool:
        """Rounds up to ``version`` that this stage has not finished (it is not done until they are)."""
        return self.enabled and self.rounds_done < version // self.every

    def resume_at(self, version: int) -> None:
        """A checkpoint of ``version`` was loaded: the rounds up to it were the writer's, not owed here."""
        self.rounds_done = version // self.every if self.every > 0 else 0

    def forget_in_flight(self) -> None:
        """A pause cut the rounds in flight short: they are not waited for."""
        self.seen.clear()
        self.sizes.clear()
        self.rounds_done = 1 << 62

    def expect(self, round_: int, size: int) -> None:
        """A message said how many micro-batches ``round_`` has (control work, before that message runs)."""
        self.sizes[round_] = size

    def after_step(self) -> None:
        """Stage 0, after each optimizer step: start a round every ``every`` steps."""
        place, version = self._place, self._state.version
        if not (self.enabled and place.is_first and version % self.every == 0):
            return
        if self.batches is None:
            return
        round_ = version // self.every
        held_out = itertools.islice(self.batches(self._micro_batch, self.seed), self.count)
        for j, (inputs, targets), last in _marking_last(held_out):
            if last:  # the round's size is what the iterator gave (at most count): its last message says it
                self.sizes[round_] = j + 1
            mb = (place.cluster, round_ * self.count + j)
            inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
            parts: Parts = {0: {f"x{i}": x for i, x in enumerate(inputs)}}
            if place.is_last:
                self.run(mb, parts, targets=targets)
                continue
            data = {dest: data_for(dest, inputs, targets, place.model_input_needs, place.num_stages)
                    for dest in place.first_destinations()}
            self._forward_and_send(mb, parts, data)

    def run(self, mb: MicroBatch, parts: Parts, targets: Any = None) -> None:
        """An eval micro-batch arrived (or stage 0 made one): forward it, send it on or score it."""
        spec = self._place.spec
        if not self._place.is_last:
            self._forward_and_send(mb, parts, {dest: {} for dest in spec.consumer_stages})
            return
        inputs = gather_inputs(spec, parts)
        out = self._forward(inputs)
        targets = to_device(targets_of(parts[0]) if targets is None else targets, self._place.device)
        full = model_output(spec, out, inputs)  # what the unsplit model returns
        scoring = self._scoring
        with torch.no_grad(), scoring.autocast():
            loss = float(scoring.loss_fn(full, targets))
            scores = dict(scoring.metrics_fn(full, targets)) if scoring.metrics_fn else {}
        round_ = mb[1] // self.count
        self._loss_sum[round_] = self._loss_sum.get(round_, 0.0) + loss
        sums = self._metric_sums.setdefault(round_, {})
        for name, value in scores.items():
            sums[name] = sums.get(name, 0.0) + float(value)
        self._count(round_)

    def _forward(self, inputs: list[torch.Tensor]) -> Any:
        assert self.module is not None
        names = {n for n, _ in [*self.module.named_parameters(), *self.module.named_buffers()]}
        weights = {n: t for n, t in {**self._params, **self._buffers}.items() if n in names}
        args = tuple(x.to(self._place.device) for x in inputs[: len(self._place.spec.inputs)])
        t0 = self._clock()
        with torch.no_grad(), self._scoring.autocast():
            out = functional_call(self.module, weights, args)
        # busy, not waiting (the forward/backward statistics stay training's)
        self._stats.record_busy("eval", self._clock() - t0)
        return out

    def _forward_and_send(self, mb: MicroBatch, parts: Parts,
                          data: dict[int, dict[str, torch.Tensor]]) -> None:
        spec = self._place.spec
        out = self._forward(gather_inputs(spec, parts))
        outputs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        round_ = mb[1] // self.count
        for dest, extra in data.items():
            tensors = {f"o{i}": outputs[i] for i, users in spec.consumers.items() if dest in users}
            size = {"of": self.sizes[round_]} if round_ in self.sizes else {}
            self._outbox.send("eval", dest, mb[1], {**self._outbox.pack(tensors), **extra},
                              {**self._scoring.forward_meta(), "eval": round_, **size})
        self._count(round_)

    def _count(self, round_: int) -> None:
        """One more micro-batch of ``round_`` run here; the round ends with the last of its size."""
        self.seen[round_] = self.seen.get(round_, 0) + 1
        size = self.sizes.get(round_)
        if size is None or self.seen[round_] < size:
            return
        del self.seen[round_], self.sizes[round_]
        self.rounds_done += 1
        if not self._place.is_last:
            return
        loss = self._loss_sum.pop(round_) / size
        self.metrics = {k: v / size for k, v in self._metric_sums.pop(round_, {}).items()}
        self.history.append((round_ * self.every, loss))
        self._stats.record_recipe({"eval_loss": loss, "eval_loss_first": self.history[0][1],
                                   "eval_version": round_ * self.every, "eval_metrics": dict(self.metrics),
                                   "eval_history": [list(h) for h in self.history[-64:]]})
        if (metrics := self._stats.metrics) is not None:
            metrics.eval_loss.set(loss)
            metrics.evaluations.inc()
            for name, value in self.metrics.items():
                metrics.eval_metric.labels(name).set(value)
        log.info("stage %d: eval at step %d: loss %.4f %s", self._place.spec.index, round_ * self.every, loss,
                 " ".join(f"{k} {v:.4f}" for k, v in self.metrics.items()))


def _marking_last(items: Iterator[Any]) -> Iterator[tuple[int, Any, bool]]:
    """(index, item, whether it is the last) of every item, reading one ahead."""
    end = object()
    ahead = next(items, end)
    for j in itertools.count():
        if ahead is end:
            return
        item, ahead = ahead, next(items, end)
        yield j, item, ahead is end
