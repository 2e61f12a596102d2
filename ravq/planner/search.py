"""The search behind ``make_plan``: deterministic, its work counted in DP steps rather than wall time.

1. Starting points, from every pool of well-linked nodes (all nodes, and the groups joined by links of at
   least each speed present): clusters for several cluster counts (seeded far apart in link speed and
   grown with their best-linked nodes, or memory first, or dealt out in snake order), as many clusters as
   memory allows ("fill"), and one cluster grown fastest node first, best prefix kept ("ladder").
2. A cluster's cuts come from the cost model's exact dynamic programme; its node order is exhaustive when
   small, else seed orders improved by moving single nodes to their best position (one forward and one
   backward pass price every position at once).
3. Local search from the best starting points: nodes move or swap between clusters, start a cluster or
   go idle; clusters merge or go idle.
4. Finally, pipeline speed is traded for a shorter averaging round where the total gains.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from ravq.planner.cost import Layout, averaging_round_s, score
from ravq.planner.problem import INF, Problem

Clusters = list[tuple[int, ...]]


class Search:
    """Deterministic heuristic search over partitions, orders and cuts of one problem.

    ``layout`` caches, per set of nodes, the best order found so far; ``improve`` moves nodes between
    clusters.  Work is counted in DP stage steps against a budget, never in wall time, so the same input
    always gives the same plan."""

    def __init__(self, p: Problem, *, usable: list[int], max_clusters: int, allow_idle: bool,
                 budget_s: float, hints: dict[tuple[int, ...], tuple[int, ...]] | None = None) -> None:
        self.p, self.usable, self.max_clusters, self.allow_idle = p, usable, max_clusters, allow_idle
        self.budget = p.ops + int(budget_s / p.op_cost_s)
        self.exhaustive = 5 if p.op_cost_s < 25e-6 else 4
        """Clusters up to this many nodes try every order."""
        self.hints = hints or {}
        self._best: dict[tuple[int, ...], Layout | None] = {}
        self._full: set[tuple[int, ...]] = set()
        self.need = [0.0] + [p.model_memory(k) for k in range(1, p.n + 1)]

    def known_orders(self) -> dict[tuple[int, ...], tuple[int, ...]]:
        """The best order found for every set of nodes that fits."""
        return {key: lay.order for key, lay in self._best.items() if lay is not None}

    def spent(self) -> bool:
        return self.p.ops >= self.budget

    # --- one cluster

    def layout(self, members: Sequence[int], full: bool = False) -> Layout | None:
        """Best layout found for this set of nodes; ``full`` searches its orders thoroughly (once)."""
        key = tuple(sorted(members))
        if key in self._full or (not full and key in self._best):
            return self._best[key]
        known = self._best.get(key)
        orders = self._seed_orders(key) + ([known.order] if known else [])
        small = len(key) <= self.exhaustive
        if small:
            orders = list(itertools.permutations(key))
        value, order = self._best_of(orders)
        if full and order is not None and not small:
            value, order = self._improve_order(order, value)
        if full or small:
            self._full.add(key)
        self._store(key, order, value)
        return self._best[key]

    def offer(self, order: tuple[int, ...]) -> None:
        """Evaluate one order of a set and keep it if it beats what is known for that set."""
        key = tuple(sorted(order))
        known = self._best.get(key)
        value = self.p.bottleneck(order, known.bottleneck if known else INF)
        self._store(key, order, value)

    def _store(self, key: tuple[int, ...], order: tuple[int, ...] | None, value: float) -> None:
        known = self._best.get(key)
        if order is not None and math.isfinite(value) and (known is None or value < known.bottleneck):
            bottleneck, bounds = self.p.partition(order)
            self._best[key] = Layout(order=tuple(order), bounds=tuple(bounds), bottleneck=bottleneck)
        else:
            self._best.setdefault(key, None)

    def _best_of(self, orders: Sequence[tuple[int, ...]]) -> tuple[float, tuple[int, ...] | None]:
        best, best_order = INF, None
        for order in dict.fromkeys(orders):
            value = self.p.bottleneck(order, best)
            if value < best:
                best, best_order = value, order
        return best, best_order

    def _seed_orders(self, key: tuple[int, ...]) -> list[tuple[int, ...]]:
        p = self.p
        by_mem = tuple(sorted(key, key=lambda i: (-p.mem[i], i)))
        ends = by_mem[0::2] + by_mem[1::2][::-1]        # largest memory at both ends, where embeddings sit
        chain = [by_mem[0]]
        rest = list(by_mem[1:])
        while rest:
            nxt = max(rest, key=lambda i: p.bw_sym[chain[-1], i])
            chain.append(nxt)
            rest.remove(nxt)
        seeds = [ends, tuple(chain), by_mem, tuple(sorted(key, key=lambda i: (-p.flops[i], i)))]
        return seeds + ([self.hints[key]] if key in self.hints else [])

    def _improve_order(self, order: tuple[int, ...], value: float) -> tuple[float, tuple[int, ...]]:
        """First-improvement moves of one node to its best position (and, in small clusters, swaps of
        two nodes) until none helps."""
        k = len(order)
        swaps = list(itertools.combinations(range(k), 2)) if k <= 8 else []
        improved = True
        while improved and not self.spent():
            improved = False
            for x in order:
                rest = tuple(i for i in order if i != x)
                values = self.p.insertions(rest, x)
                pos = int(np.argmin(values))
                if values[pos] < value * (1 - 1e-9):
                    value, order, improved = values[pos], rest[:pos] + (x,) + rest[pos:], True
            for i, j in swaps:
                cand = list(order)
                cand[i], cand[j] = cand[j], cand[i]
                v = self.p.bottleneck(cand, value * (1 - 1e-9))
                if v < value:
                    value, order, improved = v, tuple(cand), True
        return value, order

    # --- partitions

    def value(self, clusters: Clusters, full: bool = False) -> float:
        """Predicted samples/s; a cluster whose blocks do not fit counts as idle nodes (if allowed)."""
        layouts = [self.layout(c, full) for c in clusters]
        fitting = [lay for lay in layouts if lay is not None]
        if not fitting or (len(fitting) < len(layouts) and not self.allow_idle):
            return 0.0
        return score(self.p, fitting)

    def fitting(self, clusters: Clusters) -> Clusters:
        return [c for c in clusters if self.layout(c) is not None]

    def construct(self, pool: Sequence[int], count: int, style: str) -> Clusters:
        """``count`` clusters of the ``pool``'s nodes, seeded far apart in link speed and grown with their
        best-linked nodes ("link"), or with the nodes their memory still lacks first ("memory"); or dealt
        out largest memory first in snake order, links ignored ("snake")."""
        p = self.p
        nodes = sorted(pool, key=lambda i: (-p.mem[i], -p.flops[i], i))
        if style == "snake":
            rows = [nodes[i:i + count][::(-1) ** (i // count)] for i in range(0, len(nodes), count)]
            return sorted(tuple(sorted(row[c] for row in rows if c < len(row))) for c in range(count))
        seeds = [nodes[0]]
        nearest = p.bw_sym[:, nodes[0]].copy()          # fastest link of each node to a seed
        while len(seeds) < count:
            seeds.append(
                min((i for i in nodes if i not in seeds), key=lambda i: (_bucket(nearest[i]), -p.mem[i]))
            )
            nearest = np.maximum(nearest, p.bw_sym[:, seeds[-1]])
        clusters = [[s] for s in seeds]
        slowest = p.bw_sym[:, seeds].copy()             # slowest link of each node into each cluster
        mem, flops = p.mem[seeds].copy(), p.flops[seeds].copy()
        for x in nodes:
            if x in seeds:
                continue
            short = np.array([mem[c] < self.need[len(clusters[c])] for c in range(count)], dtype=float)
            link = np.array([_bucket(v) for v in slowest[x]])
            keys = (-flops, short, link) if style == "link" else (-flops, link, short)
            c = int(np.lexsort(keys)[-1])
            clusters[c].append(x)
            mem[c] += p.mem[x]
            flops[c] += p.flops[x]
            slowest[:, c] = np.minimum(slowest[:, c], p.bw_sym[:, x])
        return sorted(tuple(sorted(c)) for c in clusters)

    def fill(self, pool: Sequence[int]) -> Clusters:
        """As many clusters of the ``pool``'s nodes as memory allows: each starts with the largest free node
        and takes the best-linked (then largest) free nodes until its blocks fit.  Leftovers stay idle if
        allowed."""
        p = self.p
        free = sorted(pool, key=lambda i: (-p.mem[i], -p.flops[i], i))
        clusters: Clusters = []
        while free:
            cluster = [free.pop(0)]
            while self.layout(cluster) is None and free:
                x = max(free, key=lambda i: (_bucket(p.bw_sym[i, cluster].min()), p.mem[i], p.flops[i], -i))
                cluster.append(x)
                free.remove(x)
            if self.layout(cluster) is not None or not clusters:
                clusters.append(tuple(sorted(cluster)))
            elif not self.allow_idle:
                clusters[-1] = tuple(sorted(clusters[-1] + tuple(cluster)))
        return sorted(clusters)

    def ladder(self, pool: Sequence[int]) -> Clusters:
        """One cluster grown from the pool's nodes, fastest first (well-linked before poorly linked), each
        inserted at its best position; the best prefix is kept."""
        p = self.p
        linked = {
            i: _bucket(float(np.median(p.bw_sym[i, [j for j in pool if j != i]]))) if len(pool) > 1 else 0
            for i in pool
        }
        order: tuple[int, ...] = ()
        best, best_set = 0.0, tuple[int, ...]()
        for x in sorted(pool, key=lambda i: (-linked[i], -p.flops[i], i)):
            values = p.insertions(order, x)
            pos = int(np.argmin(values))
            order = order[:pos] + (x,) + order[pos:]
            if math.isfinite(values[pos]):
                self._store(tuple(sorted(order)), order, values[pos])
                if 1.0 / values[pos] > best:
                    best, best_set = 1.0 / values[pos], tuple(sorted(order))
        return [best_set] if best_set else []

    def improve(self, clusters: Clusters, until_ops: int) -> tuple[float, Clusters]:
        """Local search while the predicted samples/s grow and the budget lasts: single nodes move or swap
        (``_moves``), whole clusters merge or go idle (``_cluster_moves``), judged by quick layouts (new
        sets get their members' order with the newcomer inserted); the first gain is taken.  When no move
        helps, the current clusters' orders are searched thoroughly and the moves tried again."""
        few = len(self.usable) <= 12
        best = self.value(clusters)
        improved = True
        while improved and self.p.ops < until_ops:
            improved = False
            for x in [*sorted(self.usable, key=lambda i: (-self.p.flops[i], i)), None]:
                for cand in self._moves(clusters, x) if x is not None else self._cluster_moves(clusters):
                    value = self.value(cand)
                    if few and value > 0.9 * best:      # cheap when small, and quick layouts underrate
                        value = self.value(cand, full=True)
                    if value > best * (1 + 1e-9):
                        best, clusters, improved = value, cand, True
                        break
                if self.p.ops >= until_ops:
                    break
            if not improved and self.value(clusters, full=True) > best * (1 + 1e-9):
                best, improved = self.value(clusters, full=True), True
        return self.value(clusters, full=True), clusters

    def _cluster_moves(self, clusters: Clusters) -> list[Clusters]:
        moves = []
        for a, b in itertools.combinations(range(len(clusters)), 2):
            merged = self._grow(clusters[a], clusters[b][0])
            for y in clusters[b][1:]:
                merged = self._grow(merged, y)
            moves.append(sorted([c for i, c in enumerate(clusters) if i not in (a, b)] + [merged]))
        if self.allow_idle and len(clusters) > 1:
            moves += [clusters[:i] + clusters[i + 1:] for i in range(len(clusters))]
        return moves

    def _moves(self, clusters: Clusters, x: int) -> list[Clusters]:
        """Neighbouring partitions: ``x`` joins another cluster (alone or swapped with one of its nodes,
        which takes x's place), starts a cluster of its own, or goes idle."""
        p = self.p
        src = next((c for c in clusters if x in c), None)
        few = len(self.usable) <= 12
        others = sorted(
            (c for c in clusters if c is not src), key=lambda c: (-_bucket(p.bw_sym[x, list(c)].min()), c)
        )
        left = tuple(i for i in src if i != x) if src else ()
        if src is not None and left and (lay := self.layout(src)) is not None:
            self.offer(tuple(i for i in lay.order if i != x))
        moves = []
        for target in others if few else others[:3]:
            rest = [c for c in clusters if c is not src and c is not target]
            moves.append(sorted(rest + [self._grow(target, x)] + ([left] if left else [])))
            partners = sorted(target, key=lambda i: (abs(p.mem[i] - p.mem[x]), i))
            for y in partners if few else partners[:2]:
                if src is None and not self.allow_idle:
                    break
                replaced = self._grow(tuple(i for i in target if i != y), x)
                moves.append(sorted(rest + [replaced] + ([self._grow(left, y)] if src else [])))
            if few and src is None:        # two idle nodes joining at once (one alone may not fit)
                idle = sorted(set(self.usable).difference(*clusters) - {x})
                moves += [sorted(rest + [self._grow(self._grow(target, x), y)]) for y in idle if y > x]
        if (src is None or left) and len(clusters) < self.max_clusters:
            moves.append(sorted([c for c in clusters if c is not src] + [(x,)] + ([left] if left else [])))
        if left and self.allow_idle:
            moves.append(sorted([c for c in clusters if c is not src] + [left]))
        return moves

    def _grow(self, members: tuple[int, ...], x: int) -> tuple[int, ...]:
        """``members`` plus ``x``, trying ``x`` at every position of the members' known order."""
        grown = tuple(sorted(members + (x,)))
        base = self.layout(members) if members else None
        if grown not in self._full and base is not None:
            self._insert(base.order, x)
        return grown

    def _insert(self, order: tuple[int, ...], x: int) -> float:
        """Offer ``order`` with ``x`` at its best position; return that bottleneck."""
        values = self.p.insertions(order, x)
        pos = int(np.argmin(values))
        if math.isfinite(values[pos]):
            self._store(tuple(sorted(order + (x,))), order[:pos] + (x,) + order[pos:], values[pos])
        return values[pos]

    def tune_averaging(self, clusters: Clusters) -> list[Layout]:
        """Give up pipeline speed for a shorter averaging round where the total gains."""
        p = self.p
        clusters = self.fitting(clusters)
        layouts = [lay for lay in (self.layout(c, full=True) for c in clusters) if lay is not None]
        best, t0 = score(p, layouts), averaging_round_s(p, layouts)
        if len(clusters) < 2 or not 0 < t0 < INF:
            return layouts
        caps_per_s = p.min_link_out(clusters) / p.ring_factor(len(clusters))
        for scale in (0.9, 0.75, 0.6, 0.45, 0.3, 0.2, 0.1, 0.05):
            cand = []
            for lay in layouts:
                value, bounds = p.partition(lay.order, t0 * scale * caps_per_s)
                if bounds:
                    cand.append(Layout(order=lay.order, bounds=tuple(bounds), bottleneck=value))
            if len(cand) == len(layouts) and score(p, cand) > best * (1 + 1e-9):
                best, layouts = score(p, cand), cand
        return layouts


def _bucket(bandwidth: float) -> float:
    """Link speeds within a factor 1.5 of each other count as equal when grouping nodes."""
    if bandwidth <= 0:
        return -1e9
    return round(math.log(bandwidth) / math.log(1.5)) if bandwidth < INF else 1e9


def _cluster_counts(limit: int) -> list[int]:
    counts = set(range(1, min(limit, 8) + 1))
    c = 8.0
    while c < limit:
        c *= 1.3
        counts.add(min(limit, int(c)))
    return sorted(counts)


def explore(search: Search) -> list[tuple[float, Clusters]]:
    """Constructions for several cluster counts from every pool of well-linked nodes, then local search
    from the best three (and more while the budget lasts)."""
    p = search.p
    screened: dict[tuple[tuple[int, ...], ...], float] = {}
    pools = _link_pools(p, search.usable) if search.allow_idle else [search.usable]
    for pool in pools:
        limit = max(1, min(len(pool), int(p.mem[pool].sum() // search.need[1]), search.max_clusters))
        counts = _cluster_counts(limit) if pool is search.usable else sorted({1, (limit + 1) // 2, limit})
        for count in counts:
            for style in ("link", "memory", "snake"):
                clusters = search.construct(pool, count, style)
                screened[tuple(clusters)] = search.value(clusters)
        for clusters in (search.fill(pool), search.ladder(pool)):
            if len(clusters) <= search.max_clusters:  # ``max_clusters`` holds for every candidate
                screened[tuple(clusters)] = search.value(clusters)
    ranked = sorted(((v, list(c)) for c, v in screened.items()), key=lambda r: (-r[0], r[1]))
    results = ranked[:1]
    for i, (_, clusters) in enumerate(ranked):
        if search.spent():
            break
        share = (search.budget - p.ops) // max(1, 3 - i)
        results.append(search.improve(clusters, p.ops + share))
    return sorted(results, key=lambda r: (-r[0], r[1]))


def _link_pools(p: Problem, usable: list[int], most: int = 8) -> list[list[int]]:
    """All usable nodes, then the groups of nodes joined by links of at least some speed (single linkage,
    at every speed level present) that can hold the model; the ``most`` with the most FLOP/s."""
    fast = np.vectorize(_bucket)(p.bw_sym[np.ix_(usable, usable)])
    pools: dict[tuple[int, ...], float] = {}
    for level in sorted(set(fast[np.isfinite(p.bw_sym[np.ix_(usable, usable)])].tolist()), reverse=True):
        for component in _components(fast >= level):
            pool = tuple(usable[i] for i in component)
            if len(pool) < len(usable) and p.mem[list(pool)].sum() >= p.model_memory(1):
                pools[pool] = float(p.flops[list(pool)].sum())
    ranked = sorted(pools, key=lambda pool: (-pools[pool], pool))[:most]
    return [usable] + [list(pool) for pool in ranked]


def _components(adjacent: np.ndarray) -> list[list[int]]:
    seen: set[int] = set()
    components = []
    for start in range(len(adjacent)):
        if start in seen:
            continue
        component, frontier = [], [start]
        seen.add(start)
        while frontier:
            i = frontier.pop()
            component.append(i)
            for j in np.flatnonzero(adjacent[i]).tolist():
                if j not in seen:
                    seen.add(j)
                    frontier.append(j)
        components.append(sorted(component))
    return components

