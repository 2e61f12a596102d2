"""Ring links over real ZeroMQ sockets on loopback: made before the first round, kept across plan epochs,
and the same averages with CURVE as in plaintext (issue #26)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch
import zmq
import zmq.asyncio

from ravq.average.averager import Averager
from ravq.average.group_rounds import RoundGroups
from ravq.average.mailbox import Mailbox
from ravq.average.ring import ring_allreduce
from ravq.cli.demo import free_ports
from ravq.config import ClusterPlan, Plan, Topology
from ravq.config.averaging import AveragingConfig
from ravq.metrics import Metrics
from ravq.net.options import SocketOptions
from ravq.net.security import Curve
from ravq.net.transport import Outlink
from ravq.net.wire import DecodeLimits
from ravq.node.ring_port import RingPort

NAMES = ("n1", "n2")


def _topology() -> Topology:
    ports = iter(free_ports(8))  # distinct: one free_port after another may return the same port twice
    return Topology.model_validate({
        "task": "tasks_for_tests",
        "broker": {"pub_port": next(ports), "router_port": next(ports)},
        "nodes": [{"name": n, "pipeline_port": next(ports), "ring_port": next(ports)} for n in (*NAMES, "n3")],
    })


class Ports:
    """Two nodes' RingPorts in one process, each with its own context (a ZAP handler is one per context),
    every DEALER made through a hook that records (node, peer)."""

    def __init__(self, topology: Topology, curve: bool) -> None:
        self.connects: list[tuple[str, str]] = []
        keys = {n: zmq.curve_keypair() for n in NAMES}
        publics = {n: k[0].decode() for n, k in keys.items()}
        self.ctxs = {n: zmq.asyncio.Context() for n in NAMES}
        self.curves = {n: Curve(name=n, public=publics[n], secret=keys[n][1].decode(), peers=publics,
                                metrics=Metrics(n)) for n in NAMES} if curve else {}
        self.ports: dict[str, RingPort] = {}
        for me in NAMES:
            opts = SocketOptions(linger_ms=0, curve=self.curves.get(me))
            self.ports[me] = RingPort(self.ctxs[me], topology, me, [p for p in NAMES if p != me], Metrics(me),
                                      DecodeLimits(), opts, connect=self._hook(me, topology, opts))
            self.ports[me].connect({})  # reachability known (the broker's dial-back): every link is made
        self.boxes = {n: Mailbox() for n in NAMES}

    def _hook(self, me: str, topology: Topology, opts: SocketOptions) -> Callable[[str], Outlink]:
        def connect(peer: str) -> Outlink:
            self.connects.append((me, peer))
            node = topology.node(peer)
            return Outlink.connect(self.ctxs[me], f"tcp://{node.host}:{node.ring_port}", "ring", peer, Metrics(me),
                                   DecodeLimits(), opts, identity=me)
        return connect

    async def rounds(self, inputs: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
        """Each node's averages of its inputs, one ring round per input, over the real sockets."""
        async def no_catchup(identity: bytes, msg: object) -> None:
            raise AssertionError("no catch-up here")

        async def member(me: str) -> list[torch.Tensor]:
            return [await ring_allreduce(x, ring_id=0, round_id=i + 1, members=list(NAMES), me=me,
                                         link=self.ports[me].link, mailbox=self.boxes[me], piece_bytes=4096,
                                         timeout_s=20.0) for i, x in enumerate(inputs[me])]

        async with asyncio.TaskGroup() as tg:
            readers = [tg.create_task(self.ports[n].serve(self.boxes[n], no_catchup)) for n in NAMES]
            readers += [tg.create_task(c.serve_zap()) for c in self.curves.values()]
            results = await asyncio.gather(*(member(n) for n in NAMES))
            for task in readers:
                task.cancel()
        return dict(zip(NAMES, results))

    def close(self) -> None:
        for port in self.ports.values():
            port.close()
        for curve in self.curves.values():
            curve.close()
        for ctx in self.ctxs.values():
            ctx.term()


def _inputs() -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(26)
    return {n: [torch.randn(10_000, generator=gen) for _ in range(2)] for n in NAMES}


def _run(curve: bool) -> tuple[dict[str, list[torch.Tensor]], list[tuple[str, str]], list[tuple[str, str]]]:
    """Averages of two rounds; the connects made before the first round and those made in all."""
    ports = Ports(_topology(), curve)
    try:
        before = list(ports.connects)
        return asyncio.run(ports.rounds(_inputs())), before, ports.connects
    finally:
        ports.close()


def test_ring_links_are_made_before_the_first_round_and_rounds_reuse_them() -> None:
    averages, before, connects = _run(curve=False)
    assert sorted(before) == [("n1", "n2"), ("n2", "n1")]  # one DEALER per peer, made before any round
    assert connects == before  # two rounds later: no link made again
    inputs = _inputs()
    for i in range(2):
        expected = (inputs["n1"][i] + inputs["n2"][i]) / 2
        for n in NAMES:
            torch.testing.assert_close(averages[n][i], expected)


def test_curve_rounds_give_the_plaintext_averages_bit_for_bit() -> None:
    plain, _, _ = _run(curve=False)
    encrypted, before, connects = _run(curve=True)
    assert connects == before
    for n in NAMES:
        for p, e in zip(plain[n], encrypted[n]):
            assert torch.equal(p, e)


def _averager(port: RingPort) -> Averager:
    """An Averager with what ``on_plan`` and ``rename`` use: node n1 of cluster 0, one tensor held by n1
    in cluster 0 and n2 in cluster 1."""
    avg = Averager.__new__(Averager)
    avg.me, avg.cluster, avg.port, avg.mailbox, avg._seen_epoch = "n1", 0, port, Mailbox(), 0
    avg.names, avg.numels, avg.owners = ["w"], [8], [{"w": "n1"}, {"w": "n2"}]
    avg.groups = RoundGroups(AveragingConfig(), 0, 1)
    return avg


def test_a_plan_epoch_keeps_the_ring_links_of_peers_it_keeps() -> None:
    topology = _topology()
    made: list[str] = []
    ctx = zmq.asyncio.Context()

    def connect(peer: str) -> Outlink:
        made.append(peer)
        node = topology.node(peer)
        return Outlink.connect(ctx, f"tcp://{node.host}:{node.ring_port}", "ring", peer, Metrics("n1"),
                               DecodeLimits(), SocketOptions(linger_ms=0), identity="n1")

    port = RingPort(ctx, topology, "n1", ["n2"], Metrics("n1"), DecodeLimits(), SocketOptions(linger_ms=0),
                    connect=connect)
    try:
        assert made == []  # until the peers' reachability is known (``connect``), no route is chosen
        port.connect({})
        assert made == ["n2"]  # then at once: before any round
        avg = _averager(port)
        first = port.outlinks["n2"]
        for epoch in (1, 2, 3):  # churn elsewhere: new epochs, the same ring peer
            avg.on_plan(Plan(epoch=epoch, clusters=[ClusterPlan(nodes=["n1"]), ClusterPlan(nodes=["n2"])]))
        assert made == ["n2"] and port.outlinks["n2"] is first
        avg.rename({"n2": "n3"})  # a standby took n2's stage: one new link, to it alone
        avg.on_plan(Plan(epoch=4, clusters=[ClusterPlan(nodes=["n1"]), ClusterPlan(nodes=["n3"])]))
        assert made == ["n2", "n3"] and set(port.outlinks) == {"n3"}
    finally:
        port.close()
        ctx.term()


def test_a_curve_node_gets_a_second_io_thread_when_it_has_the_cpus() -> None:
    from types import SimpleNamespace

    import pytest

    from ravq.net.options import CURVE_IO_THREADS, io_threads

    curve = SocketOptions(curve=SimpleNamespace())
    assert io_threads(SocketOptions(), 8) == 1  # plaintext: ZeroMQ's one thread
    assert io_threads(curve, 8) == CURVE_IO_THREADS == 2
    assert io_threads(curve, 1) == 1  # a one-CPU node: a second thread would only take turns
    with pytest.raises(ValueError, match="cpus"):
        io_threads(curve, 0)
