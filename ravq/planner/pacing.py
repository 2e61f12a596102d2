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
from collections.abc import Callable, Iterable, Mapping, Sequence

from ravq.planner.groups import Mode, groups_for


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
# node.  Round r's takers are the live clusters with r % k == 0 (round 0 of an epoch: all of them), and its
# groups are formed among the takers alone, so nobody holds back or waits in silence for a cluster that
# skips.  A cluster that skips mixes, when it next takes part, with weight = its samples since its last mix:
# k rounds' steps (``mix_steps``), so the samples-weighted mean over all clusters stays where it was.


def link_every(averaging_s: float, round_period_s: float) -> int:
    """The k for a cluster whose round of averaging takes ``averaging_s`` (its link and segment sizes) against
    the plan's round period: ceil(averaging_s / round_period_s), at least 1, so its averaging keeps up."""
    if not round_period_s > 0 or not averaging_s > 0:
        return 1
    return max(1, math.ceil(averaging_s / round_period_s - 1e-9))


def takes_part(round_index: int, every: int) -> bool:
    """Whether a cluster paced every ``every`` rounds takes part in round ``round_index`` of its epoch."""
    if every < 1:
        raise ValueError(f"averaging.every: at least 1, got {every}")
    return round_index % every == 0


def takers(round_index: int, live: Iterable[int], every: Sequence[int] | None) -> list[int]:
    """The live clusters taking part in round ``round_index`` (all of them without ``every``)."""
    return sorted(c for c in set(live) if every is None or takes_part(round_index, every[c]))


def mix_steps(steps: Sequence[int], every: Sequence[int] | None) -> list[int]:
    """Each cluster's steps since its last mix when it takes part: its steps per round times its k."""
    return list(steps) if every is None else [s * k for s, k in zip(steps, every, strict=True)]


def rounds_until_mixed(groups_of: Callable[[int, list[int]], Sequence[tuple[int, ...]]], live: Iterable[int],
                       every: Sequence[int] | None, limit: int = 64) -> int | None:
    """How many rounds (round indices from 0) until every live cluster's weights hold every other's, when
    round r mixes within ``groups_of(r, takers of r)``; None if not within ``limit``.  With every-k-th-round
    clusters, "every cluster mixes with every other within n rounds" counts the slowest's own rounds:
    ceil(this / max k) <= n."""
    members = sorted(set(live))
    held = {c: {c} for c in members}
    for r in range(limit):
        if all(len(h) == len(members) for h in held.values()):
            return r
        for group in groups_of(r, takers(r, members, every)):
            union = set().union(*(held[c] for c in group))
            for c in group:
                held[c] = set(union)
    return limit if all(len(h) == len(members) for h in held.values()) else None


def round_groups(epoch: int, round_index: int, live: Iterable[int], mode: Mode, group_size: int,
                 rates: Mapping[int, float] | None = None,
                 every: Sequence[int] | None = None) -> list[tuple[int, ...]]:
    """Round ``round_index``'s groups among its takers (``groups_for`` over them): a cluster that skips the
    round is in none, and the others form their groups as if it were not live."""
    return groups_for(epoch, round_index, takers(round_index, live, every), mode, group_size, rates)
