"""What relays cost, for the planner and the simulator (issue #24).  Plain data: no sockets.

A link between two nodes behind NAT goes through a relay (``ravq.config.routes``): its bytes cross the
sender's uplink to the relay and the relay's uplink to the receiver, and every link through one relay
shares that relay's uplink (and downlink).  So a relayed link a -> b runs at

    min(a's measured rate to b, relay bandwidth / links through the relay)

and takes the latency measured through the relay (``ravq profile`` probes two nodes behind NAT through
their relay) plus ``relay_latency_s`` when it was not measured.  The links through a relay depend on the
plan, so ``plan_with_relays`` plans, counts them, re-prices the profiles and plans again (twice: the
count settles at once in practice; the second plan is the one returned).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from ravq.config import Plan, Topology
from ravq.config.routes import RelayPoint, relay_for, relays
from ravq.planner.types import NodeProfile

T = TypeVar("T")


def plan_links(plan: Plan) -> list[tuple[str, str, str]]:
    """Every (kind, a, b) link a plan makes: each cluster's consecutive stages and stage 0 -> last stage
    (pipeline), and the holders of the same stage in every two clusters (ring)."""
    out: list[tuple[str, str, str]] = []
    for c in plan.clusters:
        pairs = list(zip(c.nodes, c.nodes[1:], strict=False))
        if len(c.nodes) > 2:
            pairs.append((c.nodes[0], c.nodes[-1]))
        out += [("pipeline", a, b) for a, b in pairs]
    for i, ci in enumerate(plan.clusters):
        for cj in plan.clusters[i + 1:]:
            out += [("ring", a, b) for a, b in zip(ci.nodes, cj.nodes, strict=False)]
    return out


def relayed_links(
    plan: Plan, behind_nat: set[str], points: Sequence[RelayPoint]
) -> list[tuple[str, str, str, str]]:
    """(kind, a, b, relay) of every link of ``plan`` between two nodes behind NAT."""
    return [(kind, a, b, relay_for(a, b, list(points)).name) for kind, a, b in plan_links(plan)
            if a in behind_nat and b in behind_nat]


def priced_profiles(nodes: Sequence[NodeProfile], relayed: Sequence[tuple[str, str, str, str]],
                    points: Sequence[RelayPoint], relay_latency_s: float = 0.0) -> list[NodeProfile]:
    """``nodes`` with each relayed pair's bandwidth capped at its share of its relay (and the relay's
    latency added where the pair's latency was not measured)."""
    through: dict[str, int] = {}
    for *_, relay in relayed:
        through[relay] = through.get(relay, 0) + 1
    bandwidth = {p.name: p.bandwidth_bytes_per_s for p in points}
    caps: dict[tuple[str, str], float] = {}
    for _, a, b, relay in relayed:
        relay_bw = bandwidth.get(relay)
        if relay_bw is not None:
            caps[(a, b)] = caps[(b, a)] = relay_bw / through[relay]
    out = []
    for node in nodes:
        bw, lat = dict(node.bandwidth_bytes_per_s), dict(node.latency_s)
        for (a, b), cap in caps.items():
            if a == node.name and b in bw:
                bw[b] = min(bw[b], cap)
        for _, a, b, _relay in relayed:
            for x, y in ((a, b), (b, a)):
                if x == node.name and y not in lat:
                    lat[y] = relay_latency_s
        out.append(dataclasses.replace(node, bandwidth_bytes_per_s=bw, latency_s=lat))
    return out


def behind_nat_of(topology: Topology, reach: Mapping[str, bool] | None = None) -> set[str]:
    """Nodes behind NAT: declared (``reachable: false``) or as ``reach`` says (a broker's verdicts)."""
    declared = {n.name for n in topology.nodes if n.reachable is False}
    return declared | {n for n, ok in (reach or {}).items() if not ok}


def plan_with_relays(
    topology: Topology,
    nodes: Sequence[NodeProfile],
    make: Callable[[Sequence[NodeProfile]], tuple[Plan, T]],
    reach: Mapping[str, bool] | None = None,
) -> tuple[Plan, T, list[tuple[str, str, str, str]]]:
    """``make(profiles)`` on profiles priced for the relays the plan uses; returns the plan, what ``make``
    returned beside it and the plan's relayed links."""
    behind, points = behind_nat_of(topology, reach), relays(topology)
    plan, extra = make(nodes)
    relayed = relayed_links(plan, behind, points) if behind else []
    if relayed:
        plan, extra = make(priced_profiles(nodes, relayed, points))
        relayed = relayed_links(plan, behind, points)
    return plan, extra, relayed


def format_relayed(relayed: Sequence[tuple[str, str, str, str]]) -> list[str]:
    return [f"relayed {kind} link {a} <-> {b} via {relay} (both behind NAT)" for kind, a, b, relay in relayed]
