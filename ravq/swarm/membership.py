"""The broker's state as a node follows it (ZeroMQ clone pattern), without the sockets.

The broker publishes keyed updates (``ravq.net.clone``): each carries its topic's sequence number and
the keys that changed.  An update one past the number held is applied (``apply_update``); an older one
is skipped; a later one, or one from another broker process (a restart: a new incarnation), is a gap,
and the node fetches a snapshot (``apply_snapshot``) whose sequence numbers it goes on from.  A tick on
the global topic says its number and that the broker is alive.  Whole-state snapshots replace the view;
the snapshots a node fetches after a gap carry only its own topics and are merged into it (members of
other clusters stay as the last whole snapshot showed them).  A member's silence is published once it
passes ``SILENT_AFTER`` heartbeat intervals; one not published reads as the time since the broker's last
message (with the broker away, everyone looks silent).  The node's socket client
(``ravq.node.membership.Membership``) feeds it; churn, resume and averaging read it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from ravq.config import Plan
from ravq.metrics import Metrics
from ravq.net.clone import GLOBAL, cluster_topic, plan_from

log = logging.getLogger(__name__)

_DEFAULT_CLUSTER = {"state": "starting", "generation": 0, "trained": 0, "catchup": False, "reason": ""}


class MembershipState:
    def __init__(self, *, name: str, metrics: Metrics, clock: Callable[[], float] = time.monotonic,
                 tick_s: float = 0.0) -> None:
        self.name, self.metrics = name, metrics
        self.tick_s = tick_s
        """Seconds between the broker's ticks (``TICK_INTERVALS``): it is heard that often at least."""
        self.clock = clock
        """What silences are read on (seconds; tests pass a virtual one)."""
        self.seqs: dict[str, int] = {}
        """Topic -> sequence number of the latest update applied (from the latest snapshot on)."""
        self.incarnation: str | None = None
        """The broker process whose state this is."""
        self.plan: Plan | None = None
        """The plan now: the one owner of the plan on a node (everyone else asks ``current_plan``)."""
        self.run_id: str | None = None
        """The broker's run id (checkpoints carry it)."""
        self.run_explicit = False
        """The broker's run was started with --new-run (checkpoints of older runs are set aside)."""
        self.checkpoints: dict[str, Any] = {}
        """What each member reported of its stage's checkpoints of this run (``ravq.swarm.resume``)."""
        self.members: dict[str, str] = {}
        self.phases: dict[str, str] = {}
        self._silent: dict[str, tuple[float, float]] = {}
        """Member -> (its published silence, when this node received it)."""
        self._heard_at = clock()
        self.synced_at: float | None = None
        """When this node last knew its view current: a snapshot applied, or a tick with its number."""
        self.clusters: list[dict[str, Any]] = []
        """Per cluster: state (starting, training, paused, recovering, done), generation, trained, catchup
        (each on its cluster's topic: this node's own as published, the others' as the last whole snapshot
        said)."""
        self._clusters: dict[int, dict[str, Any]] = {}
        self._disrupted = False
        self.start: dict[str, bool] = {}
        """The broker's ``start`` flags: every node of the plan is ``up``, and has a verdict (``reached``)."""
        self._plan_parts: dict[str, Any] = {}
        self._plan_dirty = False
        """A key of the plan changed since it was last made of them (``_settle``)."""
        self._topics_plan: Plan | None = None
        self._topics = {GLOBAL, cluster_topic(None)}
        self.changed = asyncio.Event()
        self.reach: dict[str, str] = {}
        """The broker's reachability verdicts: node -> ``reachable`` or ``behind_nat`` (issue #24)."""

    def topics(self) -> set[str]:
        """What this node follows: the global topic and its cluster's members (a standby's: the standbys')."""
        if self.plan is not self._topics_plan:
            self._topics_plan = self.plan
            self._topics = {GLOBAL, cluster_topic(self._own_cluster())}
        return set(self._topics)

    def _own_cluster_nodes(self) -> list[str]:
        c = self._own_cluster()
        return [] if c is None or self.plan is None else self.plan.clusters[c].nodes

    def _own_cluster(self) -> int | None:
        if self.plan is None:
            return None
        return next((c for c, cl in enumerate(self.plan.clusters) if self.name in cl.nodes), None)

    def apply_update(self, meta: dict[str, Any]) -> bool:
        """A published update or tick; False when it shows a gap (or another broker): fetch a snapshot."""
        if meta.get("incarnation") != self.incarnation:
            if self.incarnation is not None:
                log.info("%s: broker %s (was %s): following its state", self.name, meta.get("incarnation"),
                         self.incarnation)
            return False
        self._heard_at = self.clock()
        topic, seq = str(meta["topic"]), int(meta["seq"])
        held = self.seqs.get(topic)
        if held is None or seq <= held and meta.get("kind") != "tick":
            return True  # not a topic this view follows (yet), or an update it already holds
        if meta.get("kind") == "tick":  # an older one was queued while a snapshot came
            if seq > held:
                return False
            if seq == held and topic == GLOBAL:
                self.synced_at = self.clock()
            return True
        if seq != held + 1:
            return False
        self.seqs[topic] = seq
        self._apply(meta["items"])
        if not meta.get("more"):
            self._settle()
        return True

    def apply_snapshot(self, parts: list[dict[str, Any]]) -> None:
        """A snapshot's parts, in order: the whole state (replacing the view) or a node's own topics'
        (``scope``; merged into it)."""
        first = parts[0]
        if first.get("scope") is None or first.get("incarnation") != self.incarnation:
            self.members, self.phases, self.checkpoints, self.reach = {}, {}, {}, {}
            self._clusters = {}
        else:  # the keys of the topics it carries are all in it: those it lacks are gone
            mine = self._own_cluster_nodes()
            for held in (self.members, self.phases, self.checkpoints, self.reach):
                for node in mine:
                    held.pop(node, None)
            self._clusters.pop(self._own_cluster(), None)
        self._silent, self._plan_parts = {}, {}
        for part in parts:
            self._apply(part["items"])
        self.seqs = {str(t): int(n) for t, n in first["seqs"].items()}
        self.incarnation = first.get("incarnation")
        self._heard_at = self.synced_at = self.clock()
        self._settle()

    def _apply(self, items: list[Any]) -> None:
        for key, value in items:
            kind, _, name = str(key).partition("/")
            if kind == "member":
                self._member(name, value)
            elif kind == "cluster":
                _put(self._clusters, int(name), value)
            elif kind in ("plan", "out"):  # the plan's head, a cluster's nodes and cuts, an exclusion
                _put(self._plan_parts, key, value)
                self._plan_dirty = True
            elif kind == "reach":
                _put(self.reach, name, None if value is None else str(value))
            elif kind == "silent":
                _put(self._silent, name, None if value is None else (float(value), self.clock()))
            elif kind == "run":
                self._run(value)
            elif kind == "disrupted":
                self._disrupted = bool(value)
            elif kind == "start":
                self.start = dict(value) if isinstance(value, dict) else {}

    def _member(self, node: str, value: dict[str, Any] | None) -> None:
        before = self.members.get(node)
        if value is None:
            for held in (self.members, self.phases, self.checkpoints):
                held.pop(node, None)
            return
        state = str(value["state"])
        if node != self.name and before is not None and state != before and "lost" in (state, before):
            if state == "lost":
                log.warning("%s: the broker reports %s lost (no heartbeat for its timeout)", self.name, node)
            else:
                log.info("%s: %s is back (%s)", self.name, node, state)
        self.members[node], self.phases[node] = state, str(value["phase"])
        if isinstance(value.get("checkpoints"), list):
            self.checkpoints[node] = value["checkpoints"]
        else:
            self.checkpoints.pop(node, None)

    def _run(self, value: dict[str, Any]) -> None:
        run_id = value.get("run_id") if isinstance(value.get("run_id"), str) else self.run_id
        if self.run_id is not None and run_id != self.run_id:
            log.warning("%s: the broker now runs %s, not %s (it lost its state directory?): this "
                        "node goes on with its run's weights; a restarted node will refuse them", self.name,
                        run_id, self.run_id)
        self.run_id = run_id
        self.run_explicit = bool(value.get("run_explicit"))

    def _settle(self) -> None:
        """A change set is whole: the plan from its parts (once they are all here), and the clusters."""
        if self._plan_dirty:
            plan = plan_from(self._plan_parts)
            if plan is not None:
                self.plan, self._plan_dirty = plan, False
        n = len(self.plan.clusters) if self.plan is not None else 1 + max(self._clusters, default=-1)
        self.clusters = [self._clusters.get(c, dict(_DEFAULT_CLUSTER)) for c in range(n)]
        self.changed.set()

    def silent_s(self, node: str) -> float:
        """Seconds since ``node``'s last heartbeat reached the broker, as the broker published it (a member
        silent past ``SILENT_AFTER`` intervals) or, for one it did not, the time since the broker's last
        message less the period of its ticks: with the broker away, everyone looks silent (that period
        later; without it a live member would read up to a whole period silent: at one tick an interval,
        two thirds of ``Averager.hold_s``)."""
        published = self._silent.get(node)
        if published is not None:
            return published[0] + self.clock() - published[1]
        return max(0.0, self.clock() - self._heard_at - self.tick_s)

    def cluster_state(self, cluster: int) -> dict[str, Any]:
        """The broker's view of one cluster (``starting`` until the broker said otherwise)."""
        if 0 <= cluster < len(self.clusters) and isinstance(self.clusters[cluster], dict):
            return self.clusters[cluster]
        return dict(_DEFAULT_CLUSTER)

    def current_plan(self) -> Plan:
        """The broker's plan now (this node joined: it has one)."""
        assert self.plan is not None
        return self.plan

    def disrupted(self) -> bool:
        """Whether a cluster of the run was ever disrupted (its generation rose), as the broker last said
        (``disrupted``: the other clusters' states are on their own topics)."""
        return self._disrupted or any(isinstance(c, dict) and c.get("generation", 0) > 0
                                      for c in self.clusters)


def _put(held: dict[Any, Any], key: Any, value: Any) -> None:
    """``held[key] = value``, or its deletion for None."""
    if value is None:
        held.pop(key, None)
    else:
        held[key] = value
