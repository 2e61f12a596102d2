"""What a pipeline stage costs a node beyond its FLOPs: a stage timed as a node runs it.

On issue #14's and #26's testbed every stage of a pipeline used 4-27 ms of CPU per micro-batch more
than its FLOPs, its messages and the loss said, first, middle and last stages alike, where a whole copy
of the model on one PC used what it was charged (docs/testbed.md).  What a node adds around a stage
(its compute thread handing work to the event loop and back, the send and read loops, wire encoding
and decoding, ZeroMQ's I/O thread, CURVE, the stage's own bookkeeping of parts, stashes and credits)
is not in a bare forward and backward, nor in a message sent on its own.

``measure_stage_cpu`` runs the task's model as a node runs it: the real ``StageWorker``s built by
``ravq.stage.build.build_stage`` with the topology's training settings, each in its own compute thread,
joined over loopback TCP by their own ROUTER and DEALER sockets with the node's socket options (CURVE
when on), messages made and read as a node's pipeline links make and read them; and the same model as
one stage (no sockets).  Both in CPU seconds of the whole process per micro-batch, so other work on
the machine hardly moves them; what a CPU second buys still drifts, so the runs alternate (one, two,
two, one: ``balanced_order``) and each kind's mean is kept.  ``ravq.profile.measure`` turns the
difference, less the two messages the profile already charges, into a per-stage cost
(``Measurement.stage_s``; the planner's ``NodeProfile.pipeline_stage_s``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from ravq.codec.compress import Packed
from ravq.config import Topology
from ravq.cut.meta import build_meta_model
from ravq.cut.split import candidate_cuts, even_cuts
from ravq.metrics import Metrics
from ravq.net.security import socket_options_for
from ravq.net.transport import Inbox, Outlink
from ravq.net.wire import DecodeLimits, Message, MsgType
from ravq.profile.links import CHUNK_BYTES
from ravq.profile.session import zmq_session
from ravq.stage.build import build_stage
from ravq.stage.pipeline import StageWorker
from ravq.stage.types import Outbound

log = logging.getLogger(__name__)

_KINDS = {"fwd": MsgType.FORWARD, "bwd": MsgType.BACKWARD}


@dataclass(kw_only=True, slots=True)
class StageCostConfig:
    micro_batches: int = 12
    """Micro-batches timed (after ``warmup``), in each run."""
    repeats: int = 2
    """Runs of each of the two, in the order one, two, two, one (then again): a drift in what a CPU second
    buys over the measurement cancels out of the difference.  Each run timed once (issue #26, third
    session), per-stage costs came out 0-16 ms of CPU on PCs alike: the difference of two runs of about
    100 ms each, taken seconds apart on a machine whose CPU per step moves by 10% within minutes."""
    warmup: int = 3
    max_inflight: int | None = None
    """In flight in the two-stage pipeline; None: the topology's ``max_inflight``, else 2 (one per stage)."""
    micro_batch: int | None = None
    """Samples per micro-batch; None: the topology's.  Smaller on a PC where two stages at the topology's
    do not fit (``ravq.profile.measure``): the per-stage cost is taken to be per micro-batch."""


@dataclass(kw_only=True, slots=True)
class StageCpu:
    pipeline_cpu_s: float
    """CPU seconds of the whole process per micro-batch: the model as two stages over sockets."""
    single_cpu_s: float
    """CPU seconds per micro-batch of the same model as one stage (no messages)."""
    act_bytes: int
    """Float32 bytes of what crosses the cut forward per micro-batch (activations, targets)."""
    grad_bytes: int
    """Float32 bytes of the gradients coming back."""


class _Window:
    """CPU time of the process between the ``warmup``-th and the last finished micro-batch of a stage."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start: tuple[float, int] | None = None
        self.end: tuple[float, int] | None = None

    def on_update(self, worker: StageWorker) -> None:
        done = worker.stats.backwards
        if done >= self.warmup:
            point = (time.process_time(), done)
            if self.start is None:
                self.start = point
            self.end = point

    def per_micro_batch(self) -> float:
        if self.start is None or self.end is None or self.end[1] <= self.start[1]:
            raise RuntimeError("profile: too few micro-batches to time the stage")
        return (self.end[0] - self.start[0]) / (self.end[1] - self.start[1])


def _float_bytes(tensors: dict[str, Any]) -> int:
    total = 0
    for t in tensors.values():
        if isinstance(t, Packed):
            total += t.shape.numel() * torch.empty((), dtype=t.dtype).element_size()
        elif isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


def _workers(task: Any, topology: Topology, name: str, stages: int, steps: int,
             max_inflight: int | None, micro_batch: int | None) -> tuple[list[StageWorker], int]:
    me = topology.node(name)
    micro_batch = micro_batch or topology.training.micro_batch
    training = topology.training.model_copy(update={"steps": steps, "eval_every": 0, "batch": None,
                                                    "max_inflight": max_inflight, "micro_batch": micro_batch})
    cuts = even_cuts(candidate_cuts(build_meta_model(task, 0).model, task), stages) if stages > 1 else []
    built = [build_stage(task, training, seed=0, cuts=cuts, stage=i, cluster=0, clusters=1, device=me.device,
                         metrics=Metrics(f"{name}.{i}")) for i in range(stages)]
    return [b.worker for b in built], max(b.largest_frame for b in built)


def _single_cpu_s(task: Any, topology: Topology, name: str, config: StageCostConfig) -> float:
    steps = config.warmup + config.micro_batches
    (worker,), _ = _workers(task, topology, name, 1, steps, 1, config.micro_batch)
    window = _Window(config.warmup)
    worker.subscribe_updates(window.on_update)
    worker.run(lambda out: None)
    return window.per_micro_batch()


async def _pipeline_cpu_s(task: Any, topology: Topology, name: str,
                          config: StageCostConfig) -> tuple[float, int, int]:
    inflight = config.max_inflight or topology.training.max_inflight or 2
    workers, largest = _workers(task, topology, name, 2, config.warmup + config.micro_batches, inflight,
                                config.micro_batch)
    metrics = Metrics(name)
    options = dataclasses.replace(socket_options_for(topology, name, None, metrics), linger_ms=0,
                                  max_message_bytes=2 * largest + CHUNK_BYTES)
    limits = DecodeLimits(max_tensor_bytes=2 * largest)
    window = _Window(config.warmup)
    workers[-1].subscribe_updates(window.on_update)
    sent = {"fwd": 0, "bwd": 0}
    loop = asyncio.get_running_loop()
    async with zmq_session(options) as (ctx, group):
        inboxes = [Inbox.bind(ctx, "tcp://127.0.0.1:*", name, metrics, limits, options) for _ in workers]
        addresses = [inbox.sock.getsockopt_string(zmq.LAST_ENDPOINT) for inbox in inboxes]
        outlinks = [Outlink.connect(ctx, addresses[1 - i], name, name, metrics, limits, options)
                    for i in range(2)]
        queues: list[asyncio.Queue[Outbound]] = [asyncio.Queue() for _ in workers]

        async def send_loop(i: int) -> None:  # as ravq.node.pipeline_links.StageLinks.send_loop
            while True:
                out = await queues[i].get()
                tensors = {n: t for n, t in out.tensors.items() if not isinstance(t, Packed)}
                packed = {n: t for n, t in out.tensors.items() if isinstance(t, Packed)}
                await outlinks[i].send(Message(type=_KINDS[out.kind], sender=name,
                                               micro_batch=out.micro_batch, version=out.version,
                                               meta={**out.meta, "gen": out.generation},
                                               tensors=tensors, packed=packed))

        async def read_loop(i: int) -> None:  # as ravq.node.pipeline_links.StageLinks.read_loop
            while True:
                _, msg = await inboxes[i].recv()
                kind = next(k for k, t in _KINDS.items() if t == msg.type)
                assert msg.micro_batch is not None
                payload = {**msg.tensors, **msg.packed}
                reason = workers[i].deliver(kind, msg.micro_batch, 1 - i, payload, msg.meta)
                if reason is not None:
                    raise RuntimeError(f"profile: the two-stage pipeline dropped a message: {reason}")
                workers[i].queue_depths()

        def emit_from(i: int) -> Callable[[Outbound], None]:
            def emit(out: Outbound) -> None:
                if out.micro_batch[1] == config.warmup:  # one micro-batch's bytes each way
                    sent[out.kind] = _float_bytes(out.tensors)
                loop.call_soon_threadsafe(queues[i].put_nowait, out)
            return emit

        loops = [group.create_task(f(i)) for i in range(2) for f in (send_loop, read_loop)]
        try:
            await asyncio.gather(*(asyncio.to_thread(w.run, emit_from(i)) for i, w in enumerate(workers)))
        finally:
            for w in workers:
                w.stop()
            for task_ in loops:
                task_.cancel()
            for link in outlinks:
                link.close()
            for inbox in inboxes:
                inbox.close()
    return window.per_micro_batch(), sent["fwd"], sent["bwd"]


def measure_stage_cpu(topology: Topology, name: str, task: Any,
                      config: StageCostConfig | None = None) -> StageCpu:
    """CPU seconds per micro-batch of the task's model run as a node runs a pipeline of two stages (see
    the module's doc) and as one stage, and the float32 bytes crossing the cut each way."""
    config = config or StageCostConfig()
    singles: list[float] = []
    pipelines: list[float] = []
    act = grad = 0
    for kind in balanced_order(config.repeats):
        if kind == "single":
            singles.append(_single_cpu_s(task, topology, name, config))
        else:
            cpu, act, grad = asyncio.run(_pipeline_cpu_s(task, topology, name, config))
            pipelines.append(cpu)
    pipeline, single = statistics.fmean(pipelines), statistics.fmean(singles)
    log.info("profile: %s as two stages %.3g ms of CPU per micro-batch (runs %s), as one %.3g ms (runs %s)",
             name, pipeline * 1e3, _ms(pipelines), single * 1e3, _ms(singles))
    return StageCpu(pipeline_cpu_s=pipeline, single_cpu_s=single, act_bytes=act, grad_bytes=grad)


def balanced_order(repeats: int) -> list[str]:
    """``repeats`` runs of each kind ("single", "pipeline") in the order one, two, two, one, ...: each pair of
    pairs is symmetric in time, so a speed that drifts linearly over the measurement adds as much to each
    kind's mean (an odd ``repeats`` leaves one pair in that order)."""
    order: list[str] = []
    for i in range(max(1, repeats)):
        order += ["single", "pipeline"] if i % 2 == 0 else ["pipeline", "single"]
    return order


def _ms(values: list[float]) -> str:
    return ", ".join(f"{v * 1e3:.3g}" for v in values)
