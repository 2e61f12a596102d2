"""The discrete-event core: a heap of timed callbacks, shared resources and FIFO connections.

``SharedResource`` is a processor-sharing server: its capacity (bytes/s of an uplink, or cores of a
host) is split equally among the jobs in service, each at most its own cap, the rest going to the
others (water-filling).  An uplink shared by a node's pipeline and ring connections is one; a host
whose cores several node processes share is another.  ``Connection`` is one TCP stream over an
uplink: its messages leave in order, one in service at a time, and arrive a latency later.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from typing import Any

INF = math.inf


class EventQueue:
    """Callbacks run in time order; ties in the order they were scheduled."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.events = 0

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self, until: float = INF) -> None:
        heap, pop = self._heap, heapq.heappop
        while heap and heap[0][0] <= until:
            t, _, fn, args = pop(heap)
            self.now = t
            self.events += 1
            fn(*args)

    def empty(self) -> bool:
        return not self._heap


class _Job:
    __slots__ = ("cap", "done", "rate", "remaining")

    def __init__(self, work: float, cap: float, done: Callable[[], None]) -> None:
        self.remaining, self.cap, self.done, self.rate = work, cap, done, 0.0


class SharedResource:
    """Processor sharing with per-job caps; ``served`` counts the work done (bytes, or core-seconds)."""

    def __init__(self, q: EventQueue, capacity: float) -> None:
        if not capacity > 0:
            raise ValueError(f"capacity: must be > 0, got {capacity}")
        self.q, self.capacity = q, capacity
        self.jobs: list[_Job] = []
        self.served = 0.0
        self.busy_s = 0.0
        """Time with at least one job in service."""
        self._last = 0.0
        self._token = 0

    def add(self, work: float, cap: float, done: Callable[[], None]) -> None:
        """Serve ``work`` units at up to ``cap`` units/s; call ``done`` when finished."""
        if work <= 0 or (cap == INF and self.capacity == INF):
            self.q.after(0.0, done)
            return
        self._advance()
        self.jobs.append(_Job(work, cap, done))
        self._schedule()

    def _advance(self) -> None:
        dt = self.q.now - self._last
        self._last = self.q.now
        if dt <= 0 or not self.jobs:
            return
        self.busy_s += dt
        for job in self.jobs:
            step = job.rate * dt
            job.remaining -= step
            self.served += step

    def _schedule(self) -> None:
        jobs = self.jobs
        self._token += 1
        if not jobs:
            return
        if len(jobs) == 1:
            jobs[0].rate = min(jobs[0].cap, self.capacity)
        else:
            left, count = self.capacity, len(jobs)
            for job in sorted(jobs, key=lambda j: j.cap):
                share = left / count
                job.rate = min(job.cap, share)
                left -= job.rate
                count -= 1
        soonest = min(max(j.remaining, 0.0) / j.rate for j in jobs)
        self.q.after(soonest, self._complete, self._token)

    def _complete(self, token: int) -> None:
        if token != self._token:
            return
        self._advance()
        soonest = min(max(j.remaining, 0.0) / j.rate for j in self.jobs)
        threshold = soonest + 1e-12 * max(1.0, self.q.now)     # the soonest always finishes: progress
        finished = [j for j in self.jobs if max(j.remaining, 0.0) / j.rate <= threshold]
        for job in finished:
            self.served += max(job.remaining, 0.0)
            job.remaining = 0.0
        self.jobs = [j for j in self.jobs if j.remaining > 0.0]
        self._schedule()
        for job in finished:
            job.done()


class Connection:
    """One stream from a node: messages leave in order over the sender's uplink (capped at the path's
    bandwidth) and arrive ``latency_s`` after their last byte left."""

    __slots__ = ("_queue", "_sending", "bytes_sent", "cap", "latency_s", "messages", "q", "uplink")

    def __init__(self, q: EventQueue, uplink: SharedResource, cap: float, latency_s: float) -> None:
        self.q, self.uplink, self.cap, self.latency_s = q, uplink, cap, latency_s
        self._queue: deque[tuple[float, Callable[..., None], tuple[Any, ...]]] = deque()
        self._sending = False
        self.bytes_sent = 0.0
        self.messages = 0

    def send(self, nbytes: float, arrive: Callable[..., None], *args: Any) -> None:
        self._queue.append((nbytes, arrive, args))
        if not self._sending:
            self._next()

    def _next(self) -> None:
        if not self._queue:
            self._sending = False
            return
        self._sending = True
        self.uplink.add(self._queue[0][0], self.cap, self._sent)

    def _sent(self) -> None:
        nbytes, arrive, args = self._queue.popleft()
        self.bytes_sent += nbytes
        self.messages += 1
        self.q.after(self.latency_s, arrive, *args)
        self._next()
