"""The broker's membership gauges: per member and per cluster set only when their state changes, the
aggregates once a heartbeat interval (``Broker._watch_heartbeats``), so a heartbeat sets no series."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from brokers.book import CLUSTER_STATES, NODE_STATES, PHASES, Book
from ravq.metrics import Metrics


class Gauges:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._members: dict[str, str] = {}
        self._clusters: dict[int, str] = {}
        """The states the per-member and per-cluster series show."""

    def count(self, book: Book) -> None:
        """Every gauge: the aggregates (nodes by state and phase, what paused clusters wait for) and the
        per-member and per-cluster ones that changed."""
        self.show(book, book.members, range(len(book.clusters)))
        states = Counter(m.state for m in book.members.values())
        phases = Counter(m.said.phase for m in book.members.values() if m.state == "up")
        for state in NODE_STATES:
            self.metrics.broker_nodes.labels(state).set(states[state])
        for phase in PHASES:
            self.metrics.broker_phases.labels(phase).set(phases[phase])
        self.metrics.cluster_waiting_for.clear()
        for (c, member), why in waiting_for(book).items():
            self.metrics.cluster_waiting_for.labels(str(c), member, why).set(1)

    def show(self, book: Book, names: Iterable[str], clusters: Iterable[int]) -> None:
        """The per-member and per-cluster series of those that may have changed, set only if they did."""
        for name in names:
            m = book.members.get(name)
            if m is not None and self._members.get(name) != m.state:
                for s in NODE_STATES:
                    self.metrics.broker_member_state.labels(name, s).set(float(m.state == s))
                self._members[name] = m.state
        for c in clusters:
            state = book.clusters[c].state
            if self._clusters.get(c) != state:
                for s in CLUSTER_STATES:
                    self.metrics.cluster_state.labels(str(c), s).set(float(state == s))
                self._clusters[c] = state


def waiting_for(book: Book) -> dict[tuple[int, str], str]:
    """(cluster, member) -> why, for each member a cluster that does not train waits for: the members
    that are not up (lost, missing, ...) or, once all are, those not yet ready (what they do now)."""
    waiting: dict[tuple[int, str], str] = {}
    for c, (cs, cluster) in enumerate(zip(book.clusters, book.plan.clusters)):
        if cs.state not in ("paused", "recovering"):
            continue
        members = {n: book.members[n] for n in cluster.nodes if n in book.members}
        down = {n: m.state for n, m in members.items() if m.state != "up"}
        waiting |= {(c, n): why for n, why in (down or {n: m.said.phase for n, m in members.items()
                                                       if m.said.ready < cs.generation}).items()}
    return waiting
