"""Homes behind NAT in network namespaces: a public network, open PCs on it, and per home a router that
masquerades its LAN (nftables) and forwards nothing inbound (issue #24).

``nat_homes(open_pcs, homes, rate_mbit)`` makes:

- a hub namespace with the "internet" bridge, 10.x.y.0/24;
- ``open_pcs`` namespaces on it (10.x.y.2, .3, ...): reachable PCs;
- per home h a router namespace (public 10.x.y.(20+h) on the bridge, LAN 192.168.(h+1).1 on a bridge of
  its own) with ``ip_forward`` on, ``masquerade`` out of its public side, and a forward chain that drops
  every new connection from outside (only replies get in); its PCs (192.168.(h+1).2, ...) route through it.

Every PC's and router's upload (veth egress) is shaped with tc tbf to ``rate_mbit``.  Nobody outside a
home can dial a PC in it: there is no route to 192.168/16 outside, and the router's own public address
has nothing listening and forwards nothing.  Needs root, iproute2, tbf and nft (Debian: nftables);
``unavailable_reason`` says what is missing.  Everything is deleted on the way out.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from benchmarks._netns import _check, _run, tbf_burst_bytes
from benchmarks._netns import unavailable_reason as _netns_reason


@dataclasses.dataclass(frozen=True)
class Pc:
    name: str
    netns: str
    address: str
    """Its own address (a LAN address behind NAT)."""
    public: str
    """The address others would try to dial: its own when open, its router's when behind NAT."""
    behind_nat: bool


NFT_RULES = """
table ip ravqnat {
  chain postrouting { type nat hook postrouting priority 100; oifname "wan" masquerade; }
  chain forward {
    type filter hook forward priority 0; policy drop;
    ct state established,related accept
    iifname "lan" accept
  }
}
"""


def unavailable_reason() -> str | None:
    if reason := _netns_reason():
        return reason
    if shutil.which("nft") is None:
        return "needs nft (Debian package nftables: apt-get install nftables)"
    return None


def _shape(ns: str, dev: str, rate_mbit: float) -> None:
    _check(_run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                f"{rate_mbit:g}mbit", "burst", str(tbf_burst_bytes(rate_mbit)), "latency", "20ms"))


def _veth(a_ns: str, a_dev: str, b_ns: str, b_dev: str) -> None:
    _check(_run("ip", "link", "add", a_dev, "netns", a_ns, "type", "veth", "peer", "name", b_dev, "netns", b_ns))


def _up(ns: str, dev: str, cidr: str | None = None) -> None:
    if cidr:
        _check(_run("ip", "-n", ns, "addr", "add", cidr, "dev", dev))
    _check(_run("ip", "-n", ns, "link", "set", dev, "up"))


@contextmanager
def nat_homes(open_pcs: Sequence[str], homes: Sequence[Sequence[str]], rate_mbit: float = 100.0,
              prefix: str = "rqn") -> Iterator[dict[str, Pc]]:
    """PCs by name (``open_pcs`` reachable, ``homes[h]`` behind home h's NAT router)."""
    tag = os.getpid()
    subnet = f"10.{200 + tag % 50}.{tag // 50 % 250}"
    hub = f"{prefix}hub{tag}"
    created: list[str] = []

    def netns(name: str) -> str:
        _check(_run("ip", "netns", "add", name))
        created.append(name)
        _up(name, "lo")
        return name

    pcs: dict[str, Pc] = {}
    try:
        netns(hub)
        _check(_run("ip", "-n", hub, "link", "add", "br0", "type", "bridge"))
        _up(hub, "br0")
        for i, name in enumerate(open_pcs):
            ns = netns(f"{prefix}o{i}n{tag}")
            _veth(ns, "eth0", hub, f"o{i}")
            _check(_run("ip", "-n", hub, "link", "set", f"o{i}", "master", "br0"))
            _up(hub, f"o{i}")
            address = f"{subnet}.{i + 2}"
            _up(ns, "eth0", f"{address}/24")
            _shape(ns, "eth0", rate_mbit)
            pcs[name] = Pc(name, ns, address, address, False)
        for h, members in enumerate(homes):
            router, public, lan = netns(f"{prefix}r{h}n{tag}"), f"{subnet}.{20 + h}", f"192.168.{h + 1}"
            _veth(router, "wan", hub, f"r{h}")
            _check(_run("ip", "-n", hub, "link", "set", f"r{h}", "master", "br0"))
            _up(hub, f"r{h}")
            _up(router, "wan", f"{public}/24")
            _shape(router, "wan", rate_mbit)
            _check(_run("ip", "-n", router, "link", "add", "lan", "type", "bridge"))
            _up(router, "lan", f"{lan}.1/24")
            _check(_run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1"))
            _check(_nft(router))
            for i, name in enumerate(members):
                ns = netns(f"{prefix}h{h}p{i}n{tag}")
                _veth(ns, "eth0", router, f"p{i}")
                _check(_run("ip", "-n", router, "link", "set", f"p{i}", "master", "lan"))
                _up(router, f"p{i}")
                address = f"{lan}.{i + 2}"
                _up(ns, "eth0", f"{address}/24")
                _check(_run("ip", "-n", ns, "route", "add", "default", "via", f"{lan}.1"))
                _shape(ns, "eth0", rate_mbit)
                pcs[name] = Pc(name, ns, address, public, True)
        yield pcs
    finally:
        for ns in reversed(created):
            _run("ip", "netns", "del", ns)


def _nft(router: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", "exec", router, "nft", "-f", "-"], input=NFT_RULES, check=False,
                          capture_output=True, text=True, timeout=30)
