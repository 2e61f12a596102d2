"""What the simulator knows of each node: its stage, its compute thread's queues and version, its
averaging rounds, and the counters the report reads.

Shared by the schedule (``training``) and the rings (``rings``), which both change it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ravq.planner.pacing import due_on_entry, round_by_time
from ravq.simulate.world import StageSpec


@dataclass(eq=False, slots=True)
class NodeRound:
    """One averaging round of one node: all its rings at once, from the snapshot at ``version``."""

    round_id: int
    version: int
    plan_epoch: int = 0
    """The plan epoch the round belongs to: a new epoch abandons it (``ravq.average.averager.on_plan``)."""
    done: bool = False
    started_at: float = 0.0
    rings_left: int = 0
    aborted: bool = False
    lead: int = 1
    """Steps past ``version`` the node trains before holding back for it (longer for a slow ring's round)."""


@dataclass(eq=False, slots=True)
class Node:
    """One simulated node: its stage, compute thread, queues, version, rounds and counters."""

    spec: StageSpec
    cluster: int
    stage: int
    last: bool
    epoch: int = 0
    """Incarnation: raised when the node's cluster fails, so events of the old one are dropped."""
    plan_epoch: int = -1
    """The plan epoch this node counts rounds in, and its optimizer steps since it saw it."""
    steps_in_epoch: int = 0
    epoch_began: float = 0.0
    """When ``plan_epoch`` began (rounds by time count from then)."""
    rounds_due: int = 0
    """Rounds by time: rounds of ``plan_epoch`` it has ended or passed over."""
    arrived: range = range(0)
    """Rounds by time: rounds due before it entered ``plan_epoch`` that peers may hold open."""
    step_round: int | None = None
    """The round its newest optimizer step ended, if any (``round_ended``)."""
    busy: bool = False
    blocked: NodeRound | str | None = None
    """What the compute thread waits for: a NodeRound, "queue", or None."""
    blocked_since: float = 0.0
    fwd_queue: deque[int] = field(default_factory=deque)
    bwd_queue: deque[int] = field(default_factory=deque)
    stash: dict[int, int] = field(default_factory=dict)
    """Micro-batch -> version its forward used (stage 0: its in-flight micro-batches)."""
    started: int = 0
    backwards: int = 0
    """Backwards done (stage 0's: the cluster's trained micro-batches, lost ones excluded)."""
    version: int = 0
    accumulated: int = 0
    pending_staleness: list[int] = field(default_factory=list)
    staleness_sum: int = 0
    staleness_max: int = 0
    updates: int = 0
    forwards_total: int = 0
    backwards_total: int = 0
    busy_s: float = 0.0
    first_work: float | None = None
    end: float = 0.0
    idle_since: float = 0.0
    """When its compute thread last finished a forward or backward."""
    wait_s: float = 0.0
    """Compute thread waiting for averaging (hold-back, full round queue, or the round itself)."""
    pending: list[NodeRound] = field(default_factory=list)
    snapshot_version: int = -1
    queued: deque[NodeRound] = field(default_factory=deque)
    running: NodeRound | None = None
    rounds_done: int = 0
    rounds_aborted: int = 0
    round_s_sum: float = 0.0
    pipe_bytes: float = 0.0
    ring_bytes: float = 0.0
    failures: int = 0
    down_s: float = 0.0

    def enter_epoch(self, epoch: int, began: float, now: float, period_s: float | None) -> None:
        """Count steps and rounds in plan epoch ``epoch`` (which ``began`` then) from now on.  Rounds by time
        count from its start, as nodes count from the broker's stamp (``ravq.average.group_rounds.
        epoch_began``); those already due are not this node's to run, and it passes over the newest (as
        ``RoundClock`` does)."""
        self.plan_epoch, self.steps_in_epoch, self.epoch_began = epoch, 0, began
        self.rounds_due = int((now - began) / period_s) if period_s is not None else 0
        self.arrived = due_on_entry(self.rounds_due)

    def round_ended(self, period: int, period_s: float | None, now: float) -> list[int]:
        """Set ``step_round`` for the step just counted, as ``ravq.average.group_rounds.RoundClock`` does:
        every ``period``-th step in the epoch, or by time (``period_s``) the first step once (k + 1) x
        ``period_s`` have passed since the epoch began; the rounds that step passed over (by time)."""
        if period_s is None:
            self.step_round = None if self.steps_in_epoch % period else self.steps_in_epoch // period - 1
            return []
        due, arrived, self.arrived = int((now - self.epoch_began) / period_s), self.arrived, range(0)
        self.step_round, passed = round_by_time(self.rounds_due, due)
        self.rounds_due = max(self.rounds_due, due)
        return [*arrived, *passed]

    @property
    def name(self) -> str:
        return self.spec.node
