"""Binary Star (ZeroMQ guide, chapter 4): which of two brokers serves the nodes.  No sockets, no clock of
its own: every event comes with its time, so tests drive it on a virtual one.

A pair is a *primary* and a *backup* (``broker.backup`` in the topology).  Each publishes its state
(``primary``, ``backup``, ``active``, ``passive``) and its term to the other ``TICKS`` times a heartbeat
interval; a peer not heard from for ``expiry_s`` is lost.  The rules are the guide's:

- a primary becomes active when it hears a backup (a first start) and passive when it hears an active
  peer (it comes back after a failover: the old primary returns passive);
- a backup becomes passive when it hears an active primary, and never serves before that;
- a passive broker becomes active when its peer restarts (it says ``primary`` or ``backup``), and on a
  node's request (its *vote*: the node lost the active broker) only once it has lost the peer too: a
  passive broker that still hears the active one turns the vote down, so a cut between the two brokers
  alone never makes a second active one;
- a primary that hears nobody becomes active on a vote once ``expiry_s`` has passed since it started.

Beyond the guide (which exits on two actives): each term of activity has a number, one past every term
either broker has seen; when two actives hear each other (a partition between the brokers healed while
nodes voted on both sides) the one of the older term, the backup on a tie, turns passive at once and
follows the other.  The term is the floor the new active lifts its plan epoch and sequence numbers past.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from brokers.replica import Restored
    from ravq.net.wire import Message

log = logging.getLogger(__name__)

PRIMARY, BACKUP, ACTIVE, PASSIVE = "primary", "backup", "active", "passive"
STATES = (PRIMARY, BACKUP, ACTIVE, PASSIVE)
TOPIC = "bs."
"""The topic of the pair's state messages on each broker's PUB (nodes do not subscribe to it)."""


class Pairing(Protocol):
    """What the active broker of a pair runs beside its own work (``brokers.pair.ActiveSide``)."""

    by: dict[str, Any]
    """The broker's role and term of activity, as its updates name their sender."""
    restored: Restored | None
    """The state a passive broker followed, when it took over (None: the run from its state directory)."""

    async def serve(self, publish: Callable[[Message, str], Awaitable[None]],
                    stop: Callable[[], None]) -> None:
        """Publish this broker's state to the peer and follow the peer's; ``stop`` when it turns passive."""

    def public(self) -> dict[str, Any]:
        """For ``ravq status``: the pair as this broker sees it."""


@dataclass(frozen=True, slots=True)
class Change:
    """A transition: the state before and after, and why."""

    before: str
    after: str
    why: str


class BinaryStar:
    def __init__(self, *, primary: bool, expiry_s: float, now: float) -> None:
        self.role = PRIMARY if primary else BACKUP
        """What this broker is in the topology (``broker`` or ``broker.backup``)."""
        self.state = self.role
        """Its state now: primary or backup (starting), active or passive."""
        self.expiry_s = expiry_s
        """Seconds without the peer's state after which it is lost (2 heartbeat intervals)."""
        self.peer_expiry = now + expiry_s
        """When the peer counts as lost; at start, as if heard just now: a starting broker waits that long
        for an active peer before a vote may make it active."""
        self.peer: str | None = None
        """The peer's last state (None: never heard)."""
        self.peer_term = 0
        self.term = 0
        """This broker's term of activity (0: never active); once active, one past every term seen."""
        self.failovers = 0
        """Times this broker took over from a passive state (its peer failed or restarted)."""
        self.changes: list[Change] = []

    @property
    def active(self) -> bool:
        return self.state == ACTIVE

    def peer_lost(self, now: float) -> bool:
        return now >= self.peer_expiry

    def peer_said(self, state: str, term: int, now: float) -> Change | None:
        """The peer published its state (``state``, ``term``); the transition it causes, if any."""
        assert state in STATES, state
        self.peer, self.peer_term, self.peer_expiry = state, max(self.peer_term, term), now + self.expiry_s
        if self.state == PRIMARY:
            if state == BACKUP:
                return self._go(ACTIVE, "the backup is up")
            if state == ACTIVE:
                return self._go(PASSIVE, "the backup is active")
        elif self.state == BACKUP:
            if state == ACTIVE:
                return self._go(PASSIVE, "the primary is active")
        elif self.state == PASSIVE:
            if state in (PRIMARY, BACKUP):
                return self._go(ACTIVE, f"the {state} restarted", takeover=True)
            if state == PASSIVE and self.role == PRIMARY:  # both passive: the primary serves
                return self._go(ACTIVE, "both were passive", takeover=True)
        elif state == ACTIVE and (term, self.role == BACKUP) > (self.term, self.role == PRIMARY):
            return self._go(PASSIVE, f"two actives: the peer's term {term} is newer than {self.term}")
        return None

    def vote(self, now: float) -> Change | None:
        """A node's request reached this broker; serve it when this is the active broker afterwards
        (``active``).  A vote makes a passive broker active only once its peer is lost; a primary that has
        heard nobody, once ``expiry_s`` passed since it started; a backup that never heard an active
        primary, never."""
        if self.state in (PASSIVE, PRIMARY) and self.peer_lost(now):
            return self._go(ACTIVE, "a node voted and the peer is silent", takeover=self.state == PASSIVE)
        return None

    def public(self, now: float) -> dict[str, object]:
        """For ``ravq status``: this broker's role, state, term and failovers, and its peer as it hears it."""
        return {"role": self.role, "state": self.state, "term": self.term, "failovers": self.failovers,
                "peer": self.peer, "peer_term": self.peer_term,
                "peer_silent_s": round(max(0.0, now - self.peer_expiry + self.expiry_s), 3)}

    def _go(self, state: str, why: str, *, takeover: bool = False) -> Change:
        change = Change(self.state, state, why)
        self.state = state
        if state == ACTIVE:
            self.term = max(self.term, self.peer_term) + 1
            self.failovers += takeover
        self.changes.append(change)
        log.warning("broker %s: %s -> %s (%s)", self.role, change.before, state, why)
        return change
