"""The broker's published state as keys (``ravq.net.clone``): what each key holds, which changed, the
updates to publish and the snapshots to answer with.  No sockets.

``KeyedState.put`` records a key's value on its topic; ``flush`` returns the updates of every key whose
value changed since the last flush, per topic, each with the topic's next sequence number and cut under
the header limit.  A key that moves to another topic (a standby takes a lost node's stage) is deleted on
the old one and set on the new one.  An item that alone exceeds the limit is never sent: it is counted
and logged once (``oversized``), and its key holds ``{"too_large": bytes}`` instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from brokers.book import Book, Member
from ravq.config import Plan
from ravq.net.clone import GLOBAL, Item, chunks, item_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Update:
    topic: str
    seq: int
    items: list[Item]
    more: bool
    """More updates of the same change set follow (a node applies the plan once it has them all)."""


class KeyedState:
    def __init__(self, limit: int, seqs: dict[str, int] | None = None) -> None:
        """``seqs``: the numbers the topics go on from (a backup that takes over: past those it saw)."""
        self.limit = limit
        """Bytes of items per update or snapshot part (``ravq.net.clone.budget``)."""
        self.values: dict[str, Any] = {}
        self.topics: dict[str, str] = {}
        """Key -> the topic it is published on."""
        self.sizes: dict[str, int] = {}
        """Key -> its item's encoded bytes (snapshots cut parts without encoding every item again)."""
        self.keys: dict[str, dict[str, None]] = {}
        """Topic -> its keys (a snapshot of a node's topics visits those only)."""
        self.seqs: dict[str, int] = {GLOBAL: 0, **(seqs or {})}
        """Topic -> sequence number of its latest update."""
        self.touched: set[str] = set()
        """Topics updated since ``echoes`` last returned them."""
        self.oversized = 0
        self._pending: dict[str, dict[str, Any]] = {}
        self._parts: dict[str, list[list[Item]]] = {}
        """Topic -> its keys' items cut in parts, kept until a key of the topic changes: at 10,000 members
        every registration is answered with the global topic's thousands of keys."""
        self._logged_oversized = False

    def put(self, key: str, topic: str, value: Any) -> None:
        """``key`` holds ``value`` (None: deleted) on ``topic``; the next ``flush`` sends it if it changed."""
        before = self.topics.get(key)
        if value is None:
            if before is not None:
                del self.values[key], self.topics[key], self.sizes[key], self.keys[before][key]
                self._pending.setdefault(before, {})[key] = None
                self._parts.pop(before, None)
            return
        if before == topic and self.values[key] == value:
            return
        size = item_bytes((key, value))
        if size > self.limit:
            self._oversize(key, size)
            value = {"too_large": size}
            size = item_bytes((key, value))
        if before is not None and before != topic:
            self._pending.setdefault(before, {})[key] = None
            del self.keys[before][key]
            self._parts.pop(before, None)
        self._parts.pop(topic, None)
        self.values[key], self.topics[key], self.sizes[key] = value, topic, size
        self.keys.setdefault(topic, {})[key] = None
        self._pending.setdefault(topic, {})[key] = value

    def pending_topics(self) -> list[str]:
        """The topics with changes not flushed yet."""
        return list(self._pending)

    def flush(self) -> list[Update]:
        updates = []
        for topic, changes in self._pending.items():
            parts = list(chunks(changes.items(), self.limit))
            for i, part in enumerate(parts):
                self.seqs[topic] = self.seqs.get(topic, 0) + 1
                updates.append(Update(topic, self.seqs[topic], part, i < len(parts) - 1))
            self.touched.add(topic)
        self._pending.clear()
        return updates

    def echoes(self) -> list[str]:
        """The topics updated since the last call: a node that missed the last update of one learns it from
        their number's echo (``g.`` is echoed by every tick)."""
        touched, self.touched = self.touched, set()
        return sorted(t for t in touched if t != GLOBAL)

    def snapshot(self, topics: set[str] | None, live: dict[str, list[Item]] | None = None
                 ) -> tuple[dict[str, int], list[list[Item]]]:
        """The sequence numbers of ``topics`` (None: every topic's) and their keys' values, in parts (each
        topic's own; kept until one of its keys changes); ``live``: topics whose items are these, as of
        now (silences read on), cut afresh."""
        live = live or {}
        wanted = set(self.seqs) | set(self.keys) if topics is None else topics
        parts = [p for topic in sorted(wanted & (self.keys.keys() | live.keys()))
                 for p in (chunks(live[topic], self.limit) if topic in live else self.parts(topic))]
        return {t: self.seqs.get(t, 0) for t in wanted}, parts or [[]]

    def parts(self, topic: str) -> list[list[Item]]:
        """``topic``'s keys and values in parts under the limit (the last cut, unless a key changed since)."""
        cached = self._parts.get(topic)
        if cached is None:
            cached = self._parts[topic] = []
            size = self.limit
            for k in self.keys[topic]:
                if size + self.sizes[k] > self.limit:
                    cached.append([])
                    size = 0
                cached[-1].append((k, self.values[k]))
                size += self.sizes[k]
        return cached

    def _oversize(self, key: str, nbytes: int) -> None:
        self.oversized += 1
        if not self._logged_oversized:
            log.error("state key %s takes %d bytes, over the %d an update may carry: published as "
                      "too_large (logged once; ravq_bad_messages_total{socket=pub,reason=header_too_large} "
                      "counts them)", key, nbytes, self.limit)
            self._logged_oversized = True


def plan_head(plan: Plan) -> tuple[str, str, Any]:
    """The plan's head as (key, topic, value): ``plan``, its epoch, number of clusters and the averaging the
    planner chose for it (nodes run it over the topology's).  Its exclusions are keys of their own
    (``out_items``): a list here grew with every paused cluster (23 KiB at 10,000 members), sent whole to
    every node on each pause and rejoin."""
    head = {"epoch": plan.epoch, "clusters": len(plan.clusters),
            "predicted_samples_per_s": plan.predicted_samples_per_s,
            "averaging": plan.averaging.model_dump() if plan.averaging is not None else None}
    return "plan", GLOBAL, head


def out_items(plan: Plan, before: Plan | None = None) -> list[tuple[str, str, Any]]:
    """``out/<c>`` (True) for each cluster the rings leave out of ``plan``, and its deletion (None) for each
    one ``before`` left out that ``plan`` takes back: the clusters whose exclusion changed only."""
    now, was = set(plan.excluded), set(before.excluded) if before is not None else set()
    return [(f"out/{c}", GLOBAL, True if c in now else None) for c in sorted(now ^ was)]


def plan_items(plan: Plan, before: Plan | None = None) -> list[tuple[str, str, Any]]:
    """The plan as (key, topic, value): its head, ``plan/<c>`` per cluster (its nodes and cuts) and the
    exclusions that changed since ``before`` (the plan published last; None: none was)."""
    return [plan_head(plan), *((f"plan/{c}", GLOBAL, cl.model_dump()) for c, cl in enumerate(plan.clusters)),
            *out_items(plan, before)]


def start_flags(book: Book, verdicts: dict[str, str]) -> dict[str, bool]:
    """The ``start`` key: whether every member of the plan is up (or done) and has a reachability
    verdict.  A starting node waits for these of every node of the swarm; from this one key, not by
    polling whole snapshots (every node, five times a second: O(N^2) bytes at a first start)."""
    nodes = [n for c in book.plan.clusters for n in c.nodes]
    return {"up": all(n in book.members and book.members[n].state in ("up", "done") for n in nodes),
            "reached": all(n in verdicts for n in nodes)}


def status_of(m: Member, now: float) -> dict[str, Any]:
    """A member as ``ravq status`` shows it (not published: its age and statistics change every beat)."""
    return {"state": m.state, "phase": m.said.phase, "generation": m.said.generation,
            "age_s": round(now - m.last_seen, 3), "stats": m.stats}


def member_value(m: Member) -> dict[str, Any]:
    return {"state": m.state, "phase": m.said.phase, "incarnation": m.incarnation,
            "checkpoints": m.checkpoints}
