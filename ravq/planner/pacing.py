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

from collections.abc import Iterable, Mapping, Sequence


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
