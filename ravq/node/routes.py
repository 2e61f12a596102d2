"""Opening a node's links along their routes (issue #24): the broker dials the node's ports back, and
each link is then bound, dialled or relayed by ``ravq.config.routes`` from who is reachable."""

from __future__ import annotations

import logging

from ravq.config import Topology
from ravq.config.routes import declared_reach
from ravq.metrics import Metrics
from ravq.node.membership import Membership
from ravq.node.pipeline_links import StageLinks
from ravq.node.ring_port import RingPort

log = logging.getLogger("ravq.node")  # the node's own lines


async def open_routes(*, name: str, topology: Topology, membership: Membership, metrics: Metrics,
                      links: StageLinks, ring: RingPort | None, everyone: list[str], rejoining: bool,
                      cluster_nodes: list[str], peers: set[int]) -> None:
    """Wait for the broker's verdict on each of ``everyone`` this node links to (a rejoining node waits only
    for its own: some of the others may be gone; it takes theirs as the broker has them,
    ``Membership.wait_reach``), then open the pipeline links to ``peers`` and, with ring sockets (clusters
    average), the ring's."""
    ports = ["pipeline", "ring"] if ring is not None else ["pipeline"]
    names, others = ([name], [n for n in everyone if n != name]) if rejoining else (everyone, [])
    verdicts = await membership.wait_reach(names, ports, topology.timeouts.connect_s, others)
    reach = {**declared_reach(topology), **verdicts}
    metrics.node_reachable.labels(name).set(float(reach.get(name, True)))
    log.info("%s: %s (%s)", name, "reachable" if reach.get(name, True) else "behind NAT: dialling out",
             membership.reach.get(name, "declared"))
    links.open(cluster_nodes, peers, reach=reach)
    if ring is not None:
        ring.connect(reach)
