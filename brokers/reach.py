"""The broker's side of the reachability check (issue #24): dial a node's ports back, keep the verdicts.

A node asks once it has bound its ports (``REACH_REQ``, meta ``ports``: the socket kinds it bound);
the broker dials ``host:pipeline_port`` (and ``host:ring_port``) of the topology in a task of its own
group, so a slow check never holds up other requests, and publishes the verdict with the state
(``reach``: node -> ``reachable`` or ``behind_nat``).  A node whose topology entry sets ``reachable``
is not dialled.  A restarted node is measured again; a verdict that changed is logged (its peers'
links keep the direction they were opened with until they are opened again).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import zmq.asyncio

from ravq.config import Topology
from ravq.metrics import Metrics
from ravq.net.options import endpoint
from ravq.net.reach import BEHIND_NAT, REACHABLE, dial_back

if TYPE_CHECKING:
    from ravq.net.security import Curve

log = logging.getLogger(__name__)

PORT_FIELDS = {"pipeline": "pipeline_port", "ring": "ring_port"}


class Reachability:
    def __init__(self, topology: Topology, metrics: Metrics, curve: Curve | None = None,
                 verdicts: dict[str, str] | None = None) -> None:
        """``verdicts``: those a broker that took over followed (``brokers.replica.Restored``)."""
        self.topology, self.metrics, self.curve = topology, metrics, curve
        self.verdicts: dict[str, str] = dict(verdicts or {})
        self.tried: dict[str, str] = {}
        """What was tried for each node, in a few words (``ravq status``)."""
        self._running: set[str] = set()
        self._last: dict[str, str] = dict(self.verdicts)
        """Each node's latest verdict, kept across its restarts (to log a change)."""
        for node, verdict in self.verdicts.items():
            metrics.node_reachable.labels(node).set(float(verdict == REACHABLE))

    def public(self) -> dict[str, str]:
        return dict(self.verdicts)

    def forget(self, node: str) -> None:
        """A node (re)started: measure it again when it asks."""
        self.verdicts.pop(node, None)

    def wants(self, node: str) -> bool:
        """Whether a check of ``node`` should start now (none running, no verdict yet)."""
        return node not in self._running and node not in self.verdicts

    async def check(self, ctx: zmq.asyncio.Context, node: str, ports: list[str]) -> str:
        """Measure (or read from the topology) whether ``node`` can be dialled; record and return it."""
        self._running.add(node)
        try:
            config = self.topology.node(node)
            timeout_s = self.topology.timeouts.reach_s
            if config.reachable is not None:
                verdict = REACHABLE if config.reachable else BEHIND_NAT
                tried = f"not dialled: the topology declares reachable: {str(config.reachable).lower()}"
            else:
                kinds = [k for k in PORT_FIELDS if k in ports] or ["pipeline"]
                addrs = [endpoint(config.host, getattr(config, PORT_FIELDS[k])) for k in kinds]
                results = await asyncio.gather(*(dial_back(ctx, a, timeout_s, self.curve, node)
                                                 for a in addrs))
                verdict = REACHABLE if all(results) else BEHIND_NAT
                failed = f"no handshake in {timeout_s:g}s"
                tried = "; ".join(f"dialled {k} {a} back: {'handshake ok' if ok else failed}"
                                  for k, a, ok in zip(kinds, addrs, results, strict=True))
            before = self._last.get(node)
            if before is not None and before != verdict:
                log.warning("node %s was %s and is now %s: links opened before keep their direction",
                            node, before, verdict)
            self.verdicts[node] = self._last[node] = verdict
            self.tried[node] = tried
            self.metrics.node_reachable.labels(node).set(float(verdict == REACHABLE))
            log.info("node %s is %s (%s)", node, verdict, tried)
            return verdict
        finally:
            self._running.discard(node)
