"""The planner's entry points: plan from profiles (``make_plan``), cut fixed clusters (``cut_plan``),
judge any plan (``evaluate_plan``), and plans without profiles (``even_plan``).

Models of more than ``_COARSE_BLOCKS`` blocks are searched first with runs of blocks merged into that
many, then refined on the real blocks."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Required, TypedDict, Unpack

import numpy as np

from ravq.config import ClusterPlan, Plan, Topology, TrainingConfig
from ravq.config.batch import update_every as micro_batches_per_step
from ravq.planner.cost import Layout, coarsen, fixed_layout
from ravq.planner.grouped import averaging_of
from ravq.planner.problem import Problem
from ravq.planner.report import explain, memory_error
from ravq.planner.search import Search, explore
from ravq.planner.types import GIB, BlockProfile, Explanation, NodeProfile, PlanError, Wire, size_text


def training_settings(training: TrainingConfig, clusters: int | None = None) -> dict[str, Any]:
    """The planner's settings (keyword arguments of ``make_plan``, ``evaluate_plan`` and the rest) as a
    topology's ``training`` section sets them: the same cost model wherever a plan is made or judged.
    ``clusters``: how many the plan has, when fixed; a stated ``batch`` then gives the micro-batches per
    step, which bound the window.  Unknown (a search over clusters): one, the widest window."""
    per_step = training.update_every if training.batch is None else 1
    if clusters is not None:
        per_step = micro_batches_per_step(training, clusters)
    return {"micro_batch": training.micro_batch, "sync_every": training.sync_every, "update_every": per_step,
            "max_inflight": training.max_inflight, "overlap_averaging": training.overlap_averaging,
            "averaging_lead": training.averaging_lead,
            "wire": Wire.of(training.compress.pipeline, training.compress.ring, training.compress.int8_block,
                            training.average_optimizer_state)}


class CostSettings(TypedDict, total=False):
    """The cost model's settings, as ``cut_plan`` and ``evaluate_plan`` take them (``training_settings``
    makes them from a topology).  ``max_inflight`` None: a k-stage cluster keeps k micro-batches in flight,
    at most ``update_every`` (micro-batches per step) when that is above 1."""

    micro_batch: Required[int]
    sync_every: Required[int]
    max_inflight: int | None
    update_every: int
    overlap_averaging: bool
    averaging_lead: int | None
    wire: Wire | None


class PlanSettings(CostSettings, total=False):
    """The search's settings, as ``make_plan`` and ``plan_candidates`` take them.  ``allow_idle``: nodes may
    be left out when that predicts more samples/s (nodes that cannot hold any block always are).
    ``effort`` scales the search budget (about one second at 1.0)."""

    max_clusters: int | None
    allow_idle: bool
    effort: float


def make_plan(nodes: Sequence[NodeProfile], blocks: Sequence[BlockProfile],
              **settings: Unpack[PlanSettings]) -> tuple[Plan, Explanation]:
    """Clusters, node order and cuts maximising predicted samples/s; every stage fits its node's memory.

    Deterministic.  Raises PlanError, saying how much memory is missing, when nothing fits.
    """
    return plan_candidates(nodes, blocks, count=1, **settings)[0]


def plan_candidates(nodes: Sequence[NodeProfile], blocks: Sequence[BlockProfile], *, count: int,
                    **settings: Unpack[PlanSettings]) -> list[tuple[Plan, Explanation]]:
    """The ``count`` best distinct plans the search found, best predicted first (the first is
    ``make_plan``'s); for judging them another way, e.g. by simulation (``ravq plan --simulate``)."""
    if count < 1:
        raise PlanError(f"count: must be >= 1, got {count}")
    p, search, results, usable, idle = _search(nodes, blocks, **settings)
    return _explained(p, search, results, usable, idle, count)


def _explained(
    p: Problem,
    search: Search,
    results: list[tuple[float, list[tuple[int, ...]]]],
    usable: list[int],
    idle: dict[int, str],
    count: int,
) -> list[tuple[Plan, Explanation]]:
    ranked = sorted(results, key=lambda r: (r[0], [(-len(c), c) for c in r[1]]), reverse=True)
    if not ranked or ranked[0][0] <= 0:
        raise memory_error(p)
    out, seen = [], set()
    for value, clusters in ranked:
        key = tuple(sorted(tuple(sorted(c)) for c in clusters))
        if value <= 0 or key in seen:
            continue
        seen.add(key)
        layouts = search.tune_averaging(clusters)
        used = {i for lay in layouts for i in lay.order}
        left = dict(idle)
        left.update({i: "leaving it out predicts more samples/s" for i in usable if i not in used})
        out.append(explain(p, layouts, left))
        if len(out) == count:
            break
    return out


def _search(
    nodes: Sequence[NodeProfile],
    blocks: Sequence[BlockProfile],
    *,
    micro_batch: int,
    sync_every: int,
    max_clusters: int | None = None,
    max_inflight: int | None = None,
    update_every: int = 1,
    overlap_averaging: bool = False,
    averaging_lead: int | None = None,
    allow_idle: bool = True,
    effort: float = 1.0,
    wire: Wire | None = None,
) -> tuple[Problem, Search, list[tuple[float, list[tuple[int, ...]]]], list[int], dict[int, str]]:
    p = Problem(nodes, blocks, max_inflight=max_inflight, micro_batch=micro_batch, sync_every=sync_every,
                overlap_averaging=overlap_averaging, averaging_lead=averaging_lead, wire=wire,
                update_every=update_every)
    usable, idle = _usable_nodes(p)
    if not usable or (idle and not allow_idle):
        raise memory_error(p)
    fits = int(p.mem[usable].sum() // p.model_memory(1))
    limit = max(1, min(len(usable), fits, max_clusters or len(usable)))
    if p.B > _COARSE_BLOCKS:
        coarse = Problem(nodes, coarsen(blocks, _COARSE_BLOCKS), max_inflight=max_inflight,
                          micro_batch=micro_batch, sync_every=sync_every, overlap_averaging=overlap_averaging,
                          averaging_lead=averaging_lead, wire=wire, update_every=update_every)
        rough = Search(
            coarse, usable=usable, max_clusters=limit, allow_idle=allow_idle, budget_s=0.8 * effort
        )
        found = [c for v, c in explore(rough) if v > 0] or [rough.fill(usable)]
        search = Search(p, usable=usable, max_clusters=limit, allow_idle=allow_idle, budget_s=0.8 * effort,
                         hints=rough.known_orders())
        results = [search.improve(c, search.p.ops + (search.budget - search.p.ops) // (2 - i))
                   for i, c in enumerate(found[:2])]
    else:
        search = Search(p, usable=usable, max_clusters=limit, allow_idle=allow_idle, budget_s=1.5 * effort)
        results = explore(search)
    return p, search, results, usable, idle


_COARSE_BLOCKS = 24
"""Models with more blocks are first searched with runs of blocks merged into this many."""


def _usable_nodes(p: Problem) -> tuple[list[int], dict[int, str]]:
    smallest = float(np.diagonal(p.mem_span(1), offset=1).min())
    usable = [i for i in range(p.n) if p.mem[i] >= smallest]
    idle = {i: f"cannot hold even the smallest block ({smallest / GIB:.3g} GiB needed, "
               f"{p.mem[i] / GIB:.3g} GiB available)" for i in range(p.n) if p.mem[i] < smallest}
    return usable, idle


def cut_plan(
    clusters: Sequence[Sequence[str]],
    nodes: Sequence[NodeProfile],
    blocks: Sequence[BlockProfile],
    **settings: Unpack[CostSettings],
) -> tuple[Plan, Explanation]:
    """The best cuts for clusters and stage orders the user fixed (node names in stage order)."""
    p = Problem(nodes, blocks, **settings)
    index = {name: i for i, name in enumerate(p.names)}
    layouts = []
    for c, names in enumerate(clusters):
        unknown = [n for n in names if n not in index]
        if unknown:
            raise PlanError(f"cluster {c}: no profile for node {unknown[0]!r}")
        order = tuple(index[n] for n in names)
        bottleneck, bounds = p.partition(order)
        if not bounds:
            need, have = p.model_memory(len(order)), float(p.mem[list(order)].sum())
            raise PlanError(
                f"cluster {c} ({', '.join(names)}): its blocks do not fit in its nodes' memory in this "
                f"order: the model needs {size_text(need)}, the nodes have {size_text(have)}"
                + (f": {size_text(need - have)} missing" if need > have else "")
            )
        layouts.append(Layout(order=order, bounds=tuple(bounds), bottleneck=bottleneck))
    used = {i for lay in layouts for i in lay.order}
    return explain(p, layouts, {i: "not in any cluster of the topology" for i in range(p.n) if i not in used})


def evaluate_plan(
    plan: Plan,
    nodes: Sequence[NodeProfile],
    blocks: Sequence[BlockProfile],
    **settings: Unpack[CostSettings],
) -> Explanation:
    """The cost model's verdict on any plan (hand-written, even or Ravnest's); PlanError if it does not
    fit."""
    p = Problem(nodes, blocks, **settings)
    index = {name: i for i, name in enumerate(p.names)}
    block_index = {b.name: i for i, b in enumerate(blocks)}
    layouts = []
    for c, cluster in enumerate(plan.clusters):
        missing = [n for n in cluster.nodes if n not in index] + [
            b for b in cluster.cuts if b not in block_index
        ]
        if missing:
            raise PlanError(f"clusters[{c}]: no profile for {missing[0]!r}")
        bounds = (0, *(block_index[b] for b in cluster.cuts), p.B)
        if any(b >= e for b, e in itertools.pairwise(bounds)):
            raise PlanError(f"clusters[{c}].cuts: cuts must be increasing and leave every stage a block")
        layouts.append(fixed_layout(p, tuple(index[n] for n in cluster.nodes), bounds))
    idle = {i: "not in the plan" for i in range(p.n) if not any(i in lay.order for lay in layouts)}
    return explain(p, layouts, idle, averaging_of(plan.averaging))[1]


def topology_clusters(topology: Topology) -> list[list[str]]:
    """Node names per cluster in stage order, from the topology (one cluster when none is set)."""
    nodes = [n for n in topology.nodes if not n.standby]  # standbys wait outside the plan
    if all(n.cluster is None for n in nodes):
        return [[n.name for n in nodes]]
    clusters: dict[int, list[tuple[int, int, str]]] = {}
    for i, n in enumerate(nodes):
        assert n.cluster is not None   # the topology sets it on every training node or on none
        clusters.setdefault(n.cluster, []).append((n.stage if n.stage is not None else i, i, n.name))
    return [[name for _, _, name in sorted(members)] for _, members in sorted(clusters.items())]


def even_plan(topology_nodes_by_cluster: Sequence[Sequence[str]], candidate_cuts: Sequence[str]) -> Plan:
    """Without profiles: each cluster's candidate cuts spread evenly over its nodes (1..len+1 stages)."""
    clusters = []
    slots = len(candidate_cuts) + 1
    for c, names in enumerate(topology_nodes_by_cluster):
        k = len(names)
        if not 1 <= k <= slots:
            raise PlanError(f"cluster {c}: {k} stages need 0..{k - 1} cut points; the model offers "
                            f"{len(candidate_cuts)} (at most {slots} stages)")
        cuts = [candidate_cuts[round(i * slots / k) - 1] for i in range(1, k)]
        clusters.append(ClusterPlan(nodes=list(names), cuts=cuts))
    if not clusters:
        raise PlanError("even_plan: no clusters given")
    return Plan(epoch=0, clusters=clusters)

