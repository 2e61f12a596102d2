"""A node's part in cross-cluster averaging: ring sockets, round schedule, applying the result.

Every ``sync_every`` optimizer steps the compute thread snapshots this stage's segments (version v)
and hands them to the event loop; the rings run there while training goes on, and the compute
thread later adds (average - snapshot) to its live weights, keeping the updates made meanwhile.
A stage that is ``averaging_lead`` steps past the snapshot of a round not finished yet (another
cluster is behind) waits for it there, so no cluster runs further ahead of the others.
With ``overlap_averaging: false`` the compute thread instead waits for the round (synchronous data
parallelism; used by the equivalence test).

Round ids come from the plan epoch (the broker raises it whenever the rings change, and starts it from
its clock, so it grows across broker restarts too) and a count of this stage's optimizer steps since
the stage saw that epoch: ``epoch * ROUNDS_PER_EPOCH + k``.  Every member of a ring agrees on them
without talking to the broker, and a cluster that was away (or restarted) joins the next round the
others start, whatever its own version.  When the epoch changes, every open round of the old one is
abandoned at once on every node (their rings cannot finish), and a stage never holds back for longer
than a heartbeat or two on a round that does not finish: a dead member costs the others no training time.
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

from ravq.average import catchup
from ravq.average import ring as allreduce
from ravq.average.ring import Mailbox, RoundResult, Segment
from ravq.net.compress import Format, Packed
from ravq.config import Plan, Topology
from ravq.metrics import Metrics
from ravq.stage.split import build_task_model, split_model
from ravq.stage.optim import set_clusters
from ravq.stage.pipeline import StageWorker
from ravq.average.ring_compression import RingCompression
from ravq.net.transport import Inbox, Outlink, SocketOptions, endpoint
from ravq.net.wire import DecodeLimits, Message, MsgType

log = logging.getLogger(__name__)

PENDING_ROUNDS = 2
"""Snapshots waiting for their round; when more would queue, the new round is skipped (and its ring
peers told, so they abandon it at once)."""
ROUNDS_PER_EPOCH = 1 << 20
FINAL_ROUND = ROUNDS_PER_EPOCH - 1
"""The last round of a run in which a cluster was disrupted: once every member finished, it brings
every cluster to the same weights (clusters that were away end at different step counts)."""


class RingLinks:
    """``allreduce.RingLink`` over one DEALER per ring peer."""

    def __init__(self, me: str, outlinks: dict[str, Outlink], fault: str | None = None) -> None:
        self.me, self.outlinks = me, outlinks
        self._kill_round = int(fault.split(":")[1]) if fault and fault.startswith("kill_in_round:") else None

    async def send(self, peer: str, meta: dict[str, int], tensor: torch.Tensor | Packed) -> None:
        await self.outlinks[peer].send(ring_chunk(self.me, meta, tensor))
        if self._kill_round is not None and meta["round"] % ROUNDS_PER_EPOCH >= self._kill_round:
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
    waited: bool = False
    """The stage held back for it once and trained on: it is not waited for again."""


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
        """Compressed rings with error feedback (ravq.average.ring_compression); None sends float32 as it is."""
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
        self._skips: asyncio.Queue[tuple[int, list[Segment]]] = asyncio.Queue()
        self._epoch = -1
        """The plan epoch this stage counts rounds in (compute thread)."""
        self._steps_in_epoch = 0
        self._seen_epoch = -1
        """The newest plan epoch the event loop has acted on (aborting older rounds)."""
        self.hold_s = 1.5 * topology.timeouts.heartbeat_interval_s
        """A stage holding back for a round stops waiting while a member of its rings has sent the broker
        no heartbeat for this long (it is slow to die, not slow to train); it trains on and the round
        applies if it ends.  A member that is merely behind is waited for, as ``averaging_lead`` asks,
        and so is a member heard from again: a live member can look silent for a moment (its heartbeat's
        interval, then the broker's, more on a slow PC whose event loop shares a small CPU with its
        compute thread).  When a round once released was never waited for again, a full-core PC averaging
        with PCs of 0.14 core took them for dead every few rounds, ran ahead, skipped most rounds (5 of 50
        ran) and trained on alone."""
        self.silent_s: Callable[[str], float] = lambda node: 0.0
        """Seconds since a node's last heartbeat reached the broker (set by the node from membership)."""
        self.skipped = 0
        self.final_done = False
        self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        """The node's event loop (the Averager is made in it): rounds queue there from the first step on."""
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
        self.ctx, self.limits, self.sock_opts = ctx, limits, sock_opts
        self.link = RingLinks(me, self.outlinks, os.environ.get("RAVQ_FAULT"))
        set_clusters(worker.optimizer, self.live_clusters())  # before the compute thread's first step

    def live_clusters(self, plan: Plan | None = None) -> int:
        """Clusters averaging with this node under the plan (1 once its own cluster is dropped)."""
        plan = plan or self.plan()
        live = [c for c in range(len(plan.clusters)) if c not in plan.excluded]
        return len(live) if self.cluster in live else 1

    def segments(self, plan: Plan | None = None) -> list[Segment]:
        """This node's segments under the plan (default: current; dropped clusters take no part)."""
        plan = plan or self.plan()
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
        self._hold_back(worker)
        plan = self.plan()
        set_clusters(worker.optimizer, self.live_clusters(plan))  # the next step's (a dropped cluster counts no more)
        if plan.epoch != self._epoch:
            self._epoch, self._steps_in_epoch = plan.epoch, 0
        self._steps_in_epoch += 1  # every step counts, or this stage's round ids drift from its peers'
        if self._steps_in_epoch % self.sync_every or self.loop is None:
            return
        segments = self.segments(plan)
        if not segments:
            return
        named = self.tensors()
        snapshots = allreduce.snapshot_segments(named, segments)
        done: concurrent.futures.Future[RoundResult] = concurrent.futures.Future()
        round_id = plan.epoch * ROUNDS_PER_EPOCH + min(self._steps_in_epoch // self.sync_every - 1, FINAL_ROUND - 1)
        self.loop.call_soon_threadsafe(self._enqueue, (round_id, snapshots, segments, done))
        if not self.overlap:
            t0 = time.monotonic()
            finished = self._wait_round(worker, done, round_id) == "done"
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
            oldest = next((p for p in self._pending if not p.waited), None)
            if oldest is None or worker.version - oldest.version < self.lead:
                break
            assert oldest.done is not None
            if not oldest.done.done():
                gone = self._gone(oldest)
                if gone():  # a member is silent: train on; waited for again once it is heard from
                    break
                t0 = time.monotonic()
                outcome = self._wait_round(worker, oldest.done, oldest.round_id, gone=gone)
                if worker.should_abort():
                    self._pending.remove(oldest)
                    continue
                self.hold_backs += 1
                self.held_s += time.monotonic() - t0
                worker.waited("averaging", time.monotonic() - t0)
                if outcome == "gone":
                    break
                if outcome != "done":  # the round outlived its own limit: train on; it applies if it ends
                    oldest.waited = True
                    continue
            self._apply_finished()

    def _gone(self, pending: _Pending) -> Callable[[], bool]:
        """Whether a node of a cluster in the round's rings has been silent (no heartbeat) for ``hold_s``:
        a dead node stops its whole cluster, so its ring members, alive, would never reach the round."""
        plan = self.plan()
        members = {m for seg in pending.segments for m in seg.ring}
        nodes = {n for cluster in plan.clusters if members & set(cluster.nodes) for n in cluster.nodes} - {self.me}
        return lambda: any(self.silent_s(n) > self.hold_s for n in nodes)

    def _wait_round(self, worker: StageWorker, done: concurrent.futures.Future[RoundResult], round_id: int,
                    gone: Callable[[], bool] | None = None) -> str:
        """Block the compute thread until the round is done ("done"); "gone" once ``gone()`` says a member
        went silent, "timeout" if it does not finish within a round's own limit, "abort" if the process
        gives up meanwhile (a forced stop must not wait for a ring's timeouts)."""
        deadline = time.monotonic() + self._round_limit_s()
        while not worker.should_abort():
            if gone is not None and gone():
                return "gone"
            try:
                done.result(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
                return "done"
            except concurrent.futures.TimeoutError:
                if time.monotonic() >= deadline:
                    log.warning("%s: round %d never finished; going on without it", self.me, round_id)
                    return "timeout"
        return "abort"

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

    def rename(self, renamed: dict[str, str]) -> None:
        """Event loop: nodes that took over other nodes' stages (standbys) hold their tensors now."""
        for owners in self.owners:
            for name, node in owners.items():
                owners[name] = renamed.get(node, node)
        for old, new in renamed.items():
            if old in self.outlinks:
                self.outlinks.pop(old).close()
            if new != self.me and new not in self.outlinks and any(new in o.values() for o in self.owners):
                peer = self.topology.node(new)
                self.outlinks[new] = Outlink.connect(self.ctx, endpoint(peer.host, peer.ring_port), "ring", new,
                                                     self.metrics, self.limits, self.sock_opts, identity=self.me)

    def reset(self) -> None:
        """Compute thread, at a pause: forget rounds not applied yet (the stage may load new weights,
        and the rounds of the old plan are abandoned anyway)."""
        self._pending.clear()

    # ------------------------------------------------------------ event loop
    def on_plan(self, plan: Plan) -> None:
        """A new plan epoch: abandon at once every open round of an older one (their rings changed;
        queued ones are skipped when their turn comes)."""
        if plan.epoch > self._seen_epoch:
            self._seen_epoch = plan.epoch
            if aborted := self.mailbox.abort_open("plan_changed"):
                log.info("%s: plan epoch %d: abandoned %d open ring round(s)", self.me, plan.epoch, aborted)

    def _enqueue(self, item: tuple[int, dict[int, torch.Tensor], list[Segment],
                                   concurrent.futures.Future[RoundResult]]) -> None:
        """Queue a round without ever blocking the compute thread; when the queue is full (a ring is
        stuck or a member slow), skip the round and tell its ring peers, who abandon it at once."""
        round_id, _, segments, done = item
        try:
            self.rounds.put_nowait(item)
        except asyncio.QueueFull:
            log.warning("%s: round %d skipped: %d rounds already wait for their rings", self.me, round_id,
                        self.rounds.qsize())
            self.skipped += 1
            self._skips.put_nowait((round_id, segments))
            done.set_result(RoundResult(aborted={s.ring_id: allreduce.RingAborted(s.ring_id, round_id, "skipped")
                                                 for s in segments}))

    async def send_skips(self) -> None:
        """Tell ring peers about skipped rounds (best effort: RING_ABORT to every member)."""
        while True:
            round_id, segments = await self._skips.get()
            for seg in segments:
                for peer in seg.ring:
                    if peer != self.me:
                        try:
                            async with asyncio.timeout(self.hold_s):
                                await self.link.send_abort(peer, seg.ring_id, round_id, "skipped")
                        except TimeoutError:
                            log.debug("%s: skip of round %d not sent to %s", self.me, round_id, peer)

    async def serve(self) -> None:
        """The ring socket's one reader."""
        self.loop = asyncio.get_running_loop()
        while True:
            identity, msg = await self.inbox.recv()
            piece = allreduce.received_piece(msg.meta, msg.tensors, msg.packed)
            if msg.type == MsgType.RING_CHUNK and piece is not None:
                self.mailbox.deliver(msg.sender, msg.meta, piece)
            elif msg.type == MsgType.RING_ABORT:
                self.mailbox.deliver_abort(msg.sender, msg.meta["ring"], msg.meta["round"],
                                           str(msg.meta.get("reason", ""))[:64])
            elif msg.type == MsgType.CATCHUP_REQ:
                await self._answer_catchup(identity, msg)
            else:
                self.metrics.bad_messages.labels("ring", "unexpected_message").inc()

    async def _answer_catchup(self, identity: bytes, msg: Message) -> None:
        """Hand a (re)joining peer our copy of the tensors it asks for, read in the compute thread."""
        names = catchup.requested_names(msg, self.worker)
        if names is None:
            self.metrics.bad_messages.labels("ring", "bad_catchup_request").inc()
            await self.inbox.reply(identity, catchup.reply_for(self.me, msg, None, "bad request"), msg.sender)
            return
        tensors = await self.in_compute(lambda w: catchup.stage_tensors(w, names))
        await self.inbox.reply(identity, catchup.reply_for(self.me, msg, tensors), msg.sender)
        log.info("%s: sent %d tensors to %s for its catch-up", self.me, len(tensors), msg.sender)

    async def in_compute(self, fn: Callable[[StageWorker], Any]) -> Any:
        """Run ``fn(worker)`` in the compute thread (or in a helper thread once that has ended)."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def call(w: StageWorker) -> None:
            try:
                future.set_result(fn(w))
            except Exception as err:  # noqa: BLE001 (handed to the awaiting coroutine, which raises it)
                future.set_exception(err)

        if not self.worker.call(call):
            await asyncio.to_thread(call, self.worker)
        return await asyncio.wrap_future(future)

    async def fetch_catchup(self) -> dict[str, torch.Tensor]:
        """This stage's tensors from their live holders in another cluster (CatchupError if none)."""
        plan = self.plan()
        by_node = catchup.holders(plan, self.cluster, self.owners, list({**self.worker.params, **self.worker.buffers}))
        t0 = time.monotonic()
        tensors = await catchup.fetch(self.outlinks, self.me, by_node, self.topology.timeouts.request_s)
        self.metrics.catchup_seconds.observe(time.monotonic() - t0)
        log.info("%s: fetched %d tensors from %s in %.2fs", self.me, len(tensors), ", ".join(sorted(by_node)),
                 time.monotonic() - t0)
        return tensors

    async def run_rounds(self) -> None:
        self.loop = asyncio.get_running_loop()
        while True:
            round_id, snapshots, segments, done = await self.rounds.get()
            try:
                if round_id // ROUNDS_PER_EPOCH < self.plan().epoch:  # its rings changed: it cannot finish
                    result = RoundResult(aborted={s.ring_id: allreduce.RingAborted(s.ring_id, round_id, "plan_changed")
                                                  for s in segments})
                else:
                    result = await allreduce.average_segments(
                        snapshots, segments, me=self.me, round_id=round_id, link=self.link, mailbox=self.mailbox,
                        piece_bytes=self.piece_bytes, timeout_s=self.timeout_s, compression=self.compression)
                self._account(round_id, result)
                done.set_result(result)
            finally:
                self.rounds.task_done()

    async def final_round(self, wait_s: float) -> bool:
        """After training, when a cluster was disrupted during the run: one last round over the whole
        stage, so every training cluster ends with the same weights.  Retried under a new plan when a
        member is lost meanwhile; True if it finished."""
        while True:
            plan = self.plan()
            segments = self.segments(plan)
            if not segments:
                return False
            outcome = await self._final_once(plan, segments, wait_s)
            if outcome is None:
                self.final_done = True
                log.info("%s: final averaging round done (%d rings)", self.me, len(segments))
                return True
            if self.plan().epoch == plan.epoch:
                log.warning("%s: final averaging round failed: %s", self.me, outcome)
                return False

    async def _final_once(self, plan: Plan, segments: list[Segment], wait_s: float) -> str | None:
        """One attempt; None if it finished and was applied, else why not."""
        named, snapshots = await self.in_compute(
            lambda w: (named := self.tensors(), allreduce.snapshot_segments(named, segments)))
        result = await allreduce.average_segments(
            snapshots, segments, me=self.me, round_id=plan.epoch * ROUNDS_PER_EPOCH + FINAL_ROUND,
            link=self.link, mailbox=self.mailbox, piece_bytes=self.piece_bytes, timeout_s=wait_s)
        if result.aborted:
            return ", ".join(sorted({e.reason for e in result.aborted.values()}))
        await self.in_compute(lambda w: allreduce.apply_round(named, segments, snapshots, result))
        return None

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
