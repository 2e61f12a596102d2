"""Which way each link between two nodes goes, given who can be dialled (issue #24).  Plain data, no sockets.

Every link of a node to a peer (pipeline, ring, catch-up) takes one of four routes, from the node's side:

- ``direct``: both are reachable; the node connects a DEALER to the peer's ROUTER (as always).
- ``accept``: the peer is behind NAT and this node is reachable: the peer dials in; this node sends on its
  own ROUTER to the peer's routing id, once the peer's connection is there.
- ``dial``: this node is behind NAT and the peer is reachable: this node's ROUTER connects to the peer's
  ROUTER (ZeroMQ lets either end bind), and both directions use that one connection.
- ``relay``: neither can be dialled: both dial a relay (``ravq.net.relay``), which forwards frames.

Reachability comes from the topology (``reachable: false``) or from the broker's dial-back check at
start; a node nobody measured yet counts as reachable.  The relay of a pair is chosen by a stable hash
of the two names over the topology's relays (the broker's first), so both ends and the planner agree.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ravq.config.base import ConfigError
from ravq.config.topology import Topology

DIRECT, ACCEPT, DIAL, RELAY = "direct", "accept", "dial", "relay"
ROUTES = (DIRECT, ACCEPT, DIAL, RELAY)
BROKER_RELAY = "broker"
"""The relay the broker's process runs when ``broker.relay_port`` is set (it uses the broker's key)."""


@dataclass(frozen=True, slots=True)
class RelayPoint:
    name: str
    host: str
    port: int
    bandwidth_bytes_per_s: float | None = None


@dataclass(frozen=True, slots=True)
class Route:
    kind: str
    """One of ``ROUTES``."""
    relay: RelayPoint | None = None
    """The relay of a ``relay`` route."""


def relays(topology: Topology) -> list[RelayPoint]:
    """Every relay of the topology: the broker's (when it relays) first."""
    points = []
    b = topology.broker
    if b.relay_port is not None:
        points.append(RelayPoint(BROKER_RELAY, b.host, b.relay_port))
    points += [RelayPoint(r.name, r.host, r.port, r.bandwidth_bytes_per_s) for r in topology.relays]
    return points


def relay_names(topology: Topology) -> set[str]:
    return {r.name for r in relays(topology)}


def declared_reach(topology: Topology) -> dict[str, bool]:
    """What the topology says: False for nodes with ``reachable: false``, True for ``reachable: true``."""
    return {n.name: n.reachable for n in topology.nodes if n.reachable is not None}


def is_reachable(node: str, reach: Mapping[str, bool | None]) -> bool:
    """Unmeasured nodes count as reachable."""
    return reach.get(node) is not False


def relay_for(a: str, b: str, points: list[RelayPoint]) -> RelayPoint:
    if not points:
        raise ConfigError(f"nodes {a} and {b} are both behind NAT and the topology has no relay: set "
                          "broker.relay_port (the broker's PC relays) or list relays")
    lo, hi = sorted((a, b))
    return points[zlib.crc32(f"{lo}|{hi}".encode()) % len(points)]


def route(me: str, peer: str, reach: Mapping[str, bool | None], points: list[RelayPoint]) -> Route:
    """The route of ``me``'s link to ``peer``."""
    mine, theirs = is_reachable(me, reach), is_reachable(peer, reach)
    if mine and theirs:
        return Route(DIRECT)
    if mine:
        return Route(ACCEPT)
    if theirs:
        return Route(DIAL)
    return Route(RELAY, relay_for(me, peer, points))


def relayed_pairs(pairs: Iterable[tuple[str, str]], reach: Mapping[str, bool | None],
                  points: list[RelayPoint]) -> dict[tuple[str, str], str]:
    """The pairs among ``pairs`` that go through a relay, with that relay's name."""
    out: dict[tuple[str, str], str] = {}
    for a, b in pairs:
        r = route(a, b, reach, points)
        if r.kind == RELAY and r.relay is not None:
            out[(a, b)] = r.relay.name
    return out
