"""Failures and recovery in the simulation (``Settings.churn_per_hour``), as ravq's broker and nodes do them.

A failure stops the node's whole cluster: its in-flight micro-batches are lost and redone, and rings with
a member there abort after ``ring_timeout_s``.  ``lost_s`` later the broker takes the cluster out of the
rings (a new plan epoch: every node abandons every open round; a node back sooner than that is, when its
new process registers).  After ``restart_s`` the cluster's nodes
fetch their stages' weights from the holders in another cluster (the stage's bytes over that link) and
rejoin at that cluster's version; the rings take the cluster back (another epoch).  A cluster done while
another still trains ``lost_s`` later leaves the rings too.
"""

from __future__ import annotations

import random
from typing import Protocol

from ravq.simulate.engine import EventQueue
from ravq.simulate.rings import Ring
from ravq.simulate.state import Node
from ravq.simulate.world import SegmentSpec, Settings, World


class ChurnHost(Protocol):
    """What churn needs of the simulation it disrupts (``training.Simulation``)."""

    q: EventQueue
    settings: Settings
    world: World
    rng: random.Random
    clusters: list[list[Node]]
    nodes: dict[str, Node]
    node_segments: dict[str, list[SegmentSpec]]
    cluster_done_at: list[float | None]
    rings: dict[tuple[int, ...], Ring]

    def new_epoch(self, live: tuple[int, ...]) -> None:
        """The rings' membership changed to ``live`` (a new plan epoch)."""

    def dispatch(self, node: Node) -> None:
        """Give ``node``'s compute thread its next work, if any."""

    def release_holds(self) -> None:
        """Nodes holding back for a round with a cluster silent ``hold_s`` train on."""


class Churn:
    """Which clusters run (``up``) and which are in the plan's rings (``in_rings``), and the failures that
    change them."""

    def __init__(self, host: ChurnHost) -> None:
        self.host = host
        self.up = [True] * len(host.clusters)
        self.in_rings = [True] * len(host.clusters)
        self.failed_at = [0.0] * len(host.clusters)
        """Per cluster: when it last failed."""

    def start(self) -> None:
        if self.host.settings.churn_per_hour > 0:
            for node in self.host.nodes.values():
                self._schedule_failure(node)

    def _schedule_failure(self, node: Node) -> None:
        rate = self.host.settings.churn_per_hour / 3600.0
        if rate > 0:
            self.host.q.after(self.host.rng.expovariate(rate), self.fail, node)

    def fail(self, node: Node) -> None:
        """``node`` fails now (its cluster stops)."""
        h, c = self.host, node.cluster
        if h.cluster_done_at[c] is not None:
            return
        if not self.up[c]:
            self._schedule_failure(node)
            return
        node.failures += 1
        self.up[c] = False
        self._schedule_failure(node)                    # each node's failures are one Poisson process
        stages = h.clusters[c]
        first = stages[0]
        first.started = first.backwards                 # everything in flight is lost and redone
        for n in stages:
            n.epoch += 1
            n.busy = False
            if n.blocked is not None:
                n.wait_s += h.q.now - n.blocked_since
                n.blocked = None
            n.fwd_queue.clear()
            n.bwd_queue.clear()
            n.stash.clear()
            n.pending.clear()
            n.queued.clear()
            n.running = None
            n.snapshot_version = -1
            n.plan_epoch = -1                           # a new process: it counts from the epoch it sees
        for ring in list(h.rings.values()):
            if any(m.cluster == c for m in ring.members):
                h.q.after(h.settings.ring_timeout_s, ring.abort)
        self.failed_at[c] = h.q.now
        h.q.after(h.settings.hold_s, h.release_holds)
        h.q.after(h.settings.lost_s, self._exclude, c)
        h.q.after(h.settings.restart_s, self._restart, c, h.q.now)

    def _exclude(self, c: int) -> None:
        """``lost_s`` after a failure: the broker takes the cluster out of the rings (if still down)."""
        if not self.up[c] and self.in_rings[c]:
            self.in_rings[c] = False
            self.host.new_epoch(self._ring_members())

    def finished(self, c: int) -> None:
        """Cluster ``c`` trained its last micro-batch: its nodes exit.  A cluster done while another still
        trains ``lost_s`` later leaves the rings then (``brokers.book.Book.excluded``)."""
        self.host.q.after(self.host.settings.lost_s, self._retire, c)

    def _retire(self, c: int) -> None:
        h = self.host
        if not self.in_rings[c] or all(at is not None for at in h.cluster_done_at):
            return
        for d, at in enumerate(h.cluster_done_at):                 # all that are due in one change
            if at is not None and at + h.settings.lost_s <= h.q.now * (1 + 1e-12):
                self.in_rings[d] = False
        h.new_epoch(self._ring_members())

    def _ring_members(self) -> tuple[int, ...]:
        return tuple(c for c, inside in enumerate(self.in_rings) if inside)

    def _restart(self, c: int, failed_at: float) -> None:
        h = self.host
        if self.in_rings[c]:  # back before lost_s: its new process registers, the broker pauses the cluster
            self.in_rings[c] = False
            h.new_epoch(self._ring_members())
        donors = [d for d, up in enumerate(self.up) if up and d != c]
        net = h.world.network
        catch_up, version = 0.0, None
        for n in h.clusters[c]:
            for h_node in (h.nodes[seg.holders[d]] for seg in h.node_segments[n.name] for d in donors):
                t = n.spec.param_bytes / min(net.bandwidth(h_node.name, n.name), net.uplink[h_node.name]) \
                    + net.latency(h_node.name, n.name)
                catch_up = max(catch_up, t)
                version = h_node.version if version is None else min(version, h_node.version)
        h.q.after(catch_up, self._rejoin, c, failed_at, version)

    def _rejoin(self, c: int, failed_at: float, version: int | None) -> None:
        h = self.host
        self.up[c] = True
        self.in_rings[c] = True
        h.new_epoch(self._ring_members())               # the rings take it back
        for n in h.clusters[c]:
            n.down_s += h.q.now - failed_at
            if version is not None:
                n.version = max(n.version, version)
            n.accumulated = 0
            n.pending_staleness.clear()
        h.dispatch(h.clusters[c][0])
