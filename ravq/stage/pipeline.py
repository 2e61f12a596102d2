"""The asynchronous stage: weight stashing, backward-before-forward scheduling, per-stage updates.

No sockets here.  A ``StageWorker`` owns one stage's weights and optimizer and runs in the node's
single compute thread.  The event loop hands it arrivals with ``deliver``; it hands back what must
be sent through an ``emit`` callback.  Stage 0 reads the data and holds the credits that bound the
micro-batches in flight (``max_inflight``), which bounds both stashed memory and staleness.

Weight stashing (PipeDream): a forward runs on a snapshot of the weights of the current version,
taken once per version and shared by every micro-batch that used it, so the gradient of micro-batch
m is the gradient at exactly the weights its forward saw, however many updates happen in between.

Churn: a micro-batch is named by its index in stage 0's data, and every message carries the cluster
*generation* it belongs to.  When a member of the cluster is lost, every stage ``pause``s and
``reset``s: it drops the work in flight (stashes, partial parts; stage 0 gets its credits back and
re-queues the dropped micro-batches, which are trained again under the same index) and keeps its
weights and optimizer.  ``resume`` sets the count of finished micro-batches to stage 0's, so every
stage agrees on what is left.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from ravq.net import compress
from ravq.net.compress import DEFAULT_BLOCK, Format, Packed
from ravq.stage.split import StageSpec, model_output

log = logging.getLogger(__name__)

MicroBatch = tuple[int, int]
LOSS_WINDOW = 10
HISTORY = 100_000
PREDICTION_WINDOW = 64
"""Backwards whose mean staleness sets how far ``predict_weights`` extrapolates."""


def _mean(values: Any) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


@dataclass(slots=True)
class Outbound:
    """A message the stage wants sent: ``kind`` "fwd" or "bwd" to stage ``dest``."""

    kind: str
    dest: int
    micro_batch: MicroBatch
    version: int
    tensors: dict[str, torch.Tensor | Packed]
    """Activations and gradients packed when the stage compresses (``StageOptions.compress``)."""
    generation: int = 0
    """The cluster generation the work belongs to; work of an older generation is never sent."""


@dataclass(kw_only=True, slots=True)
class StageStats:
    forwards: int = 0
    backwards: int = 0
    updates: int = 0
    samples: int = 0
    busy_s: float = 0.0
    """Forward and backward compute only: waits inside them (``wait_s``) are taken out."""
    wait_s: dict[str, float] = field(default_factory=dict)
    """Seconds waited instead of computing, by reason: "input" (no activations or gradients to work
    on), "credits" (stage 0 at ``max_inflight``), "averaging" (held back for an averaging round),
    "checkpoint" (writing one)."""
    forward_s: float = 0.0
    backward_s: float = 0.0
    forward_sq_s: float = 0.0
    """Sum of squared forward durations (with forward_s and forwards: their spread, for ``ravq simulate``)."""
    backward_sq_s: float = 0.0
    forward_step_sq_s: float = 0.0
    """Sum of squared differences of consecutive forward durations from the second on (the first warms
    up): the part of their spread that changes from one micro-batch to the next (slow drift cancels)."""
    forward_last_s: float | None = None
    staleness_sum: int = 0
    staleness_max: int = 0
    loss_last: float | None = None
    loss_first: float | None = None
    loss_sum: float = 0.0
    losses: int = 0
    started_at: float | None = None
    inflight: int = 0
    loss_head: list[float] = field(default_factory=list)
    """The first LOSS_WINDOW losses (for a steadier initial loss than one micro-batch)."""
    loss_tail: deque[float] = field(default_factory=lambda: deque(maxlen=LOSS_WINDOW))
    loss_history: list[float] = field(default_factory=list)
    """Every micro-batch's loss, in order (last stage only; written to the summary, not heartbeats)."""
    update_times: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    """Wall-clock time of the latest optimizer steps (summary only: shows how long a stage stalled)."""
    completed: list[int] = field(default_factory=list)
    """Stage 0: data index of each micro-batch finished, in order (the first HISTORY; summary only)."""

    def snapshot(self) -> dict[str, Any]:
        wall = time.monotonic() - self.started_at if self.started_at else 0.0
        return {
            "forwards": self.forwards, "backwards": self.backwards, "updates": self.updates,
            "samples": self.samples, "busy_s": self.busy_s, "wall_s": wall,
            "busy_fraction": self.busy_s / wall if wall > 0 else 0.0, "wait_s": dict(self.wait_s),
            "staleness_mean": self.staleness_sum / self.backwards if self.backwards else 0.0,
            "staleness_max": self.staleness_max, "loss": self.loss_last, "loss_first": self.loss_first,
            "loss_initial": _mean(self.loss_head), "loss_recent": _mean(self.loss_tail),
            "inflight": self.inflight, "forward_s": self.forward_s, "backward_s": self.backward_s,
            "forward_sq_s": self.forward_sq_s, "backward_sq_s": self.backward_sq_s,
            "forward_step_sq_s": self.forward_step_sq_s,
        }


@dataclass(kw_only=True, slots=True)
class StageOptions:
    steps: int
    """Micro-batches this cluster trains on."""
    max_inflight: int
    update_every: int = 1
    micro_batch: int = 1
    predict_weights: float = 0.0
    """Run each forward at weights extrapolated along the last update by this many times the stage's
    recent mean staleness (see ``StageWorker._weights``); 0 runs it at the current weights.  The last
    update and the staleness window are not checkpointed: after a resume the forwards run unpredicted
    until the first update, so with staleness > 0 a resume is not bit-exact (an asynchronous resume is
    not anyway: the micro-batches in flight start over).  With max_inflight 1 it stays exact."""
    compress: Format = Format.NONE
    """How activations and gradients leave this stage (``ravq.net.compress``); model inputs and targets never
    are compressed, and what arrives compressed is restored to the dtype this stage expects."""
    int8_block: int = DEFAULT_BLOCK


@dataclass(slots=True)
class _Stash:
    version: int
    params: dict[str, torch.Tensor]
    inputs: list[torch.Tensor]
    """Leaves for everything the stage received (``StageSpec.received``), in that order."""
    outputs: tuple[torch.Tensor, ...]


class StageWorker:
    """One stage's torch state and schedule.  All methods but ``deliver``/``stop`` run in the
    compute thread."""

    def __init__(self, spec: StageSpec, num_stages: int, optimizer_factory: Callable[..., torch.optim.Optimizer],
                 loss_fn: Callable[[Any, Any], torch.Tensor], options: StageOptions,
                 device: torch.device | str = "cpu", batches: Iterator[Any] | None = None,
                 cluster: int = 0, metrics: Any = None,
                 model_input_needs: dict[int, list[int]] | None = None,
                 input_specs: list[tuple[torch.Size, torch.dtype]] | None = None,
                 target_example: Any = None) -> None:
        self.spec, self.num_stages, self.options = spec, num_stages, options
        self.device = torch.device(device)
        self.module = spec.module.to(self.device)
        self.params: dict[str, nn.Parameter] = dict(self.module.named_parameters())
        self.buffers: dict[str, torch.Tensor] = dict(self.module.named_buffers())
        self.optimizer = optimizer_factory(self.params.values())
        self.loss_fn, self.batches, self.cluster, self.metrics = loss_fn, batches, cluster, metrics
        self.is_first, self.is_last = spec.index == 0, spec.index == num_stages - 1
        self.model_input_needs = model_input_needs or {}
        assert not self.is_first or batches is not None, "stage 0 reads the data"
        self.version = 0
        self.data_position = 0  # micro-batches stage 0 has taken from its iterator
        self.trained = 0
        """Micro-batches finished (backward done here); set to stage 0's count at every resume."""
        self.generation = 0
        self.paused = False
        self.running = False
        """True while ``run`` works: control work submitted now runs in the compute thread."""
        self.cluster_done: Callable[[], bool] = lambda: True
        """Whether stage 0 finished (later stages keep serving until then: a pause may ask for redos)."""
        self._requeue: deque[tuple[int, Any]] = deque()
        """Stage 0: dropped micro-batches (index, batch), trained again before new data."""
        self._inflight_data: dict[MicroBatch, Any] = {}
        """Stage 0: the batch of each micro-batch in flight, to re-queue it if the pause drops it."""
        self.stats = StageStats()
        self._snapshot: tuple[int, dict[str, torch.Tensor]] | None = None
        self._last_update: dict[str, torch.Tensor] | None = None
        """Each parameter's change in the last optimizer step (for ``predict_weights``)."""
        self._recent_staleness: deque[int] = deque(maxlen=PREDICTION_WINDOW)
        self._stash: dict[MicroBatch, _Stash] = {}
        self._pending_staleness: list[int] = []
        self._accumulated = 0
        self._forward_parts: OrderedDict[MicroBatch, dict[int, dict[str, torch.Tensor | Packed]]] = OrderedDict()
        self._backward_parts: OrderedDict[MicroBatch, dict[int, dict[str, torch.Tensor | Packed]]] = OrderedDict()
        self._control: list[Callable[[StageWorker], None]] = []
        self._cond = threading.Condition()
        self._stopping = False
        self.on_update: Callable[[StageWorker], None] | None = None
        self._waited_in_op = 0.0
        """Seconds of the current forward or backward spent waiting (``waited``), not computing."""
        self.should_abort: Callable[[], bool] = lambda: False
        """Whether the process is giving up (set by ``run``); hooks that block check it."""
        self._fwd_sources = self._forward_sources()
        self._expected_fwd = self._expected_forward(input_specs, target_example)
        self._raw_output: Any = None

    # ----------------------------------------------------------------- called from the event loop
    def deliver(self, kind: str, micro_batch: MicroBatch, source: int,
                tensors: dict[str, torch.Tensor | Packed]) -> str | None:
        """Hand over an arrived message.  Returns None if accepted, else why it was refused (the
        caller counts and drops it): nothing unexpected ever reaches torch.  A packed tensor is checked
        by the shape and dtype it restores to (its descriptor's, sizes verified by ``ravq.net.wire``) and
        restored in the compute thread."""
        forward = kind == "fwd"
        parts = self._forward_parts if forward else self._backward_parts
        sources = self._fwd_sources if forward else self.spec.consumer_stages
        with self._cond:
            if source not in sources:
                return "unexpected_source"
            if source in parts.get(micro_batch, {}):
                return "duplicate"
            if forward:
                if micro_batch in self._stash or micro_batch[0] != self.cluster:
                    return "unexpected_micro_batch"
                reason = _check_tensors(tensors, self._expected_fwd.get(source, {}), exact=True)
            else:
                stash = self._stash.get(micro_batch)
                if stash is None:
                    return "unexpected_micro_batch"
                allowed = {f"g{i}": (stash.outputs[i].shape, stash.outputs[i].dtype)
                           for i, users in self.spec.consumers.items() if source in users}
                reason = _check_tensors(tensors, allowed, exact=False)
            if reason is not None:
                return reason
            if len(parts) >= 4 * self.options.max_inflight + 4:
                return "queue_full"
            parts.setdefault(micro_batch, {})[source] = tensors
            self._cond.notify()
        return None

    def _expected_forward(self, input_specs: list[tuple[torch.Size, torch.dtype]] | None,
                          target_example: Any) -> dict[int, dict[str, tuple[torch.Size, torch.dtype]]]:
        expected: dict[int, dict[str, tuple[torch.Size, torch.dtype]]] = {s: {} for s in self._fwd_sources}
        if input_specs is None:
            return {}
        for ref, spec in zip(self.spec.received, input_specs):
            name = f"x{ref.index}" if ref.stage < 0 else f"o{ref.index}"
            expected.setdefault(max(ref.stage, 0), {})[name] = spec
        if self.is_last and not self.is_first and target_example is not None:
            targets = target_example if isinstance(target_example, (tuple, list)) else (target_example,)
            names = ["t"] if not isinstance(target_example, (tuple, list)) else [f"t{i}" for i in range(len(targets))]
            expected[0].update({n: (t.shape, t.dtype) for n, t in zip(names, targets)})
        return expected

    def submit(self, fn: Callable[[StageWorker], None]) -> None:
        """Run ``fn(self)`` in the compute thread before any further forward or backward."""
        with self._cond:
            self._control.append(fn)
            self._cond.notify()

    def call(self, fn: Callable[[StageWorker], None]) -> bool:
        """``submit`` if ``run`` is working (True); False if not: the caller runs ``fn`` itself."""
        with self._cond:
            if not self.running:
                return False
            self._control.append(fn)
            self._cond.notify()
            return True

    def run_pending(self) -> None:
        """Run control work submitted after ``run`` returned (e.g. the last averaging round's result)."""
        with self._cond:
            pending, self._control = self._control, []
        for fn in pending:
            fn(self)

    def stop(self) -> None:
        """Stop taking new micro-batches; run() returns once in-flight work is done or on ``abort``."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def pause(self) -> None:
        """Start no new micro-batch until ``resume`` (called from the event loop; ``reset`` follows)."""
        with self._cond:
            self.paused = True
            self._cond.notify()

    def reset(self, generation: int) -> int:
        """Compute thread: drop all work in flight, keep weights and optimizer; returns how many
        micro-batches stage 0 re-queued (or this stage dropped)."""
        with self._cond:
            self.paused = True
            self.generation = generation
            dropped = len(self._stash)
            self._stash.clear()
            self._forward_parts.clear()
            self._backward_parts.clear()
            if self.is_first:
                again = sorted((mb[1], batch) for mb, batch in self._inflight_data.items())
                self._requeue = deque(sorted([*again, *self._requeue], key=lambda item: item[0]))
                self._inflight_data.clear()
            self.stats.inflight = 0
        return dropped

    def resume(self, trained: int) -> None:
        """Compute thread: train again, counting ``trained`` micro-batches as finished."""
        with self._cond:
            self.trained = trained
            self.paused = False
            self._cond.notify()

    @property
    def trained_prefix(self) -> int:
        """Stage 0: data index below which every micro-batch is finished (a checkpoint's data_position)."""
        pending = [mb[1] for mb in self._inflight_data] + [i for i, _ in self._requeue]
        return min(pending, default=self.data_position)

    def forget_weight_history(self) -> None:
        """After weights were replaced (catch-up): no cached forward weights, no last update to extrapolate."""
        self._snapshot = None
        self._last_update = None
        self._recent_staleness.clear()

    def queue_depths(self) -> dict[str, int]:
        with self._cond:
            return {"forward": len(self._forward_parts), "backward": len(self._backward_parts)}

    # ----------------------------------------------------------------- the compute thread
    @property
    def done(self) -> bool:
        return self.trained >= self.options.steps and (self.is_first or self.cluster_done())

    def run(self, emit: Callable[[Outbound], None], should_abort: Callable[[], bool] = lambda: False) -> None:
        """Work until this stage has finished ``steps`` micro-batches (or was stopped and drained)."""
        self.should_abort = should_abort
        self.running = True
        try:
            while True:
                work = self._take(should_abort)
                if work is None:
                    break
                t0 = time.monotonic()
                if self.stats.started_at is None:
                    self.stats.started_at = t0
                work(emit)
            self._flush_update()
        finally:
            with self._cond:
                self.running = False
                pending, self._control = self._control, []
            for fn in pending:  # submitted while run was ending: run them here rather than lose them
                fn(self)

    def waited(self, reason: str, seconds: float) -> None:
        """Count ``seconds`` the compute thread waited for ``reason`` (compute thread only).  A wait
        inside a forward or backward (an update hook held back for an averaging round) is taken out of
        that phase's time, so ``busy_s`` stays compute."""
        self.stats.wait_s[reason] = self.stats.wait_s.get(reason, 0.0) + seconds
        self._waited_in_op += seconds
        if self.metrics is not None:
            self.metrics.wait_seconds.labels(reason).inc(seconds)

    def _idle_wait(self) -> None:
        """Wait (holding ``_cond``) for work, counted as "credits" when stage 0 is at ``max_inflight``,
        else as "input"; not counted before training starts or while draining."""
        if self.stats.started_at is None or self._stopping:
            self._cond.wait(timeout=0.5)
            return
        reason = "credits" if self.is_first and len(self._stash) >= self.options.max_inflight else "input"
        t0 = time.monotonic()
        self._cond.wait(timeout=0.5)
        self.waited(reason, time.monotonic() - t0)
        self._waited_in_op = 0.0  # between operations: nothing to take out

    def _take(self, should_abort: Callable[[], bool]) -> Callable[[Callable[[Outbound], None]], None] | None:
        with self._cond:
            while True:
                if self._control:
                    fn = self._control.pop(0)
                    return lambda emit: fn(self)
                if should_abort():
                    return None
                if self.paused:
                    if self._stopping:
                        return None
                    self._cond.wait(timeout=0.5)
                    continue
                mb = self._ready(self._backward_parts, self.spec.consumer_stages)
                if mb is not None:
                    parts = self._backward_parts.pop(mb)
                    return lambda emit: self._run_backward(mb, parts, emit)
                mb = self._ready(self._forward_parts, self._fwd_sources)
                if mb is not None and not self.is_first:
                    parts = self._forward_parts.pop(mb)
                    return lambda emit: self._run_forward(mb, parts, emit)
                if self.is_first and self._may_start():
                    return self._run_first_forward
                if self.done or (self._stopping and not self._stash):
                    return None
                self._idle_wait()

    def _ready(self, parts: OrderedDict[MicroBatch, dict[int, Any]], sources: list[int]) -> MicroBatch | None:
        for mb, got in parts.items():
            if len(got) == len(sources):
                return mb
        return None

    def _may_start(self) -> bool:
        more = bool(self._requeue) or self.data_position < self.options.steps
        return not self._stopping and more and len(self._stash) < self.options.max_inflight

    def _forward_sources(self) -> list[int]:
        sources = set(self.spec.producer_stages)
        if not self.is_first and (self.spec.model_inputs or self.is_last):
            sources.add(0)
        return sorted(sources)

    # ----------------------------------------------------------------- forward / backward
    def _weights(self) -> dict[str, torch.Tensor]:
        """The weights of this version's forwards: one snapshot per version, shared and stashed.

        With ``predict_weights`` k the snapshot is extrapolated to where the weights will be when this
        forward's gradient is applied, ``s`` updates later (``s`` = the stage's recent mean staleness):
        w + k * s * (last update).  Optimizers with momentum (Adam, SGD with momentum) change direction
        slowly, so this lands near the weights the gradient is applied to, as in SpecTrain and PipeMare;
        k a little above 1 also looks ahead as Nesterov momentum does.  The gradient is still exactly
        the gradient at the stashed (predicted) weights.  With no staleness the prediction is off, so
        ``max_inflight: 1`` still trains exactly like one process.
        """
        if self._snapshot is None or self._snapshot[0] != self.version:
            ahead = self._prediction_steps()
            with torch.no_grad():
                if ahead > 0 and self._last_update is not None:
                    copies = {n: torch.add(p.detach(), self._last_update[n], alpha=ahead).requires_grad_(p.requires_grad)
                              for n, p in self.params.items()}
                else:
                    copies = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in self.params.items()}
            self._snapshot = (self.version, copies)
        return self._snapshot[1]

    def _prediction_steps(self) -> float:
        """k x the mean staleness of the last PREDICTION_WINDOW backwards (0 when prediction is off)."""
        recent = self._recent_staleness
        if not self.options.predict_weights or not recent:
            return 0.0
        return self.options.predict_weights * sum(recent) / len(recent)

    def _forward(self, mb: MicroBatch, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Run the module on what the stage received; returns its outputs as a tuple (the raw output,
        e.g. the unsplit model's ModelOutput, is kept in ``self._raw_output`` for the last stage)."""
        weights = self._weights()
        leaves = [x.detach().to(self.device).requires_grad_(x.is_floating_point() and ref.stage >= 0)
                  for x, ref in zip(inputs, self.spec.received)]
        with torch.enable_grad():
            out = functional_call(self.module, {**weights, **self.buffers}, tuple(leaves[: len(self.spec.inputs)]))
        self._raw_output = out if self.is_last else None
        outputs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        self._stash[mb] = _Stash(self.version, weights, leaves, outputs)
        self.stats.forwards += 1
        self.stats.inflight = len(self._stash)
        return outputs

    def fresh_buffers(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Give these buffers new storage (a copy) and return them, so that changing them in place (an
        averaging round's delta) never reaches the forwards in flight: autograd saved the old tensors
        (BatchNorm saves its running statistics) and checks they are unchanged at backward."""
        fresh = {}
        for name in names:
            owner, _, leaf = name.rpartition(".")
            module = self.module.get_submodule(owner)
            copy = self.buffers[name].detach().clone()
            module._buffers[leaf] = copy
            self.buffers[name] = fresh[name] = copy
        return fresh

    def _gather_inputs(self, parts: dict[int, dict[str, Any]]) -> list[torch.Tensor]:
        args = []
        for ref in self.spec.received:
            if ref.stage < 0:
                args.append(compress.unpack(parts[0][f"x{ref.index}"]))
            else:
                args.append(compress.unpack(parts[ref.stage][f"o{ref.index}"]))
        return args

    def _pack(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | Packed]:
        """Activations or gradients as they leave this stage: compressed unless ``compress`` is none."""
        fmt, block = self.options.compress, self.options.int8_block
        return {name: compress.pack(t, fmt, block) for name, t in tensors.items()}

    def _run_first_forward(self, emit: Callable[[Outbound], None]) -> None:
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
            self._run_last(mb, self._gather_inputs(parts), targets, emit)
            return
        t0 = time.monotonic()
        outputs = self._forward(mb, self._gather_inputs(parts))
        self._account("forward", t0)
        for dest in self._first_destinations():
            tensors = self._pack({f"o{i}": outputs[i].detach() for i, users in self.spec.consumers.items()
                                  if dest in users})
            tensors.update(self._data_for(dest, inputs, targets))
            emit(Outbound("fwd", dest, mb, self.version, tensors, self.generation))

    def _first_destinations(self) -> list[int]:
        """Stages stage 0 sends to: consumers of its outputs, of model inputs, and the last stage."""
        return sorted(set(self.spec.consumer_stages) | self._data_readers)

    @property
    def _data_readers(self) -> set[int]:
        return {self.num_stages - 1} | set(self.model_input_needs)

    def _data_for(self, dest: int, inputs: tuple[Any, ...], targets: Any) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        for k in self.model_input_needs.get(dest, ()):
            tensors[f"x{k}"] = inputs[k]
        if dest == self.num_stages - 1:
            tgt = targets if isinstance(targets, (tuple, list)) else (targets,)
            tensors.update({f"t{i}": t for i, t in enumerate(tgt)})
            if not isinstance(targets, (tuple, list)):
                tensors["t"] = tensors.pop("t0")
        return tensors

    def _run_forward(self, mb: MicroBatch, parts: dict[int, dict[str, Any]],
                     emit: Callable[[Outbound], None]) -> None:
        if self.is_last:
            self._run_last(mb, self._gather_inputs(parts), _targets(parts[0]), emit)
            return
        t0 = time.monotonic()
        outputs = self._forward(mb, self._gather_inputs(parts))
        self._account("forward", t0)
        for dest in self.spec.consumer_stages:
            tensors = {f"o{i}": outputs[i].detach() for i, users in self.spec.consumers.items() if dest in users}
            emit(Outbound("fwd", dest, mb, self.version, self._pack(tensors), self.generation))

    def _run_last(self, mb: MicroBatch, inputs: list[torch.Tensor], targets: Any,
                  emit: Callable[[Outbound], None]) -> None:
        t0 = time.monotonic()
        self._forward(mb, inputs)
        stash = self._stash[mb]
        out = model_output(self.spec, self._raw_output, stash.inputs)
        self._raw_output = None
        targets = _to_device(targets, self.device)
        with torch.enable_grad():
            loss = self.loss_fn(out, targets)
        self._account("forward", t0)
        loss_value = float(loss.detach())
        self._record_loss(loss_value)
        t1 = time.monotonic()
        self._backward_from(mb, stash, [loss], [None], emit)
        self._account("backward", t1)

    def _run_backward(self, mb: MicroBatch, parts: dict[int, dict[str, Any]],
                      emit: Callable[[Outbound], None]) -> None:
        t0 = time.monotonic()
        stash = self._stash[mb]
        grads: list[torch.Tensor | None] = [None] * len(stash.outputs)
        for tensors in parts.values():
            for name, packed in tensors.items():
                i = int(name[1:])
                g = compress.unpack(packed, stash.outputs[i].dtype).to(self.device)
                grads[i] = g if grads[i] is None else grads[i] + g
        pairs = [(o, g) for o, g in zip(stash.outputs, grads) if g is not None and o.requires_grad]
        self._backward_from(mb, stash, [o for o, _ in pairs], [g for _, g in pairs], emit)
        self._account("backward", t0)

    def _backward_from(self, mb: MicroBatch, stash: _Stash, roots: list[torch.Tensor],
                       root_grads: list[torch.Tensor | None], emit: Callable[[Outbound], None]) -> None:
        weights = [w for w in stash.params.values() if w.requires_grad]
        grad_inputs = [x for x in stash.inputs if x.requires_grad]
        if roots:
            grads = torch.autograd.grad(roots, weights + grad_inputs, root_grads, allow_unused=True)
        else:
            grads = (None,) * (len(weights) + len(grad_inputs))
        del self._stash[mb]
        if self._inflight_data.pop(mb, None) is not None and len(self.stats.completed) < HISTORY:
            self.stats.completed.append(mb[1])
        self.stats.inflight = len(self._stash)
        scale = 1.0 / self.options.update_every
        live = [p for p in self.params.values() if p.requires_grad]
        for p, g in zip(live, grads[: len(weights)]):
            if g is None:
                continue
            g = g * scale if scale != 1.0 else g
            p.grad = g if p.grad is None else p.grad.add_(g)
        self._send_input_grads(mb, stash, dict(zip(map(id, grad_inputs), grads[len(weights):])), emit)
        self.stats.backwards += 1
        self.trained += 1
        self.stats.samples += self.options.micro_batch
        if self.metrics is not None:  # ravq_samples_total: the throughput panels read it
            self.metrics.samples.inc(self.options.micro_batch)
        self._pending_staleness.append(stash.version)
        self._accumulated += 1
        if self._accumulated >= self.options.update_every:
            self._step()

    def _send_input_grads(self, mb: MicroBatch, stash: _Stash, grad_of: dict[int, torch.Tensor | None],
                          emit: Callable[[Outbound], None]) -> None:
        per_producer: dict[int, dict[str, torch.Tensor]] = {s: {} for s in self.spec.producer_stages}
        for x, ref in zip(stash.inputs, self.spec.received):
            if ref.stage < 0:
                continue
            g = grad_of.get(id(x))
            if g is not None:
                name = f"g{ref.index}"
                prev = per_producer[ref.stage].get(name)
                per_producer[ref.stage][name] = g if prev is None else prev + g
        for producer, tensors in per_producer.items():
            emit(Outbound("bwd", producer, mb, self.version, self._pack(tensors), self.generation))

    def _step(self) -> None:
        for used in self._pending_staleness:
            staleness = self.version - used  # updates applied since this micro-batch's forward
            self.stats.staleness_sum += staleness
            self.stats.staleness_max = max(self.stats.staleness_max, staleness)
            self._recent_staleness.append(staleness)
            if self.metrics is not None:
                self.metrics.staleness.observe(staleness)
        self._pending_staleness.clear()
        if self._prediction_steps() > 0:  # the update is only needed to extrapolate along it
            with torch.no_grad():
                before = {n: p.detach().clone() for n, p in self.params.items()}
                self.optimizer.step()
                self._last_update = {n: p.detach() - before[n] for n, p in self.params.items()}
        else:
            self.optimizer.step()
            self._last_update = None
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        self.stats.updates += 1
        self.stats.update_times.append(time.time())
        self._accumulated = 0
        if self.metrics is not None:
            self.metrics.version.set(self.version)
        if self.on_update is not None:
            self.on_update(self)

    def _flush_update(self) -> None:
        if self._accumulated:
            self._step()

    def _record_loss(self, value: float) -> None:
        s = self.stats
        s.loss_last = value
        s.loss_first = value if s.loss_first is None else s.loss_first
        s.loss_sum += value
        s.losses += 1
        if len(s.loss_head) < LOSS_WINDOW:
            s.loss_head.append(value)
        s.loss_tail.append(value)
        s.loss_history.append(value)
        if self.metrics is not None:
            self.metrics.loss.set(value)
            self.metrics.losses.inc(value)

    def _account(self, phase: str, t0: float) -> None:
        dt = max(0.0, time.monotonic() - t0 - self._waited_in_op)
        self._waited_in_op = 0.0
        self.stats.busy_s += dt
        if phase == "forward":
            self.stats.forward_s += dt
            self.stats.forward_sq_s += dt * dt
            if self.stats.forward_last_s is not None and self.stats.forwards > 2:   # not the warm-up forward
                self.stats.forward_step_sq_s += (dt - self.stats.forward_last_s) ** 2
            self.stats.forward_last_s = dt
        else:
            self.stats.backward_s += dt
            self.stats.backward_sq_s += dt * dt
        if self.metrics is not None:
            self.metrics.compute_seconds.labels(phase).observe(dt)
            self.metrics.busy_seconds.inc(dt)
            self.metrics.inflight.set(len(self._stash))


def _check_tensors(tensors: dict[str, torch.Tensor | Packed], expected: dict[str, tuple[torch.Size, torch.dtype]],
                   exact: bool) -> str | None:
    if exact and set(tensors) != set(expected):
        return "unexpected_tensors"
    for name, t in tensors.items():
        want = expected.get(name)
        if want is None:
            return "unexpected_tensors"
        if isinstance(t, Packed) and name[0] not in "og":  # model inputs and targets go uncompressed
            return "unexpected_tensors"
        if t.shape != want[0] or t.dtype != want[1]:
            return "bad_tensor_shape"
    return None


def _targets(tensors: dict[str, torch.Tensor]) -> Any:
    if "t" in tensors:
        return tensors["t"]
    return tuple(tensors[f"t{i}"] for i in range(sum(1 for k in tensors if k.startswith("t"))))


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return type(value)(v.to(device) for v in value)


def model_input_needs(specs: list[StageSpec]) -> dict[int, list[int]]:
    """Stage index -> the model inputs it reads directly (sent to it by stage 0)."""
    return {s.index: s.model_inputs for s in specs if s.index > 0 and s.model_inputs}
