"""Listening ports bound before the processes that serve them start, and a clear error for a taken port.

A launcher that picks free ports and starts processes that bind them later races every other process on
the machine: once in ~45 runs of ``ravq demo`` on a busy machine another process took a port in the
minute between (EADDRINUSE).  So ``ravq demo`` and the tests' swarms bind first: a launcher's
``Listeners`` binds and listens (on port 0, or on a topology's port), and each child process inherits its
own listening sockets: ``subprocess``'s ``pass_fds``, with ``RAVQ_LISTEN_FDS=port:fd,port:fd`` saying
which is which.  In the child, a ZeroMQ socket that binds one of those ports takes the inherited
descriptor (``ZMQ_USE_FD``: ZeroMQ accepts on it instead of binding again) and so does the metrics
server.  Anywhere else (``ravq node`` under systemd) a port is bound as usual, and one that another
process holds is reported with the topology field that names it (``PortInUse``).
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
from collections.abc import Iterable, Mapping
from typing import Any, Self

import zmq

from ravq.config import ConfigError, Topology
from ravq.metrics import Metrics

ENV = "RAVQ_LISTEN_FDS"
"""``port:fd,port:fd``: the listening sockets a process inherited from its launcher."""
BACKLOG = 100
"""Connections the kernel queues before the child accepts (ZeroMQ's own ``ZMQ_BACKLOG`` default)."""

_inherited: dict[int, int] | None = None
_labels: dict[int, str] = {}


class PortInUse(ConfigError):
    """A port of the topology that another process holds."""

    def __init__(self, host: str, port: int, what: str) -> None:
        super().__init__(f"port {port} on {host} ({what}) is already in use by another process; stop that "
                         "process or give this one another port in the topology")
        self.host, self.port = host, port


def parse(spec: str) -> dict[int, int]:
    """``port:fd,port:fd`` as {port: fd}; a malformed entry is an error that names ``RAVQ_LISTEN_FDS``."""
    table: dict[int, int] = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        port, sep, fd = item.partition(":")
        if not (sep and port.isdigit() and fd.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"{ENV}: {item!r} is not port:fd")
        table[int(port)] = int(fd)
    return table


def ports_of(topology: Topology, process: str) -> dict[int, str]:
    """The ports ``process`` (a node's name, ``broker`` or ``broker-backup``) listens on, each with the field
    that names it."""
    backup = topology.broker.backup
    if process == "broker-backup" and backup is not None:
        fields = {"pub_port": backup.pub_port, "router_port": backup.router_port,
                  "metrics_port": backup.metrics_port}
        return {port: f"broker.backup.{field}" for field, port in fields.items() if port is not None}
    if process == "broker":
        b = topology.broker
        fields = {"pub_port": b.pub_port, "router_port": b.router_port, "metrics_port": b.metrics_port,
                  "relay_port": b.relay_port}
        return {port: f"broker.{field}" for field, port in fields.items() if port is not None}
    i, node = next((i, n) for i, n in enumerate(topology.nodes) if n.name == process)
    fields = {"pipeline_port": node.pipeline_port, "ring_port": node.ring_port,
              "metrics_port": node.metrics_port}
    return {port: f"nodes[{i}].{field} of node {process}"
            for field, port in fields.items() if port is not None}


def name_ports(topology: Topology, process: str) -> None:
    """Say which topology field each of this process's ports comes from, for ``PortInUse``."""
    _labels.update(ports_of(topology, process))


def take(port: int) -> socket.socket | None:
    """This process's inherited listening socket for ``port``, once (binding the port again later binds
    as usual); None without one."""
    global _inherited
    if _inherited is None:  # read once, and out of the environment: this process's children get none
        _inherited = parse(os.environ.pop(ENV, ""))
    fd = _inherited.pop(port, None)
    if fd is None:
        return None
    try:
        sock = socket.socket(fileno=fd)
    except OSError as err:
        raise ValueError(f"{ENV}: descriptor {fd} for port {port}: {err.strerror}") from None
    sock.set_inheritable(False)
    if sock.type != socket.SOCK_STREAM or sock.getsockname()[1] != port \
            or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        sock.detach()  # not ours to close
        raise ValueError(f"{ENV}: descriptor {fd} is not a TCP socket listening on port {port}")
    return sock


def _host_port(addr: str) -> tuple[str, int | None]:
    """``tcp://host:port`` -> (host, port); no port for a wildcard (``*``) or another transport."""
    if not addr.startswith("tcp://"):
        return addr, None
    host, _, port = addr[len("tcp://"):].rpartition(":")
    return host, int(port) if port.isdigit() else None


def bind(sock: zmq.Socket, addr: str, role: str) -> None:
    """``sock.bind(addr)``: on the inherited listening socket for the port if this process has one, else
    binding it, with ``PortInUse`` if another process holds it.  ``role`` names the socket in that error
    when ``name_ports`` did not name the port."""
    host, port = _host_port(addr)
    inherited = take(port) if port is not None else None
    if inherited is not None:
        sock.setsockopt(zmq.USE_FD, inherited.detach())  # ZeroMQ owns it now and closes it with the socket
        try:
            sock.bind(addr)
        finally:
            sock.setsockopt(zmq.USE_FD, -1)
        return
    try:
        sock.bind(addr)
    except zmq.ZMQError as err:
        if err.errno == errno.EADDRINUSE and port is not None:
            raise PortInUse(host, port, _labels.get(port, f"the {role} socket's port")) from None
        raise


def serve_metrics(metrics: Metrics, port: int, host: str) -> None:
    """``metrics.serve``: on the inherited listening socket for ``port`` if this process has one."""
    try:
        metrics.serve(port, host, take(port))
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise PortInUse(host, port, _labels.get(port, "the metrics port")) from None
        raise


class Listeners:
    """A launcher's listening sockets, bound before the processes that serve them start.

    ``ports(n)`` binds n free ports and ``hold(ports)`` given ones; ``spawn(argv, ports)`` starts the
    process that serves them, which inherits their sockets, and closes this process's copies.
    ``close()`` closes the sockets no process took."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._socks: dict[int, socket.socket] = {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ports(self, count: int) -> list[int]:
        """``count`` distinct free ports, bound and listening from now on."""
        return [self._listen(0) for _ in range(count)]

    def hold(self, ports: Mapping[int, str]) -> None:
        """Bind and listen on these ports (``ports_of``: port -> topology field) unless held already;
        ``PortInUse`` if another process has one."""
        for port, field in ports.items():
            if port not in self._socks:
                try:
                    self._listen(port)
                except OSError as err:
                    if err.errno != errno.EADDRINUSE:
                        raise
                    raise PortInUse(self.host, port, field) from None

    def spawn(self, argv: list[str], ports: Mapping[int, str], env: Mapping[str, str] | None = None,
              **popen: Any) -> subprocess.Popen[Any]:
        """``subprocess.Popen(argv, **popen)`` for the process that listens on ``ports`` (held already, or
        bound now).  That child inherits their sockets, and no other: ``pass_fds`` makes them inheritable
        in it alone.  This process's copies close once it runs, so a port is free when the child dies."""
        self.hold(ports)
        socks = {port: self._socks[port] for port in ports}
        child_env = {k: v for k, v in (os.environ if env is None else env).items() if k != ENV}
        if socks:  # and never a table meant for another process
            child_env[ENV] = ",".join(f"{port}:{s.fileno()}" for port, s in socks.items())
        try:
            return subprocess.Popen(argv, env=child_env, pass_fds=[s.fileno() for s in socks.values()],
                                    **popen)
        finally:
            self.release(ports)

    def release(self, ports: Iterable[int]) -> None:
        for port in ports:
            sock = self._socks.pop(port, None)
            if sock is not None:
                sock.close()

    def close(self) -> None:
        self.release(list(self._socks))

    def _listen(self, port: int) -> int:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ's own listeners: a port
            sock.bind((self.host, port))  # a dead child served is not held up by its TIME_WAIT connections
            sock.listen(BACKLOG)
        except OSError:
            sock.close()
            raise
        port = sock.getsockname()[1]
        self._socks[port] = sock
        return port
