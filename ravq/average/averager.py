"""A node's part in cross-cluster averaging: round schedule, applying the result, catch-up answers.

Every ``sync_every`` optimizer steps the compute thread snapshots this stage's segments (version v)
and hands them to the event loop; the rings run there while training goes on, and the compute
thread later adds (average - snapshot) to its live weights, keeping the updates made meanwhile.
A stage that is ``averaging_lead`` steps past the snapshot of a round not finished yet (another
cluster is behind) waits for it there, so no cluster runs further ahead of the others.
With ``overlap_averaging: false`` the compute thread instead waits for the round (synchronous data
parallelism; used by the equivalence test).

Round ids come from the plan epoch (the broker stamps it from its clock whenever the rings change, so it
grows across broker restarts too) and a count of this stage's optimizer steps since the stage saw that
epoch (paced by time, of ``period_s`` since the stamp): ``epoch * ROUNDS_PER_EPOCH + k``.  Every member
of a ring agrees on them without talking to the broker, and a cluster that was away (or restarted) joins
the next round the others start, whatever its own version.  When the epoch changes, every open round of
the old one is abandoned at once on every node (their rings cannot finish), and a stage never holds back
for longer than a heartbeat or two on a round that does not finish: a dead member costs the others no
training time.  In groups mode (``ravq.average.group_rounds``) a round's rings span its group only, and a
new epoch abandons only the rounds of groups it touched; paced by rate, a cluster's round follows its share.
The ring sockets are the node's (``ravq.node.ring_port``): the averager gets them built, as a ``Port``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from ravq.average import catchup
from ravq.average.compute import in_compute
from ravq.average.correction import PendingRound, correct, keep_non_negative_state, outer_step, record_applied
from ravq.average.group_rounds import RoundGroups, live_clusters
from ravq.average.mailbox import BUSY_WAITS, Mailbox
from ravq.average.owners import averaged_tensors
from ravq.average.port import Port
from ravq.average.ring_compression import RingCompression
from ravq.average.round_queue import RoundQueue
from ravq.average.rounds import FINAL_ROUND, ROUNDS_PER_EPOCH, RoundResult, apply_round, average_segments
from ravq.average.segments import (
    Segment,
    optimizer_state_tensors,
    plan_segments,
    segments_for,
    snapshot_segments,
)
from ravq.codec.compress import Format
from ravq.config import Plan, Topology
from ravq.metrics import Metrics
from ravq.net.wire import Message
from ravq.stage.optim import set_clusters
from ravq.stage.pipeline import StageWorker
from ravq.stage.tied_hold import hand_over, held_params, tied_sinks

log = logging.getLogger(__name__)


class Averager:
    """One stage's averaging: its segments' rings, the rounds it snapshots and how they apply.

    The compute thread calls ``on_update`` after every optimizer step; the node's task group runs
    ``serve``, ``run_rounds`` and ``send_skips`` on the event loop.

    It gets its node's ring sockets (``port``, linked to ``ravq.average.owners.ring_peers(owners)``) and
    the ring ``owners`` (``ravq.average.owners.ring_owners``, computed in the node's build thread) built."""

    def __init__(self, *, topology: Topology, plan: Callable[[], Plan], me: str, cluster: int,
                 worker: StageWorker, model: torch.nn.Module, task: Any, metrics: Metrics, port: Port,
                 owners: list[dict[str, str]], silent_s: Callable[[str], float], run_id: str | None,
                 compute_timer: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
                 ) -> None:
        self.topology, self.me, self.cluster, self.worker = topology, me, cluster, worker
        self.metrics = metrics
        t = topology.training
        self.sync_every, self.overlap = t.sync_every, t.overlap_averaging
        self.piece_bytes, self.timeout_s = t.ring_chunk_bytes, topology.timeouts.ring_step_s
        self.with_state = t.average_optimizer_state
        self.outer_lr, self.lead = t.outer_lr, t.averaging_lead
        ring_format = Format(t.compress.ring)
        self.compression = (RingCompression(ring_format, t.compress.int8_block)
                            if ring_format is not Format.NONE else None)
        """Compressed rings with error feedback (ravq.average.ring_compression); None: float32 as it is."""
        self.anchors: dict[tuple[str, ...], torch.Tensor] = {}
        self._pending: list[PendingRound] = []
        """Overlapped rounds snapshotted and not applied yet, oldest first (compute thread only)."""
        held = {**held_params(worker), **worker.buffers}
        self.initial = {n: v.detach().to("cpu").clone() for n, v in held.items()}
        self.names, self.numels = averaged_tensors(model, task, self.with_state)
        self.owners = owners
        """For each cluster, tensor name -> its holder (renamed when standbys take stages over)."""
        self.plan = plan
        self.mailbox = Mailbox(refuse=lambda *abort: self.queue.refuse(*abort))
        self.groups = RoundGroups(topology.averaging, cluster, t.sync_every, metrics, skip=self._skipped)
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
        self.silent_s = silent_s
        """Seconds since a node's last heartbeat reached the broker (the node's membership says)."""
        self.final_done = False
        self.run_id = run_id
        """The run this stage's weights belong to (told to a peer catching up from them)."""
        self.compute_timer = compute_timer
        """A context around this averager's own work in the compute thread (``on_update``, applying a
        round): the profiler times it (``ravq.profile.averaging_cost``); by default nothing."""
        self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        """The node's event loop (the Averager is made in it): rounds queue there from the first step on."""
        self.hold_backs, self.held_s = 0, 0.0
        self.port = port
        self.queue = RoundQueue(me=me, plan=plan, mailbox=self.mailbox, link=self.port.link, metrics=metrics,
                                piece_bytes=self.piece_bytes, timeout_s=self.timeout_s, notify_s=self.hold_s,
                                compression=self.compression, spared=self.groups.spared)
        set_clusters(worker.optimizer, self.groups.effective_clusters(plan()))  # before the first step

    def live_clusters(self, plan: Plan | None = None) -> int:
        """Clusters averaging with this node under the plan (1 once its own cluster is dropped)."""
        live = live_clusters(plan or self.plan())
        return len(live) if self.cluster in live else 1

    def segments(self, plan: Plan | None = None) -> list[Segment]:
        """This node's segments under the plan (default: current; dropped clusters take no part)."""
        plan = plan or self.plan()
        if self.live_clusters(plan) < 2:
            return []
        segs = plan_segments(self.names, self.numels, self.owners, plan.excluded)
        return segments_for(self.me, segs)

    def tensors(self) -> dict[str, torch.Tensor]:
        worker = self.worker
        # a tied weight's every name
        named: dict[str, torch.Tensor] = {**held_params(worker), **worker.buffers}
        if self.with_state:
            named.update(optimizer_state_tensors(worker.optimizer, held_params(worker)))
        return named

    # ------------------------------------------------------------ compute thread
    def on_update(self, worker: StageWorker) -> None:
        """Called by the stage after each optimizer step, in the compute thread (inside ``compute_timer``)."""
        with self.compute_timer():
            self._after_step(worker)

    def _after_step(self, worker: StageWorker) -> None:
        self._hold_back(worker)
        plan = self.plan()
        # the next step's count (a dropped cluster counts no more; unequal shares count less)
        set_clusters(worker.optimizer, self.groups.effective_clusters(plan))
        due = self.groups.step(plan, self.segments)  # this round's group's rings
        if due is None or self.loop is None:
            return
        round_id, segments = due
        snapshots = snapshot_segments(named := self.tensors(), segments)
        done: concurrent.futures.Future[RoundResult] = concurrent.futures.Future()
        sent = self.groups.weighed(plan, round_id, snapshots)  # samples-weighted mix under rate pacing
        self.loop.call_soon_threadsafe(self.queue.enqueue, (round_id, sent, segments, done))
        if not self.overlap:
            t0 = time.monotonic()
            finished = self._wait_round(worker, done, round_id) == "done"
            worker.waited("averaging", time.monotonic() - t0)
            if finished:
                self._apply(named, segments, snapshots, done.result())
            return
        extra = self.groups.extra_lead(plan, round_id % ROUNDS_PER_EPOCH)  # a slow ring's span (by link)
        self._pending.append(PendingRound(round_id, worker.version, done, segments, snapshots, extra=extra))
        done.add_done_callback(lambda f: worker.submit(lambda w: self._apply_finished()))

    def _skipped(self, round_id: int, segments: list[Segment]) -> None:
        if self.loop is not None:  # a round of the old epoch this stage will not run: tell its peers
            self.loop.call_soon_threadsafe(self.queue.skip, round_id, segments)

    def _hold_back(self, worker: StageWorker) -> None:
        """Wait for the oldest unfinished round once this stage is ``lead`` steps past its snapshot.

        A round finishes when the slowest cluster reaches its version; until then a faster cluster
        trains on without the other clusters' progress, and the steps it runs ahead are steps on a
        model the others have not caught up with.  Bounding the lead keeps the clusters within
        ``averaging_lead`` steps of one another; in-flight micro-batches stay where they are."""
        while self._pending and self._pending[0].overdue(worker.version, self.lead):
            oldest = next((p for p in self._pending if not p.waited), None)
            if oldest is None or not oldest.overdue(worker.version, self.lead):
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

    def _gone(self, pending: PendingRound) -> Callable[[], bool]:
        """Whether a node of a cluster in the round's rings has been silent (no heartbeat) for ``hold_s``:
        a dead node stops its whole cluster, so its ring members, alive, would never reach the round."""
        plan = self.plan()
        members = {m for seg in pending.segments for m in seg.ring}
        nodes = {n for cluster in plan.clusters if members & set(cluster.nodes) for n in cluster.nodes}
        nodes.discard(self.me)
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
        """Longest a compute thread waits on the event loop for a round: its ring steps' timeouts and more (a
        step waits up to ``BUSY_WAITS`` more while its peer is busy elsewhere: ``Mailbox.take``)."""
        return (4 + BUSY_WAITS) * self.timeout_s + 10

    def _apply_finished(self) -> None:
        """Apply every round that has finished and is not applied yet, oldest first."""
        for pending in list(self._pending):
            if pending.done is not None and pending.done.done():  # _apply removes only its own round
                result = pending.done.result()
                self._apply(self.tensors(), pending.segments, pending.snapshots, result, pending)

    def _apply(self, named: dict[str, torch.Tensor], segments: list[Segment],
               snapshots: dict[int, torch.Tensor], result: RoundResult,
               pending: PendingRound | None = None) -> None:
        """Move each finished segment to the new common point, keeping progress made since the snapshot
        and, for an overlapped round, the rounds applied since it (``ravq.average.correction``)."""
        worker = self.worker
        with self.compute_timer():
            if pending is not None:
                self._pending.remove(pending)
                correct(pending, segments, snapshots, result)
            shifts = outer_step(segments, result, self.anchors, self.initial, self.outer_lr)
            # Buffers get new storage before the delta lands: forwards in flight saved the old tensors
            # (BatchNorm's running statistics) and must find them unchanged at backward.
            averaged = [seg for seg in segments if seg.ring_id in result.averaged]
            moved = [n for seg in averaged for n in seg.names if n in worker.buffers]
            if moved:
                named = {**named, **worker.fresh_buffers(moved)}
            worker.before_weight_change()  # the same for the weights forwards in flight run on
            named, sinks = tied_sinks(worker, named)  # a tied weight's delta reaches every copy in step order
            deltas = apply_round(named, segments, snapshots, result)
            hand_over(worker, sinks)
            if self.compression is not None:
                keep_non_negative_state(named, segments, snapshots, result)
            record_applied(self._pending, segments, deltas, shifts)

    def rename(self, renamed: dict[str, str]) -> None:
        """Event loop: nodes that took over other nodes' stages (standbys) hold their tensors now."""
        for owners in self.owners:
            for name, node in owners.items():
                owners[name] = renamed.get(node, node)
        self.port.rename(renamed, lambda node: any(node in o.values() for o in self.owners))

    def reset(self) -> None:
        """Compute thread, at a pause: forget rounds not applied yet (the stage may load new weights,
        and the rounds of the old plan are abandoned anyway)."""
        self._pending.clear()

    # ------------------------------------------------------------ event loop
    def on_plan(self, plan: Plan) -> None:
        """A new plan epoch: abandon every open round of an older one at once (queued ones are skipped in
        turn) and link ring peers new to this node, keeping every other link (``RingPort.ensure``)."""
        if plan.epoch > self._seen_epoch:
            self._seen_epoch = plan.epoch
            if aborted := self.mailbox.abort_open("plan_changed", self.groups.touched(plan)):
                log.info("%s: plan epoch %d: abandoned %d open ring round(s)", self.me, plan.epoch, aborted)
            self.port.ensure(m for seg in self.segments(plan) for m in seg.ring)

    async def serve(self) -> None:
        """The ring socket's one reader."""
        self.loop = asyncio.get_running_loop()
        await self.port.serve(self.mailbox, self._answer_catchup)

    async def run_rounds(self) -> None:
        """Run the rounds the compute thread queues, one at a time."""
        self.loop = asyncio.get_running_loop()
        await self.queue.run()

    async def send_skips(self) -> None:
        """Tell ring peers about skipped rounds (best effort: RING_ABORT to every member)."""
        await self.queue.send_skips()

    async def drain(self) -> None:
        """Wait until every queued round has finished (at the end of training)."""
        await self.queue.drain()

    def finish(self) -> None:
        """Event loop, after the node's last round: every later round a peer starts is refused at once."""
        self.mailbox.finish()

    async def _answer_catchup(self, identity: bytes, msg: Message) -> None:
        """Hand a (re)joining peer our copy of the tensors it asks for, read in the compute thread."""
        names = catchup.requested_names(msg, self.worker)
        if names is None:
            self.metrics.bad_messages.labels("ring", "bad_catchup_request").inc()
            await self.port.reply(identity, catchup.reply_for(self.me, msg, None, "bad request"), msg.sender)
            return
        tensors, version = await self.in_compute(lambda w: (catchup.stage_tensors(w, names), w.version))
        lineage = {"run_id": self.run_id, "version": version}  # read with the tensors: one consistent copy
        await self.port.reply(identity, catchup.reply_for(self.me, msg, tensors, lineage=lineage), msg.sender)
        log.info("%s: sent %d tensors to %s for its catch-up", self.me, len(tensors), msg.sender)

    async def in_compute(self, fn: Callable[[StageWorker], Any]) -> Any:
        """Run ``fn(worker)`` in the compute thread (``ravq.average.compute.in_compute``)."""
        return await in_compute(self.worker, fn)

    async def fetch_catchup(self, lineages: dict[str, dict[str, Any]] | None = None,
                            source: int | None = None) -> dict[str, torch.Tensor]:
        """This stage's tensors from their live holders in another cluster (``source`` when it trains;
        CatchupError if none); each holder's lineage (run id, version) goes into ``lineages``."""
        names = list({**self.worker.params, **self.worker.buffers})
        by_node = catchup.holders(self.plan(), self.cluster, self.owners, names, source)
        t0 = time.monotonic()
        tensors = await catchup.fetch(self.port.outlinks, self.me, by_node, self.topology.timeouts.request_s,
                                      lineages)
        self.metrics.catchup_seconds.observe(time.monotonic() - t0)
        log.info("%s: fetched %d tensors from %s in %.2fs", self.me, len(tensors), ", ".join(sorted(by_node)),
                 time.monotonic() - t0)
        return tensors

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
            lambda w: (named := self.tensors(), snapshot_segments(named, segments)))
        result = await average_segments(
            snapshots, segments, me=self.me, round_id=plan.epoch * ROUNDS_PER_EPOCH + FINAL_ROUND,
            link=self.port.link, mailbox=self.mailbox, piece_bytes=self.piece_bytes, timeout_s=wait_s)
        if result.aborted:
            return ", ".join(sorted({e.reason for e in result.aborted.values()}))
        def apply(w: StageWorker) -> None:
            w.before_weight_change()
            live, sinks = tied_sinks(w, named)
            apply_round(live, segments, snapshots, result)
            hand_over(w, sinks)

        await self.in_compute(apply)
        return None

    def stats(self) -> dict[str, Any]:
        named = self.tensors()
        segments = self.segments()
        return {"allreduce_rounds": self.queue.completed, "allreduce_aborts": self.queue.aborts,
                "ring_size": len(segments[0].ring) if segments else 0,
                "averaging_group": list(self.groups.last),
                "segment_bytes": sum(named[n].numel() * named[n].element_size()
                                     for s in segments for n in s.names if n in named),
                "allreduce_seconds_mean": self.queue.mean_seconds(),
                "averaging_waits": self.hold_backs, "averaging_wait_seconds": self.held_s}

    def close(self) -> None:
        self.port.close()
