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
with the node's socket options (CURVE when on), rounds compressed as ``training.compress.ring`` asks.  The
process's CPU seconds per micro-batch and copy, less one copy training alone (``StageCpu.single_cpu_s``),
is one member's round in a ring of two: it sends and receives the model's parameter bytes once, which
``ravq.profile.measure`` turns into seconds per parameter byte (``NodeProfile.ring_s_per_byte``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import zmq

from ravq.average.averager import Averager
from ravq.config import Topology
from ravq.config.plan import ClusterPlan, Plan
from ravq.metrics import Metrics
from ravq.net.security import socket_options_for
from ravq.net.transport import Outlink
from ravq.net.wire import DecodeLimits
from ravq.profile.links import CHUNK_BYTES
from ravq.profile.session import zmq_session
from ravq.profile.stage_cost import StageCostConfig, _Window, single_cpu_s
from ravq.stage.build import build_stage
from ravq.stage.pipeline import StageWorker

log = logging.getLogger(__name__)

MEMBERS = 2


def _members(name: str) -> list[str]:
    return [f"{name}.avg{i}" for i in range(MEMBERS)]


def _ring_topology(topology: Topology, name: str) -> Topology:
    """The topology with the two members in place of its nodes: this node's settings on loopback, each
    ring ROUTER on a port of the system's choosing, averaging every step (one round per micro-batch) and
    never the optimizer state (its bytes are the planner's ``Wire.state`` factor, not this figure's)."""
    me = topology.node(name)
    nodes = [me.model_copy(update={"name": m, "host": "127.0.0.1", "bind_host": None, "ring_port": 0,
                                   "reachable": True, "cluster": None, "stage": None}) for m in _members(name)]
    training = topology.training.model_copy(update={
        "sync_every": 1, "averaging_lead": max(1, topology.training.averaging_lead), "overlap_averaging": True,
        "average_optimizer_state": False, "eval_every": 0, "checkpoint_every": 0, "max_inflight": 1})
    return topology.model_copy(update={"nodes": nodes, "training": training, "relays": []})


async def _pair_cpu_s(task: Any, topology: Topology, name: str, config: StageCostConfig) -> float:
    """CPU seconds of the whole process per micro-batch and copy, the two copies averaging every step."""
    ring = _ring_topology(topology, name)
    members = _members(name)
    plan = Plan(epoch=1, clusters=[ClusterPlan(nodes=[m]) for m in members])
    training = ring.training.model_copy(update={"steps": config.warmup + config.micro_batches})
    metrics = Metrics(name)
    options = dataclasses.replace(socket_options_for(topology, name, None, metrics), linger_ms=0)
    built = [build_stage(task, training, seed=0, cuts=[], stage=0, cluster=i, clusters=MEMBERS, device=ring.node(m).device,
                         metrics=Metrics(m)) for i, m in enumerate(members)]
    largest = max(b.largest_frame for b in built)
    options = dataclasses.replace(options, max_message_bytes=2 * max(largest, training.ring_chunk_bytes) + CHUNK_BYTES)
    limits = DecodeLimits(max_tensor_bytes=2 * max(largest, training.ring_chunk_bytes))
    window = _Window(config.warmup)
    async with zmq_session(options) as (ctx, group):
        addresses: dict[str, str] = {}

        def connect_from(member: str) -> Any:
            # both members are this node as far as CURVE knows (its own key pair, as its ring uses it)
            return lambda peer: Outlink.connect(ctx, addresses[peer], "ring", name, metrics, limits, options,
                                                identity=member)

        averagers = [Averager(ctx=ctx, topology=ring, plan=lambda: plan, me=m, cluster=i, worker=b.worker,
                              model=b.model, stage_names=b.stage_names, task=task, metrics=Metrics(m),
                              sock_opts=options, limits=limits, connect=connect_from(m))
                     for i, (m, b) in enumerate(zip(members, built, strict=True))]
        for m, averager in zip(members, averagers, strict=True):
            averager.port.inbox.authenticated = False  # CURVE names every connection after this node, not a member
            addresses[m] = averager.port.inbox.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        for averager in averagers:
            averager.port.connect({m: True for m in members})

        def on_update_of(averager: Averager, timed: bool) -> Any:
            def on_update(worker: StageWorker) -> None:
                averager.on_update(worker)
                if timed:
                    window.on_update(worker)
            return on_update

        loops = []
        for i, averager in enumerate(averagers):
            averager.worker.on_update = on_update_of(averager, timed=i == MEMBERS - 1)
            loops += [group.create_task(f()) for f in (averager.serve, averager.run_rounds, averager.send_skips)]
        try:
            await asyncio.gather(*(asyncio.to_thread(a.worker.run, lambda out: None) for a in averagers))
            await asyncio.wait_for(asyncio.gather(*(a.drain() for a in averagers)), 60)
            rounds = min(a.queue.completed for a in averagers)
            if rounds < config.micro_batches:
                raise RuntimeError(f"profile: only {rounds} of {config.warmup + config.micro_batches} loopback "
                                   "averaging rounds finished")
        finally:
            for a in averagers:
                a.worker.stop()
            for task_ in loops:
                task_.cancel()
            for a in averagers:
                a.close()
    return window.per_micro_batch() / MEMBERS


def measure_averaging_cpu(topology: Topology, name: str, task: Any, single: float | None = None,
                          config: StageCostConfig | None = None) -> float:
    """CPU seconds of one member's part of one averaging round of the task's whole model in a ring of two,
    as a node runs it (see the module's doc): the two copies averaging every step, less one copy training
    alone (``single``: ``StageCpu.single_cpu_s`` when ``ravq.profile.stage_cost`` timed it, else timed
    here); never below 0."""
    config = config or StageCostConfig()
    t0 = time.process_time()
    if single is None:
        single = single_cpu_s(task, topology, name, config)
    pair = asyncio.run(_pair_cpu_s(task, topology, name, config))
    log.info("profile: %s averaging every step %.3g ms of CPU per micro-batch and copy, alone %.3g ms "
             "(%.1f s of CPU)", name, pair * 1e3, single * 1e3, time.process_time() - t0)
    return max(0.0, pair - single)
