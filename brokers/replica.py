"""The active broker's state as the passive one of a Binary Star pair follows it.  No sockets.

The passive broker subscribes to every topic of the active one's PUB (``ravq.net.clone``) and fetches a
whole snapshot first and after every gap: ``Replica`` holds every key (run, plan and epoch, clusters
with their generations, members with their incarnations, phases and checkpoints, reachability, the
standbys among the members) with each topic's sequence number, as a node holds its own topics.  When
the passive broker takes over, ``restore`` makes of it what a broker starts from (``Restored``): the
run, a book of the same members and clusters, and sequence numbers and a plan epoch past any it saw.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from brokers.book import Book, ClusterState, Member
from brokers.run import Run, next_epoch
from ravq.config import Plan
from ravq.net.clone import plan_from
from ravq.net.protocol import Heartbeat

log = logging.getLogger(__name__)

SEQ_JUMP = 1000
"""How far past the numbers it saw a new active broker numbers its topics: past the updates the failed
one may have published that the passive one never received."""


@dataclass(kw_only=True, slots=True)
class Restored:
    """What a broker that takes over starts from (``brokers.topology.Broker``)."""

    run: Run
    book: Book
    seqs: dict[str, int]
    """Each topic's next numbers go on from here."""
    seq: int
    """The broker's count of updates goes on from here."""
    reach: dict[str, str] = dataclasses.field(default_factory=dict)
    """The reachability verdicts published (node -> verdict): nodes are not dialled back again (every
    node asked again after a takeover, and a rejoining one waited for its peers' verdicts)."""


class Replica:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        """When an update arrives (the passive broker's clock, as ``restore``'s ``now``)."""
        self.values: dict[str, Any] = {}
        """Key -> its value, as the active broker published it."""
        self._silent_at: dict[str, float] = {}
        """Member -> when its ``silent/<name>`` (seconds silent as of then) arrived."""
        self.seqs: dict[str, int] = {}
        """Topic -> the number of its latest update applied."""
        self.incarnation: str | None = None
        """The active broker process this state is of (None: no snapshot yet)."""
        self.seq = 0
        """The active broker's count of updates, as of the latest snapshot."""
        self.synced_at: float | None = None
        """When the latest snapshot was applied."""

    def apply_update(self, meta: dict[str, Any]) -> bool:
        """A published update or tick; False when it shows a gap or another broker: fetch a snapshot."""
        if self.incarnation is None or meta.get("incarnation") != self.incarnation:
            return False
        topic, seq = str(meta["topic"]), int(meta["seq"])
        held = self.seqs.get(topic, 0)
        if meta.get("kind") == "tick":
            return seq <= held
        if seq <= held:
            return True
        if seq != held + 1:
            return False
        self.seqs[topic] = seq
        self.seq += 1
        self._apply(meta["items"])
        return True

    def apply_snapshot(self, parts: list[dict[str, Any]], now: float) -> None:
        """A whole snapshot's parts, in order (every topic's number comes with the first)."""
        self.values = {}
        for part in parts:
            self._apply(part["items"])
        first = parts[0]
        self.seqs = {str(t): int(n) for t, n in first["seqs"].items()}
        self.incarnation, self.seq, self.synced_at = first.get("incarnation"), int(first.get("seq", 0)), now

    def _apply(self, items: list[Any]) -> None:
        for key, value in items:
            if value is None:
                self.values.pop(str(key), None)
            else:
                self.values[str(key)] = value
            if str(key).startswith("silent/"):
                self._silent_at[str(key)[len("silent/"):]] = self.clock()

    def plan(self) -> Plan | None:
        """The plan as published (None: not whole yet)."""
        return plan_from(self.values)

    def restore(self, base: Run, *, lost_s: float, replace_s: float, standbys: list[str], now: float,
                term: int) -> Restored:
        """What the broker that takes over starts from: ``base`` (this broker's own run as it opened it)
        with the run id and plan followed, the plan's epoch past the one seen (and the time in
        milliseconds, as a restarted broker's), the book's members and clusters as published, each
        member heard from ``now`` on (one published silent: that long before the update saying so
        arrived); topics numbered past ``SEQ_JUMP`` times the term."""
        plan = self.plan()
        assert plan is not None, "restore before a whole snapshot"
        epoch = next_epoch(plan.epoch)
        plan = plan.model_copy(update={"epoch": epoch})
        run_value = self.values.get("run") or {}
        run = dataclasses.replace(base, run_id=str(run_value.get("run_id", base.run_id)),
                                  explicit=bool(run_value.get("run_explicit", base.explicit)), plan=plan)
        in_plan = {n for c in plan.clusters for n in c.nodes}
        book = Book(plan, lost_s=lost_s, now=now, replace_s=replace_s,
                    standbys=[n for n in standbys if n not in in_plan])
        published = {key[len("member/"):]: value for key, value in self.values.items()
                     if key.startswith("member/") and isinstance(value, dict)}
        members = {name: _member(value, now, self._silent_at.get(name, now),
                                 self.values.get(f"silent/{name}")) for name, value in published.items()}
        clusters = [_cluster(self.values.get(f"cluster/{c}"), c in plan.excluded, now)
                    for c in range(len(plan.clusters))]
        book.restore(members, clusters)
        log.warning("taking over run %s at plan epoch %d: %d members, clusters %s", run.run_id, epoch,
                    len(members), [cs.state for cs in clusters])
        seqs = {t: n + SEQ_JUMP * term for t, n in self.seqs.items()}
        reach = {key[len("reach/"):]: str(value) for key, value in self.values.items()
                 if key.startswith("reach/") and isinstance(value, str)}
        return Restored(run=run, book=book, seqs=seqs, seq=self.seq + SEQ_JUMP * term, reach=reach)


def _member(value: dict[str, Any], now: float, silent_at: float, silent_s: Any) -> Member:
    """A member as published; one the active broker published silent (``silent/<name>``: seconds, as of
    that update, which arrived at ``silent_at``) was last heard that long before it, so its loss is not put
    off by the takeover (it was, by the time from that update to ``now``: a node killed a second before
    the primary was lost that much later than with the broker alone)."""
    state = str(value.get("state", "missing"))
    incarnation = value.get("incarnation") if isinstance(value.get("incarnation"), str) else None
    checkpoints = value.get("checkpoints") if isinstance(value.get("checkpoints"), list) else None
    said = Heartbeat(incarnation=incarnation or "", phase=str(value.get("phase", "starting")))
    last_seen = silent_at - float(silent_s) if isinstance(silent_s, int | float) else now
    return Member(state=state, last_seen=last_seen, incarnation=incarnation, registered=state != "missing",
                  said=said, checkpoints=checkpoints, lost_at=now if state in ("lost", "left") else None)


def _cluster(value: Any, excluded: bool, now: float) -> ClusterState:
    if not isinstance(value, dict):
        return ClusterState()
    state = str(value.get("state", "starting"))
    source = value.get("source")
    return ClusterState(state=state, generation=int(value.get("generation", 0)),
                        trained=int(value.get("trained", 0)), catchup=bool(value.get("catchup")),
                        source=source if isinstance(source, int) else None,
                        reason=str(value.get("reason", "")), note=str(value.get("note", "")),
                        disrupted_at=now if state in ("paused", "recovering") else None,
                        done_at=now if state == "done" else None, out_of_rings=state == "done" and excluded)
