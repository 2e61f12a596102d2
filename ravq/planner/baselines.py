"""What the planner is measured against: Ravnest's own rule, and the exhaustive optimum on small inputs.
Both are scored by the same cost model."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import numpy as np

from ravq.config import Plan
from ravq.planner.cost import Layout, fixed_layout
from ravq.planner.problem import INF, Problem
from ravq.planner.report import explain, memory_error
from ravq.planner.types import GIB, BlockProfile, Explanation, NodeProfile, PlanError, Wire

# ----------------------------------------------------------------------------------------------------
# Ravnest's rule, for comparison


def ravnest_plan(nodes: Sequence[NodeProfile], blocks: Sequence[BlockProfile], *, micro_batch: int,
                 sync_every: int, seed: int = 0, max_clusters: int = 5, population: int = 200,
                 generations: int = 500, mutation_rate: float = 0.01, split: str = "memory",
                 max_inflight: int | None = None, overlap_averaging: bool = False,
                 averaging_lead: int | None = None, wire: Wire | None = None,
                 update_every: int = 1) -> tuple[Plan, Explanation]:
    """Ravnest's planner reimplemented: a genetic algorithm assigns nodes to clusters so that each cluster
    has the model's RAM (penalty 100 x GiB short) and clusters have similar "speed" (sum of RAM/bandwidth);
    each cluster then cuts the model, nodes in listing order, into stages sized in proportion to the
    nodes' RAM (``split="memory"``, as Ravnest's split percentages) or of equal parameter size
    (``split="equal"``, as pippy's split_into_equal_size).  Scored with this module's cost model;
    PlanError when its stages do not fit in memory."""
    p = Problem(nodes, blocks, max_inflight=max_inflight, micro_batch=micro_batch, sync_every=sync_every,
                update_every=update_every, overlap_averaging=overlap_averaging, averaging_lead=averaging_lead,
                wire=wire)
    rng = np.random.default_rng(seed)
    ram = p.mem / GIB
    links = np.where(np.isfinite(p.bw_sym), p.bw_sym, np.nan)
    bandwidth = np.nan_to_num(np.nanmedian(links, axis=1) if p.n > 1 else np.ones(1), nan=1.0) / 1e6
    need = float(p.mem_span(1)[0, p.B]) / GIB
    genes = _ravnest_ga(ram, ram / np.maximum(bandwidth, 1e-9), need, rng, max_clusters=max_clusters,
                        population=population, generations=generations, mutation_rate=mutation_rate)
    layouts = []
    for c in sorted(set(genes.tolist())):
        order = tuple(int(i) for i in np.flatnonzero(genes == c))
        if len(order) > p.B:
            raise PlanError(f"ravnest rule: a cluster of {len(order)} nodes cannot split {p.B} blocks")
        if split == "equal":
            weights, shares = p.param, np.ones(len(order))
        else:
            weights, shares = np.diagonal(p.mem_span(len(order)), offset=1), p.mem[list(order)]
        layouts.append(fixed_layout(p, order, _proportional_bounds(weights, shares)))
    return explain(p, layouts, {})


def _ravnest_ga(ram: np.ndarray, speed: np.ndarray, need: float, rng: np.random.Generator, *,
                max_clusters: int, population: int, generations: int, mutation_rate: float) -> np.ndarray:
    n = len(ram)
    if n == 1:
        return np.zeros(1, dtype=int)
    pop = rng.integers(0, max_clusters, size=(population, n))
    best, best_fit = pop[0], INF
    for _ in range(generations):
        fit = _ravnest_fitness(pop, ram, speed, need, max_clusters)
        i = int(np.argmin(fit))
        if fit[i] < best_fit:
            best, best_fit = pop[i].copy(), float(fit[i])
        pairs = population // 2
        tournaments = rng.integers(0, population, size=(pairs, 2, 5))
        winners = np.take_along_axis(tournaments, np.argmin(fit[tournaments], axis=2)[..., None], 2)[..., 0]
        mum, dad = pop[winners[:, 0]], pop[winners[:, 1]]
        point = rng.integers(1, n, size=pairs)[:, None]
        head = np.arange(n)[None, :] < point
        children = np.concatenate([np.where(head, mum, dad), np.where(head, dad, mum)])
        mutate = rng.random(children.shape) < mutation_rate
        pop = np.where(mutate, rng.integers(0, max_clusters, size=children.shape), children)
    return best


def _ravnest_fitness(pop: np.ndarray, ram: np.ndarray, speed: np.ndarray, need: float,
                     max_clusters: int) -> np.ndarray:
    member = pop[:, :, None] == np.arange(max_clusters)[None, None, :]        # (pop, node, cluster)
    present = member.any(axis=1)
    cluster_ram = np.einsum("pnc,n->pc", member, ram)
    cluster_speed = np.einsum("pnc,n->pc", member, speed)
    short = np.where(present & (cluster_ram <= need), need - cluster_ram, 0.0).sum(axis=1)
    spread = (np.where(present, cluster_speed, -INF).max(axis=1)
              - np.where(present, cluster_speed, INF).min(axis=1))
    return 100 * short + spread


def _proportional_bounds(weights: np.ndarray, shares: np.ndarray) -> tuple[int, ...]:
    """Stage bounds giving stage i about shares[i] / sum(shares) of the total weight, one block at least."""
    cum = np.concatenate([[0.0], np.cumsum(weights)])
    targets = cum[-1] * np.cumsum(shares)[:-1] / shares.sum()
    bounds, count = [0], len(weights)
    for i, target in enumerate(targets, start=1):
        lo, hi = bounds[-1] + 1, count - (len(shares) - i)
        bounds.append(lo + int(np.argmin(np.abs(cum[lo:hi + 1] - target))))
    return (*bounds, count)


# ----------------------------------------------------------------------------------------------------
# The exhaustive optimum, to check the planner on small inputs


def optimum_plan(nodes: Sequence[NodeProfile], blocks: Sequence[BlockProfile], *, micro_batch: int,
                 sync_every: int, max_inflight: int | None = None, overlap_averaging: bool = False,
                 averaging_lead: int | None = None, wire: Wire | None = None,
                 allow_idle: bool = True, update_every: int = 1) -> tuple[Plan, Explanation]:
    """The best plan under the cost model by enumerating every partition of the nodes into clusters (and
    idle nodes), every node order and every set of cuts.  Exponential: for about 8 nodes and 10 blocks."""
    p = Problem(nodes, blocks, max_inflight=max_inflight, micro_batch=micro_batch, sync_every=sync_every,
                update_every=update_every, overlap_averaging=overlap_averaging, averaging_lead=averaging_lead,
                wire=wire)
    top: dict[tuple[int, ...], float] = {}
    for size in range(1, p.n + 1):
        for members in itertools.combinations(range(p.n), size):
            top[members] = max((float(r.max()) for r, _ in _layout_chunks(p, members)), default=0.0)
    partitions = []
    for clusters in _partitions(list(range(p.n)), allow_idle):
        bound = p.micro_batch * sum(top[c] for c in clusters)
        if bound > 0 and all(top[c] > 0 for c in clusters):
            partitions.append((bound, clusters))
    partitions.sort(key=lambda bc: -bc[0])
    best, best_layouts = 0.0, None
    for bound, clusters in partitions:
        if bound <= best * (1 + 1e-12):
            break
        value, layouts = _best_for_partition(p, clusters)
        if value > best:
            best, best_layouts = value, layouts
    if best_layouts is None:
        raise memory_error(p)
    used = {i for lay in best_layouts for i in lay.order}
    return explain(p, best_layouts, {i: "left out by the optimum" for i in range(p.n) if i not in used})


def _partitions(items: list[int], allow_idle: bool) -> list[list[tuple[int, ...]]]:
    """Every set partition of ``items`` into clusters; with ``allow_idle`` some items may stay out."""
    out: list[list[tuple[int, ...]]] = []

    def rec(i: int, groups: list[list[int]]) -> None:
        if i == len(items):
            if groups:
                out.append(sorted(tuple(g) for g in groups))
            return
        x = items[i]
        for g in groups:
            g.append(x)
            rec(i + 1, groups)
            g.pop()
        groups.append([x])
        rec(i + 1, groups)
        groups.pop()
        if allow_idle:
            rec(i + 1, groups)

    rec(0, [])
    return out


def _layout_chunks(p: Problem, members: tuple[int, ...],
                   chunk: int = 4096) -> Iterator[tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]]:
    """(rates, meta) per chunk of every (order, cuts) of a cluster; meta = (orders, bounds) arrays."""
    k = len(members)
    combos = list(itertools.combinations(range(1, p.B), k - 1))
    cuts = np.array(combos, dtype=int).reshape(len(combos), k - 1)
    if len(cuts) == 0:
        return
    bounds = np.concatenate([np.zeros((len(cuts), 1), int), cuts, np.full((len(cuts), 1), p.B)], axis=1)
    s, e = bounds[:, :-1], bounds[:, 1:]
    work, memory = p.work_span[s, e], p.mem_span(k)[s, e]                 # (cuts, k)
    act, grad = p.act[cuts], p.grad[cuts]                                    # (cuts, k - 1)
    perms = np.array(list(itertools.permutations(members)), dtype=int)
    per_chunk = max(1, chunk // len(cuts))
    for lo in range(0, len(perms), per_chunk):
        o = perms[lo:lo + per_chunk]  # (orders, k)
        t = (
            work[None] / p.flops[o][:, None, :]
            + p.message[o[:, None, :], s[None]]
            + p.message[o[:, None, :], e[None]]
            + p.pipelined[o][:, None, :] * p.piece[s, e][None]
        )
        fits = (memory[None] <= p.mem[o][:, None, :]).all(axis=2)
        worst, cycle = t.max(axis=2), t.sum(axis=2)
        if k > 1:
            a, b = o[:, :-1], o[:, 1:]
            transfer = (
                act[None] * p.fwd_s_per_byte[a, b][:, None, :]
                + grad[None] * p.bwd_s_per_byte[a, b][:, None, :]
            )
            worst = np.maximum(worst, (transfer + p.lat[a, b][:, None, :]).max(axis=2))
            cycle = cycle + (transfer + 2 * p.lat[a, b][:, None, :]).sum(axis=2)
        rate = np.minimum(1.0 / np.maximum(worst, 1e-12), p.inflight_for(k) / np.maximum(cycle, 1e-12))
        rates = np.where(fits, rate, 0.0)
        yield rates.ravel(), (np.repeat(o, len(cuts), axis=0), np.tile(bounds, (len(o), 1)))


def _best_for_partition(p: Problem, clusters: list[tuple[int, ...]]) -> tuple[float, list[Layout]]:
    """Exact best layouts for a fixed partition: a Pareto front of (averaging time, rate) per cluster,
    then the best averaging-time threshold."""
    slowest = p.min_link_out(clusters)
    factor = p.ring_factor(len(clusters))
    fronts = []
    for members in clusters:
        front: list[tuple[float, float, Layout]] = []
        for rates, (orders, bounds) in _layout_chunks(p, members):
            held = p.param_span[bounds[:, :-1], bounds[:, 1:]]
            with np.errstate(divide="ignore", invalid="ignore"):
                t = (factor * held / slowest[orders]).max(axis=1) if factor else np.zeros(len(rates))
            t = np.nan_to_num(t, nan=0.0)
            keep = np.flatnonzero(rates > 0)
            idx = keep[np.lexsort((-rates[keep], t[keep]))]
            better = rates[idx] > np.maximum.accumulate(np.concatenate([[0.0], rates[idx]]))[:-1]
            front = _pareto(front + [
                (float(t[i]), float(rates[i]), Layout(order=tuple(int(x) for x in orders[i]),
                                                       bounds=tuple(int(x) for x in bounds[i]),
                                                       bottleneck=1.0 / rates[i]))
                for i in idx[better]])
        fronts.append(front)
    best, best_layouts = 0.0, []
    for threshold in sorted({t for front in fronts for t, _, _ in front}):
        chosen = [
            max((f for f in front if f[0] <= threshold), key=lambda f: f[1], default=None) for front in fronts
        ]
        if any(c is None for c in chosen):
            continue
        value = p.samples_per_s([c[1] for c in chosen if c], threshold)
        if value > best:
            best, best_layouts = value, [c[2] for c in chosen if c]
    return best, best_layouts


def _pareto(points: list[tuple[float, float, Layout]]) -> list[tuple[float, float, Layout]]:
    """Points with a strictly higher rate than every point of smaller or equal averaging time."""
    front: list[tuple[float, float, Layout]] = []
    for point in sorted(points, key=lambda f: (f[0], -f[1])):
        if not front or point[1] > front[-1][1]:
            front.append(point)
    return front
