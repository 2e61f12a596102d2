"""A cluster the rings leave out reaches a node over loopback sockets as its own key (issue #37): a real
broker (``brokers.topology.Broker.run``) and two nodes' broker clients (``ravq.node.membership.Membership``);
one cluster's node leaves, and the other node's plan leaves that cluster out, though the plan's head no
longer carries a list of exclusions."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import zmq.asyncio

from brokers.topology import Broker
from ravq.cli.demo import free_ports
from ravq.cli.main import plan_for
from ravq.config import parse_topology
from ravq.metrics import Metrics
from ravq.net.options import SocketOptions
from ravq.net.protocol import Heartbeat
from ravq.net.wire import DecodeLimits, Message, MsgType
from ravq.node.membership import Membership
from ravq.swarm.report import Progress

INTERVAL_S = 0.2
TRAINING = Progress(generation=0, phase="training", ready=0, trained=0, stage_bytes=0)


async def _until(check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.02)


def test_a_node_leaves_out_the_cluster_whose_out_key_the_broker_publishes(tmp_path: Path) -> None:
    p = free_ports(6)
    topology = parse_topology({
        "task": "ravq.tasks.charlm", "timeouts": {"heartbeat_interval_s": INTERVAL_S, "lost_s": 5.0},
        "training": {"checkpoint_dir": str(tmp_path / "ckpt")},
        "broker": {"pub_port": p[0], "router_port": p[1], "state_dir": str(tmp_path / "state")},
        "nodes": [{"name": f"c{c}s0", "pipeline_port": p[2 + 2 * c], "ring_port": p[3 + 2 * c], "cluster": c,
                   "stage": 0} for c in range(2)]}, resolve_task=False)
    broker = Broker(topology, plan_for(topology, None), Metrics("broker"), SocketOptions(linger_ms=0))

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        nodes = {n: Membership(ctx, topology, n, Metrics("node"), DecodeLimits(), SocketOptions(linger_ms=0))
                 for n in ("c0s0", "c1s0")}
        leaving = asyncio.Event()

        async def beat(m: Membership) -> None:
            while True:
                if m.name == "c1s0" and leaving.is_set():
                    left = Heartbeat(incarnation=m.report.incarnation, phase="training", left=True)
                    await m.link.send(Message(type=MsgType.HEARTBEAT, sender=m.name, meta=left.meta()))
                else:
                    await m.heartbeat(TRAINING, {}, done=False)
                await asyncio.sleep(INTERVAL_S / 2)

        try:
            async with asyncio.TaskGroup() as tg:
                served = tg.create_task(broker.run())
                for m in nodes.values():
                    await m.join()
                tasks = [tg.create_task(t) for m in nodes.values() for t in (m.follow(), beat(m))]
                await _until(lambda: all(cs.state == "training" for cs in broker.book.clusters))
                assert nodes["c0s0"].current_plan().excluded == []
                leaving.set()
                await _until(lambda: nodes["c0s0"].current_plan().excluded == [1])
                assert broker.keyed.values.get("out/1") is True and "excluded" not in broker.keyed.values["plan"]
                assert nodes["c0s0"].current_plan() == broker.plan
                for t in tasks:
                    t.cancel()
                broker.stop()
                await served
        finally:
            for m in nodes.values():
                m.close()
            ctx.destroy(linger=0)

    asyncio.run(main())
