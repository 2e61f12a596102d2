"""A node's part in cross-cluster averaging: ring sockets, round schedule, applying the result.

Every ``sync_every`` optimizer steps the compute thread snapshots this stage's segments (version v)
and hands them to the event loop; the rings run there while training goes on, and the compute
thread later adds (average - snapshot) to its live weights, keeping the updates made meanwhile.
A stage that is ``averaging_lead`` steps past the snapshot of a round not finished yet (another
cluster is behind) waits for it there, so no cluster runs further ahead of the others.
With ``overlap_averaging: false`` the compute thread instead waits for the round (synchronous data
parallelism; used by the equivalence test).  Rounds are numbered by version, so every member of a
ring agrees on them without talking to the broker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq.asyncio

from ravq import allreduce
from ravq.allreduce import Mailbox, RoundResult, Segment
from ravq.compress import Format, Packed
from ravq.config import Plan, Topology
from ravq.metrics import Metrics
from ravq.model import build_task_model, split_model
from ravq.optim import set_clusters
from ravq.pipeline import StageWorker
from ravq.ring_compression import RingCompression
from ravq.transport import Inbox, Outlink, SocketOptions, endpoint
from ravq.wire import DecodeLimits, Message, MsgType

log = logging.getLogger(__name__)

PENDING_ROUNDS = 2
"""Snapshots waiting for their round; a faster cluster is held back when more would queue."""


class RingLinks:
    """``allreduce.RingLink`` over one DEALER per ring peer."""

    def __init__(self, me: str, outlinks: dict[str, Outlink], fault: str | None = None) -> None:
        self.me, self.outlinks = me, outlinks
        self._kill_round = int(fault.split(":")[1]) if fault and fault.startswith("kill_in_round:") else None

    async def send(self, peer: str, meta: dict[str, int], tensor: torch.Tensor | Packed) -> None:
        await self.outlinks[peer].send(ring_chunk(self.me, meta, tensor))
        if self._kill_round is not None and meta["round"] >= self._kill_round:
            # Fault injection for tests (RAVQ_FAULT=kill_in_round:N): die mid-round, as a crash would.
            os.kill(os.getpid(), signal.SIGKILL)

    async def send_abort(self, peer: str, ring_id: int, round_id: int, reason: str) -> None:
        await self.outlinks[peer].send(Message(type=MsgType.RING_ABORT, sender=self.me,
                                               meta={"ring": ring_id, "round": round_id, "reason": reason}))


def ring_chunk(sender: str, meta: dict[str, int], piece: torch.Tensor | Packed) -> Message:
    """The RING_CHUNK message of one piece (a plain tensor or a packed one)."""
    if isinstance(piece, Packed):
        return Message(type=MsgType.RING_CHUNK, sender=sender, meta=meta, packed={"piece": piece})
    return Message(type=MsgType.RING_CHUNK, sender=sender, meta=meta, tensors={"piece": piece})


def stage_owners(build: Callable[[], torch.nn.Module], example: tuple[Any, ...], plan: Plan,
                 known: dict[tuple[str, ...], list[list[str]]] | None = None) -> list[dict[str, str]]:
    """For each cluster: tensor name -> node holding it (one split of a fresh model per distinct set of
    cuts: tracing consumes the model it splits)."""
    cache: dict[tuple[str, ...], list[list[str]]] = dict(known or {})
    owners = []
    for cluster in plan.clusters:
        key = tuple(cluster.cuts)
        if key not in cache:
            specs = split_model(build(), example, list(key))
            cache[key] = [list(s.module.state_dict().keys()) for s in specs]
        owners.append({name: node for node, names in zip(cluster.nodes, cache[key]) for name in names})
    return owners


def optimizer_state_keys(task: Any) -> list[str]:
    """The per-element state keys of the task's optimizer (e.g. exp_avg), from one step on a probe."""
    probe = torch.nn.Parameter(torch.zeros(2))
    opt = task.make_optimizer([probe])
    probe.grad = torch.ones(2)
    opt.step()
    return sorted(k for k, v in opt.state[probe].items()
                  if isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape == probe.shape)


@dataclass(eq=False, slots=True)
class _Pending:
    """A round snapshotted and not applied yet, with what rounds applied since did to this segment."""

    round_id: int
    version: int = 0
    """The stage's version at the snapshot."""
    done: concurrent.futures.Future[RoundResult] | None = None
    segments: list[Segment] = field(default_factory=list)
    snapshots: dict[int, torch.Tensor] = field(default_factory=dict)
    applied: dict[tuple[str, ...], torch.Tensor] = field(default_factory=dict)
    """Segment names -> the sum of the deltas applied to this node's live weights since the snapshot."""
    shift: dict[tuple[str, ...], torch.Tensor] = field(default_factory=dict)
    """Segment names -> the mean of those deltas over the clusters: the sum of (common point - average)
    of the rounds applied since; nonzero only with outer_lr != 1, and the same on every cluster."""


class Averager:
    def __init__(self, *, ctx: zmq.asyncio.Context, topology: Topology, plan: Callable[[], Plan], me: str,
                 cluster: int,
                 worker: StageWorker, model: torch.nn.Module, stage_names: list[list[str]], task: Any,
                 metrics: Metrics,
                 sock_opts: SocketOptions, limits: DecodeLimits) -> None:
        self.topology, self.me, self.cluster, self.worker, self.metrics = topology, me, cluster, worker, metrics
        t = topology.training
        self.sync_every, self.overlap, self.piece_bytes = t.sync_every, t.overlap_averaging, t.ring_chunk_bytes
        self.timeout_s = topology.timeouts.ring_step_s
        self.with_state = t.average_optimizer_state
        self.outer_lr = t.outer_lr
        self.lead = t.averaging_lead
        ring_format = Format(t.compress.ring)
        self.compression = (RingCompression(ring_format, t.compress.int8_block)
                            if ring_format is not Format.NONE else None)
        """Compressed rings with error feedback (ravq.ring_compression); None sends float32 as it is."""
        self.anchors: dict[tuple[str, ...], torch.Tensor] = {}
        self._pending: list[_Pending] = []
        """Overlapped rounds snapshotted and not applied yet, oldest first (compute thread only)."""
        self.initial = {n: v.detach().to("cpu").clone() for n, v in {**worker.params, **worker.buffers}.items()}
        names = allreduce.averaged_names(model)
        state = model.state_dict()
        numels = [state[n].numel() for n in names]
        if self.with_state:
            stateful = [n for n, p in model.named_parameters() if p.requires_grad]
            names, numels = allreduce.with_optimizer_state(names, numels, stateful, optimizer_state_keys(task))
        self.names, self.numels = names, numels
        own_cuts = tuple(plan().clusters[cluster].cuts)
        self.owners = stage_owners(lambda: build_task_model(task, topology.seed),
                                   task.example_inputs(t.micro_batch), plan(), {own_cuts: stage_names})
        self.plan = plan
        self.mailbox = Mailbox()
        self.rounds: asyncio.Queue[tuple[int, dict[int, torch.Tensor], list[Segment],
                                         concurrent.futures.Future[RoundResult]]] = asyncio.Queue(PENDING_ROUNDS)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.completed = 0
        self.seconds_total = 0.0
        self.aborts = 0
        self.hold_backs = 0
        self.held_s = 0.0
        peers = sorted({m for owners in self.owners for m in owners.values()} - {me})
        bind = topology.node(me).bind_host or topology.node(me).host
        self.inbox = Inbox.bind(ctx, endpoint(bind, topology.node(me).ring_port), "ring", metrics, limits, sock_opts)
        self.outlinks = {p: Outlink.connect(ctx, endpoint(topology.node(p).host, topology.node(p).ring_port), "ring",
                                            p, metrics, limits, sock_opts, identity=me) for p in peers}
        self.link = RingLinks(me, self.outlinks, os.environ.get("RAVQ_FAULT"))
        set_clusters(worker.optimizer, self.live_clusters())  # before the compute thread's first step

    def live_clusters(self, plan: Plan | None = None) -> int:
        """Clusters averaging with this node under the plan (1 once its own cluster is dropped)."""
        plan = plan or self.plan()
        live = [c for c in range(len(plan.clusters)) if c not in plan.excluded]
        return len(live) if self.cluster in live else 1

    def segments(self) -> list[Segment]:
        """This node's segments under the current plan (dropped clusters take no part)."""
        plan = self.plan()
        if self.live_clusters(plan) < 2:
            return []
        segs = allreduce.plan_segments(self.names, self.numels, self.owners, plan.excluded)
        return allreduce.segments_for(self.me, segs)

    def tensors(self) -> dict[str, torch.Tensor]:
        worker = self.worker
        named: dict[str, torch.Tensor] = {**worker.params, **worker.buffers}
        if self.with_state:
            named.update(allreduce.optimizer_state_tensors(worker.optimizer, worker.params))
        return named

    # ------------------------------------------------------------ compute thread
    def on_update(self, worker: StageWorker) -> None:
        """Called by the stage after each optimizer step, in the compute thread."""
        if self.loop is None:
            return
        self._hold_back(worker)
        set_clusters(worker.optimizer, self.live_clusters())  # the next step's (a dropped cluster counts no more)
        if worker.version % self.sync_every:
            return
        segments = self.segments()
        if not segments:
            return
        named = self.tensors()
        snapshots = allreduce.snapshot_segments(named, segments)
        done: concurrent.futures.Future[RoundResult] = concurrent.futures.Future()
        round_id = worker.version // self.sync_every
        queued = asyncio.run_coroutine_threadsafe(self.rounds.put((round_id, snapshots, segments, done)), self.loop)
        queued.result(timeout=self._round_limit_s())
        if not self.overlap:
            t0 = time.monotonic()
            finished = self._wait_round(worker, done, round_id)
            worker.waited("averaging", time.monotonic() - t0)
            if finished:
                self._apply(named, segments, snapshots, done.result())
            return
        self._pending.append(_Pending(round_id, worker.version, done, segments, snapshots))
        done.add_done_callback(lambda f: worker.submit(lambda w: self._apply_finished()))

    def _hold_back(self, worker: StageWorker) -> None:
        """Wait for the oldest unfinished round once this stage is ``lead`` steps past its snapshot.

        A round finishes when the slowest cluster reaches its version; until then a faster cluster
        trains on without the other clusters' progress, and the steps it runs ahead are steps on a
        model the others have not caught up with.  Bounding the lead keeps the clusters within
        ``averaging_lead`` steps of one another; in-flight micro-batches stay where they are."""
        while self._pending and worker.version - self._pending[0].version >= self.lead:
            oldest = self._pending[0]
            assert oldest.done is not None
            if not oldest.done.done():
                t0 = time.monotonic()
                if not self._wait_round(worker, oldest.done, oldest.round_id):
                    self._pending.remove(oldest)
                    continue
                self.hold_backs += 1
                self.held_s += time.monotonic() - t0
                worker.waited("averaging", time.monotonic() - t0)
            self._apply_finished()

    def _wait_round(self, worker: StageWorker, done: concurrent.futures.Future[RoundResult], round_id: int) -> bool:
        """Block the compute thread until the round is done; False if it never finishes or the process
        gives up meanwhile (a forced stop must not wait for a ring's timeouts)."""
        deadline = time.monotonic() + self._round_limit_s()
        while not worker.should_abort():
            try:
                done.result(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
                return True
            except concurrent.futures.TimeoutError:
                if time.monotonic() >= deadline:
                    log.warning("%s: round %d never finished; going on without it", self.me, round_id)
                    return False
        return False

    def _round_limit_s(self) -> float:
        """Longest a compute thread waits on the event loop for a round: its ring steps' timeouts and more."""
        return 4 * self.timeout_s + 10

    def _apply_finished(self) -> None:
        """Apply every round that has finished and is not applied yet, oldest first."""
        for pending in list(self._pending):
            if pending.done is not None and pending.done.done():  # _apply removes only its own round
                self._apply(self.tensors(), pending.segments, pending.snapshots, pending.done.result(), pending)

    def _apply(self, named: dict[str, torch.Tensor], segments: list[Segment], snapshots: dict[int, torch.Tensor],
               result: RoundResult, pending: _Pending | None = None) -> None:
        """Move each finished segment to the new common point, keeping progress made since the snapshot.

        With outer_lr a != 1 the common point is anchor + a * (average - anchor), where the anchor is
        the previous common point (at first the initial weights every cluster started from).

        Rounds overlap training, so a round's snapshot may predate the deltas of earlier rounds applied
        while it ran.  Those deltas are already in the live weights, so they are added to this round's
        snapshot (``_Pending.applied``) and their mean over the clusters to its average
        (``_Pending.shift``, zero unless outer_lr != 1): the round then does what it would have done had
        the earlier ones been applied at once.  Without this every round pulls the clusters together
        again by the same distance and, with frequent rounds, swaps them past each other instead of
        averaging them; with outer_lr > 1 it would also undo the earlier rounds' extrapolation."""
        if pending is not None:
            self._pending.remove(pending)
            self._correct(pending, segments, snapshots, result)
        shifts: dict[int, torch.Tensor] = {}
        if self.outer_lr != 1.0:
            for seg in segments:
                average = result.averaged.get(seg.ring_id)
                if average is None:
                    continue
                anchor = self.anchors.get(seg.names)
                if anchor is None and all(n in self.initial for n in seg.names):
                    anchor = allreduce.flatten([self.initial[n] for n in seg.names])
                if anchor is not None:
                    point = anchor + self.outer_lr * (average - anchor)
                    shifts[seg.ring_id] = point - average
                    result.averaged[seg.ring_id] = average = point
                self.anchors[seg.names] = average.clone()
        # Buffers get new storage before the delta lands: forwards in flight saved the old tensors
        # (BatchNorm's running statistics) and must find them unchanged at backward.
        moved = [n for seg in segments if seg.ring_id in result.averaged for n in seg.names if n in self.worker.buffers]
        if moved:
            named = {**named, **self.worker.fresh_buffers(moved)}
        deltas = allreduce.apply_round(named, segments, snapshots, result)
        if self.compression is not None:
            _keep_non_negative_state(named, segments, snapshots, result)
        for seg in segments:
            if (delta := deltas.get(seg.ring_id)) is None:
                continue
            for later in self._pending:  # rounds whose snapshots do not hold this delta yet
                _accumulate(later.applied, seg.names, delta)
                if seg.ring_id in shifts:
                    _accumulate(later.shift, seg.names, shifts[seg.ring_id])

    @staticmethod
    def _correct(pending: _Pending, segments: list[Segment], snapshots: dict[int, torch.Tensor],
                 result: RoundResult) -> None:
        """Bring a round's snapshot and average up to the rounds applied since it was taken."""
        for seg in segments:
            if seg.ring_id not in result.averaged:
                continue
            if (applied := pending.applied.get(seg.names)) is not None:
                snapshots[seg.ring_id] = snapshots[seg.ring_id] + applied
            if (shift := pending.shift.get(seg.names)) is not None:
                result.averaged[seg.ring_id] = result.averaged[seg.ring_id] + shift

    # ------------------------------------------------------------ event loop
    async def serve(self) -> None:
        """The ring socket's one reader."""
        self.loop = asyncio.get_running_loop()
        while True:
            _, msg = await self.inbox.recv()
            piece = allreduce.received_piece(msg.meta, msg.tensors, msg.packed)
            if msg.type == MsgType.RING_CHUNK and piece is not None:
                self.mailbox.deliver(msg.sender, msg.meta, piece)
            elif msg.type == MsgType.RING_ABORT:
                self.mailbox.deliver_abort(msg.sender, msg.meta["ring"], msg.meta["round"],
                                           str(msg.meta.get("reason", ""))[:64])
            else:
                self.metrics.bad_messages.labels("ring", "unexpected_message").inc()

    async def run_rounds(self) -> None:
        self.loop = asyncio.get_running_loop()
        while True:
            round_id, snapshots, segments, done = await self.rounds.get()
            try:
                result = await allreduce.average_segments(
                    snapshots, segments, me=self.me, round_id=round_id, link=self.link, mailbox=self.mailbox,
                    piece_bytes=self.piece_bytes, timeout_s=self.timeout_s, compression=self.compression)
                self._account(round_id, result)
                done.set_result(result)
            finally:
                self.rounds.task_done()

    def _account(self, round_id: int, result: RoundResult) -> None:
        for ring, nbytes in result.bytes_sent.items():
            self.metrics.allreduce_bytes.labels(str(ring)).inc(nbytes)
        if result.aborted:
            self.aborts += 1
            reasons = {e.reason for e in result.aborted.values()}
            for reason in reasons:
                self.metrics.allreduce_aborts.labels(reason[:32]).inc()
            log.warning("%s: averaging round %d aborted on %d ring(s) (%s); training goes on", self.me, round_id,
                        len(result.aborted), ", ".join(sorted(reasons)))
        else:
            self.completed += 1
            self.seconds_total += result.seconds
            self.metrics.allreduce_rounds.inc()
            self.metrics.allreduce_seconds.observe(result.seconds)

    async def drain(self) -> None:
        """Wait until every queued round has finished (at the end of training)."""
        await self.rounds.join()

    def stats(self) -> dict[str, Any]:
        named = self.tensors()
        segments = self.segments()
        return {"allreduce_rounds": self.completed, "allreduce_aborts": self.aborts,
                "ring_size": len(segments[0].ring) if segments else 0,
                "segment_bytes": sum(named[n].numel() * named[n].element_size()
                                     for s in segments for n in s.names if n in named),
                "allreduce_seconds_mean": self.seconds_total / self.completed if self.completed else 0.0,
                "averaging_waits": self.hold_backs, "averaging_wait_seconds": self.held_s}

    def close(self) -> None:
        for link in self.outlinks.values():
            link.close()
        self.inbox.close()


def _accumulate(sums: dict[tuple[str, ...], torch.Tensor], key: tuple[str, ...], value: torch.Tensor) -> None:
    held = sums.get(key)
    sums[key] = value.clone() if held is None else held + value


def _keep_non_negative_state(named: dict[str, torch.Tensor], segments: list[Segment],
                             snapshots: dict[int, torch.Tensor], result: RoundResult) -> None:
    """Optimizer state that was nowhere negative here (Adam's second moments) stays so after a compressed
    average: the exact average of non-negative values is, but a compression error near zero need not be,
    and Adam takes its square root."""
    for seg in segments:
        if seg.ring_id not in result.averaged or not any(allreduce.OPTIM_SEP in n for n in seg.names):
            continue
        offset = 0
        for name in seg.names:
            numel = named[name].numel()
            part = snapshots[seg.ring_id][offset:offset + numel]
            if allreduce.OPTIM_SEP in name and numel and float(part.min()) >= 0:
                named[name].clamp_(min=0)
            offset += numel
