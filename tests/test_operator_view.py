"""What the operator is told: fault and abort series exist at 0 from the start (so ``increase()`` sees
the first event), ``ravq status`` is not a dropped connection, and the broker names who is down and
what a paused cluster waits for (issue #27)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import orjson
import pytest
import zmq
import zmq.asyncio

from brokers.book import Book
from brokers.gauges import waiting_for
from brokers.topology import Broker
from ravq.cli.demo import free_ports
from ravq.cli.status import fetch_status
from ravq.config import ClusterPlan, Plan, parse_topology
from ravq.metrics import ABORT_REASONS, Metrics
from ravq.net.connections import ConnectionMonitor
from ravq.net.options import SocketOptions
from ravq.net.protocol import Heartbeat
from ravq.net.security import AUTH_FAILURES, Curve, keygen, load_secret
from ravq.net.transport import Inbox, request
from ravq.net.wire import WIRE_REASONS, DecodeLimits, Message, MsgType

REPO = Path(__file__).resolve().parents[1]
PLAN = Plan(clusters=[ClusterPlan(nodes=["a0", "a1"], cuts=["l3"]), ClusterPlan(nodes=["b0", "b1"], cuts=["l3"])])


def _value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_abort_and_timeout_series_exist_at_zero_before_any_event() -> None:
    metrics = Metrics("n1")
    for reason in ABORT_REASONS:
        assert _value(metrics, "ravq_allreduce_aborts_total", reason=reason) == 0.0, reason
    assert _value(metrics, "ravq_peer_timeouts_total", peer="pipeline", what="give_up") == 0.0


@pytest.mark.parametrize("curve", [False, True], ids=["plaintext", "curve"])
def test_a_server_sockets_fault_series_exist_at_zero_once_it_is_bound(tmp_path: Path, curve: bool) -> None:
    metrics = Metrics("n1")
    ctx = zmq.asyncio.Context()
    if curve:
        keygen("n1", tmp_path)
        public, secret = load_secret("n1", tmp_path)
        monitor: ConnectionMonitor = Curve(name="n1", public=public, secret=secret, peers={"n1": public},
                                           metrics=metrics)
        opts = SocketOptions(curve=monitor, monitor=monitor, linger_ms=0)
    else:
        monitor = ConnectionMonitor(metrics)
        opts = SocketOptions(monitor=monitor, linger_ms=0)
    pipeline = Inbox.bind(ctx, "tcp://127.0.0.1:*", "pipeline", metrics, DecodeLimits(), opts)
    broker = Inbox.bind(ctx, "tcp://127.0.0.1:*", "broker", metrics, DecodeLimits(), opts, one_shot_clients=True)
    try:
        for reason in (*WIRE_REASONS, "no_identity"):
            assert _value(metrics, "ravq_bad_messages_total", socket="pipeline", reason=reason) == 0.0, reason
        assert _value(metrics, "ravq_connections_dropped_total", socket="pipeline", reason="closed") == 0.0
        # the broker's request socket: clients come and go, so no `closed` series at all
        assert _value(metrics, "ravq_connections_dropped_total", socket="broker", reason="closed") is None
        failed = ("ravq_auth_failures_total", AUTH_FAILURES) if curve else (
            "ravq_connections_dropped_total", ("handshake_failed",))
        for sock in ("pipeline", "broker"):
            for reason in failed[1]:
                assert _value(metrics, failed[0], socket=sock, reason=reason) == 0.0, (sock, reason)
    finally:
        pipeline.close()
        broker.close()
        monitor.close()
        ctx.term()


def _topology(ports: list[int]) -> dict[str, object]:
    return {"task": "tests.churn_task", "broker": {"pub_port": ports[0], "router_port": ports[1]},
            "nodes": [{"name": n, "pipeline_port": ports[2 + 2 * i], "ring_port": ports[3 + 2 * i],
                       "cluster": i // 2} for i, n in enumerate(["a0", "a1", "b0", "b1"])]}


def test_status_reads_a_reply_over_a_nodes_header_limit() -> None:
    """A swarm of 600 members answers STATUS with a header of some 300 KiB, over a node's 64 KiB: ``ravq
    status`` still reads it (with the node's limit the reply was dropped and status timed out)."""
    ports = free_ports(10)
    topology = parse_topology(_topology(ports), resolve_task=False)
    members = {f"pc{i}": {"state": "up", "phase": "training", "generation": 3, "age_s": 0.5,
                          "stats": {"waiting": {"input": 0.25, "grad": 0.125}, "x" * 300: 1}} for i in range(600)}

    async def scenario() -> dict[str, object]:
        ctx = zmq.asyncio.Context()
        server = Inbox.bind(ctx, f"tcp://127.0.0.1:{topology.broker.router_port}", "broker", Metrics(),
                            DecodeLimits(), SocketOptions(linger_ms=0), one_shot_clients=True)
        try:
            async with asyncio.TaskGroup() as tg:
                asking = tg.create_task(fetch_status(topology, timeout_s=10.0))
                identity, _ = await server.recv()
                await server.reply(identity, Message(type=MsgType.STATUS, sender="broker",
                                                     meta={"members": members}), "x")
                return await asking
        finally:
            server.close()
            ctx.term()

    status = asyncio.run(scenario())
    assert len(orjson.dumps(status)) > DecodeLimits().max_header_bytes
    assert status["members"] == members


def _garbage(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n" * 4)
        time.sleep(0.05)


def test_status_requests_are_not_counted_as_dropped_connections() -> None:
    """Three `ravq status` round trips, then one garbage connection: the broker's monitor reports events
    in order, so once the garbage is counted the status clients' closes have been seen, and not counted.
    A node's socket (not one-shot) counts the same kind of client's close: the monitor does see it."""
    ports = free_ports(10)
    topology = parse_topology(_topology(ports), resolve_task=False)
    metrics = Metrics("broker")
    monitor = ConnectionMonitor(metrics)
    broker = Broker(topology, PLAN, metrics, SocketOptions(monitor=monitor, linger_ms=0))

    def counted(sock: str, reason: str) -> float:
        return _value(metrics, "ravq_connections_dropped_total", socket=sock, reason=reason) or 0.0

    async def scenario() -> None:
        async with asyncio.TaskGroup() as tg:
            running = tg.create_task(broker.run())
            for _ in range(3):
                status = await fetch_status(topology, timeout_s=10.0)
                assert status["plan"]["clusters"][0]["nodes"] == ["a0", "a1"]
            # a node's ROUTER (same monitor): one request/reply client closing is a `closed` there
            ctx = zmq.asyncio.Context()
            node_sock = Inbox.bind(ctx, "tcp://127.0.0.1:*", "pipeline", metrics, DecodeLimits(),
                                   SocketOptions(monitor=monitor, linger_ms=0))
            addr = node_sock.sock.getsockopt_string(zmq.LAST_ENDPOINT)
            asking = tg.create_task(request(ctx, addr, Message(type=MsgType.STATUS_REQ, sender="x"), 10.0, Metrics(),
                                            DecodeLimits(), SocketOptions()))
            identity, _ = await node_sock.recv()
            await node_sock.reply(identity, Message(type=MsgType.STATUS, sender="a0", meta={}), "x")
            await asking
            await asyncio.to_thread(_garbage, topology.broker.router_port)
            deadline = time.monotonic() + 20
            while (counted("broker", "handshake_failed") < 1 or counted("pipeline", "closed") < 1) \
                    and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            broker.stop()
            await running
            node_sock.close()
            ctx.term()

    asyncio.run(scenario())
    assert counted("pipeline", "closed") == 1
    assert counted("broker", "handshake_failed") == 1
    assert counted("broker", "closed") == 0
    assert metrics.registry.get_sample_value("ravq_broker_requests_total", {"type": "status_req"}) == 3


def test_the_broker_names_the_lost_node_and_what_its_paused_cluster_waits_for() -> None:
    ports = free_ports(10)
    topology = parse_topology(_topology(ports), resolve_task=False)
    metrics = Metrics("broker")
    broker = Broker(topology, PLAN, metrics, SocketOptions(), heartbeat_timeout_s=5.0, clock=lambda: 0.0)
    book: Book = broker.book
    for n in ("a0", "a1", "b0", "b1"):
        book.register(n, f"i-{n}", 0.0)
    for t in (1.0, 3.0, 5.0, 7.0):
        for n in ("a0", "a1", "b0") if t > 1.0 else ("a0", "a1", "b0", "b1"):
            book.heartbeat(n, Heartbeat(incarnation=f"i-{n}", phase="training",
                                        generation=book.clusters[0].generation), t)
        book.check(t)
    broker.gauges.count(broker.book)
    assert waiting_for(book) == {(1, "b1"): "lost"}

    def member(name: str, state: str) -> float | None:
        return metrics.registry.get_sample_value("ravq_broker_member_state", {"member": name, "state": state})

    assert member("b1", "lost") == 1.0 and member("b1", "up") == 0.0 and member("a0", "up") == 1.0
    assert metrics.registry.get_sample_value("ravq_cluster_waiting_for",
                                             {"cluster": "1", "member": "b1", "why": "lost"}) == 1.0
    # b1 is back: the cluster recovers and waits for the members not ready yet, by what they do
    book.heartbeat("b1", Heartbeat(incarnation="i-b1", phase="paused", generation=1), 8.0)
    book.heartbeat("b0", Heartbeat(incarnation="i-b0", phase="catching_up", generation=1), 8.0)
    book.check(8.0)
    assert book.clusters[1].state == "recovering"
    broker.gauges.count(broker.book)
    assert waiting_for(book) == {(1, "b0"): "catching_up", (1, "b1"): "paused"}
    assert metrics.registry.get_sample_value("ravq_cluster_waiting_for",
                                             {"cluster": "1", "member": "b1", "why": "lost"}) is None
    for n in ("b0", "b1"):
        book.heartbeat(n, Heartbeat(incarnation=f"i-{n}", phase="paused", generation=1, ready=1), 9.0)
    book.check(9.0)
    broker.gauges.count(broker.book)
    assert book.clusters[1].state == "training" and waiting_for(book) == {}


def test_the_dashboard_names_who_is_down_and_why_a_cluster_waits() -> None:
    """The panels exist and query the series above (a real Prometheus answers them in
    tests/test_walkthrough.py; here, without one, their queries and zero-documentation are checked)."""
    dashboard = json.loads((REPO / "grafana" / "dashboards" / "ravq.json").read_text())
    exprs = {p["title"]: (p["targets"][0]["expr"], p.get("description", "")) for p in dashboard["panels"]
             if p.get("targets")}
    down = [t for t, (e, _) in exprs.items() if "up{" in e and "by (node)" in e]
    lost = [t for t, (e, _) in exprs.items() if "ravq_broker_member_state" in e and "member" in e]
    why = [t for t, (e, _) in exprs.items() if "ravq_cluster_waiting_for" in e and "why" in e]
    assert down and lost and why, sorted(exprs)
    for title in (*down, *lost, *why):
        assert "Zero is normal" in exprs[title][1], title
