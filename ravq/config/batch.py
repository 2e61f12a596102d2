"""The optimization batch a user states (``training.batch``) and the accumulation ravq derives from it.

``training.batch`` is samples per optimizer step over all clusters: the batch one process would train with.
Every cluster trains on its own micro-batches and the clusters' weights are averaged, so a step of a stage
sums ``update_every = batch / (micro_batch x clusters)`` micro-batches of its cluster.  The clusters come
from the plan (the topology's ``cluster`` fields, or the planner's choice), so the derivation is checked
when the topology is loaded if every node names its cluster, and again by each node from its plan.

Why the batch matters to an asynchronous pipeline: a micro-batch's gradient is applied a few micro-batches
after its forward (``max_inflight``), so its staleness in optimizer updates is about
``(max_inflight - 1) / update_every``.  With one update per micro-batch it is a whole update late on the
first stage and Adam can lose the run (docs/convergence.md); with several micro-batches per update the
staleness is a fraction of an update and asynchrony cost nothing in the measurements there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol, Self, TypeVar

from ravq.config.base import ConfigError


class BatchSettings(Protocol):
    """The fields of ``ravq.config.topology.TrainingConfig`` read here (that module imports this one)."""

    batch: int | None
    micro_batch: int
    update_every: int
    schedule: str
    precision: str

    @property
    def model_fields_set(self) -> set[str]: ...

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self: ...


T = TypeVar("T", bound="BatchSettings")


class Member(Protocol):
    standby: bool
    cluster: int | None


def _not_a_multiple(batch: int, micro_batch: int, clusters: int) -> str:
    unit = micro_batch * clusters
    near = sorted({max(unit, batch // unit * unit), (batch // unit + 1) * unit})
    where = f"micro_batch {unit}"
    if clusters > 1:
        where = f"micro_batch x clusters = {micro_batch} x {clusters} = {unit}"
    choices = " or ".join(f"{n} ({n // unit} micro-batches per cluster and step)" for n in near)
    return (f"training.batch: {batch} samples per step is not a multiple of {where} (each cluster sums whole "
            f"micro-batches); set batch to {choices}, or change micro_batch")


def check_fields(training: T) -> T:
    """``TrainingConfig``'s own check: ``batch`` and ``update_every`` are one setting stated two ways, and
    a batch of whole micro-batches (the clusters are checked once they are known); and no fp16 loss scaling
    with split backwards (a micro-batch's scale is not kept for its deferred weight pass)."""
    if training.schedule == "zero_bubble" and training.precision == "fp16":
        raise ValueError("training.schedule: zero_bubble does not take precision fp16 (its loss scaling "
                         "unscales each micro-batch's weight gradients whole); use sync, or precision bf16 "
                         "or fp32")
    batch = training.batch
    if batch is None:
        return training
    if "update_every" in training.model_fields_set:
        raise ValueError("training: set batch (samples per optimizer step) or update_every (micro-batches "
                         "per step), not both: ravq derives update_every from batch")
    if batch % training.micro_batch:
        raise ValueError(_not_a_multiple(batch, training.micro_batch, 1))
    return training


def update_every(training: BatchSettings, clusters: int) -> int:
    """Micro-batches each optimizer step of a stage sums, with ``clusters`` clusters training."""
    if training.batch is None:
        return training.update_every
    assert clusters >= 1
    if training.batch % (training.micro_batch * clusters):
        raise ConfigError(_not_a_multiple(training.batch, training.micro_batch, clusters))
    return training.batch // (training.micro_batch * clusters)


def for_clusters(training: T, clusters: int) -> T:
    """``training`` with ``update_every`` derived from ``batch`` for ``clusters`` clusters (itself when no
    batch is stated)."""
    if training.batch is None:
        return training
    return training.model_copy(update={"update_every": update_every(training, clusters)})


def check_declared(training: BatchSettings, nodes: Iterable[Member]) -> None:
    """At load: when every training node names its cluster the clusters are known, so is the accumulation."""
    training_nodes = [n for n in nodes if not n.standby]
    if training.batch is None or any(n.cluster is None for n in training_nodes):
        return
    clusters = len({n.cluster for n in training_nodes})
    if training.batch % (training.micro_batch * clusters):
        raise ValueError(_not_a_multiple(training.batch, training.micro_batch, clusters))


def staleness_bound(max_inflight: int, update_every: int) -> float:
    """The first stage's staleness in optimizer updates with ``max_inflight`` micro-batches in flight: the
    micro-batches that finish between a forward and its backward, over those an update sums."""
    return (max_inflight - 1) / update_every


def default_inflight(stages: int, update_every: int) -> int:
    """``max_inflight`` when the topology leaves it unset: at most one update of staleness, whatever the
    batch.  With a stated batch of ``update_every`` > 1 micro-batches per update at most ``update_every``,
    so the first stage is less than one update stale (``staleness_bound`` < 1) and the micro-batches in
    flight span at most two weight versions (PipeDream-2BW's regime: one stashed copy).  With an update
    per micro-batch 2 (one update stale, as on 2 stages), not one per stage: with a window of every stage
    the first of 3-4 stages was 2-3 updates stale, and the zoo met its target in 15 of 30 runs there; with
    2, in 28 of 30 (docs/convergence.md, "The window with an update per micro-batch").  Deeper pipelines
    keep every stage busy with a stated batch (``training.batch``) or a stated ``max_inflight``.

    A batch of many micro-batches per update also keeps up to half an update in flight, at most two per
    stage: one per stage is the window of a pipeline whose links cost nothing, and over WAN links a
    micro-batch's round trip outlasts stages x its slowest stage, so the pipeline waits for credits
    (a 14-stage cluster at 1,024 PCs simulated at 0.83 of its slowest stage's rate with 14 in flight, at
    its rate with 28; docs/simulator.md).  Such a stage is at most half an update stale."""
    if stages <= 1:
        return 1
    return max(min(stages, max(2, update_every)), min(2 * stages, update_every // 2))
