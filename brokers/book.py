"""The broker's membership book: who is up, which clusters train, pause or recover.  No sockets.

A node is ``missing`` (in the plan, never heard from by this broker), ``up``, ``lost`` (silent for
``lost_s``), ``left`` (stopped while the run goes on: SIGTERM, an upgrade, a reboot; its cluster pauses
at once, a standby may take its stage, it rejoins when it comes back) or ``done`` (its training is
over).  A cluster is ``starting`` (first start, until every member registered),
``training``, ``paused`` (a member lost or restarted), ``recovering`` (every member up again: each
drops its in-flight work, catches up and reports ready) or ``done``.  Every disruption increments the
cluster's *generation*; a cluster trains again once every member reported ready for the current one,
so the members of a cluster always resume together, from one consistent point.

Clusters that do not train (starting, paused, recovering) are out of the averaging rings.

After a broker restart the book is rebuilt from what nodes re-send in every heartbeat (their
incarnation, generation and phase): a cluster whose members say they train is training again at
once; nodes of the plan not heard from within ``lost_s`` are lost.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from brokers.run import next_epoch
from ravq.config import ClusterPlan, Plan
from ravq.net.protocol import NODE_PHASES, Heartbeat

log = logging.getLogger(__name__)

NODE_STATES = ("missing", "up", "lost", "left", "done")
PHASES = NODE_PHASES
"""What a node says it is doing (in its heartbeats); ``ravq status`` shows it for nodes that are up."""
CLUSTER_STATES = ("starting", "training", "paused", "recovering", "done")


@dataclass(kw_only=True, slots=True)
class Member:
    state: str = "missing"
    last_seen: float
    incarnation: str | None = None
    """Random id a node process draws at start: a new one means the process restarted."""
    registered: bool = False
    """It registered with this broker (else this broker knows it from heartbeats only: it restarted)."""
    said: Heartbeat = field(default_factory=lambda: Heartbeat(incarnation=""))
    """Its last heartbeat (phase, generation, readiness, trained, memory); a REGISTER starts its phase,
    generation and readiness again."""
    lost_at: float | None = None
    """When it was lost or left."""
    stats: dict[str, Any] = field(default_factory=dict)
    checkpoints: list[Any] | None = None
    """Its stage's checkpoints of this run as it reported them (None: not reported yet); every member of
    a starting cluster reads them to agree on one consistent point to resume from (ravq.swarm.resume)."""


@dataclass(kw_only=True, slots=True)
class ClusterState:
    state: str = "starting"
    generation: int = 0
    trained: int = 0
    """Micro-batches finished when the cluster resumed: every stage counts on from here."""
    catchup: bool = False
    """Whether the members load their stages from other clusters before resuming."""
    source: int | None = None
    """The cluster to catch up from: of those training, the one whose stages are furthest on (their lowest
    reported version), so a staler copy is never offered when a fresher one is up."""
    reason: str = ""
    disrupted_at: float | None = None
    done_at: float | None = None
    out_of_rings: bool = False
    """Done while another cluster still trains (``Book.check``): the rings leave it out."""
    note: str = ""
    """What the members reported about their recovery (a stage that kept its own weights because no
    holder was fresher); kept until the next disruption."""

    def public(self) -> dict[str, Any]:
        return {"state": self.state, "generation": self.generation, "trained": self.trained,
                "catchup": self.catchup, "source": self.source, "reason": self.reason, "note": self.note}


@dataclass(slots=True)
class Changes:
    """What ``Book.check`` changed: members and clusters (a standby that took a stage changes the plan)."""

    names: set[str] = field(default_factory=set)
    clusters: set[int] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.names or self.clusters)


class Book:
    def __init__(self, plan: Plan, *, lost_s: float, now: float, replace_s: float = 30.0,
                 standbys: list[str] | None = None) -> None:
        """``standbys``: nodes of the topology the plan leaves idle (they may replace lost ones)."""
        self.plan, self.lost_s, self.replace_s = plan, lost_s, replace_s
        self.standbys = list(standbys or [])
        self.members: dict[str, Member] = {n: Member(last_seen=now) for c in plan.clusters for n in c.nodes}
        self.clusters = [ClusterState() for _ in plan.clusters]
        self.began = False
        """Training began (``running``)."""
        self.recoveries: list[float] = []
        """Seconds from a disruption to training again, one per recovery (the broker observes them)."""
        self._ranked: list[int] | None = None
        """The training clusters, furthest on first (``freshest_source``); None: rank them again."""
        self._out: set[int] = set(plan.excluded)
        """The clusters ``exclude_idle`` found idle (it keeps them as events touch them)."""
        self._where: dict[str, int] = {}
        self._where_plan: list[ClusterPlan] | None = None
        """Node -> cluster of the plan's clusters ``_where_plan`` (rebuilt when they are another list): a
        heartbeat finds its member's cluster in O(1), not by a scan of the plan."""

    # ------------------------------------------------------------------ queries
    def cluster_of(self, node: str) -> int | None:
        if self._where_plan is not self.plan.clusters:  # an exclusion keeps the clusters: O(N) less per event
            self._where = {n: c for c, cluster in enumerate(self.plan.clusters) for n in cluster.nodes}
            self._where_plan = self.plan.clusters
        return self._where.get(node)

    def excluded(self) -> list[int]:
        """Clusters out of the rings: those paused or recovering, and those done while another cluster still
        trains ``lost_s`` later (their nodes have exited: a cluster that lost time to a pause must not wait
        for them every round).  Clusters that finish together stay in: the plan does not change at the end
        of every run, under rounds that are still open."""
        return [c for c in range(len(self.clusters)) if self._idle(c)]

    def _idle(self, c: int) -> bool:
        cs = self.clusters[c]
        return cs.state in ("paused", "recovering") or (cs.state == "done" and cs.out_of_rings)

    @property
    def running(self) -> bool:
        """Whether training has begun: a cluster went from starting to training (or nodes said they train
        to a restarted broker; a broker that took over: a cluster left starting).  Not
        "a cluster left ``starting``": a member that registered and went silent during a first start pauses
        its own cluster, and that made every member not registered yet lost (at 10,000 members, 8,624)."""
        return self.began

    def public(self) -> dict[str, Any]:
        return {"members": {n: m.state for n, m in self.members.items()},
                "phases": {n: m.said.phase for n, m in self.members.items()},
                "incarnations": {n: m.incarnation for n, m in self.members.items()},
                "checkpoints": {n: m.checkpoints for n, m in self.members.items()
                                if m.checkpoints is not None},
                "clusters": [cs.public() for cs in self.clusters]}

    def freshest_source(self, c: int) -> int | None:
        """The training cluster other than ``c`` whose stages are furthest on: the highest lowest version
        its members reported (ties: the lower index); None when no other cluster trains.  The clusters are
        ranked once an interval (``check``) and when one starts training, not per call: each ranking visits
        every member, and thousands of clusters may recover at once (a broker restart)."""
        if self._ranked is None:
            def lowest(i: int) -> int:
                return min(_int(self.members[n].stats.get("version"), 0) if n in self.members else 0
                           for n in self.plan.clusters[i].nodes)

            training = [i for i, o in enumerate(self.clusters) if o.state == "training"]
            self._ranked = sorted(training, key=lambda i: (-lowest(i), i))
        return next((i for i in self._ranked if i != c and self.clusters[i].state == "training"), None)

    # ------------------------------------------------------------------ events
    def restore(self, members: dict[str, Member], clusters: list[ClusterState]) -> None:
        """Take over the membership a passive broker followed (``brokers.replica``): the members and
        clusters as the active broker last published them."""
        assert len(clusters) == len(self.plan.clusters), (len(clusters), len(self.plan.clusters))
        self.members.update(members)
        self.clusters, self._ranked = clusters, None
        self.began = self.began or any(cs.state != "starting" for cs in clusters)

    def exclude_idle(self, clusters: Iterable[int] | None = None) -> None:
        """The plan's excluded clusters follow ``excluded``, looking at ``clusters`` only (those an event
        touched: O(1) a heartbeat; None: every cluster); each change is a new plan epoch."""
        for c in range(len(self.clusters)) if clusters is None else clusters:
            if self._idle(c):
                self._out.add(c)
            else:
                self._out.discard(c)
        if len(self._out) == len(self.plan.excluded) and self._out.issuperset(self.plan.excluded):
            return
        excluded = sorted(self._out)
        if excluded != list(self.plan.excluded):
            log.info("rings now exclude clusters %s", _listed(excluded, self.plan.excluded))
            epoch = next_epoch(self.plan.epoch)
            self.plan = self.plan.model_copy(update={"excluded": excluded, "epoch": epoch})

    def register(self, node: str, incarnation: str | None, now: float) -> bool:
        """A node (re)started; True when the book changed."""
        m = self.members.setdefault(node, Member(last_seen=now))
        c = self.cluster_of(node)
        if c is None and node not in self.standbys:
            self.standbys.append(node)
        if c is not None and self.clusters[c].state in ("training", "recovering", "done"):
            self._disrupt(c, f"{node} restarted", now)
        elif c is not None and self.clusters[c].state == "paused":
            log.info("node %s is back (restarted) while cluster %d is paused", node, c)
        m.state, m.incarnation, m.last_seen, m.registered = "up", incarnation, now, True
        m.said = dataclasses.replace(m.said, phase="starting" if c is not None else "standby", ready=-1,
                                     generation=0)
        m.checkpoints, m.lost_at = None, None
        return True

    def heartbeat(self, node: str, beat: Heartbeat, now: float) -> bool:
        """A heartbeat with the node's own view; True when the book changed.  Its cluster moves along
        (``advance``) when the heartbeat changed the book or what a cluster's move depends on (the member's
        state, phase, readiness, generation): most heartbeats change nothing, and visit nothing more."""
        m = self.members.get(node)
        if m is None:
            m = self.members[node] = Member(last_seen=now)
        changed = False
        c = self.cluster_of(node)
        was = (m.state, m.registered, m.said.phase, m.said.ready, m.said.generation)
        if m.incarnation is not None and beat.incarnation != m.incarnation:
            changed |= self.register(node, beat.incarnation, now)  # restarted and its REGISTER went missing
        m.last_seen, m.incarnation, m.stats = now, beat.incarnation, beat.stats
        changed |= beat.phase != m.said.phase
        m.said = beat
        if beat.checkpoints is not None and beat.checkpoints != m.checkpoints:
            m.checkpoints, changed = beat.checkpoints[:8], True
        new_state = "left" if beat.left else "done" if beat.done else "up"
        if m.state != new_state:
            if m.state == "lost":
                log.info("node %s is back", node)
            m.state = new_state
            changed = True
            if new_state == "left":
                changed |= self._left(node, m, c, now)
        if c is not None:
            changed |= self._note(c, node, m, beat.kept)
            changed |= self._adopt(c, node, m, now)
            if changed or was != (m.state, m.registered, beat.phase, beat.ready, beat.generation):
                changed |= self._advance(c, self.clusters[c], now)
        return changed

    def _left(self, node: str, m: Member, c: int | None, now: float) -> bool:
        """A node said it stops while the run goes on: pause its cluster at once (no ``lost_s`` wait)."""
        m.lost_at = now
        log.info("node %s left (stopped while the run goes on)", node)
        if c is not None and self.clusters[c].state in ("training", "recovering", "starting", "paused"):
            self._disrupt(c, f"{node} left", now)
        return True

    def _note(self, c: int, node: str, m: Member, kept: str | None) -> bool:
        """A member of the current generation kept its own weights (no holder was fresher): say so."""
        cs = self.clusters[c]
        if not kept or m.said.generation != cs.generation:
            return False
        note = f"{node} {kept[:160]}"
        if note in cs.note:
            return False
        cs.note = f"{cs.note}; {note}" if cs.note else note
        return True

    def _adopt(self, c: int, node: str, m: Member, now: float) -> bool:
        """Rebuild a cluster's state from a member's heartbeat (after a broker restart), and notice a
        member that runs behind its training cluster (it restarted while nobody was watching)."""
        cs = self.clusters[c]
        if cs.state == "starting" and not m.registered and m.said.phase not in ("starting", "standby"):
            cs.generation = max(cs.generation, m.said.generation)
            cs.state = "training" if m.said.phase in ("training", "finishing") else "paused"
            self._ranked, self.began = None, True
            cs.trained = m.said.trained
            if cs.state == "paused":
                cs.disrupted_at = now
                cs.reason = "paused before the broker restarted"
            log.info("cluster %d rebuilt from heartbeats: %s, generation %d", c, cs.state, cs.generation)
            fresh = [n for n in self.plan.clusters[c].nodes if self.members[n].registered]
            if fresh:  # they registered with this broker: they restarted while it was down
                self._disrupt(c, f"{', '.join(fresh)} restarted while the broker was down", now)
            return True
        if cs.state == "training" and m.said.generation < cs.generation and m.state == "up":
            behind = f"generation {m.said.generation} < {cs.generation}"
            self._disrupt(c, f"{node} runs behind ({behind})", now)
            return True
        if m.said.generation > cs.generation:  # a node knows a newer generation than this restarted broker
            cs.generation = m.said.generation
            return True
        return False

    def advance(self, c: int | None, now: float) -> bool:
        """Move one cluster along after an event of one of its members (a heartbeat, a registration): the
        work of a heartbeat stays within its cluster; the time-driven rest is ``check``'s."""
        return c is not None and self._advance(c, self.clusters[c], now)

    def check(self, now: float) -> Changes:
        """Time-driven transitions (the broker runs it on a timer, never per heartbeat: it visits every
        member); what changed (false when nothing did)."""
        changed, self._ranked = Changes(), None  # the versions moved on
        running = self.running  # once, not per silent member: O(N) each at a 10,000-member start
        for name, m in self.members.items():
            silent = now - m.last_seen > self.lost_s
            if not silent or m.state not in ("up", "missing"):
                continue
            c = self.cluster_of(name)
            if m.state == "missing" and (c is None or not running):
                continue  # a first start: everyone waits for it
            log.warning("node %s silent for %.1fs: lost", name, now - m.last_seen)
            m.state, m.lost_at = "lost", now
            changed.names.add(name)
            if c is not None and self.clusters[c].state in ("training", "recovering", "starting", "paused"):
                self._disrupt(c, f"{name} lost", now)
                changed.clusters.add(c)
        for c, cs in enumerate(self.clusters):
            if self._advance(c, cs, now) | (cs.state == "paused" and self._replace(c, cs, now)):
                changed.clusters.add(c)
        training_on = any(cs.state != "done" for cs in self.clusters)
        for c, cs in enumerate(self.clusters):
            if cs.state == "done" and not cs.out_of_rings and training_on and now - cs.done_at >= self.lost_s:
                cs.out_of_rings = True
                changed.clusters.add(c)
        return changed

    def _replace(self, c: int, cs: ClusterState, now: float) -> bool:
        """Hand the stage of a member lost for ``replace_s`` to a standby whose memory fits; else say why
        the cluster stays paused."""
        nodes = self.plan.clusters[c].nodes
        gone = [n for n in nodes if self.members[n].state in ("lost", "left")
                and now - (self.members[n].lost_at or now) >= self.replace_s]
        if not gone:
            return False
        lost = gone[0]
        need = self.members[lost].said.stage_bytes
        standing = [n for n in self.standbys if self.members.get(n) is not None
                    and self.members[n].state == "up" and self.members[n].said.phase == "standby"]
        fits = sorted((n for n in standing if self.members[n].said.memory_bytes >= need),
                      key=lambda n: self.members[n].said.memory_bytes)
        if not fits:
            since_s = now - self.members[lost].lost_at  # type: ignore[operator]
            why = (f"{lost} {self.members[lost].state} {since_s:.0f}s ago; "
                   + (f"no standby has {need / 2**30:.2f} GiB (standbys: " + ", ".join(
                       f"{n} {self.members[n].said.memory_bytes / 2**30:.2f} GiB" for n in standing) + ")"
                      if standing else "no standby node is up"))
            if why != cs.reason:
                cs.reason = why
                return True
            return False
        new = fits[0]
        clusters = [cl.model_copy(update={"nodes": [new if n == lost else n for n in cl.nodes]})
                    if i == c else cl for i, cl in enumerate(self.plan.clusters)]
        self.plan = self.plan.model_copy(update={"clusters": clusters, "epoch": next_epoch(self.plan.epoch)})
        self.standbys = [n for n in self.standbys if n != new] + [lost]  # if it comes back, it stands by
        self.members[new].said = dataclasses.replace(self.members[new].said, phase="starting", ready=-1)
        cs.reason = f"{new} replaces {lost}"
        log.warning("cluster %d: standby %s takes over the stage of %s (%s %.0fs ago)", c, new, lost,
                    self.members[lost].state, now - self.members[lost].lost_at)  # type: ignore[operator]
        return True

    def _advance(self, c: int, cs: ClusterState, now: float) -> bool:
        members = [self.members[n] for n in self.plan.clusters[c].nodes]
        up = all(m.state in ("up", "done") for m in members)
        if cs.state == "starting" and all(m.state in ("up", "done") and m.registered
                                          and m.said.phase in ("training", "finishing") for m in members):
            cs.state, self._ranked, self.began = "training", None, True  # a first start: all got past waiting
            return True
        if cs.state == "paused" and up:
            cs.state = "recovering"
            cs.source = self.freshest_source(c)
            cs.catchup = cs.source is not None
            log.info("cluster %d recovering (generation %d, %s)", c, cs.generation,
                     f"catching up from cluster {cs.source}" if cs.catchup else "keeping its weights")
            return True
        if cs.state == "recovering" and all(m.said.ready >= cs.generation for m in members):
            cs.state, self._ranked = "training", None
            cs.trained = members[0].said.trained
            if cs.disrupted_at is not None:
                self.recoveries.append(now - cs.disrupted_at)
                cs.disrupted_at = None
            cs.reason = ""
            log.info("cluster %d trains again (generation %d, from micro-batch %d)", c, cs.generation,
                     cs.trained)
            return True
        if cs.state == "training" and all(m.state == "done" for m in members):
            cs.state, cs.done_at, cs.out_of_rings = "done", now, False
            return True
        return False

    def _disrupt(self, c: int, reason: str, now: float) -> None:
        cs = self.clusters[c]
        cs.generation += 1
        cs.state, cs.reason, cs.catchup, cs.source, cs.note = "paused", reason, False, None, ""
        if cs.disrupted_at is None:
            cs.disrupted_at = now
        log.warning("cluster %d paused (generation %d): %s", c, cs.generation, reason)


def _int(value: Any, default: int) -> int:
    return value if type(value) is int else default



def _listed(excluded: list[int], before: list[int], most: int = 16) -> str:
    """The excluded clusters for a log line: the list while short, else how many and what changed (the
    whole list, once per pause and rejoin, was O(N) a line: thousands at a 10,000-member start)."""
    if len(excluded) <= most:
        return str(excluded) if excluded else "none"
    now, was = set(excluded), set(before)
    added, back = sorted(now - was)[:most], sorted(was - now)[:most]
    return f"({len(excluded)} in all): now also {added}, no longer {back}"
