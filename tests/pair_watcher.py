"""Nodes' broker clients without training, and a watch on both brokers of a pair (tests/test_pair_netns.py).

``python -m tests.pair_watcher TOPOLOGY OUT NAME...``: each NAME runs a node's broker client
(``ravq.node.membership.Membership``: join, follow the published state, a heartbeat every interval, turning
to the other broker as a node does), and a quarter interval apart both brokers are asked for their status;
every sample is a JSON line in OUT: the time, each broker's Binary Star state as it says it, and which
broker each client talks to.  Runs until killed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import zmq.asyncio

from ravq.cli.status import fetch_status
from ravq.config import Topology, load_topology
from ravq.metrics import Metrics
from ravq.net.options import SocketOptions
from ravq.net.security import socket_options_for
from ravq.net.wire import DecodeLimits
from ravq.node.membership import Membership, beat_on_cadence
from ravq.swarm.report import Progress


def _alone(topology: Topology, backup: bool) -> Topology:
    """The topology as `ravq status` would ask one broker of the pair only."""
    b = topology.broker
    one = b.model_copy(update={"backup": None})
    if backup:
        assert b.backup is not None
        one = one.model_copy(update={"host": b.backup.host, "pub_port": b.backup.pub_port,
                                     "router_port": b.backup.router_port})
    return topology.model_copy(update={"broker": one})


async def _state(topology: Topology) -> str:
    try:
        status = await fetch_status(topology, 0.3)
    except (TimeoutError, OSError):
        return "silent"
    return str((status.get("pair") or {}).get("state", "?"))


async def follow_and_beat(ctx: zmq.asyncio.Context, topology: Topology, name: str,
                          clients: dict[str, Membership]) -> None:
    """One node's broker client (in ``clients[name]``): join, follow, and a heartbeat every interval."""
    metrics = Metrics("node")
    curve = topology.security.curve
    opts = socket_options_for(topology, name, None, metrics) if curve else SocketOptions(linger_ms=0)
    m = Membership(ctx, topology, name, metrics, DecodeLimits(), opts)
    clients[name] = m
    await m.join()
    progress = Progress(generation=0, phase="training", ready=0, trained=0, stage_bytes=0)

    async def beat() -> None:
        await m.heartbeat(progress, {}, done=False)

    async with asyncio.TaskGroup() as tg:
        tg.create_task(m.follow())
        tg.create_task(beat_on_cadence(beat, topology.timeouts.heartbeat_interval_s, asyncio.Event()))


async def main(topology_path: str, out: str, names: list[str]) -> None:
    topology = load_topology(topology_path)
    ctx = zmq.asyncio.Context()
    clients: dict[str, Membership] = {}
    brokers = {"primary": _alone(topology, False), "backup": _alone(topology, True)}
    async with asyncio.TaskGroup() as tg:
        for name in names:
            tg.create_task(follow_and_beat(ctx, topology, name, clients))
        while True:
            states = await asyncio.gather(*(_state(t) for t in brokers.values()))
            sample: dict[str, Any] = {"t": time.time(), **dict(zip(brokers, states, strict=True)),
                                      "on": {n: m.on for n, m in clients.items()}}
            _append(Path(out), json.dumps(sample))
            await asyncio.sleep(topology.timeouts.heartbeat_interval_s / 4)


def _append(path: Path, line: str) -> None:
    with path.open("a") as f:
        f.write(line + "\n")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
