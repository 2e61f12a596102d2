"""Which members are silent past the threshold, found from a heap of deadlines: O(log N) a heartbeat, and
no visit of the members that beat on time.  No sockets.

Each heartbeat pushes the member's deadline (its time plus ``after_s``); ``due`` pops the deadlines that
passed and returns the members still silent at theirs (a member that beat since has a later deadline in
the heap: its older one is stale and skipped).  The broker publishes a silent member's key
(``silent/<name>``, ``ravq.net.clone``) once, and deletes it when the member beats again.  At a first
start it times only the members it heard from (10,000 members that have not started yet would be 10,000
keys in every snapshot, and nobody trains before they are all up); a broker that continues a run times
every member from its start (one that died while no broker watched is found silent).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping


class Silences:
    def __init__(self, after_s: float, names: Iterable[str], now: float,
                 heard_at: Mapping[str, float] | None = None) -> None:
        """``heard_at``: when each of ``names`` was last heard, if before ``now`` (a broker that takes over
        a pair's run: a member silent then is published silent at once, not ``after_s`` later)."""
        self.after_s = after_s
        self.last: dict[str, float] = {}
        """Each member's latest heartbeat (or when this broker started, for one not heard from yet)."""
        self.silent: set[str] = set()
        """Members whose silence was published (they have not beaten since)."""
        self._heap: list[tuple[float, str]] = []
        for name in names:
            self.beat(name, min(now, (heard_at or {}).get(name, now)))

    def beat(self, name: str, now: float) -> bool:
        """``name`` beat at ``now``; True when it was published silent (its key goes)."""
        self.last[name] = now
        heapq.heappush(self._heap, (now + self.after_s, name))
        if name in self.silent:
            self.silent.discard(name)
            return True
        return False

    def due(self, now: float) -> list[str]:
        """Members silent for ``after_s`` at ``now`` whose silence is not published yet (now it is)."""
        found = []
        while self._heap and self._heap[0][0] <= now:
            deadline, name = heapq.heappop(self._heap)
            if self.last[name] + self.after_s == deadline and name not in self.silent:
                self.silent.add(name)
                found.append(name)
        return found

    def figures(self, now: float) -> list[tuple[str, float]]:
        """The published silences' keys and their figures at ``now`` (a snapshot's)."""
        return [(f"silent/{name}", round(now - self.last[name], 3)) for name in sorted(self.silent)]

    def next_deadline(self) -> float | None:
        return self._heap[0][0] if self._heap else None
