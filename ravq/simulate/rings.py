"""Averaging rounds as the simulator runs them: one segment's ring in one round.

A ring (the holders of a run of blocks, one per cluster) does reduce-scatter then all-gather, 2(C-1)
steps; at step t a member sends chunk (rank - t) mod C to its successor in pieces of ``piece_bytes``,
piece j of step t leaving once piece j of step t-1 has arrived (``ravq.average.ring.RingRun``).  A
member starts when its node starts that round; a ring with no progress for ``ring_timeout_s`` aborts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

from ravq.simulate.engine import EventQueue
from ravq.simulate.state import Node, NodeRound
from ravq.simulate.world import SegmentSpec, Settings, World

BUSY_WAITS = 20
"""As ``ravq.average.mailbox.BUSY_WAITS``: more ``ring_timeout_s`` a step waits on a busy predecessor."""


class RingHost(Protocol):
    """What a ring needs of the simulation that runs it (``training.Simulation``)."""

    q: EventQueue
    settings: Settings
    world: World
    up: list[bool]
    """Per cluster: whether it is running (not failed)."""

    def ring_send(self, src: Node, dst: Node, nbytes: float, arrive: Callable[..., None], *args: Any) -> None:
        """Send ``nbytes`` on the ring stream src -> dst; ``arrive(*args)`` once they are there."""

    def ring_messages(self, src: Node, dst: Node) -> int:
        """Ring messages ``src`` has sent ``dst`` so far, of every ring (one link carries them in order)."""

    def member_done(self, node: Node, nr: NodeRound, aborted: bool) -> None:
        """``node`` is through with this ring in its round ``nr``."""

    def ring_closed(self, ring: Ring) -> None:
        """Every member of ``ring`` is through with it."""

    @property
    def node_segments(self) -> dict[str, list[SegmentSpec]]: ...

    @property
    def seg_index(self) -> dict[int, int]: ...

    @property
    def rings(self) -> dict[tuple[int, ...], Ring]: ...

    @property
    def closed(self) -> set[tuple[int, ...]]: ...


class Ring:
    """One round of one segment's ring.  Piece by piece (exact), or, when that would be more than
    ``fluid_ring_pieces`` transfers, as flows: once every member has started, each member sends its
    2(C-1)/C share of the segment as one message over its ring stream, and the round ends when the
    last of them has arrived, or no sooner than 2(C-1) piece-and-latency hops after the start."""

    def __init__(self, sim: RingHost, seg: SegmentSpec, key: tuple[int, ...], members: list[Node]) -> None:
        self.sim, self.seg, self.key, self.members = sim, seg, key, members
        """``key``: which ring of which round (the simulation's)."""
        self.size = len(members)
        c = self.size
        self.steps = 2 * (c - 1)
        bounds = [seg.nbytes * i / c for i in range(c + 1)]
        self.chunk = [bounds[i + 1] - bounds[i] for i in range(c)]
        piece = float(sim.settings.piece_bytes)
        self.pieces = [max(1, math.ceil(x / piece)) if x > 0 else 1 for x in self.chunk]
        self.fluid = c * self.steps * max(self.pieces) > sim.settings.fluid_ring_pieces
        self.opened: dict[int, bool] = {}
        self.rounds: dict[int, tuple[NodeRound | None, int]] = {}
        """Member rank -> (its node's round, the node's epoch) when it opened."""
        self.progress = 0
        self.received: dict[int, list[tuple[int, int]]] = {i: [] for i in range(c)}
        self.recv_count = [0] * c
        self.total_recv = [sum(self.pieces[(r - t - 1) % c] for t in range(self.steps)) for r in range(c)]
        self.finished: set[int] = set()
        self.aborted = False
        self.started_at = 0.0
        self.flows_left = c

    def rank(self, node: Node) -> int:
        return self.members.index(node)

    def open(self, r: int) -> None:
        node = self.members[r]
        self.opened[r] = True
        self.rounds[r] = (node.running, node.epoch)
        self.progress += 1
        self.sim.q.after(self.sim.settings.ring_timeout_s, self._watch, self.progress, self._heard())
        if self.aborted:
            self._finish(r)
            return
        if self.fluid:
            if len(self.opened) == self.size:
                self._start_flows()
            return
        for j in range(self.pieces[r % self.size]):
            self._send(r, 0, j)
        for t, j in self.received[r]:
            if t + 1 < self.steps:
                self._send(r, t + 1, j)
        self.received[r].clear()

    def _piece_bytes(self, chunk: int) -> float:
        return self.chunk[chunk] / self.pieces[chunk]

    def _send(self, r: int, t: int, j: int) -> None:
        k = (r - t) % self.size
        succ = (r + 1) % self.size
        self.sim.ring_send(
            self.members[r], self.members[succ], self._piece_bytes(k), self._arrive, succ, t, j
        )

    def _arrive(self, r: int, t: int, j: int) -> None:
        if self.aborted or r in self.finished:
            return
        self.progress += 1
        self.recv_count[r] += 1
        if self.opened.get(r):
            if t + 1 < self.steps:
                self._send(r, t + 1, j)
        else:
            self.received[r].append((t, j))
        if self.recv_count[r] == self.total_recv[r] and self.opened.get(r):
            self._finish(r)

    def _start_flows(self) -> None:
        sim = self.sim
        self.started_at = sim.q.now
        hops = 0.0
        for r, node in enumerate(self.members):
            succ = self.members[(r + 1) % self.size]
            nbytes = sum(self.chunk) * 2 - self.chunk[(r + 1) % self.size] - self.chunk[(r + 2) % self.size]
            piece = max(self._piece_bytes(k) for k in range(self.size))
            link = sim.world.network
            hop = link.latency(node.name, succ.name) + piece / min(link.bandwidth(node.name, succ.name),
                                                                    sim.world.network.uplink[node.name])
            hops = max(hops, hop)
            sim.ring_send(node, succ, nbytes, self._flow_done)
        self.earliest = self.started_at + self.steps * hops

    def _heard(self) -> tuple[int, ...]:
        """Per member, the ring messages its predecessor has sent it so far, of every ring."""
        return tuple(self.sim.ring_messages(self.members[r - 1], self.members[r]) for r in range(self.size))

    def _watch(self, seen: int, heard: tuple[int, ...], waits: int = 0) -> None:
        """A ring step waits ``ring_timeout_s`` for its piece, and again while the predecessor of every member
        still waiting for pieces delivers (other rings' pieces, queued ahead on the one link), at most
        ``BUSY_WAITS`` times over (``ravq.average.mailbox.Mailbox.take``): no progress and a silent
        predecessor aborts."""
        if self.aborted or len(self.finished) == self.size:
            return
        streaming = self.fluid and len(self.opened) == self.size     # flows make progress all along
        now = self._heard()
        if self.progress == seen and not streaming:
            waiting = [r for r in range(self.size) if self.recv_count[r] < self.total_recv[r]]
            if waits >= BUSY_WAITS or any(now[r] == heard[r] for r in waiting):
                self.abort()
                return
            waits += 1
        else:
            waits = 0
        self.sim.q.after(self.sim.settings.ring_timeout_s, self._watch, self.progress, now, waits)

    def _flow_done(self) -> None:
        self.progress += 1
        self.flows_left -= 1
        if self.flows_left == 0 and not self.aborted:
            self.sim.q.at(self.earliest, self._finish_all)

    def _finish_all(self) -> None:
        for r in range(self.size):
            if r not in self.finished:
                self._finish(r)

    def _finish(self, r: int) -> None:
        if r in self.finished:
            return
        self.finished.add(r)
        nr, epoch = self.rounds.get(r, (None, -1))
        node = self.members[r]
        if nr is not None and node.epoch == epoch:
            self.sim.member_done(node, nr, self.aborted)
        if len(self.finished) == self.size:
            self.sim.ring_closed(self)

    def abort(self) -> None:
        """A member died: every member still in the round gives up (its ring step timed out)."""
        if self.aborted:
            return
        self.aborted = True
        for r in range(self.size):
            if r not in self.finished and self.opened.get(r):
                self._finish(r)
            elif not self.sim.up[self.members[r].cluster]:
                self.finished.add(r)
        if len(self.finished) == self.size:
            self.sim.ring_closed(self)


def skip_round(sim: RingHost, node: Node, round_id: int, group: tuple[int, ...]) -> None:
    """``node`` passes over round ``round_id`` of its plan epoch (rounds by time, a step that spanned
    several): as a node tells its ring peers (``RoundGroups.step``), its rings of that round close at once."""
    if len(group) < 2:
        return
    for seg in sim.node_segments[node.name]:
        key = (sim.seg_index[id(seg)], node.plan_epoch, round_id, group[0])
        ring = sim.rings.get(key)
        if ring is not None:
            ring.abort()
        sim.closed.add(key)
