"""The broker's state as keyed updates (ZeroMQ's Clone pattern), shared by the broker and its clients.

The state is a map of keys to JSON values: ``run``, ``plan`` (its epoch and number of clusters),
``plan/<c>`` (cluster ``c``'s nodes and cuts), ``out/<c>`` (the rings leave cluster ``c`` out: a key per
cluster, not a list that grows in the plan's head), ``cluster/<c>`` (whether it trains),
``disrupted`` (a cluster's generation rose: clusters end at different steps), ``start`` (every node of
the plan is up, and has a reachability verdict: what a starting node waits for),
``member/<name>`` (state, phase, incarnation, checkpoints), ``reach/<name>`` (the dial-back verdict)
and ``silent/<name>`` (a member silent past ``SILENT_AFTER`` heartbeat intervals: how long, as of the
update; the key goes when it beats again).  A value of None deletes its key.

Each key is published on a topic (the first frame of a PUB message, which ZeroMQ filters by prefix):
``g.`` for what every node reads (run, plan, whether a cluster was ever disrupted), ``g.s.`` for the
silences (every node receives it with ``g.``: ZeroMQ filters by prefix; a topic of its own, so that the
global topic's snapshot, the same for every node, is cut once per change), ``c<i>.`` for cluster ``i``'s
state, its members and their verdicts, ``sb.`` for the standbys.  A node subscribes to ``g.`` and its own
cluster's topic.  Every update carries its topic's sequence number, one more than the last on that topic;
a node that sees another number (a gap) fetches a snapshot, which carries every topic's number.  Updates
and snapshot parts are cut so that no header exceeds ``budget(max_header_bytes)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import orjson

from ravq.config import Plan

GLOBAL = "g."
SILENCES = "g.s."
STANDBYS = "sb."
SILENT_AFTER = 1.4
"""Heartbeat intervals of silence after which the broker publishes a member's silence: a stage stops
holding back a round at 1.5 (``Averager.hold_s``), and the broker finds it within a sixteenth of an
interval; as high as that allows, so a live member whose beat comes late by its jitter is not published
silent and back (each is an update to every node)."""
TICKS = 4
"""Times per heartbeat interval the broker publishes the global topic's pending changes (and the brokers of
a pair tell each other their state)."""
TICK_INTERVALS = 1.0
"""Heartbeat intervals between ticks on ``g.`` (the topic's sequence number and the broker's liveness).
Four an interval were half the broker's CPU at 1,000 members (a CURVE send to every subscriber each);
a node reads a member the broker did not publish silent as silent for the time since the broker's last
message less this period (``MembershipState.silent_s``)."""

Item = tuple[str, Any]
"""A key and its new value (None: deleted)."""


def cluster_topic(c: int | None) -> str:
    """The topic of cluster ``c``'s members (None: a standby)."""
    return STANDBYS if c is None else f"c{c}."


def budget(max_header_bytes: int) -> int:
    """Bytes of items one message may carry: what is left of the limit after the header's other fields."""
    return max(1024, max_header_bytes - 2048)


def item_bytes(item: Item) -> int:
    return len(orjson.dumps(item)) + 1


def chunks(items: Iterable[Item], limit: int) -> Iterator[list[Item]]:
    """``items`` cut into lists of at most ``limit`` encoded bytes each (an item larger than ``limit``
    alone in its list: the sender counts and reports it)."""
    part: list[Item] = []
    size = 0
    for item in items:
        n = item_bytes(item)
        if part and size + n > limit:
            yield part
            part, size = [], 0
        part.append(item)
        size += n
    if part:
        yield part


def plan_from(values: dict[str, Any]) -> Plan | None:
    """The plan from its published keys (``plan``, ``plan/<c>``, ``out/<c>``; None: not whole yet), as a
    node and the passive broker hold them."""
    head = values.get("plan")
    if not isinstance(head, dict):
        return None
    parts = [values.get(f"plan/{c}") for c in range(int(head["clusters"]))]
    if not all(isinstance(p, dict) for p in parts):
        return None
    excluded = [c for c in range(len(parts)) if values.get(f"out/{c}")]
    return Plan.model_validate({k: v for k, v in head.items() if k not in ("clusters", "excluded")}
                               | {"clusters": parts, "excluded": excluded})


class SnapshotParts:
    """The parts of one snapshot as they arrive (each reply says its snapshot, its index and how many there
    are): a part of a newer snapshot starts over; ``add`` returns them in order once all are in."""

    def __init__(self) -> None:
        self._snap: Any = None
        self._parts: dict[int, dict[str, Any]] = {}

    def add(self, meta: dict[str, Any]) -> list[dict[str, Any]] | None:
        if meta.get("snap") != self._snap:
            self._snap, self._parts = meta.get("snap"), {}
        self._parts[int(meta["part"])] = meta
        if len(self._parts) == int(meta["parts"]) and 0 in self._parts:
            return [self._parts[i] for i in range(len(self._parts))]
        return None
