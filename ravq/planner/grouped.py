"""What averaging in groups costs a plan, and which averaging a plan should use (issue #38).

In ``groups`` mode each round's rings run within groups of at most ``group_size`` clusters (a grid,
``ravq.planner.groups``): a group's round lasts 2(m-1)/m of each member's held bytes over its slowest
link to another cluster *of the group*, and a stage's CPU for averaging is charged for m clusters, not
all C.  A round is over when its slowest group is.  The places on the grid are shuffled per (plan epoch,
cycle), which the broker sets at run time, so the planner takes the mean round of ``GRID_EPOCHS`` epochs'
grids, every axis of each, as the nodes would derive them.

Groups buy a shorter round, not a pace of their own: a stage still holds back for its round with the
group of the moment, and the grid changes axis every round, so within its d rounds every cluster is
held to the slowest one (the simulator shows it: four clusters, one five times slower, groups of two,
all four at the slow one's pace).  The clusters' period is therefore the cost model's, with the grouped
round in it (``ravq.planner.cost``).

Rounds paced by rate (``ravq.planner.pacing``) end that tie: each cluster ends a round after its own
share of ``sync_every`` steps, so round k falls due everywhere at once and every cluster trains at its own
rate r_c.  The round period is then the fastest cluster's S/r_max, or the round itself when longer (with
``averaging_lead`` L: max(S/r_max, T, S/r_max + T - L/r_max)), and samples/s = micro_batch * sum of each
cluster's steps per round S_c / that period (``paced_samples_per_s``).

``best_averaging`` picks global rings or groups, the group size and the pace by this score; groups only
when every cluster mixes with every other within ``MIX_ROUNDS`` rounds.  ``recut`` then keeps nodes behind
slow links off stages that hold large segments: their stages' parameter bytes are capped in proportion
to their slowest link to another cluster, when the shorter round gains more than the pipeline loses.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ravq.config.averaging import AveragingConfig
from ravq.planner.cost import Layout, averaging_round_s, cluster_rate, ring_bandwidth, score, shared_rate
from ravq.planner.groups import Mode, groups_for, rounds_to_mix
from ravq.planner.pacing import Schedule, link_every, link_groups, round_steps, rounds_until_mixed
from ravq.planner.problem import INF, Problem

GRID_EPOCHS = 4
"""Plan epochs whose grids the planner averages a round over."""
MAX_EVERY = 16
"""Pacing by link: a cluster whose averaging would take more rounds than this is not kept for it."""
MIX_ROUNDS = 3
"""Groups mode only with a grid of at most this many axes: every cluster mixes with every other within it."""
STEP_PERIODS = 2
"""Paced by rate and link, a cluster whose optimizer step takes longer than this many round periods is not
planned: it would take part in a round at most every few, holding a share of under half a step."""
LINK_ROUNDS = 6
"""Pacing by link: the score walks this many times the largest k rounds of each epoch's schedule."""


@dataclass(frozen=True, slots=True)
class Averaging:
    """How clusters average: ``mode`` "global" (one set of rings over all) or "groups" of ``group_size``."""

    mode: str = "global"
    group_size: int = 2
    pace: str = "steps"
    """``steps`` (every cluster averages every ``sync_every`` steps) or ``rate`` (each after its share)."""
    rates: tuple[float, ...] = ()
    """Rate pacing: each cluster's predicted samples/s in plan order (``paced``), which the nodes pace by."""
    every: tuple[int, ...] = ()
    """Pacing by link: each cluster takes part in every k-th round (``linked``); (): every round."""
    period_s: float | None = None
    """Rate pacing: seconds between rounds, which nodes pace by (``AveragingConfig.period_s``; ``paced``)."""


GLOBAL = Averaging()


def averaging_config(averaging: Averaging) -> AveragingConfig | None:
    """What a plan says of its averaging (``Plan.averaging``): None for global rings paced by steps (the
    default)."""
    rate = averaging.pace == "rate" and bool(averaging.rates)
    every = list(averaging.every) if max(averaging.every, default=1) > 1 else None
    if averaging.mode == "global" and not rate and every is None:
        return None
    return AveragingConfig(mode=averaging.mode, group_size=averaging.group_size,
                           pace="rate" if rate else "steps", rates=list(averaging.rates) if rate else None,
                           period_s=averaging.period_s if rate else None, every=every)


def averaging_of(config: AveragingConfig | None) -> Averaging:
    """The averaging a plan's ``averaging`` (None: global rings) stands for."""
    if config is None:
        return GLOBAL
    return Averaging(config.mode, config.group_size, config.pace, tuple(config.rates or ()),
                     tuple(config.every or ()), config.period_s)


def paced(p: Problem, layouts: Sequence[Layout], averaging: Averaging) -> Averaging:
    """``averaging`` with the clusters' predicted samples/s it paces rounds by and the seconds between rounds
    (``period_s``: the period the score assumes, so nodes reach each round together whatever their real
    rates; pacing by link: the fastest cluster's S/r_max, its slow rings' hold-backs charged apart) (rate
    pacing only)."""
    if averaging.pace != "rate":
        return averaging
    rates = _rates(p, layouts, averaging)
    live = [r for r in rates if r > 0]
    if len(live) < 2:
        period = None
    elif max(averaging.every, default=1) > 1:
        period = p.sync_every / max(live)
    else:
        period = paced_period(p, live, round_of(p, layouts, averaging))
    return replace(averaging, rates=tuple(p.micro_batch * r for r in rates), period_s=period)


def paced_period(p: Problem, live: Sequence[float], averaging_s: float) -> float:
    """Seconds between rounds paced by rate, clusters at ``live`` micro-batches/s and a round lasting
    ``averaging_s``: the fastest cluster's S/r_max, or the round's when longer (with overlap and the lead)."""
    s, lead, top = p.sync_every, p.averaging_lead, max(live)
    period = s / top
    if p.overlap_averaging:
        return max(period, averaging_s, period + averaging_s - lead / top)
    return period + averaging_s


def paced_samples_per_s(p: Problem, rates: Sequence[float], averaging_s: float) -> float:
    """Samples/s of clusters at ``rates`` (micro-batches/s) whose rounds are paced by rate, a round lasting
    ``averaging_s``: each trains its own share of steps a period (``paced_period``)."""
    live = [r for r in rates if r > 0]
    if len(live) < 2:
        return p.micro_batch * sum(live)
    shares = paced_shares(p, live)
    period = max(paced_period(p, live, averaging_s), _longest_share_s(shares, live))
    return p.micro_batch * sum(shares) / period


def paced_shares(p: Problem, live: Sequence[float]) -> list[int]:
    """Micro-batches each cluster (at ``live`` micro-batches/s) trains a round under rate pacing, as the
    nodes count them: its share of ``sync_every`` in whole optimizer steps, at least one."""
    steps = round_steps(max(1, p.sync_every // p.update_every), live)
    return [s * p.update_every for s in steps]


def _longest_share_s(shares: Sequence[int], live: Sequence[float]) -> float:
    """The longest any cluster takes for its share of a round: a cluster too slow for one optimizer step a
    period (its share is never below one) trains each round's share for longer, and the run lasts so long."""
    return max(s / r for s, r in zip(shares, live))


def _rates(p: Problem, layouts: Sequence[Layout], averaging: Averaging) -> list[float]:
    grouped = averaging.mode == "groups" and len(layouts) > averaging.group_size
    return [cluster_rate(p, lay, averaging.group_size if grouped else len(layouts)) for lay in layouts]


def group_sizes(clusters: int) -> list[int]:
    """Group sizes worth scoring for ``clusters`` clusters: the smallest few that mix everyone within
    ``MIX_ROUNDS`` rounds (smaller groups make shorter rounds, so larger ones rarely win)."""
    sizes = [m for m in range(2, clusters) if rounds_to_mix(clusters, m) <= MIX_ROUNDS]
    return sizes[:3]


def grouped_round_s(p: Problem, layouts: Sequence[Layout], group_size: int) -> float:
    """The mean, over ``GRID_EPOCHS`` epochs' grids and each of their axes, of the slowest group's round."""
    count = len(layouts)
    rounds = []
    for epoch in range(GRID_EPOCHS):
        for r in range(rounds_to_mix(count, group_size)):
            groups = groups_for(epoch, r, range(count), "groups", group_size)
            rounds.append(max((averaging_round_s(p, [layouts[c] for c in g]) for g in groups), default=0.0))
    return statistics.fmean(rounds)


def score_with(p: Problem, layouts: Sequence[Layout], averaging: Averaging = GLOBAL) -> float:
    """Predicted samples/s of these clusters averaging as ``averaging`` says."""
    grouped = averaging.mode == "groups" and len(layouts) > averaging.group_size
    if max(averaging.every, default=1) > 1:
        return _linked_score(p, layouts, averaging)
    if not grouped and averaging.pace == "steps":
        return score(p, layouts)
    round_s = grouped_round_s(p, layouts, averaging.group_size) if grouped else averaging_round_s(p, layouts)
    if averaging.pace == "rate":
        return paced_samples_per_s(p, _rates(p, layouts, averaging), round_s)
    return p.samples_per_s(_rates(p, layouts, averaging), round_s)


def best_averaging(p: Problem, layouts: Sequence[Layout]) -> tuple[Averaging, float]:
    """The averaging that scores these clusters highest, and its score (global rings paced by steps on a
    tie); rate pacing's carries no rates yet (``paced`` adds them for the chosen clusters)."""
    best, value = GLOBAL, score(p, layouts)
    for choice in (Averaging(pace="rate"), *(Averaging("groups", m, pace) for m in group_sizes(len(layouts))
                                             for pace in ("steps", "rate"))):
        got = score_with(p, layouts, choice)
        if got > value * (1 + 1e-9):
            best, value = choice, got
        linked = link_every_of(p, layouts, choice) if choice.pace == "rate" else None
        if linked is not None and (got := score_with(p, layouts, linked)) > value * (1 + 1e-9):
            best, value = linked, got
    return best, value


def link_every_of(p: Problem, layouts: Sequence[Layout], averaging: Averaging) -> Averaging | None:
    """``averaging`` (rate pacing) with each cluster's k (``ravq.planner.pacing.link_every``): its part of a
    round (2(m-1)/m x its largest stage's bytes over that node's best link to another cluster) against
    the fastest cluster's round period S/r_max; None when every k is 1 or none is, or in groups mode when the
    takers' groups do not mix every cluster with every other within ``MIX_ROUNDS`` of the slowest's rounds.
    ``best_averaging`` offers it for each rate-paced choice (again since 2026-11-29, when the score came to
    charge what the schedule's slow rings hold back)."""
    if len(layouts) < 2:
        return None
    rates = _rates(p, layouts, averaging)
    top = max(rates, default=0.0)
    if not top > 0:
        return None
    grouped = averaging.mode == "groups" and len(layouts) > averaging.group_size
    factor = p.ring_factor(averaging.group_size if grouped else len(layouts))
    everyone = [n for lay in layouts for n in lay.order]

    def part_s(lay: Layout) -> float:  # each node's best link to another cluster, less the pipeline's traffic
        others = [n for n in everyone if n not in lay.order]
        link = ring_bandwidth(p, lay, list(p.bw_sym[list(lay.order)][:, others].max(axis=1)))
        held = [p.param_span[lay.bounds[j], lay.bounds[j + 1]] for j in range(len(lay.order))]
        return max(factor * h / b if b > 0 else INF for h, b in zip(held, link))
    # rounds by time: a cluster slower than an optimizer step a period takes part when a step of it ends
    # (one whose step outlasts STEP_PERIODS periods is too slow to plan: a tiny share, always stale)
    period = p.sync_every / top
    steps_s = [p.update_every / r if r > 0 else INF for r in rates]
    parts = [max(part_s(lay), t) if t <= STEP_PERIODS * period else INF for lay, t in zip(layouts, steps_s)]
    every = tuple(min(link_every(t, period), MAX_EVERY + 1) if t < INF else MAX_EVERY + 1
                  for t in parts)
    if max(every) <= 1 or max(every) > MAX_EVERY or min(every) > 1:  # all slow: a longer sync_every, not this
        return None
    mode: Mode = "groups" if grouped else "global"  # global rings too: a slow taker's span idles its ring
    mixed = rounds_until_mixed(lambda r, t, j: link_groups(0, r, t, mode, averaging.group_size, j),
                               range(len(layouts)), every, limit=MIX_ROUNDS * max(every) + 1)
    if mixed is None or -(-mixed // max(every)) > MIX_ROUNDS:
        return None
    return replace(averaging, every=every)


def _linked_score(p: Problem, layouts: Sequence[Layout], averaging: Averaging) -> float:
    """Samples/s paced by rate and by link, over the rounds nodes and the simulator run
    (``ravq.planner.pacing.Schedule``, ``GRID_EPOCHS`` epochs of ``LINK_ROUNDS`` x the largest k rounds):
    every cluster trains at its own rate, a round every P = S/r_max; a round's ring lasts its group's T
    (``averaging_round_s`` over the group), and each member holds back for it once T outlasts its lead:
    the span's extra periods plus ``averaging_lead`` steps (the whole T without overlap).  Rings tie the
    clusters together, so the period is P plus the largest mean hold-back of any cluster.  (2026-11-29: until
    then the score took the every-round clusters' round alone, and a fast cluster waiting for a slow taker's
    ring went uncharged: 186 predicted, 67.8 simulated at 1,024 PCs.)"""
    rates = _rates(p, layouts, averaging)
    live = [c for c, r in enumerate(rates) if r > 0]
    if len(live) < 2:
        return p.micro_batch * sum(rates)
    period = p.sync_every / max(rates)
    lead_s = p.averaging_lead / max(rates)
    mode: Mode = "groups" if averaging.mode == "groups" else "global"
    rounds = LINK_ROUNDS * max(averaging.every)
    ring: dict[tuple[int, ...], float] = {}
    held, size, every = dict.fromkeys(live, 0.0), averaging.group_size, averaging.every
    for epoch in range(GRID_EPOCHS):
        schedule = Schedule(lambda r, t, j, e=epoch: link_groups(e, r, t, mode, size, j), live, every)
        for r in range(rounds):
            plan = schedule.at(r)
            for g in plan.groups:
                if g not in ring:
                    ring[g] = averaging_round_s(p, [layouts[c] for c in g])
                for c in g:
                    slack = (plan.span[c] - 1) * period + lead_s if p.overlap_averaging else 0.0
                    held[c] += max(0.0, ring[g] - slack)
    factor = p.ring_factor(size if mode == "groups" else len(live))
    trained = 0.0
    for c in live:  # rounds by time: each trains on at its rate, less what its rings take of its uplinks
        lay = layouts[c]
        ring_bytes = [factor * p.param_span[lay.bounds[j], lay.bounds[j + 1]] for j in range(len(lay.order))]
        trained += shared_rate(p, lay, rates[c], ring_bytes, every[c] * period)
    return p.micro_batch * trained * period / (period + max(held.values()) / (GRID_EPOCHS * rounds))


def round_of(p: Problem, layouts: Sequence[Layout], averaging: Averaging) -> float:
    """A round's length under ``averaging``: its groups' (or one ring's) over the clusters taking part in
    every round (pacing by link: those with k = 1; every cluster otherwise)."""
    if max(averaging.every, default=1) > 1:
        layouts = [lay for lay, k in zip(layouts, averaging.every, strict=True) if k == 1]
    grouped = averaging.mode == "groups" and len(layouts) > averaging.group_size
    return grouped_round_s(p, layouts, averaging.group_size) if grouped else averaging_round_s(p, layouts)


def recut(p: Problem, layouts: Sequence[Layout], averaging: Averaging) -> list[Layout]:
    """The same clusters and node orders, re-cut so that a node's stage holds at most what its slowest link
    to another cluster sends in a shorter round (scales of the current round), when the score gains."""
    layouts = list(layouts)
    best = score_with(p, layouts, averaging)
    t0 = averaging_round_s(p, layouts)
    if len(layouts) < 2 or not 0 < t0 < INF:
        return layouts
    clusters = len(layouts) if averaging.mode == "global" else min(averaging.group_size, len(layouts))
    caps_per_s = p.min_link_out([lay.order for lay in layouts]) / p.ring_factor(clusters)
    for scale in (0.9, 0.75, 0.6, 0.45, 0.3, 0.2, 0.1):
        cand = []
        for lay in layouts:
            value, bounds = p.partition(lay.order, t0 * scale * caps_per_s)
            cand.append(Layout(order=lay.order, bounds=tuple(bounds), bottleneck=value) if bounds else lay)
        got = score_with(p, cand, averaging)
        if got > best * (1 + 1e-9):
            best, layouts = got, cand
    return layouts
