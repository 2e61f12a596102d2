"""The broker's state as a node follows it (ZeroMQ clone pattern), without the sockets.

Every published state update carries the broker's full state, so any update newer than the state held
(or from a restarted broker: a new incarnation) is applied as it is (``apply_state``), and the broker
re-publishes every heartbeat interval, so a missed update costs at most one interval.  Between those,
the broker publishes each member's silence four times an interval (``apply_silence``: no state change),
so that a live member never looks silent for much more than its heartbeat interval.  The node's socket
client (``ravq.node.membership.Membership``) feeds it; churn, resume and averaging read it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from ravq.config import Plan
from ravq.metrics import Metrics

log = logging.getLogger(__name__)


class MembershipState:
    def __init__(self, *, name: str, metrics: Metrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.name, self.metrics = name, metrics
        self.clock = clock
        """What silences are read on (seconds; tests pass a virtual one)."""
        self.seq = -1
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
        self._silent: dict[str, Any] = {}
        self._silent_at = clock()
        self.clusters: list[dict[str, Any]] = []
        """Per cluster: state (starting, training, paused, recovering, done), generation, trained, catchup."""
        self.changed = asyncio.Event()
        self.reach: dict[str, str] = {}
        """The broker's reachability verdicts: node -> ``reachable`` or ``behind_nat`` (issue #24)."""

    def is_news(self, meta: dict[str, Any]) -> bool:
        """Whether a published full state is newer than the one held (or from another broker process)."""
        seq, incarnation = int(meta["seq"]), meta.get("incarnation")
        if incarnation == self.incarnation and seq <= self.seq:
            return False
        if incarnation != self.incarnation:
            log.info("%s: broker %s (was %s): following its state", self.name, incarnation, self.incarnation)
        return True

    def apply_state(self, meta: dict[str, Any]) -> None:
        state = meta.get("state") or {}
        self.plan = Plan.model_validate(state["plan"])
        members = dict(state.get("members", {}))
        for node, member_state in members.items():
            before = self.members.get(node)
            if node != self.name and member_state != before and (member_state == "lost" or before == "lost"):
                if member_state == "lost":
                    log.warning("%s: the broker reports %s lost (no heartbeat for its timeout)", self.name,
                                node)
                else:
                    log.info("%s: %s is back (%s)", self.name, node, member_state)
        self.members = members
        run_id = state.get("run_id") if isinstance(state.get("run_id"), str) else self.run_id
        if self.run_id is not None and run_id != self.run_id:
            log.warning("%s: the broker now runs %s, not %s (it lost its state directory?): this "
                        "node goes on with its run's weights; a restarted node will refuse them", self.name,
                        run_id, self.run_id)
        self.run_id = run_id
        self.run_explicit = bool(state.get("run_explicit"))
        checkpoints = state.get("checkpoints")
        self.checkpoints = dict(checkpoints) if isinstance(checkpoints, dict) else {}
        silent = state.get("silent_s")
        self._silent = dict(silent) if isinstance(silent, dict) else {}
        self._silent_at = self.clock()
        self.phases = dict(state.get("phases", {}))
        reach = state.get("reach")
        self.reach = {str(k): str(v) for k, v in reach.items()} if isinstance(reach, dict) else {}
        clusters = state.get("clusters")
        self.clusters = list(clusters) if isinstance(clusters, list) else []
        self.seq = int(meta["seq"])
        self.incarnation = meta.get("incarnation")
        self.changed.set()

    def apply_silence(self, meta: dict[str, Any]) -> None:
        """A silence update of the broker whose state this node follows (one of another incarnation
        waits for that broker's full state)."""
        silent = meta.get("silent_s")
        if meta.get("incarnation") != self.incarnation or not isinstance(silent, dict):
            return
        if not all(isinstance(v, (int, float)) for v in silent.values()):
            self.metrics.bad_messages.labels("broker", "bad_state").inc()
            return
        self._silent = dict(silent)
        self._silent_at = self.clock()

    def silent_s(self, node: str) -> float:
        """Seconds since ``node``'s last heartbeat reached the broker, as of the broker's latest state
        (counted on from then: with the broker away, everyone looks silent)."""
        seen = self._silent.get(node)
        return (float(seen) if isinstance(seen, (int, float)) else 0.0) + self.clock() - self._silent_at

    def cluster_state(self, cluster: int) -> dict[str, Any]:
        """The broker's view of one cluster (``starting`` until the broker said otherwise)."""
        if 0 <= cluster < len(self.clusters) and isinstance(self.clusters[cluster], dict):
            return self.clusters[cluster]
        return {"state": "starting", "generation": 0, "trained": 0, "catchup": False, "reason": ""}

    def current_plan(self) -> Plan:
        """The broker's plan now (this node joined: it has one)."""
        assert self.plan is not None
        return self.plan

    def disrupted(self) -> bool:
        """Whether a cluster of the run was ever disrupted (its generation rose), as the broker last said."""
        return any(isinstance(c, dict) and c.get("generation", 0) > 0 for c in self.clusters)

