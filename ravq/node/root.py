"""One node's lifecycle: create -> run -> shutdown.  This module only composes the parts.

``create`` joins the broker (``ravq.node.membership``), learns this node's cluster and stage from the
plan (standing by until it has one), builds its stage and then, in dependency order, its pipeline links,
ring sockets and averager, churn (``ravq.swarm.churn``: pause, catch up, resume) and the training
session (``ravq.swarm.session``).  ``run`` owns every task in one TaskGroup: socket readers, the sender,
heartbeats, averaging and the compute thread (the only place torch trains).  ``shutdown`` writes the
final checkpoint (``ravq.node.checkpoints``) and summary and closes every socket.  A node exits only on
a signal (a leave while the run goes on: ``ravq.node.stopping``), at the end of training, or after
``timeouts.give_up_s`` paused; every stage resumes from its run's checkpoints (``ravq.swarm.resume``).
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
import zmq.asyncio

from ravq.average.averager import Averager
from ravq.average.owners import ring_owners, ring_peers
from ravq.config import Plan, Topology, resolve_task_module
from ravq.lifecycle import StartupTimes, first_error, in_daemon_thread
from ravq.metrics import Metrics
from ravq.net.listen import serve_metrics
from ravq.net.options import io_threads
from ravq.net.security import socket_options_for
from ravq.net.wire import DecodeLimits
from ravq.node.checkpoints import StageCheckpoints
from ravq.node.membership import Membership, beat_on_cadence
from ravq.node.pipeline_links import StageLinks
from ravq.node.progress import TOTALS, log_progress
from ravq.node.ring_port import RingPort
from ravq.node.routes import open_routes
from ravq.node.stopping import Stopping
from ravq.persist import checkpoint
from ravq.stage.build import BuiltStage, build_stage
from ravq.stage.frames import derived_max_message_bytes
from ravq.stage.pipeline import StageWorker
from ravq.swarm import resume
from ravq.swarm.churn import Churn
from ravq.swarm.report import Progress
from ravq.swarm.session import TrainingSession
from ravq.swarm.standing import Standing, stand_by
from ravq.tuning import cpu_budget, peak_rss_bytes, usable_memory_bytes

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


class Node:
    """The composition root of one node: membership (``ravq.node.membership``), churn
    (``ravq.swarm.churn``), the pipeline links (``ravq.node.pipeline_links``), the stage
    (``ravq.stage``) and averaging (``ravq.average``), each owning its own state."""

    def __init__(self, topology: Topology, name: str, options: NodeOptions, metrics: Metrics) -> None:
        self.topology, self.name, self.options, self.metrics = topology, name, options, metrics
        self.startup = StartupTimes()  # imports end here; create() marks each phase, logs one line at the end
        self.config = topology.node(name)
        self.task = resolve_task_module(topology.task, topology.task_options)
        t = topology.limits
        self.sock_opts = socket_options_for(topology, name, options.key_dir, metrics)
        self.limits = DecodeLimits(max_header_bytes=t.max_header_bytes, max_frames=t.max_frames,
                                   max_tensor_bytes=self.sock_opts.max_message_bytes)
        self.ctx = zmq.asyncio.Context(io_threads=io_threads(self.sock_opts, cpu_budget()))
        self.membership = Membership(self.ctx, topology, name, metrics, self.limits, self.sock_opts)
        self.standing = Standing(name=name, metrics=metrics)
        self.churn: Churn | None = None
        self.links: StageLinks | None = None
        self.worker: StageWorker | None = None
        self.cluster = self.stage = -1
        self.averager: Averager | None = None
        self.session: TrainingSession | None = None
        self.checkpoints: StageCheckpoints | None = None
        self.failure: str | None = None
        self.stopping = Stopping(name=name, drain_s=topology.timeouts.drain_s, standing=self.standing,
                                 report=self.membership.report)
        self._force = self.stopping.force
        self.run_id: str | None = None  # the run this stage's weights belong to: the broker's (brokers.run)
        self.rejoining = False
        self._resuming_at = 0  # the version this stage resumes from, reported until the stage is built
        self._owners: list[dict[str, str]] | None = None
        """Who holds each tensor in every cluster (the averaging rings), computed in the build thread."""
        self._stage_bytes = 0  # weights, gradients, optimizer state, a stash per micro-batch in flight

    def fail(self, reason: str) -> None:
        """End this node with ``reason`` as its failure (exit status 1)."""
        self.failure = reason
        log.error("%s: %s; exiting", self.name, reason)
        self._force.set()

    # ------------------------------------------------------------------ create
    async def create(self, tg: asyncio.TaskGroup) -> None:
        """Join, learn this node's stage, build it and its sockets, and wait for the cluster."""
        self.startup.mark("imports")
        self._set_threads()
        if self.config.metrics_port is not None:
            serve_metrics(self.metrics, self.config.metrics_port, self.config.bind_host or self.config.host)
        plan = await self._join(tg)
        agreeing = self._check_checkpoints(tg, plan)
        self.startup.mark("checkpoints")
        built = await in_daemon_thread(self._build_stage, plan)  # a stop need not wait for the tracer
        if agreeing is not None:  # it returns once every member reported to the broker: its state is current
            await asyncio.to_thread(self._load, built.worker, await agreeing)
        elif not self.rejoining:
            await self.membership.poll_snapshot()  # the broker's state now, not as this node registered
        self.rejoining = self.rejoining or self._rejoin_if_running()
        self.worker = built.worker
        self.checkpoints = self._checkpoints()
        self.startup.mark("build")
        everyone = await self._wire(built, plan)
        self.startup.mark("connect")
        if not self.rejoining:
            await self.membership.wait_for(everyone, self.topology.timeouts.connect_s)
            self.standing.set_phase("training")
        compress, nodes = self.topology.training.compress, len(plan.clusters[self.cluster].nodes)
        parameters = sum(p.numel() for p in built.worker.params.values())
        log.info("%s: cluster %d stage %d/%d ready (%d parameters; compression: pipeline %s, ring %s)",
                 self.name, self.cluster, self.stage, nodes, parameters, compress.pipeline, compress.ring)
        log.info("%s: %s", self.name, self.startup.line())

    def _set_threads(self) -> None:
        threads = self.options.threads or cpu_budget()
        if self.options.threads or threads < torch.get_num_threads():
            torch.set_num_threads(threads)  # torch alone sizes its pool by the cores, not the cgroup quota
        log.info("%s: torch uses %d thread(s)%s", self.name, torch.get_num_threads(),
                 "" if self.options.threads else " (CPU affinity and cgroup quota)")

    async def _join(self, tg: asyncio.TaskGroup) -> Plan:
        """Register with the broker, start the heartbeats, stand by until the plan has this node; the plan."""
        plan = await self.membership.join()
        self.run_id = self.membership.run_id
        self.startup.mark("join")
        if self.topology.training.resume is not None:
            log.warning("%s: training.resume is deprecated and ignored: a node always resumes from the "
                        "newest checkpoint of the broker's run (a new run: `ravq broker --new-run`)",
                        self.name)
        tg.create_task(self._heartbeats())  # from now on: the broker must not think us lost while we build
        tg.create_task(self.membership.follow())  # and its state as it changes (what start-up waits for)
        if not any(self.name in c.nodes for c in plan.clusters):
            plan = await stand_by(name=self.name, standing=self.standing, report=self.membership.report,
                                  memory_bytes=self._memory_bytes(), poll=self.membership.poll_snapshot,
                                  interval_s=self.topology.timeouts.heartbeat_interval_s)
        self.cluster, self.stage = plan.locate(self.name)
        self.metrics.set_role("node", self.cluster, self.stage)
        self.rejoining = self._rejoin_if_running()
        return plan

    def _check_checkpoints(self, tg: asyncio.TaskGroup, plan: Plan) -> asyncio.Task[int | None] | None:
        """Refuse another run's checkpoints before the slow part and tell the cluster what this stage
        holds; a cluster that starts as a whole agrees on one consistent point (the task returns it)."""
        root = self.topology.training.checkpoint_dir
        if not root:
            return None
        held = resume.check_run(root, cluster=self.cluster, stage=self.stage, run_id=self.run_id,
                                explicit=self.membership.run_explicit, name=self.name)
        self.membership.report.checkpoints(held)
        self.standing.beat_now.set()
        self._resuming_at = held[0]["version"] if held else 0  # exported (and reported) from now on
        self.metrics.version.set(self._resuming_at)
        if self.rejoining:
            return None
        return tg.create_task(resume.agree(self.membership, plan.clusters[self.cluster].nodes, self.name,
                                           self.topology.timeouts.connect_s))

    async def _wire(self, built: BuiltStage, plan: Plan) -> list[str]:
        """The stage's sockets, averager, churn and session, in that order; whom the node waits for."""
        worker = built.worker
        self._derive_limits(built.largest_frame)
        weights = sum(t.numel() * t.element_size() for t in {**worker.params, **worker.buffers}.values())
        self._stage_bytes = weights * (3 + worker.options.max_inflight)
        cluster = plan.clusters[self.cluster]
        self.links = links = StageLinks(ctx=self.ctx, topology=self.topology, name=self.name,
                                        metrics=self.metrics, limits=self.limits, sock_opts=self.sock_opts,
                                        generation=lambda: self.standing.generation)
        peers = set(worker.spec.consumer_stages) | set(worker.spec.producer_stages)
        peers |= {h for group in worker.spec.tied for h in group.holders if h != self.stage}  # tied copies
        links.bind()
        ring: RingPort | None = None
        if len(plan.clusters) > 1:  # the ring sockets, then the averager they serve
            assert self._owners is not None  # computed with the stage, in the build thread
            ring = RingPort(self.ctx, self.topology, self.name, ring_peers(self._owners, self.name),
                            self.metrics, self.limits, self.sock_opts)
            self.averager = Averager(topology=self.topology, plan=self.membership.current_plan, me=self.name,
                                     cluster=self.cluster, worker=worker, model=built.model, task=self.task,
                                     metrics=self.metrics, port=ring, owners=self._owners,
                                     silent_s=self.membership.silent_s, run_id=self.run_id)
        everyone = [n for c in plan.clusters for n in c.nodes] if self.averager else cluster.nodes
        await open_routes(name=self.name, topology=self.topology, membership=self.membership,
                          metrics=self.metrics, links=links, ring=ring,
                          everyone=everyone, rejoining=self.rejoining, cluster_nodes=cluster.nodes,
                          peers=peers | (set(worker.first_destinations()) if worker.is_first else set()))
        self.churn = Churn(name=self.name, topology=self.topology, metrics=self.metrics,
                           broker=self.membership, report=self.membership.report, standing=self.standing,
                           cluster=self.cluster, linked=plan, worker=worker, averager=self.averager,
                           links=links, fail=self.fail)
        if self.averager is not None:  # after each optimizer step: the averaging round, then the checkpoint
            worker.subscribe_updates(self.averager.on_update)
        if self.checkpoints is not None:
            worker.subscribe_updates(self.checkpoints.on_update)
        t = self.topology.timeouts
        self.session = TrainingSession(name=self.name, worker=worker, outbox=links, ending=self.stopping,
                                       averager=self.averager, set_phase=self.standing.set_phase,
                                       disrupted=self.membership.disrupted,
                                       final_round_s=t.give_up_s or max(t.connect_s, 3600.0))
        return everyone

    def _checkpoints(self) -> StageCheckpoints | None:
        root = self.topology.training.checkpoint_dir
        if not root:
            return None
        return StageCheckpoints(
            root=root, every=self.topology.training.checkpoint_every, name=self.name, cluster=self.cluster,
            stage=self.stage, run_id=self.run_id, metrics=self.metrics, plan=self.membership.current_plan,
            rounds=lambda: self.averager.queue.completed if self.averager is not None else 0,
            caught_up_from=lambda: self.churn.caught_up_from if self.churn is not None else None)

    def _rejoin_if_running(self) -> bool:
        return self.standing.rejoin_if_running(self.membership.cluster_state(self.cluster), self.cluster)

    def _memory_bytes(self) -> int:
        if self.config.memory_bytes is not None:
            return self.config.memory_bytes
        return usable_memory_bytes(self.config.device)

    def _derive_limits(self, largest_frame: int) -> None:
        """Data sockets accept frames up to what this stage can legitimately receive (ravq.stage.frames);
        the broker's sockets, open already, keep the control messages' limit."""
        if self.topology.limits.max_message_bytes is not None:
            return
        ring = self.topology.training.ring_chunk_bytes  # also with one cluster: a re-plan may add rings
        limit = derived_max_message_bytes(largest_frame, ring)
        self.sock_opts = dataclasses.replace(self.sock_opts, max_message_bytes=limit)  # the data sockets'
        self.limits = dataclasses.replace(self.limits, max_tensor_bytes=limit)
        log.info("%s: limits.max_message_bytes %d (2x the largest frame this stage receives, %d bytes)",
                 self.name, limit, max(largest_frame, ring))

    def _build_stage(self, plan: Plan) -> BuiltStage:
        training = self.topology.training
        cuts = list(plan.clusters[self.cluster].cuts)
        built = build_stage(self.task, training, seed=self.topology.seed, cuts=cuts,
                            stage=self.stage, cluster=self.cluster, clusters=len(plan.clusters),
                            device=self.config.device, metrics=self.metrics)
        if len(plan.clusters) > 1:  # traces the other clusters' cuts: here, not on the event loop
            self._owners = ring_owners(self.task, self.topology, plan, self.cluster, built.stage_names)
        if training.checkpoint_dir:
            checkpoint.remove_temp_files(training.checkpoint_dir, self.cluster, self.stage)
            if self.rejoining:  # its cluster goes on: its own newest checkpoint, then the catch-up
                self._load(built.worker, None)
        return built

    def _load(self, worker: StageWorker, version: int | None) -> None:
        training = self.topology.training
        assert training.checkpoint_dir
        resume.load(worker, training.checkpoint_dir, cluster=self.cluster, stage=self.stage,
                    update_every=worker.options.update_every, name=self.name, run_id=self.run_id,
                    version=version, metrics=self.metrics, micro_batch=training.micro_batch)

    # ------------------------------------------------------------------ run
    def start(self, tg: asyncio.TaskGroup) -> None:
        """Start every task of the running node in ``tg``; the group ends with _Finished."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, self._on_signal)
        assert self.links is not None and self.worker is not None
        tg.create_task(self.links.read_loop(self.worker))
        tg.create_task(self.links.send_loop())
        tg.create_task(self._compute())
        tg.create_task(self.until_forced())
        assert self.churn is not None
        tg.create_task(self.churn.follow_cluster())
        tg.create_task(self.churn.watch_paused())
        tg.create_task(log_progress(self.name, self.worker, self.stats, self.topology.training.log_every,
                                    self.topology.training.steps))
        if self.averager is not None:
            tg.create_task(self.averager.serve())
            tg.create_task(self.averager.run_rounds())
            tg.create_task(self.averager.send_skips())

    def _on_signal(self) -> None:
        assert self.worker is not None
        self.stopping.on_signal(self.worker)

    def stop_while_starting(self, sig: signal.Signals) -> None:
        """SIGTERM/SIGINT before the stage runs (importing, joining, tracing): nothing to drain or save;
        end create() and leave through shutdown, exit status 0."""
        if not self._force.is_set():
            log.info("%s: %s while starting: stopping before training", self.name, sig.name)
        self._force.set()

    async def until_forced(self) -> None:
        """End the TaskGroup (``_Finished``) once the node is forced out: a signal, a failure."""
        await self._force.wait()
        raise _Finished

    async def _compute(self) -> None:
        assert self.session is not None
        await self.session.run()
        raise _Finished

    async def _heartbeats(self) -> None:
        """A heartbeat every interval on a fixed cadence, and one at once when ``standing.beat_now`` is set
        (``ravq.node.membership.beat_on_cadence``)."""

        async def beat() -> None:
            await self.membership.heartbeat(self._progress(), self.stats(), done=False)

        await beat_on_cadence(beat, self.topology.timeouts.heartbeat_interval_s, self.standing.beat_now)

    def _progress(self) -> Progress:
        return self.standing.progress(trained=self.worker.trained if self.worker is not None else 0,
                                      stage_bytes=self._stage_bytes)

    # ------------------------------------------------------------------ shutdown
    def stats(self) -> dict[str, Any]:
        worker = self.worker
        snap = worker.stats.snapshot() if worker is not None else {}
        ring = self.averager.stats() if self.averager is not None else {}
        return {**snap, **ring, **self.metrics.totals(TOTALS), "name": self.name, "failure": self.failure,
                "cluster": self.cluster, "stage": self.stage, "phase": self.standing.phase,
                "generation": self.standing.generation,
                "version": worker.version if worker else self._resuming_at,
                "trained": worker.trained if worker else 0,
                "routes": {"pipeline": self.links.routes if self.links else {},
                           "ring": self.averager.port.routes if self.averager else {}}}

    async def shutdown(self) -> None:
        t0 = time.monotonic()
        if self.worker is not None and self.checkpoints is not None:
            await asyncio.to_thread(self.checkpoints.save, self.worker)
        saved = time.monotonic() - t0
        if self.worker is not None:
            with contextlib.suppress(Exception):
                await self.membership.heartbeat(self._progress(), self.stats(), done=self.stopping.done)
        if self.options.summary_path:
            st = self.worker.stats if self.worker else None
            final = {**self.stats(), "loss_history": st.loss_history if st else [],
                     "update_times": list(st.update_times) if st else [],
                     "completed": st.completed if st else [],
                     "final_round": bool(self.averager and self.averager.final_done),
                     "ended": self.stopping.ended(self.failure), "peak_rss_bytes": peak_rss_bytes()}
            Path(self.options.summary_path).write_text(json.dumps(final))
        if self.links is not None:
            self.links.close()
        if self.averager is not None:
            self.averager.close()
        self.membership.close()
        if self.sock_opts.monitor is not None:
            self.sock_opts.monitor.close()
        self.ctx.term()
        log.info("%s: %s; shut down in %.2fs (final checkpoint %.2fs)", self.name,
                 self.stopping.ended(self.failure), time.monotonic() - t0, saved)


async def run_node(topology: Topology, name: str, options: NodeOptions) -> str | None:
    """create -> run -> shutdown, in one TaskGroup (CURVE's ZAP handler must serve from the first bind)."""
    node = Node(topology, name, options, Metrics(name))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # until start() installs the running node's handler
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, node.stop_while_starting, sig)
    try:
        async with asyncio.TaskGroup() as tg:
            if node.sock_opts.monitor is not None:  # the Curve (ZAP handler) with CURVE
                tg.create_task(node.sock_opts.monitor.serve())
            starting = tg.create_task(node.until_forced())  # a signal or failure now ends create()
            await node.create(tg)
            starting.cancel()
            node.start(tg)
    except BaseExceptionGroup as group:
        _, rest = group.split(_Finished)
        if rest is not None:
            err = first_error(rest)
            raise err from err.__cause__  # keep what caused it (e.g. the tracer's own reason), drop the group
    finally:
        await node.shutdown()
    return node.failure
