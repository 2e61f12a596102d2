"""Bind first (``ravq.net.listen``): a launcher's listening sockets, inherited by the process that serves
them and taken by ZeroMQ (``ZMQ_USE_FD``) and the metrics server; a taken port is a one-line error
naming the topology field."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
import zmq.asyncio

from ravq.config import parse_topology
from ravq.metrics import Metrics
from ravq.net import listen
from ravq.net.listen import ENV, Listeners, PortInUse, ports_of
from ravq.net.options import SocketOptions, endpoint
from ravq.net.transport import Inbox, Outlink
from ravq.net.wire import DecodeLimits, Message, MsgType
from tests.swarm import ROOT, local_topology

OPTS = SocketOptions(linger_ms=200)


@pytest.fixture
def inherit(monkeypatch: pytest.MonkeyPatch) -> Iterator[Listeners]:
    """This process as a child of a launcher: ``inherit.ports(n)`` are bound, listening and handed to this
    process (a copy of each descriptor, as ``pass_fds`` gives a child), and the launcher's copies stay
    open, so a bind that does not use the inherited descriptor fails."""
    listeners = Listeners()
    monkeypatch.setattr(listen, "_inherited", None)
    monkeypatch.setattr(listen, "_labels", {})
    ports = listeners.ports

    def hand_over(count: int) -> list[int]:
        got = ports(count)
        spec = os.environ.get(ENV, "")
        for port in got:
            spec += f",{port}:{os.dup(listeners._socks[port].fileno())}"
        monkeypatch.setenv(ENV, spec.lstrip(","))
        return got

    monkeypatch.setattr(listeners, "ports", hand_over)
    yield listeners
    listeners.close()


def test_the_table_of_inherited_sockets_is_parsed_strictly() -> None:
    assert listen.parse("5555:3,5556:4") == {5555: 3, 5556: 4}
    assert listen.parse("") == {} and listen.parse(" 7:9 , ") == {7: 9}
    for bad in ("5555", "5555:x", "0:3", "70000:3", "5555:3:4", "-1:3"):
        with pytest.raises(ValueError, match=ENV):
            listen.parse(bad)


def test_a_zeromq_socket_binds_on_its_inherited_listening_socket(inherit: Listeners) -> None:
    """The port stays bound by the launcher's copy: the inbox can only have bound it through the
    inherited descriptor, and messages arrive through it."""
    (port,) = inherit.ports(1)
    addr = endpoint("127.0.0.1", port)
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))  # really held

    async def scenario() -> Message:
        ctx = zmq.asyncio.Context()
        inbox = Inbox.bind(ctx, addr, "pipeline", Metrics(), DecodeLimits(), OPTS)
        link = Outlink.connect(ctx, addr, "downstream", "b", Metrics(), DecodeLimits(), OPTS, identity="a")
        try:
            await link.send(Message(type=MsgType.STATUS_REQ, sender="a"))
            _, msg = await asyncio.wait_for(inbox.recv(), 10)
            return msg
        finally:
            link.close()
            inbox.close()
            ctx.term()

    assert asyncio.run(scenario()).sender == "a"
    assert ENV not in os.environ  # taken out of the environment: this process's children get none
    assert listen.take(port) is None  # used once: binding the port again would bind as usual


def test_the_metrics_server_serves_on_its_inherited_listening_socket(inherit: Listeners) -> None:
    (port,) = inherit.ports(1)
    metrics = Metrics("n0")
    metrics.samples.inc(7)
    listen.serve_metrics(metrics, port, "127.0.0.1")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert "ravq_samples_total 7.0" in response.read().decode()


def test_an_inherited_descriptor_must_be_a_socket_listening_on_its_port(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(listen, "_inherited", None)
    with open(tmp_path / "f", "w") as f, socket.socket() as unbound:
        monkeypatch.setenv(ENV, f"5001:{f.fileno()},5002:{unbound.fileno()}")
        for port in (5001, 5002):
            with pytest.raises(ValueError, match=f"{ENV}: descriptor .* port {port}"):
                listen.take(port)
        assert not f.closed and unbound.fileno() >= 0  # not closed behind their owners' backs


def _hold(port: int = 0) -> socket.socket:
    """Another process's listening socket."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_a_taken_port_is_an_error_naming_the_port_and_its_topology_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(listen, "_inherited", {})
    monkeypatch.setattr(listen, "_labels", {})
    with _hold() as other:
        port = other.getsockname()[1]
        data = local_topology("tests.sgd_task", [1, 1], {})
        data["nodes"][1]["ring_port"] = port
        topology = parse_topology(data, resolve_task=False)
        ctx = zmq.asyncio.Context()
        try:
            with pytest.raises(PortInUse, match=f"port {port} on 127.0.0.1 \\(the ring socket's port\\)"):
                Inbox.bind(ctx, endpoint("127.0.0.1", port), "ring", Metrics(), DecodeLimits(), OPTS)
            listen.name_ports(topology, "c1s0")
            with pytest.raises(PortInUse, match=f"port {port} .*nodes\\[1\\].ring_port of node c1s0.* already in use"):
                Inbox.bind(ctx, endpoint("127.0.0.1", port), "ring", Metrics(), DecodeLimits(), OPTS)
        finally:
            ctx.destroy(linger=0)
        with pytest.raises(PortInUse, match=f"port {port} .*nodes\\[1\\].ring_port of node c1s0"):
            listen.serve_metrics(Metrics(), port, "127.0.0.1")
        with Listeners() as launcher, pytest.raises(PortInUse, match="nodes\\[1\\].ring_port of node c1s0"):
            launcher.hold(ports_of(topology, "c1s0"))


def test_ravq_broker_on_a_taken_port_says_so_in_one_line(tmp_path: Path) -> None:
    topo = local_topology("tests.sgd_task", [1], {})
    with _hold() as other:
        topo["broker"]["router_port"] = other.getsockname()[1]
        (tmp_path / "t.yaml").write_text(yaml.safe_dump(topo))
        proc = subprocess.run([sys.executable, "-m", "ravq", "broker", "--topology", str(tmp_path / "t.yaml")],
                              check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()  # the log lines before it (the run it opened), then the error
    assert "Traceback" not in proc.stderr and [x for x in lines if x.startswith("ravq broker:")] == lines[-1:] == [
        (f"ravq broker: port {topo['broker']['router_port']} on 127.0.0.1 (broker.router_port) is already in use "
         "by another process; stop that process or give this one another port in the topology")], proc.stderr


_CHILD = textwrap.dedent("""
    import os, socket, sys
    from ravq.net import listen
    port = int(sys.argv[1])
    held = listen.take(port)
    print(held is not None and held.getsockname()[1] == port, os.environ.get(listen.ENV), flush=True)
    sys.stdin.read()  # until the launcher says go
""")


def test_each_child_inherits_its_own_sockets_and_a_dead_childs_port_is_free() -> None:
    """Two children, each with its own port: neither sees the other's socket, and the launcher's copies
    are closed, so once a child exits its port can be bound again while the other child still runs."""
    with Listeners() as launcher:
        a, b = launcher.ports(2)
        children = {port: launcher.spawn([sys.executable, "-c", _CHILD, str(port)], {port: f"port {port}"},
                                         {**os.environ, "PYTHONPATH": str(ROOT), ENV: "1:1"},
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                    for port in (a, b)}
        try:
            for child in children.values():
                assert child.stdout is not None
                assert child.stdout.readline().split() == ["True", "None"]  # its socket; the variable consumed
            children[a].communicate("", timeout=60)
            with socket.socket() as again:
                again.bind(("127.0.0.1", a))  # free: neither the launcher nor child b holds it
            with socket.socket() as other, pytest.raises(OSError):
                other.bind(("127.0.0.1", b))  # b's child still listens on it
        finally:
            for child in children.values():
                if child.poll() is None:
                    child.communicate("", timeout=60)
