"""From layouts to what users see: the ``Plan`` and its ``Explanation``, and errors that say how much
memory is missing."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ravq.config import ClusterPlan, Plan
from ravq.planner.cost import Layout, cluster_rate
from ravq.planner.grouped import (
    GLOBAL,
    Averaging,
    averaging_config,
    paced_samples_per_s,
    round_of,
    score_with,
)
from ravq.planner.problem import Problem
from ravq.planner.types import GIB, ClusterReport, Explanation, PlanError, StageReport, size_text


def explain(p: Problem, layouts: Sequence[Layout], idle: dict[int, str],
            averaging: Averaging = GLOBAL) -> tuple[Plan, Explanation]:
    """The plan of these layouts (clusters ordered by their first node's name) and its explanation;
    ``idle`` maps the nodes left out to the reason; the clusters average as ``averaging`` says.  In groups
    the clusters keep their order: a cluster's place in the plan is its place on the grid."""
    grouped = averaging.mode == "groups" and len(layouts) > averaging.group_size
    if not grouped and averaging.pace != "rate" and not averaging.every:  # else k and rates in that order
        layouts = sorted(layouts, key=lambda lay: p.names[lay.order[0]])
    peers = averaging.group_size if grouped else len(layouts)
    reports = []
    for lay in layouts:
        k = len(lay.order)
        stages = []
        for j, node in enumerate(lay.order):
            s, e = lay.bounds[j], lay.bounds[j + 1]
            link = float(p.link_times(node, lay.order[j + 1])[e]) if j < k - 1 else None
            stages.append(StageReport(
                node=p.names[node], first_block=s, last_block=e - 1,
                compute_s=p.stage_s(node, s, e) + p.averaging_cpu_s(node, s, e, peers), link_s=link,
                memory_bytes=int(p.mem_span(k)[s, e]), memory_available=int(p.mem[node]),
                param_bytes=int(p.param_span[s, e])))
        reports.append(ClusterReport(nodes=[p.names[i] for i in lay.order], stages=stages,
                                     rate_micro_batches_per_s=cluster_rate(p, lay, peers)))
    round_s = round_of(p, layouts, averaging)  # pacing by link: over the clusters in every round
    rates = [r.rate_micro_batches_per_s for r in reports]
    explanation = Explanation(
        clusters=reports, block_names=[b.name for b in p.blocks], micro_batch=p.micro_batch,
        sync_every=p.sync_every, idle={p.names[i]: why for i, why in sorted(idle.items())},
        averaging_s=round_s, samples_per_s_without_averaging=p.micro_batch * sum(rates),
        samples_per_s=(score_with(p, layouts, averaging) if averaging.every  # the schedule's hold-backs
                       else paced_samples_per_s(p, rates, round_s) if averaging.pace == "rate"
                       else p.samples_per_s(rates, round_s)))
    plan = Plan(epoch=0, clusters=[ClusterPlan(nodes=[p.names[i] for i in lay.order],
                                      cuts=[p.blocks[b].name for b in lay.bounds[1:-1]]) for lay in layouts],
                predicted_samples_per_s=explanation.samples_per_s,
                averaging=averaging_config(averaging)
                if grouped or averaging.pace == "rate" or averaging.every else None)
    return plan, explanation


def memory_error(p: Problem) -> PlanError:
    blocks = np.diagonal(p.mem_span(1), offset=1)
    big = int(np.argmax(blocks))
    largest = int(np.argmax(p.mem))
    if blocks[big] > p.mem[largest]:
        return PlanError(
            f"no plan fits in memory: block {p.blocks[big].name!r} alone needs {blocks[big] / GIB:.3g} GiB "
            f"(parameters, gradients, optimizer state, stashes) but the largest node, {p.names[largest]}, "
            f"has {p.mem[largest] / GIB:.3g} GiB: {(blocks[big] - p.mem[largest]) / GIB:.3g} GiB missing"
        )
    mems = np.sort(p.mem)[::-1]
    shortfall = min(p.model_memory(k) - float(mems[:k].sum()) for k in range(1, p.n + 1))
    if shortfall > 0:
        return PlanError(
            f"no plan fits in memory: the model needs at least {p.model_memory(1) / GIB:.3g} GiB "
            f"(parameters, gradients, optimizer state, stashes for in-flight micro-batches) and the nodes "
            f"have {p.mem.sum() / GIB:.3g} GiB in all, less than any pipeline of them needs: "
            f"{size_text(shortfall)} missing"
        )
    extra = min(_packing_shortfall(p, k) for k in range(1, p.n + 1))
    return PlanError(
        f"no plan fits in memory: the nodes have {p.mem.sum() / GIB:.3g} GiB in all but the blocks cannot be "
        f"cut into contiguous stages that fit: about {size_text(extra)} more on each node is missing")


def _packing_shortfall(p: Problem, k: int) -> float:
    """Extra memory per node that lets a greedy packing into the k largest nodes hold the model."""
    order = sorted(range(p.n), key=lambda i: (-p.mem[i], i))[:k]
    span = p.mem_span(k)

    def fits(extra: float) -> bool:
        start = 0
        for node in order:
            if start < p.B and span[start, start + 1] > p.mem[node] + extra:
                return False
            end = start
            while end < p.B and span[start, end + 1] <= p.mem[node] + extra:
                end += 1
            start = end
        return start == p.B

    lo, hi = 0.0, float(span[0, p.B])
    for _ in range(30):
        lo, hi = (lo, (lo + hi) / 2) if fits((lo + hi) / 2) else ((lo + hi) / 2, hi)
    return hi

