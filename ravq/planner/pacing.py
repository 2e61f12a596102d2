"""Rounds paced by rate: a slow cluster does not hold the fast ones (issue #38).

With steps pacing (ravq's default) every cluster ends round k of a plan epoch at its ``sync_every``-th
step times k+1, so a fast cluster reaches round k before a slow one and holds back for it (within
``averaging_lead`` steps): every cluster of a group, and through the grid's axes every cluster, trains at
the slowest one's pace.

With rate pacing each cluster ends a round after its own share of steps: ``sync_every`` for the fastest
cluster of the plan, fewer in proportion to its rate for a slower one (at least one), so round k falls
due on every cluster at about the same time and no cluster waits for another's steps; each trains at its
own rate.  The rates are the plan's (the planner's predicted samples/s per cluster, the same on every
node), never a node's own measurement, so every member of a round derives the same round ids and groups.

A round then mixes unequal amounts of training: each cluster's weights count in proportion to the samples
it trained since its last mix (its steps per round), so the average is the one a single run over all
those samples would move to, and a slow cluster's few steps do not pull the fast ones back as much as
they would in a plain mean.  Such a mix averages away less gradient noise than a plain mean of as many
clusters: ``effective_clusters`` says how much, for ClusterAdam (``ravq.stage.optim``), which otherwise takes
steps sized for equal weights.  Everything here is pure: the node, the simulator and the planner call it.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ravq.planner.groups import Mode, group_of, groups_for

OPEN_ROUNDS = 2
"""Rounds by time (``AveragingConfig.period_s``): a stage new to a plan epoch tells its peers it will not run
this many rounds already due, those they may still hold open (a node queues at most
``ravq.average.round_queue.PENDING_ROUNDS``)."""
PASSED_ROUNDS = OPEN_ROUNDS + 1
"""Rounds by time: a step that spans several rounds tells its peers of at most this many it passes over, the
newest (a peer holds at most one running and ``PENDING_ROUNDS`` queued; older ones it has ended)."""


def due_on_entry(due: int) -> range:
    """Rounds by time: the rounds a stage new to an epoch passes over, ``due`` having fallen due before its
    first step there (the newest ``OPEN_ROUNDS``, which peers may hold open)."""
    return range(max(0, due - OPEN_ROUNDS), due)


def round_by_time(done: int, due: int) -> tuple[int | None, range]:
    """Rounds by time: the round a step ends when ``due`` rounds of the epoch have fallen due and the stage
    has ended or passed ``done`` of them (None: none new), and the rounds it passes over, the newest
    ``PASSED_ROUNDS`` (nodes: ``RoundClock``; the simulator: ``Node.round_ended``)."""
    if due <= done:
        return None, range(0)
    return due - 1, range(max(done, due - 1 - PASSED_ROUNDS), due - 1)


def round_steps(sync_every: int, rates: Sequence[float]) -> list[int]:
    """Optimizer steps each cluster trains between its rounds: ``sync_every`` for the fastest,
    round(sync_every * rate / fastest rate) for the others, at least 1.  A cluster with no rate (0,
    unknown) keeps ``sync_every``: without a rate nobody can pace it (paced as under steps pacing)."""
    top = max(rates, default=0.0)
    if not top > 0:
        return [sync_every] * len(rates)
    return [max(1, round(sync_every * r / top)) if r > 0 else sync_every for r in rates]


def mix_weights(group: Iterable[int], steps: Mapping[int, int] | Sequence[int]) -> dict[int, float]:
    """Each cluster of ``group``'s share of the round's average: its steps since its last mix (``steps[c]``,
    its steps per round) over the group's; they sum to 1."""
    members = list(group)
    total = sum(steps[c] for c in members)
    if total <= 0:
        return {c: 1.0 / len(members) for c in members}
    return {c: steps[c] / total for c in members}


def send_scale(cluster: int, group: Iterable[int], steps: Mapping[int, int] | Sequence[int]) -> float:
    """What ``cluster`` multiplies its snapshot by before a ring that takes the plain mean of its m members,
    so that the ring's mean is the samples-weighted average: m * its weight (1.0 when the weights are
    equal)."""
    weights = mix_weights(group, steps)
    return len(weights) * weights[cluster]


def effective_clusters(steps: Sequence[int]) -> float:
    """How many clusters' worth of gradient noise a round's samples-weighted mix averages away: the b for
    which the mix moves as T = sum(s^2) / S steps of one optimizer on b clusters' batches would (S = sum(s)),
    when cluster c trains ``steps[c]`` = s_c steps per round (each step one micro-batch's noise, variance v)
    and counts s_c / S.  The mix's mean is T steps' and its variance sum(s^3) / S^2 * v, so
    b = S * sum(s^2) / sum(s^3): exactly C for C equal shares, less for unequal ones (3:3:3:1 -> 3.41, not 4;
    3:1 -> 1.43), and 1 for one cluster.

    ``steps`` are every live cluster's, not only the round's group: a samples-weighted mix within any group
    keeps the samples-weighted mean over all clusters where it was (the groups' consensus moves by it), so
    groups average away the same noise as global rings, a few rounds later."""
    total, square, cube = sum(steps), sum(s * s for s in steps), sum(s ** 3 for s in steps)
    if cube <= 0:
        return float(max(1, len(steps)))
    return max(1.0, total * square / cube)


# Pacing by link (issue #38): a cluster whose round of averaging takes longer than the round period (a slow
# uplink) takes part only in every k-th round, k in the plan beside the rates (``every``), the same on every
# node: it is due in rounds r with r % k == k - 1, after k rounds of training.  A round's takers are the live
# clusters due in it and free: a group's ring lasts as long as its slowest member's part, up to ``span`` = the
# largest k in the group rounds, so every member of the group sits out the next span - 1 rounds (its nodes
# run no rings and hold back for that round only span rounds late: ``round_lead``); no fast cluster queues
# its later rounds behind a slow ring, and none of its partners wait for it.  Groups form among the takers
# alone, and a taker mixes with weight = its samples since its last mix (``RoundPlan.since`` rounds of its
# steps), so the samples-weighted mean over all clusters stays where it was.  Every node derives the same
# schedule from (plan epoch, live clusters, per-cluster k), walking the rounds from the epoch's first.
# (2026-11-29: due at r % k == k - 1, not 0, and the busy rule; before, a fast cluster grouped with a slow
# taker queued its next rounds behind that ring, and round 0 weighed a k-cluster's one round as k.)

GroupsOf = Callable[[int, list[int], int], Sequence[tuple[int, ...]]]
"""Round r's groups among a list of takers, the third argument choosing among ``CHOICES`` candidates
(``link_groups`` with the epoch, mode and size bound)."""
CHOICES = 8
"""Candidate groupings a schedule weighs each round: it keeps the one that spreads the most weights."""


def link_every(averaging_s: float, round_period_s: float) -> int:
    """The k for a cluster whose round of averaging takes ``averaging_s`` (its link and segment sizes) against
    the plan's round period: ceil(averaging_s / round_period_s), at least 1, so its averaging keeps up."""
    if not round_period_s > 0 or not averaging_s > 0:
        return 1
    return max(1, math.ceil(averaging_s / round_period_s - 1e-9))


def takes_part(round_index: int, every: int) -> bool:
    """Whether a cluster paced every ``every`` rounds is due in round ``round_index`` of its epoch (it takes
    part unless a longer ring of its own still runs: ``Schedule``)."""
    if every < 1:
        raise ValueError(f"averaging.every: at least 1, got {every}")
    return round_index % every == every - 1


def takers(round_index: int, live: Iterable[int], every: Sequence[int] | None) -> list[int]:
    """The live clusters due in round ``round_index`` (all of them without ``every``)."""
    return sorted(c for c in set(live) if every is None or takes_part(round_index, every[c]))


def mix_steps(steps: Sequence[int], every: Sequence[int] | None) -> list[int]:
    """Each cluster's steps between its mixes in the long run: its steps per round times its k (ClusterAdam's
    count; a round's own weights are ``RoundPlan.since`` rounds of steps)."""
    return list(steps) if every is None else [s * k for s, k in zip(steps, every, strict=True)]


def round_lead(lead: int, steps: int, span: int) -> int:
    """The steps a stage trains past a round's snapshot before it holds back for it: ``averaging_lead``, plus
    the ``span`` - 1 rounds of its own ``steps`` the round's ring has to run (pacing by link)."""
    return lead + max(0, span - 1) * steps


@dataclass(frozen=True, slots=True)
class RoundPlan:
    """One round of a schedule: its groups (each of at least 2 takers; a taker alone is in none), each
    taker's rounds since its last mix (this one included) and the span of its group (its largest k)."""

    groups: tuple[tuple[int, ...], ...]
    since: Mapping[int, int]
    span: Mapping[int, int]


class Schedule:
    """Round by round from an epoch's first, the groups of clusters paced every ``every[c]``-th round under
    the busy rule (see above).  Pure and deterministic; extended on demand."""

    def __init__(self, groups_of: GroupsOf, live: Iterable[int], every: Sequence[int] | None) -> None:
        self.groups_of, self.live, self.every = groups_of, sorted(set(live)), every
        self.rounds: list[RoundPlan] = []
        self.held = {c: 1 << i for i, c in enumerate(self.live)}
        """Per cluster, whose weights its own hold (a bit per live cluster)."""
        self.last = dict.fromkeys(self.live, -1)
        self.free = dict.fromkeys(self.live, 0)

    def at(self, round_index: int) -> RoundPlan:
        """Round ``round_index``'s groups, weights and spans."""
        while len(self.rounds) <= round_index:
            r = len(self.rounds)
            ready = [c for c in takers(r, self.live, self.every) if self.free[c] <= r]
            options = (tuple(g for g in self.groups_of(r, ready, j) if len(g) > 1) for j in range(CHOICES))
            groups = max(options, key=self._spread)  # the first of the best on a tie: alike on every node
            for g in groups:
                union = 0
                for c in g:
                    union |= self.held[c]
                self.held.update(dict.fromkeys(g, union))
            since, span = {}, {}
            for g in groups:
                width = 1 if self.every is None else max(self.every[c] for c in g)
                for c in g:
                    since[c], span[c] = r - self.last[c], width
                    self.last[c], self.free[c] = r, r + width
            self.rounds.append(RoundPlan(groups, since, span))
        return self.rounds[round_index]

    def _spread(self, groups: tuple[tuple[int, ...], ...]) -> int:
        """How many (cluster, weights) holdings ``groups`` would add."""
        gain = 0
        for g in groups:
            union = 0
            for c in g:
                union |= self.held[c]
            gain += sum(union.bit_count() - self.held[c].bit_count() for c in g)
        return gain


def link_groups(epoch: int, round_index: int, ready: Sequence[int], mode: Mode, group_size: int,
                choice: int = 0) -> list[tuple[int, ...]]:
    """Pacing by link: round ``round_index``'s groups among its takers ``ready``: one in global mode, else the
    takers shuffled afresh for (epoch, round) and cut into as few groups of at most ``group_size`` as hold
    them, sizes within one of each other.  Not the grid: the takers change from round to round, so a grid's
    axes would line up with the k's (7 clusters with k 1,1,1,1,2,2,3 never mixed), and not by rate (that
    leaves the slow takers apart from the fast ones for good)."""
    members = sorted(ready)
    if mode == "global" or len(members) <= group_size:
        return [tuple(members)] if members else []
    random.Random(f"ravq-link:{epoch}:{round_index}:{choice}").shuffle(members)  # str seed: alike everywhere
    count = -(-len(members) // group_size)
    return sorted(tuple(sorted(members[i::count])) for i in range(count))


_SCHEDULES: dict[tuple[object, ...], Schedule] = {}
_LOCK = threading.Lock()


def round_plan(epoch: int, round_index: int, live: Iterable[int], mode: Mode, group_size: int,
               rates: Mapping[int, float] | None = None, every: Sequence[int] | None = None) -> RoundPlan:
    """Round ``round_index``'s plan among its takers (``groups_for`` over them), the same on every node."""
    members = sorted(set(live))
    if every is None:  # every cluster every round: the grid's groups, each cluster's one round of steps
        grid = groups_for(epoch, round_index, members, mode, group_size, rates)
        groups = tuple(g for g in grid if len(g) > 1)
        return RoundPlan(groups, {c: 1 for g in groups for c in g}, {c: 1 for g in groups for c in g})
    key = (epoch, tuple(members), mode, group_size, None if rates is None else tuple(sorted(rates.items())),
           tuple(every))
    with _LOCK:
        schedule = _SCHEDULES.get(key)
        if schedule is None:
            if len(_SCHEDULES) >= 64:
                _SCHEDULES.pop(next(iter(_SCHEDULES)))
            schedule = _SCHEDULES[key] = Schedule(
                lambda r, t, j: link_groups(epoch, r, t, mode, group_size, j), members, every)
        return schedule.at(round_index)


def rounds_until_mixed(groups_of: GroupsOf, live: Iterable[int], every: Sequence[int] | None,
                       limit: int = 64) -> int | None:
    """How many rounds (round indices from 0) until every live cluster's weights hold every other's, when
    round r mixes within ``groups_of(r, its takers, choice)`` under the busy rule (``Schedule``); None if not
    within ``limit``.  With every-k-th-round clusters, "every cluster mixes with every other within n rounds"
    counts the slowest's own rounds: ceil(this / max k) <= n."""
    schedule = Schedule(groups_of, live, every)
    everyone = (1 << len(schedule.live)) - 1
    for r in range(limit + 1):
        if all(h == everyone for h in schedule.held.values()):
            return r
        if r < limit:
            schedule.at(r)
    return None


def round_groups(epoch: int, round_index: int, live: Iterable[int], mode: Mode, group_size: int,
                 rates: Mapping[int, float] | None = None,
                 every: Sequence[int] | None = None) -> list[tuple[int, ...]]:
    """Round ``round_index``'s groups among its takers (``round_plan``): a cluster that skips the round is in
    none, and the others form their groups as if it were not live.  Without ``every``, ``groups_for``'s
    groups as they are (a cluster alone in its group included)."""
    if every is None:
        return groups_for(epoch, round_index, live, mode, group_size, rates)
    return list(round_plan(epoch, round_index, live, mode, group_size, rates, every).groups)


def group_and_lead(cluster: int, epoch: int, round_index: int, live: Iterable[int], mode: Mode,
                   group_size: int, rates: Mapping[int, float] | None, every: Sequence[int] | None, lead: int,
                   steps: int) -> tuple[tuple[int, ...], int]:
    """``cluster``'s group in the round (() when it sits it out under pacing by link) and the steps it trains
    past the round's snapshot before holding back for it (``round_lead`` with its ``steps`` per round)."""
    if every is None:
        return group_of(cluster, groups_for(epoch, round_index, live, mode, group_size, rates)), lead
    plan = round_plan(epoch, round_index, live, mode, group_size, rates, every)
    return group_of(cluster, plan.groups), round_lead(lead, steps, plan.span.get(cluster, 1))
