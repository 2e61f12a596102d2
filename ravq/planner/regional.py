"""The planner made tractable for many PCs: plan each region alone, then choose which of the regions'
clusters train together.

``make_plan`` over all PCs takes minutes at 1,024 PCs (docs/simulator.md), so ``regional_plan`` runs it
on each region's PCs alone (links inside a region are fast, so that is where clusters form) and pools
the clusters the regions found.  Which of them should train together is a choice of its own: averaging
holds every cluster to the slowest one's pace and a round lasts as long as its slowest ring link, so
adding a slow cluster, or one behind a slow uplink, can cost more than it brings.  ``best_subset``
searches the subsets of the pool with the cost model (every prefix of the pool sorted by rate, and by
averaging time, each region alone, the union; then clusters added, dropped or swapped one at a time
while that helps), so a plan over more PCs never scores below the best subset it could have kept.
Until issue #26 the choice was only "the union or the best region", and at 1,024 PCs it kept one
region's 16-PC pipeline, below what 256 PCs got.

Averaging is not free between regions (issue #38): every subset is scored with the averaging that suits
it best, global rings or groups of a size that mixes every cluster with every other within three rounds,
rounds paced by steps or by rate (``ravq.planner.grouped``: paced by rate, a slow cluster no longer holds
the others to its pace, so slow clusters are kept when they add samples), and the chosen clusters are
re-cut so that nodes behind slow links to the other clusters hold small stages.  The plan says which
averaging it was scored with (``Plan.averaging``).

Each region is planned by uplink tier (``uplink_tiers``: a PC behind a slow uplink bottlenecks any pipeline
it joins, so it forms clusters with its like), and again on the PCs each plan left (``_passes``): the best
plan of a region's fast PCs leaves out PCs that can still add samples in clusters of their own, paced by
rate and link (issue #38: at 1,024 PCs, 152 PCs train instead of 90).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ravq.config import ClusterPlan, Plan
from ravq.planner.cost import Layout, cluster_rate, fixed_layout
from ravq.planner.grouped import Averaging, averaging_config, best_averaging, paced, recut
from ravq.planner.plans import make_plan
from ravq.planner.problem import Problem
from ravq.planner.types import BlockProfile, NodeProfile, PlanError, Wire

SWAP_POOL = 48
"""Pools up to this many clusters also try swapping a kept cluster for a left-out one."""
TIER_RATIO = 3.0
"""PCs whose uplinks are within this factor of each other are planned together (``uplink_tiers``)."""
PASSES = 4
"""``make_plan`` runs on each region's tier, then on what it left, up to this many times (``_passes``)."""


def regional_plan(nodes: Sequence[NodeProfile], regions: Sequence[str], blocks: Sequence[BlockProfile], *,
                  micro_batch: int, sync_every: int, max_inflight: int | None, overlap_averaging: bool,
                  averaging_lead: int | None, wire: Wire | None = None, effort: float = 1.0,
                  update_every: int = 1) -> Plan:
    """``make_plan`` on each region's PCs alone (``regions[i]`` is ``nodes[i]``'s region), then the
    subset of all the regions' clusters the cost model scores highest (``best_subset``)."""
    if len(regions) != len(nodes):
        raise ValueError(f"regions: one per node, got {len(regions)} for {len(nodes)} nodes")
    settings: dict[str, Any] = {
        "micro_batch": micro_batch,
        "sync_every": sync_every,
        "max_inflight": max_inflight,
        "update_every": update_every,
        "overlap_averaging": overlap_averaging,
        "averaging_lead": averaging_lead,
        "wire": wire,
    }
    parts: list[list[ClusterPlan]] = []
    for region in dict.fromkeys(regions):
        for tier in uplink_tiers([n for n, r in zip(nodes, regions) if r == region]):
            parts += _passes(tier, blocks, effort, settings)
    if not parts:
        raise PlanError("no region's PCs can hold the model")
    chosen, value, averaging = best_subset(parts, nodes, blocks, **settings)
    return Plan(epoch=0, clusters=chosen, predicted_samples_per_s=value,
                averaging=averaging_config(averaging))


def uplink_tiers(nodes: Sequence[NodeProfile]) -> list[list[NodeProfile]]:
    """``nodes`` by uplink (a node's fastest measured link), fastest first, in tiers whose uplinks are within
    ``TIER_RATIO`` of the tier's fastest: a PC behind a slow uplink bottlenecks any pipeline it joins, so it
    forms clusters with its like (the design's clusters of similar link speeds)."""
    def uplink(n: NodeProfile) -> float:
        return max(n.bandwidth_bytes_per_s.values(), default=math.inf)
    tiers: list[list[NodeProfile]] = []
    for n in sorted(nodes, key=lambda n: -uplink(n)):
        if tiers and uplink(n) * TIER_RATIO >= uplink(tiers[-1][0]):
            tiers[-1].append(n)
        else:
            tiers.append([n])
    return tiers


def _passes(nodes: Sequence[NodeProfile], blocks: Sequence[BlockProfile], effort: float,
            settings: dict[str, Any]) -> list[list[ClusterPlan]]:
    """``make_plan``'s clusters of ``nodes``, then of the PCs it left, up to ``PASSES`` times: the clusters a
    region's best plan leaves out can still add samples beside the others (each pass's clusters disjoint)."""
    parts: list[list[ClusterPlan]] = []
    left = list(nodes)
    for _ in range(PASSES):
        try:
            clusters = list(make_plan(left, blocks, effort=effort, **settings)[0].clusters)
        except PlanError:
            break
        parts.append(clusters)
        used = {name for c in clusters for name in c.nodes}
        left = [n for n in left if n.name not in used]
        if not left:
            break
    return parts


def best_subset(
    groups: Sequence[Sequence[ClusterPlan]], nodes: Sequence[NodeProfile], blocks: Sequence[BlockProfile],
    **settings: Any,
) -> tuple[list[ClusterPlan], float, Averaging]:
    """The subset of the clusters (``groups``: disjoint clusters, e.g. one list per region) with the
    highest predicted samples/s under the averaging that suits it best, re-cut for that averaging's
    rounds (``ravq.planner.grouped.recut``); that figure and that averaging.  Deterministic; scores on
    the clusters' nodes only."""
    pool = [c for group in groups for c in group]
    if not pool:
        raise PlanError("best_subset: no clusters to choose from")
    used = {name for c in pool for name in c.nodes}
    p = Problem([n for n in nodes if n.name in used], blocks, **settings)
    layouts = _layouts(p, pool, blocks)
    chooser = _Chooser(p, layouts)
    starts = [frozenset(range(len(pool)))]
    first = 0
    for group in groups:
        starts.append(frozenset(range(first, first + len(group))))
        first += len(group)
    starts += _prefixes(chooser.by_rate()) + _prefixes(chooser.by_averaging())
    best = max(starts, key=lambda s: (chooser.value(s), -len(s), sorted(s)))
    best = chooser.climb(best, swaps=len(pool) <= SWAP_POOL)
    layouts = [layouts[i] for i in sorted(best)]
    averaging, value = best_averaging(p, layouts)
    cut = recut(p, layouts, averaging)
    cut_averaging, cut_value = best_averaging(p, cut)
    if cut_value > value * (1 + 1e-9):
        layouts, averaging, value = cut, cut_averaging, cut_value
    chosen = [ClusterPlan(nodes=[p.names[i] for i in lay.order],
                          cuts=[blocks[b].name for b in lay.bounds[1:-1]]) for lay in layouts]
    return chosen, value, paced(p, layouts, averaging)


def _layouts(p: Problem, pool: Sequence[ClusterPlan], blocks: Sequence[BlockProfile]) -> list[Layout]:
    index = {name: i for i, name in enumerate(p.names)}
    block_index = {b.name: i for i, b in enumerate(blocks)}
    return [fixed_layout(p, tuple(index[n] for n in c.nodes), (0, *(block_index[b] for b in c.cuts), p.B))
            for c in pool]


def _prefixes(order: Sequence[int]) -> list[frozenset[int]]:
    return [frozenset(order[:k]) for k in range(1, len(order) + 1)]


class _Chooser:
    """Scores of subsets of a pool of cluster layouts (cached), and a hill climb over them."""

    def __init__(self, p: Problem, layouts: Sequence[Layout]) -> None:
        self.p, self.layouts = p, list(layouts)
        self._values: dict[frozenset[int], float] = {}

    def value(self, subset: frozenset[int]) -> float:
        if not subset:
            return 0.0
        got = self._values.get(subset)
        if got is None:
            got = self._values[subset] = best_averaging(self.p, [self.layouts[i] for i in sorted(subset)])[1]
        return got

    def by_rate(self) -> list[int]:
        """The pool's clusters, fastest alone first."""
        rates = [cluster_rate(self.p, lay) for lay in self.layouts]
        return sorted(range(len(self.layouts)), key=lambda i: (-rates[i], i))

    def by_averaging(self) -> list[int]:
        """The pool's clusters, shortest part in an averaging round among them all first (held bytes over
        the slowest link to another cluster, the cost model's T_avg per cluster)."""
        slowest = self.p.min_link_out([lay.order for lay in self.layouts])

        def round_s(lay: Layout) -> float:
            held = [self.p.param_span[lay.bounds[j], lay.bounds[j + 1]] for j in range(len(lay.order))]
            return max(h / slowest[n] if slowest[n] > 0 else math.inf for h, n in zip(held, lay.order))
        times = [round_s(lay) for lay in self.layouts]
        return sorted(range(len(self.layouts)), key=lambda i: (times[i], i))

    def climb(self, subset: frozenset[int], *, swaps: bool) -> frozenset[int]:
        """Best-improvement steps (add, drop or, with ``swaps``, exchange one cluster) until none helps."""
        everything = range(len(self.layouts))
        value = self.value(subset)
        while True:
            moves = [subset ^ {i} for i in everything]
            if swaps:
                moves += [subset - {i} | {j} for i in subset for j in everything if j not in subset]
            moves = [m for m in moves if m]
            best = max(moves, key=lambda s: (self.value(s), -len(s), sorted(s)), default=subset)
            if self.value(best) <= value * (1 + 1e-9):
                return subset
            subset, value = best, self.value(best)
