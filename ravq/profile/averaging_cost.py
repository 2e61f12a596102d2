"""What an averaging round costs a node: rounds timed as a node runs them.

On issue #26's testbed six one-stage clusters of quarter-core PCs, averaging every 2 steps, trained at
0.83 of the plan's figure with every PC busy: the event loop and ZeroMQ's I/O thread took about 20 ms of
CPU per round where the bare ring code (``measure_ring``) costs about 6 ms on loopback.  A node's round is
more than the ring: the compute thread snapshots the segments and applies the result (error feedback,
the outer step, the stash's guard), the round queue hands it to the event loop, the ring socket's reader
sorts every piece into the mailbox, and every piece is a message encoded, encrypted and decoded.

``measure_averaging_cpu`` runs the task's model as a node runs it with averaging: two one-stage copies,
each a real ``StageWorker`` (``ravq.stage.build.build_stage``) in its own compute thread with a real
``ravq.average.averager.Averager`` averaging every step, joined by their own ring sockets over loopback TCP
with the node's socket options (CURVE when on), rounds compressed as ``training.compress.ring`` asks.  What
the rounds cost is the process's CPU time less what the two compute threads spent training: every other
thread's (the event loop: round queue, ring reader, encoding; ZeroMQ's I/O threads: CURVE) and the
compute threads' own time inside the averager (snapshots, applying results).  Measured that way, not as
the difference of two runs: two runs of ~130 ms of CPU per micro-batch differ by as much as a round costs
(issue #26's testbed: 0-13 ms either way).  One member's part of a round in a ring of two sends and
receives the model's parameter bytes once; ``ravq.profile.measure`` turns it into seconds per parameter
byte (``NodeProfile.ring_s_per_byte``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ravq.average.averager import Averager
from ravq.average.owners import ring_owners, ring_peers
from ravq.config import Topology
from ravq.config.plan import ClusterPlan, Plan
from ravq.metrics import Metrics
from ravq.net.security import socket_options_for
from ravq.net.transport import Outlink
from ravq.net.wire import DecodeLimits
from ravq.node.ring_port import RingPort
from ravq.profile.links import CHUNK_BYTES
from ravq.profile.session import zmq_session
from ravq.profile.stage_cost import StageCostConfig
from ravq.stage.build import build_stage
from ravq.stage.pipeline import StageWorker

log = logging.getLogger(__name__)

MEMBERS = 2
MICRO_BATCH = 2
"""Micro-batch of the two copies (2, not 1: a BatchNorm in training mode needs two samples)."""
MEMORY_FACTOR = 16
"""Bytes the measurement needs per parameter byte: two copies of weights, gradients, Adam's two states,
and each averager's starting point, snapshot and error feedback."""


def _members(name: str) -> list[str]:
    return [f"{name}.avg{i}" for i in range(MEMBERS)]


def _ring_topology(topology: Topology, name: str) -> Topology:
    """The topology with the two members in place of its nodes: this node's settings on loopback, each
    ring ROUTER on a port of the system's choosing, averaging every step (one round per micro-batch) and
    never the optimizer state (its bytes are the planner's ``Wire.state`` factor, not this figure's).
    Micro-batches of ``MICRO_BATCH``: a round's cost does not depend on them, and two copies training
    the topology's micro-batches took the testbed's 450 MB PCs out of memory."""
    me = topology.node(name)
    member = {"host": "127.0.0.1", "bind_host": None, "ring_port": 0, "reachable": True, "cluster": None,
              "stage": None}
    nodes = [me.model_copy(update={"name": m, **member}) for m in _members(name)]
    t = topology.training
    training = t.model_copy(update={
        "micro_batch": min(MICRO_BATCH, t.micro_batch), "sync_every": 1,
        "averaging_lead": max(1, t.averaging_lead), "overlap_averaging": True,
        "average_optimizer_state": False, "eval_every": 0, "checkpoint_every": 0, "max_inflight": 1,
        "batch": None})  # a step per micro-batch: its own micro-batches and members, not the run's batch
    return topology.model_copy(update={"nodes": nodes, "training": training, "relays": []})


class _ThreadCpu:
    """CPU seconds a compute thread spends in ``run`` and, apart, in the averager's own work there
    (``averaging``: the averager's ``compute_timer``)."""

    def __init__(self) -> None:
        self.run_s = 0.0
        self.hooks_s = 0.0
        self._depth = 0

    @contextlib.contextmanager
    def averaging(self) -> Iterator[None]:
        self._depth += 1  # the outermost counts (an update applies finished rounds within it)
        t0 = time.thread_time()
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:
                self.hooks_s += time.thread_time() - t0

    def run(self, worker: StageWorker) -> None:
        t0 = time.thread_time()
        worker.run(lambda out: None)
        self.run_s = time.thread_time() - t0


async def _round_cpu_s(task: Any, topology: Topology, name: str, config: StageCostConfig) -> float:
    """CPU seconds per round and member, the two copies averaging every step (see the module's doc)."""
    ring = _ring_topology(topology, name)
    members = _members(name)
    plan = Plan(epoch=1, clusters=[ClusterPlan(nodes=[m]) for m in members])
    training = ring.training.model_copy(update={"steps": config.warmup + config.micro_batches})
    metrics = Metrics(name)
    options = dataclasses.replace(socket_options_for(topology, name, None, metrics), linger_ms=0)
    built = [build_stage(task, training, seed=0, cuts=[], stage=0, cluster=i, clusters=MEMBERS,
                         device=ring.node(m).device, metrics=Metrics(m)) for i, m in enumerate(members)]
    largest = max(max(b.largest_frame for b in built), training.ring_chunk_bytes)
    options = dataclasses.replace(options, max_message_bytes=2 * largest + CHUNK_BYTES)
    limits = DecodeLimits(max_tensor_bytes=2 * largest)
    threads = [_ThreadCpu() for _ in members]
    async with zmq_session(options) as (ctx, group):
        addresses: dict[str, str] = {}

        def connect_from(member: str) -> Callable[[str], Outlink]:
            # both members are this node as far as CURVE knows (its own key pair, as its ring uses it)
            return lambda peer: Outlink.connect(ctx, addresses[peer], "ring", name, metrics, limits, options,
                                                identity=member)

        owners = [ring_owners(task, ring, plan, i, b.stage_names) for i, b in enumerate(built)]
        member_metrics = [Metrics(m) for m in members]
        # CURVE names every connection after this node, not a member: senders are not checked
        ports = [RingPort(ctx, ring, m, ring_peers(owners[i], m), member_metrics[i], limits, options,
                          connect_from(m), authenticate=False) for i, m in enumerate(members)]
        addresses.update({m: port.address for m, port in zip(members, ports, strict=True)})
        averagers = [Averager(topology=ring, plan=lambda: plan, me=m, cluster=i, worker=built[i].worker,
                              model=built[i].model, task=task, metrics=member_metrics[i], port=ports[i],
                              owners=owners[i], silent_s=lambda node: 0.0, run_id=None,
                              compute_timer=threads[i].averaging) for i, m in enumerate(members)]
        loops = []
        for a in averagers:
            a.worker.subscribe_updates(a.on_update)
            loops += [group.create_task(f()) for f in (a.serve, a.run_rounds, a.send_skips)]
        for port in ports:
            port.connect({m: True for m in members})
        try:
            cpu0 = time.process_time()
            await asyncio.gather(*(asyncio.to_thread(t.run, a.worker)
                                   for a, t in zip(averagers, threads, strict=True)))
            await asyncio.wait_for(asyncio.gather(*(a.drain() for a in averagers)), 60)
            cpu = time.process_time() - cpu0
            rounds = min(a.queue.completed for a in averagers)
        finally:
            for a in averagers:
                a.worker.stop()
            for task_ in loops:
                task_.cancel()
            for a in averagers:
                a.close()
    if rounds < config.micro_batches:
        raise RuntimeError(f"profile: only {rounds} of {training.steps} loopback averaging rounds finished")
    training_s = sum(t.run_s - t.hooks_s for t in threads)
    return max(0.0, cpu - training_s) / rounds / MEMBERS


def measure_averaging_cpu(topology: Topology, name: str, task: Any,
                          config: StageCostConfig | None = None) -> float:
    """CPU seconds of one member's part of one averaging round of the task's whole model in a ring of two,
    as a node runs it (see the module's doc).  torch runs one thread meanwhile, so that the compute
    threads' own CPU time is all their training (a pool's threads would count as averaging)."""
    config = config or StageCostConfig()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cpu = asyncio.run(_round_cpu_s(task, topology, name, config))
    finally:
        torch.set_num_threads(threads)
    log.info("profile: %s averaging round as a node runs it: %.3g ms of CPU per member", name, cpu * 1e3)
    return cpu
