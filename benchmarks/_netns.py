"""Bandwidth-limited links for benchmarks: one network namespace per process on a shared bridge.

``shaped_links(n, rate_mbit)`` creates a hub namespace holding a bridge and ``n`` namespaces, each joined
to the bridge by a veth pair whose egress (the node's upload) is shaped by tc tbf to ``rate_mbit``; a
packet from a to b crosses a's shaped veth and b's unshaped bridge port, so a -> b runs at a's rate
(tests/test_netns.py's ``shaped_nodes`` uses it too, with a rate per namespace). Private 10.x addresses, names unique by process id, and the
namespaces are deleted on the way out whatever happens (exceptions, Ctrl-C, SIGTERM turned into
SystemExit by the caller). A process moves itself into one with ``join_netns`` before it opens any socket.

Needs Linux, root, iproute2 (``ip``, ``tc``) and the tbf qdisc; ``unavailable_reason`` says what is missing.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"


@dataclasses.dataclass(frozen=True)
class Link:
    """One process's end: its namespace, its address on the bridge and the interface that carries it."""

    netns: str
    address: str
    ifname: str


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, check=False, capture_output=True, text=True, timeout=30)


def _check(result: subprocess.CompletedProcess[str]) -> None:
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(result.args)}: {result.stderr.strip()}")


def unavailable_reason() -> str | None:
    """Why shaped links cannot be made here, or None when they can (probes with a throwaway namespace)."""
    if not sys.platform.startswith("linux"):
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip and tc)"
    probe = f"rqbprobe{os.getpid()}"
    made = _run("ip", "netns", "add", probe)
    if made.returncode != 0:
        return f"ip netns unavailable: {made.stderr.strip()}"
    try:
        _run("ip", "-n", probe, "link", "set", "lo", "up")
        tbf = _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "10mbit",
                   "burst", "32kb", "latency", "50ms")
        if tbf.returncode != 0:
            return f"tc tbf unavailable: {tbf.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe)
    return None


def tbf_burst_bytes(rate_mbit: float) -> int:
    """5 ms of tokens (at least 32 KiB): enough for any timer granularity without loosening the rate."""
    return max(32 << 10, int(rate_mbit * 1_000_000 / 8 / 200))


@contextmanager
def shaped_links(n: int, rate_mbit: float | Sequence[float], prefix: str = "rqb") -> Iterator[list[Link]]:
    """``n`` namespaces on one bridge, each one's upload shaped to ``rate_mbit`` (one rate for all, or
    one per namespace); deleted on exit.  Their names start with ``prefix`` (and hold the process id)."""
    rates = [float(rate_mbit)] * n if isinstance(rate_mbit, (int, float)) else [float(r) for r in rate_mbit]
    if len(rates) != n:
        raise ValueError(f"rate_mbit: {len(rates)} rates for {n} links")
    tag = os.getpid()
    subnet = f"10.{150 + tag % 50}.{tag // 50 % 250}"
    hub = f"{prefix}hub{tag}"
    links = [Link(f"{prefix}{i}n{tag}", f"{subnet}.{i + 1}", f"v{i}") for i in range(n)]
    created: list[str] = []
    try:
        for ns in [hub, *(link.netns for link in links)]:
            _check(_run("ip", "netns", "add", ns))
            created.append(ns)
            _check(_run("ip", "-n", ns, "link", "set", "lo", "up"))
        _check(_run("ip", "-n", hub, "link", "add", "br0", "type", "bridge"))
        _check(_run("ip", "-n", hub, "link", "set", "br0", "up"))
        for i, link in enumerate(links):
            _check(_run("ip", "link", "add", link.ifname, "netns", link.netns, "type", "veth", "peer", "name", f"h{i}",
                        "netns", hub))
            _check(_run("ip", "-n", hub, "link", "set", f"h{i}", "master", "br0"))
            _check(_run("ip", "-n", hub, "link", "set", f"h{i}", "up"))
            _check(_run("ip", "-n", link.netns, "addr", "add", f"{link.address}/24", "dev", link.ifname))
            _check(_run("ip", "-n", link.netns, "link", "set", link.ifname, "up"))
            _check(_run("ip", "netns", "exec", link.netns, "tc", "qdisc", "add", "dev", link.ifname, "root", "tbf",
                        "rate", f"{rates[i]:g}mbit", "burst", str(tbf_burst_bytes(rates[i])), "latency", "20ms"))
        yield links
    finally:
        for ns in reversed(created):
            _run("ip", "netns", "del", ns)


def join_netns(link: Link) -> None:
    """Move the calling thread (call it first thing in a fresh process, before any thread or socket
    exists: threads started later inherit it) into ``link``'s namespace. Python 3.11 has no os.setns."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, link.netns), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {link.netns}: {os.strerror(err)}")
    finally:
        os.close(fd)
    socket.if_nametoindex(link.ifname)  # OSError unless the move took: the interface lives only in there
