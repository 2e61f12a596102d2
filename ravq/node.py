"""One node's lifecycle: create -> run -> shutdown.

``create`` joins the broker (snapshot + subscription, clone pattern), learns this node's cluster and
stage from the plan, builds its stage and binds its sockets.  ``run`` owns every task in one
TaskGroup: socket readers, the sender, heartbeats, averaging and the compute thread (the only place
torch trains).  ``shutdown`` writes the final checkpoint and summary and closes every socket.

Churn: the node follows its cluster's state as the broker publishes it (``brokers.book``).  When a
member is lost or restarts, the cluster's generation rises: the node pauses (its stage drops the work
in flight and keeps weights and optimizer), and once every member is up again it catches up (from
live holders in other clusters when the broker says so) and reports ready; when all are ready the
broker lets the cluster train again.  A node exits only on a signal, at the end of training, or after
``timeouts.give_up_s`` paused.  A node that starts while its cluster is not starting (it restarted)
loads its checkpoint, if any, and joins through the same recovery.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import zmq
import zmq.asyncio

from ravq.stage import checkpoint
from ravq.average.averager import Averager
from ravq.swarm.churn import ChurnMixin
from ravq.net.compress import Format, Packed
from ravq.config import Plan, Topology, resolve_task_module
from ravq.net.limits import derived_max_message_bytes, largest_inbound_frame
from ravq.swarm.membership import Membership
from ravq.metrics import Metrics
from ravq.stage.split import build_task_model, split_model, stage_input_specs
from ravq.stage.pipeline import Outbound, StageOptions, StageWorker, model_input_needs
from ravq.net.security import socket_options_for
from ravq.net.transport import Inbox, Outlink, endpoint
from ravq.tuning import cpu_budget
from ravq.net.wire import DecodeLimits, Message, MsgType

log = logging.getLogger(__name__)


class _Finished(Exception):
    """Raised inside the TaskGroup to end it once training and draining are over."""


@dataclass(kw_only=True, slots=True)
class NodeOptions:
    summary_path: str | None = None
    """Where to write this node's JSON summary at exit."""
    threads: int | None = None
    """torch intra-op threads for the compute thread (None: torch's default)."""
    key_dir: str | None = None
    """Directory with this node's CURVE secret key (when the topology enables CURVE)."""


class Node(ChurnMixin):
    def __init__(self, topology: Topology, name: str, options: NodeOptions, metrics: Metrics) -> None:
        self.topology, self.name, self.options, self.metrics = topology, name, options, metrics
        self.config = topology.node(name)
        self.task = resolve_task_module(topology.task)
        t = topology.limits
        self.sock_opts = socket_options_for(topology, name, options.key_dir, metrics)
        self.limits = DecodeLimits(max_header_bytes=t.max_header_bytes, max_frames=t.max_frames,
                                   max_tensor_bytes=self.sock_opts.max_message_bytes)
        self.largest_frame = 0
        self.ctx = zmq.asyncio.Context()
        self.membership = Membership(self.ctx, topology, name, metrics, self.limits, self.sock_opts)
        self.links: dict[int, Outlink] = {}
        self.outbound: asyncio.Queue[Outbound] = asyncio.Queue()
        self.worker: StageWorker | None = None
        self.plan: Plan | None = None
        self.cluster = self.stage = -1
        self.averager: Averager | None = None
        self.model: torch.nn.Module | None = None
        self.failure: str | None = None
        self._draining = False
        self._force = asyncio.Event()
        self._started_at = time.time()
        self.run_id: str | None = None
        """The run this stage's weights belong to: the broker's, or the resumed checkpoint's."""
        self.generation = 0
        """The cluster generation this node works in; pipeline messages of any other are dropped."""
        self.phase = "starting"
        self.ready = -1
        self.rejoining = False
        self._stage_bytes = 0
        """What this stage takes in memory (weights, gradients, optimizer state, a stash per micro-batch in
        flight): a standby replacing this node needs at least as much."""
        self._paused_since: float | None = None
        self._beat_now = asyncio.Event()

    # ------------------------------------------------------------------ create
    async def create(self, tg: asyncio.TaskGroup) -> None:
        threads = self.options.threads or cpu_budget()
        if self.options.threads or threads < torch.get_num_threads():
            torch.set_num_threads(threads)  # torch alone sizes its pool by the cores, not the cgroup quota
        log.info("%s: torch uses %d thread(s)%s", self.name, torch.get_num_threads(),
                 "" if self.options.threads else " (CPU affinity and cgroup quota)")
        if self.config.metrics_port is not None:
            self.metrics.serve(self.config.metrics_port, self.config.bind_host or self.config.host)
        self.plan = await self.membership.join()
        self.run_id = self.membership.run_id
        tg.create_task(self._heartbeats())  # from now on: the broker must not think us lost while we build
        try:
            self.cluster, self.stage = self.plan.locate(self.name)
        except KeyError:
            self.plan = await self._standby()
            self.cluster, self.stage = self.plan.locate(self.name)
        self.metrics.set_role("node", self.cluster, self.stage)
        state = self.membership.cluster_state(self.cluster)
        self.rejoining = state["state"] != "starting"
        if self.rejoining:
            self.generation, self._paused_since = int(state["generation"]), time.monotonic()
            self._set_phase("paused")
            log.info("%s: cluster %d is %s (generation %d): rejoining", self.name, self.cluster, state["state"],
                     self.generation)
        self.worker = await asyncio.to_thread(self._build_worker, self.plan)
        self._derive_limits()
        self.worker.generation, self.worker.paused = self.generation, self.rejoining
        self.worker.cluster_done = self._stage0_finished
        weights = sum(t.numel() * t.element_size() for t in {**self.worker.params, **self.worker.buffers}.values())
        self._stage_bytes = weights * (3 + self.worker.options.max_inflight)
        bind = self.config.bind_host or self.config.host
        self.inbox = Inbox.bind(self.ctx, endpoint(bind, self.config.pipeline_port), "pipeline", self.metrics,
                                self.limits, self.sock_opts)
        cluster = self.plan.clusters[self.cluster]
        self.stage_of = {n: i for i, n in enumerate(cluster.nodes)}
        peers = set(self.worker.spec.consumer_stages) | set(self.worker.spec.producer_stages)
        if self.worker.is_first:
            peers |= set(self.worker._first_destinations())
        for s in sorted(peers):
            peer = self.topology.node(cluster.nodes[s])
            self.links[s] = Outlink.connect(self.ctx, endpoint(peer.host, peer.pipeline_port), "pipeline",
                                            peer.name, self.metrics, self.limits, self.sock_opts, identity=self.name)
        if len(self.plan.clusters) > 1:
            self.averager = Averager(ctx=self.ctx, topology=self.topology, plan=self._current_plan, me=self.name,
                                     cluster=self.cluster, worker=self.worker, model=self.model,
                                     stage_names=self.stage_names, task=self.task,
                                     metrics=self.metrics, sock_opts=self.sock_opts, limits=self.limits)
            self.averager.silent_s = self.membership.silent_s
        everyone = [n for c in self.plan.clusters for n in c.nodes] if self.averager else cluster.nodes
        if not self.rejoining:
            await self.membership.wait_for(everyone, self.topology.timeouts.connect_s)
            self._set_phase("training")
        compress = self.topology.training.compress
        log.info("%s: cluster %d stage %d/%d ready (%d parameters; compression: pipeline %s, ring %s)", self.name,
                 self.cluster, self.stage, len(cluster.nodes), sum(p.numel() for p in self.worker.params.values()),
                 compress.pipeline, compress.ring)

    def _derive_limits(self) -> None:
        """Data sockets accept frames up to what this stage can legitimately receive (ravq.net.limits)."""
        if self.topology.limits.max_message_bytes is not None:
            return
        ring = self.topology.training.ring_chunk_bytes  # also with one cluster: a re-plan may add rings
        limit = derived_max_message_bytes(self.largest_frame, ring)
        self.sock_opts.max_message_bytes = limit
        self.limits = dataclasses.replace(self.limits, max_tensor_bytes=limit)
        log.info("%s: limits.max_message_bytes %d (2x the largest frame this stage receives, %d bytes)",
                 self.name, limit, max(self.largest_frame, ring))

    def _build_worker(self, plan: Plan) -> StageWorker:
        cluster = plan.clusters[self.cluster]
        training, seed = self.topology.training, self.topology.seed
        model = self.model = build_task_model(self.task, seed)
        example = self.task.example_inputs(training.micro_batch)
        specs = split_model(model, example, list(cluster.cuts))
        self.stage_names = [list(s.module.state_dict().keys()) for s in specs]
        spec = specs[self.stage]
        in_specs = stage_input_specs(specs, example)
        options = StageOptions(steps=training.steps, max_inflight=training.max_inflight or len(specs),
                               update_every=training.update_every, micro_batch=training.micro_batch,
                               predict_weights=training.predict_weights,
                               compress=Format(training.compress.pipeline), int8_block=training.compress.int8_block)
        batches = None
        if self.stage == 0:
            batches = iter(self.task.train_batches(training.micro_batch, self.cluster, len(plan.clusters), seed))
        _, target_example = next(iter(self.task.train_batches(training.micro_batch, 0, 1, seed)))
        self.largest_frame = largest_inbound_frame(specs, in_specs, self.stage, target_example)
        worker = StageWorker(spec, len(specs), self.task.make_optimizer, self.task.loss_fn, options,
                             device=self.config.device, batches=batches, cluster=self.cluster,
                             metrics=self.metrics, model_input_needs=model_input_needs(specs),
                             input_specs=in_specs[self.stage],
                             target_example=target_example)
        if training.checkpoint_dir:
            checkpoint.remove_temp_files(training.checkpoint_dir, self.cluster, self.stage)
        if (training.resume or self.rejoining) and training.checkpoint_dir:
            self._resume(worker)
        return worker

    def _resume(self, worker: StageWorker) -> None:
        assert self.topology.training.checkpoint_dir
        try:
            ckpt = checkpoint.load_stage(self.topology.training.checkpoint_dir, self.cluster, self.stage)
        except (FileNotFoundError, ValueError) as err:
            log.info("%s: no checkpoint to resume from (%s); starting from the seed", self.name, err)
            return
        worker.module.load_state_dict(ckpt.model)
        checkpoint.restore_optimizer(worker.optimizer, list(worker.params), ckpt.optimizer["tensors"],
                                     ckpt.optimizer["rest"])
        worker.version = ckpt.meta["version"]
        self.run_id = ckpt.meta.get("run_id") or self.run_id
        # count the micro-batches already trained towards training.steps
        done = ckpt.meta.get("trained", worker.version * self.topology.training.update_every)
        worker.stats.forwards = worker.stats.backwards = worker.trained = done
        if worker.batches is not None:
            for _ in range(ckpt.meta["data_position"]):
                next(worker.batches)
            worker.data_position = ckpt.meta["data_position"]
        log.info("%s: resumed at version %d (run %s)", self.name, worker.version, self.run_id)

    # ------------------------------------------------------------------ run
    def start(self, tg: asyncio.TaskGroup) -> None:
        """Start every task of the running node in ``tg``; the group ends with _Finished."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, self._on_signal)
        tg.create_task(self._read_pipeline())
        tg.create_task(self._send_loop())
        tg.create_task(self.membership.follow())
        tg.create_task(self._compute(loop))
        tg.create_task(self._force_exit_watch())
        tg.create_task(self._follow_cluster())
        tg.create_task(self._watch_paused())
        tg.create_task(self._log_progress())
        if self.averager is not None:
            tg.create_task(self.averager.serve())
            tg.create_task(self.averager.run_rounds())
            tg.create_task(self.averager.send_skips())

    def _on_signal(self) -> None:
        assert self.worker is not None
        if self._draining:
            log.warning("%s: second signal: forcing exit", self.name)
            self._force.set()
            return
        self._draining = True
        log.info("%s: draining %d in-flight micro-batch(es) at step %d (up to %.0fs, timeouts.drain_s); send again "
                 "to force", self.name, self.worker.stats.inflight, self.worker.version, self.topology.timeouts.drain_s)
        self.worker.stop()
        asyncio.get_running_loop().call_later(self.topology.timeouts.drain_s, self._drain_expired)

    def _drain_expired(self) -> None:
        if not self._force.is_set() and self.worker is not None:
            log.warning("%s: drain limit of %.0fs reached with %d micro-batch(es) still in flight (a peer is slow or "
                        "gone); forcing exit", self.name, self.topology.timeouts.drain_s, self.worker.stats.inflight)
        self._force.set()

    async def _force_exit_watch(self) -> None:
        await self._force.wait()
        raise _Finished

    async def _compute(self, loop: asyncio.AbstractEventLoop) -> None:
        worker = self.worker
        assert worker is not None

        def emit(out: Outbound) -> None:
            loop.call_soon_threadsafe(self.outbound.put_nowait, out)

        worker.on_update = self._after_update
        await asyncio.to_thread(worker.run, emit, self._force.is_set)
        if not self._draining and not self._force.is_set():
            self._set_phase("finishing")
        if self.averager is not None and not self._force.is_set():
            await self.averager.drain()
            await asyncio.to_thread(worker.run_pending)
            if not self._draining and any(c.get("generation", 0) > 0 for c in self.membership.clusters):
                # a cluster was disrupted: clusters ended at different step counts; agree once more
                t = self.topology.timeouts
                await self.averager.final_round(t.give_up_s or max(t.connect_s, 3600.0))
        await self.outbound.join()
        if self._draining and not self._force.is_set():
            log.info("%s: drained at step %d", self.name, worker.version)
        elif not self._force.is_set():
            log.info("%s: training done at step %d (%d micro-batches)", self.name, worker.version, worker.stats.backwards)
        raise _Finished

    def _after_update(self, worker: StageWorker) -> None:
        """After each optimizer step, in the compute thread: averaging round, periodic checkpoint."""
        if self.averager is not None:
            self.averager.on_update(worker)
        every, root = self.topology.training.checkpoint_every, self.topology.training.checkpoint_dir
        if every and root and worker.version % every == 0 and not worker.paused:
            t0 = time.monotonic()
            self._save_checkpoint()
            worker.waited("checkpoint", time.monotonic() - t0)

    async def _log_progress(self) -> None:
        """One INFO line every training.log_every optimizer steps, so a person can follow training."""
        worker, every = self.worker, self.topology.training.log_every
        assert worker is not None
        next_at, last_t, last_samples = every, time.monotonic(), 0
        while True:
            await asyncio.sleep(0.5)
            if worker.version < next_at:
                continue
            next_at = (worker.version // every + 1) * every
            st, now = self.stats(), time.monotonic()
            rate = (st["samples"] - last_samples) / max(now - last_t, 1e-9)
            last_t, last_samples = now, st["samples"]
            loss = f"loss {st['loss_recent']:.4f}" if st.get("loss_recent") is not None else "no loss (not last stage)"
            ring = (f"; averaging {st['allreduce_rounds']} rounds, {st['allreduce_aborts']} aborted, "
                    f"{st['averaging_waits']} waits ({st['averaging_wait_seconds']:.1f}s)"
                    if "allreduce_rounds" in st else "")
            log.info("%s: step %d, micro-batch %d/%d, %s, %.1f samples/s, staleness %.2f (max %d), busy %.0f%%, "
                     "%d in flight%s", self.name, worker.version, st["trained"], self.topology.training.steps, loss,
                     rate, st["staleness_mean"], st["staleness_max"], 100 * st["busy_fraction"], st["inflight"], ring)

    async def _send_loop(self) -> None:
        while True:
            out = await self.outbound.get()
            try:
                if out.generation != self.generation:
                    continue  # work of a generation the cluster dropped
                kind = MsgType.FORWARD if out.kind == "fwd" else MsgType.BACKWARD
                tensors = {n: t for n, t in out.tensors.items() if not isinstance(t, Packed)}
                packed = {n: t for n, t in out.tensors.items() if isinstance(t, Packed)}
                msg = Message(type=kind, sender=self.name, micro_batch=out.micro_batch, version=out.version,
                              meta={"gen": out.generation}, tensors=tensors, packed=packed)
                await self.links[out.dest].send(msg)
            finally:
                self.outbound.task_done()

    async def _read_pipeline(self) -> None:
        assert self.worker is not None
        while True:
            _, msg = await self.inbox.recv()
            source = self.stage_of.get(msg.sender)
            if msg.type not in (MsgType.FORWARD, MsgType.BACKWARD) or source is None or msg.micro_batch is None:
                self.metrics.bad_messages.labels("pipeline", "unexpected_message").inc()
                continue
            if msg.meta.get("gen", 0) != self.generation:
                self.metrics.bad_messages.labels("pipeline", "other_generation").inc()
                continue
            kind = "fwd" if msg.type == MsgType.FORWARD else "bwd"
            reason = self.worker.deliver(kind, msg.micro_batch, source, {**msg.tensors, **msg.packed})
            if reason is not None:
                self.metrics.bad_messages.labels("pipeline", reason).inc()
            depths = self.worker.queue_depths()
            for queue, depth in depths.items():
                self.metrics.queue_depth.labels(queue).set(depth)

    async def _heartbeats(self) -> None:
        """A heartbeat every interval on a fixed cadence (and one at once when ``_beat_now`` is set).
        Sleeping a whole interval after each send stretched the period by the send's own time, which on
        a PC of a seventh of a core (statistics, encoding, CURVE, an event loop sharing the CPU with
        the compute thread) made the node read as silent to its ring peers (``Averager.hold_s``)."""
        interval = self.topology.timeouts.heartbeat_interval_s
        loop = asyncio.get_running_loop()
        due, early = loop.time(), False
        while True:
            worker = self.worker
            self.membership.report.update({
                "gen": self.generation, "phase": self.phase, "ready": self.ready,
                "trained": (worker.trained if worker is not None else 0),
                "stage_bytes": self._stage_bytes})
            await self.membership.heartbeat(self.stats(), done=False)
            self._beat_now.clear()
            if not early:  # the regular beat: the next one is due an interval after it was
                due = max(due + interval, loop.time())
            # (not asyncio.wait_for: on 3.11 it can swallow a cancellation that meets the event being set,
            # and the TaskGroup would then wait for this task forever)
            early = False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(due):
                    await self._beat_now.wait()
                    early = True

    # ------------------------------------------------------------------ shutdown
    def _save_checkpoint(self) -> None:
        """Runs in the compute thread (from on_update) or after it ended."""
        worker, root = self.worker, self.topology.training.checkpoint_dir
        assert worker is not None and root is not None
        t0 = time.monotonic()
        checkpoint.save_stage(root, cluster=self.cluster, stage=self.stage, num_stages=worker.num_stages,
                              node=self.name, module=worker.module, optimizer=worker.optimizer,
                              version=worker.version,
                              data_position=worker.trained_prefix if worker.is_first else 0, run_id=self.run_id,
                              cluster_nodes=list(self._current_plan().clusters[self.cluster].nodes),
                              extra={"trained": worker.trained_prefix if worker.is_first else worker.trained})
        self.metrics.checkpoints.inc()
        self.metrics.checkpoint_seconds.observe(time.monotonic() - t0)

    def stats(self) -> dict[str, Any]:
        worker = self.worker
        snap = worker.stats.snapshot() if worker is not None else {}
        ring = self.averager.stats() if self.averager is not None else {}
        return {**snap, **ring, "name": self.name, "failure": self.failure, "cluster": self.cluster, "stage": self.stage,
                "phase": self.phase, "generation": self.generation, "pauses": _total(self.metrics, "ravq_pauses_total"),
                "version": worker.version if worker else 0, "trained": worker.trained if worker else 0,
                "bytes_sent": _total(self.metrics, "ravq_bytes_sent_total"),
                "bytes_received": _total(self.metrics, "ravq_bytes_received_total"),
                "ring_bytes_sent": _total(self.metrics, "ravq_bytes_sent_total", socket="ring"),
                "payload_wire_bytes_sent": _total(self.metrics, "ravq_payload_wire_bytes_total", direction="sent"),
                "payload_logical_bytes_sent": _total(self.metrics, "ravq_payload_logical_bytes_total",
                                                     direction="sent"),
                "bad_messages": _total(self.metrics, "ravq_bad_messages_total")}

    async def shutdown(self) -> None:
        if self.worker is not None and self.topology.training.checkpoint_dir:
            await asyncio.to_thread(self._save_checkpoint)
        if self.worker is not None:
            with contextlib.suppress(Exception):
                await self.membership.heartbeat(self.stats(), done=not self._force.is_set())
        if self.options.summary_path:
            st = self.worker.stats if self.worker else None
            final = {**self.stats(), "loss_history": st.loss_history if st else [],
                     "update_times": list(st.update_times) if st else [], "completed": st.completed if st else [],
                     "final_round": bool(self.averager and self.averager.final_done)}
            Path(self.options.summary_path).write_text(json.dumps(final))
        for link in self.links.values():
            link.close()
        if self.averager is not None:
            self.averager.close()
        if hasattr(self, "inbox"):
            self.inbox.close()
        self.membership.close()
        if self.sock_opts.monitor is not None:
            self.sock_opts.monitor.close()
        self.ctx.term()


def _total(metrics: Metrics, name: str, **labels: str) -> float:
    """Sum of a metric's samples, optionally only those with the given labels."""
    total = 0.0
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def run_node(topology: Topology, name: str, options: NodeOptions) -> str | None:
    """create -> run -> shutdown, in one TaskGroup (CURVE's ZAP handler must serve from the first bind)."""
    node = Node(topology, name, options, Metrics(name))
    try:
        async with asyncio.TaskGroup() as tg:
            if node.sock_opts.monitor is not None:  # the Curve (ZAP handler) with CURVE
                tg.create_task(node.sock_opts.monitor.serve())
            await node.create(tg)
            node.start(tg)
    except BaseExceptionGroup as group:
        _, rest = group.split(_Finished)
        if rest is not None:
            err = first_error(rest)
            raise err from err.__cause__  # keep what caused it (e.g. the tracer's own reason), drop the group
    finally:
        await node.shutdown()
    return node.failure


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The one real error of a TaskGroup, so callers see e.g. a TimeoutError rather than a group."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for sub in e.exceptions:
                walk(sub)
        else:
            leaves.append(e)

    walk(group)
    return leaves[0] if len(leaves) == 1 else group
