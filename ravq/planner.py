"""The planner: which nodes form clusters, in which order, and where each stage begins.

Pure planning on plain data: node and block profiles in, a ``Plan`` and an ``Explanation`` out.  No
sockets, no torch.

The cost model (DESIGN.md, "Planner and profiler"), per micro-batch:

- A stage on node n holding blocks [s, e) computes for sum(fwd + bwd FLOPs) / n.flops seconds and needs
  sum(memory_bytes) bytes, a hard limit.  When ``max_inflight`` is None every stage of a k-stage cluster
  stashes k micro-batches (the pipeline's default); each block's ``inflight_bytes`` scales with that.
- The link from stage a to stage b (cut before block e) carries the activations crossing the cut one way
  and their gradients back: act/bw(a->b) + grad/bw(b->a) + latency(a, b) seconds.
- A cluster runs r = 1 / max(slowest stage, slowest link) micro-batches per second.
- Averaging, every ``sync_every`` steps: each node sends 2(C-1)/C of the parameter bytes it holds (the
  sum over its segments) through its ring links.  Ring neighbours depend on every cluster's cuts, so the
  planner charges the node's slowest link to any node of another cluster (the worst ring order).  The
  round lasts as long as its slowest node: T_avg.
- samples/s = micro_batch * sum over clusters of r * duty, with duty = (S/r) / (S/r + T_avg) when
  averaging pauses training, or (S/r) / max(S/r, T_avg) when it overlaps with training (S = sync_every).

The search (``make_plan``): for several cluster counts, seed clusters far apart in link speed and grow
them with the nodes best linked to them, order each cluster's nodes (exhaustively when small, else seed
orders plus swaps), cut it with an exact dynamic programme on the bottleneck time under every node's
memory limit, then improve the partition by moving nodes between clusters (or leaving them idle) and
finally trade pipeline speed for averaging time where that pays.  Every step is deterministic.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ravq.config import ClusterPlan, Plan

_INF = math.inf
_SLOW_S_PER_BYTE = 1e9
"""Time per byte charged on a link with no measured bandwidth: unusable in practice."""
_GIB = float(1 << 30)


class PlanError(ValueError):
    """No plan satisfies the memory limits (or the inputs are inconsistent); says what is missing."""


@dataclass(kw_only=True, slots=True, frozen=True)
class NodeProfile:
    name: str
    flops: float
    """Achieved FLOP/s on forward + backward."""
    memory_bytes: int
    """Memory usable for a stage."""
    bandwidth_bytes_per_s: dict[str, float] = field(default_factory=dict)
    """Measured bandwidth from this node to each peer."""
    latency_s: dict[str, float] = field(default_factory=dict)
    """Measured one-way latency from this node to each peer."""


@dataclass(kw_only=True, slots=True, frozen=True)
class BlockProfile:
    name: str
    """Module where the block begins (a candidate cut; the first block's name is never cut at)."""
    param_bytes: int
    fwd_flops: float
    """FLOPs of one micro-batch's forward through the block."""
    bwd_flops: float
    act_bytes_out: int
    """Bytes crossing a cut right after this block, per micro-batch (forward)."""
    memory_bytes: int
    """Parameters, gradients, optimizer state and stashes for ``max_inflight`` micro-batches."""
    grad_bytes_out: int | None = None
    """Gradient bytes coming back across that cut; None: same as act_bytes_out."""
    inflight_bytes: int = 0
    """Part of memory_bytes held once per in-flight micro-batch (stashed activations and weights)."""
    max_inflight: int = 1
    """In-flight micro-batches that memory_bytes assumes."""


@dataclass(kw_only=True, slots=True)
class StageReport:
    node: str
    first_block: int
    last_block: int
    compute_s: float
    link_s: float | None
    """Time of the link to the next stage; None for the last stage."""
    memory_bytes: int
    memory_available: int
    param_bytes: int


@dataclass(kw_only=True, slots=True)
class ClusterReport:
    nodes: list[str]
    stages: list[StageReport]
    rate_micro_batches_per_s: float


@dataclass(kw_only=True, slots=True)
class Explanation:
    clusters: list[ClusterReport]
    block_names: list[str]
    micro_batch: int
    sync_every: int
    idle: dict[str, str]
    """Nodes the plan leaves out, with the reason."""
    averaging_s: float
    """Duration of one averaging round (T_avg)."""
    samples_per_s_without_averaging: float
    samples_per_s: float

    @property
    def averaging_cost_samples_per_s(self) -> float:
        return self.samples_per_s_without_averaging - self.samples_per_s

    def slowest_stage(self) -> tuple[str, float]:
        return max(((s.node, s.compute_s) for c in self.clusters for s in c.stages), key=lambda x: x[1])

    def slowest_link(self) -> tuple[str, float] | None:
        links = [(f"{s.node}->{c.stages[i + 1].node}", s.link_s) for c in self.clusters
                 for i, s in enumerate(c.stages) if s.link_s is not None]
        return max(links, key=lambda x: x[1]) if links else None

    def format(self) -> str:
        """A readable table of the plan and its predicted speed."""
        lines = []
        for c, cluster in enumerate(self.clusters):
            lines.append(f"cluster {c}: {len(cluster.stages)} stages, "
                         f"{cluster.rate_micro_batches_per_s:.3g} micro-batches/s")
            lines.append(f"  {'stage':>5} {'node':<16} {'blocks':<28} {'compute':>10} {'link':>10} "
                         f"{'memory used/available':>24}")
            for i, s in enumerate(cluster.stages):
                blocks = f"{s.first_block}-{s.last_block} " \
                         f"({self.block_names[s.first_block]}..{self.block_names[s.last_block]})"
                link = "-" if s.link_s is None else _ms(s.link_s)
                mem = f"{s.memory_bytes / _GIB:.2f}/{s.memory_available / _GIB:.2f} GiB"
                lines.append(f"  {i:>5} {s.node:<16} {blocks[:28]:<28} {_ms(s.compute_s):>10} {link:>10} "
                             f"{mem:>24}")
        for name, reason in sorted(self.idle.items()):
            lines.append(f"idle: {name}: {reason}")
        node, t = self.slowest_stage()
        lines.append(f"slowest stage: {node} {_ms(t)}")
        link = self.slowest_link()
        if link is not None:
            lines.append(f"slowest link: {link[0]} {_ms(link[1])}")
        lines.append(f"averaging: {_ms(self.averaging_s)} per round every {self.sync_every} steps, "
                     f"costs {self.averaging_cost_samples_per_s:.4g} samples/s")
        lines.append(f"predicted: {self.samples_per_s:.4g} samples/s "
                     f"({self.samples_per_s_without_averaging:.4g} without averaging, "
                     f"micro_batch {self.micro_batch})")
        return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if math.isfinite(seconds) else "inf"


# ----------------------------------------------------------------------------------------------------
# The problem in arrays


class _Problem:
    """Nodes and blocks as arrays, and the per-cluster dynamic programme over cut points."""

    def __init__(self, nodes: Sequence[NodeProfile], blocks: Sequence[BlockProfile], *,
                 max_inflight: int | None, micro_batch: int, sync_every: int, overlap_averaging: bool) -> None:
        _check_inputs(nodes, blocks, micro_batch, sync_every)
        self.nodes, self.blocks = list(nodes), list(blocks)
        self.names = [n.name for n in nodes]
        self.n, self.B = len(nodes), len(blocks)
        self.max_inflight, self.micro_batch, self.sync_every = max_inflight, micro_batch, sync_every
        self.overlap_averaging = overlap_averaging
        self.flops = np.array([n.flops for n in nodes], dtype=float)
        self.mem = np.array([n.memory_bytes for n in nodes], dtype=float)
        bw = np.array([[_lookup(nodes, a, b, "bandwidth_bytes_per_s") for b in range(self.n)]
                       for a in range(self.n)], dtype=float)
        lat = np.array([[_lookup(nodes, a, b, "latency_s") for b in range(self.n)]
                        for a in range(self.n)], dtype=float)
        self.bw_sym = np.minimum(bw, bw.T)
        np.fill_diagonal(self.bw_sym, _INF)
        with np.errstate(divide="ignore"):
            per_byte = np.where(bw > 0, 1.0 / np.where(bw > 0, bw, 1.0), _SLOW_S_PER_BYTE)
        self.fwd_s_per_byte, self.bwd_s_per_byte = per_byte, per_byte.T
        self.lat = (lat + lat.T) / 2
        work = np.array([b.fwd_flops + b.bwd_flops for b in blocks], dtype=float)
        self.param = np.array([b.param_bytes for b in blocks], dtype=float)
        inflight = np.array([b.inflight_bytes for b in blocks], dtype=float)
        static = np.array([b.memory_bytes - b.max_inflight * b.inflight_bytes for b in blocks], dtype=float)
        self.act = np.full(self.B + 1, _INF)       # act[e]: bytes crossing a cut before block e
        self.grad = np.full(self.B + 1, _INF)
        self.act[1:self.B] = [b.act_bytes_out for b in blocks[:-1]]
        self.grad[1:self.B] = [b.act_bytes_out if b.grad_bytes_out is None else b.grad_bytes_out
                               for b in blocks[:-1]]
        self.work_span = _spans(work)
        self.param_span = _spans(self.param)
        self.static_span, self.inflight_span = _spans(static), _spans(inflight)
        self._mem_span: dict[int, np.ndarray] = {}
        self._times: dict[tuple[int, int], np.ndarray] = {}
        self.ops = 0
        """Stage steps of the dynamic programme run so far: the unit of the search budget."""

    def inflight_for(self, stages: int) -> int:
        return self.max_inflight if self.max_inflight is not None else stages

    def mem_span(self, stages: int) -> np.ndarray:
        """mem_span[s, e]: memory of a stage holding blocks [s, e) in a cluster of ``stages`` stages."""
        k = self.inflight_for(stages)
        if k not in self._mem_span:
            self._mem_span[k] = self.static_span + k * self.inflight_span
        return self._mem_span[k]

    def stage_times(self, node: int, stages: int) -> np.ndarray:
        """times[s, e]: compute time of blocks [s, e) on ``node``; inf where it does not fit."""
        key = (node, self.inflight_for(stages))
        t = self._times.get(key)
        if t is None:
            t = np.where(self.mem_span(stages) <= self.mem[node], self.work_span / self.flops[node], _INF)
            self._times[key] = t
        return t

    def link_times(self, a: int, b: int) -> np.ndarray:
        """link[e]: time of the link a -> b when the cut is before block e (inf at 0 and B)."""
        return self.act * self.fwd_s_per_byte[a, b] + self.grad * self.bwd_s_per_byte[a, b] + self.lat[a, b]

    def bottleneck(self, order: Sequence[int], limit: float = _INF,
                   caps: np.ndarray | None = None) -> float:
        """Smallest achievable max(stage time, link time) for this node order; inf if it does not fit or
        cannot beat ``limit``.  ``caps[node]``: most parameter bytes a node may hold (averaging limit)."""
        return self._dp(order, limit, caps, want_bounds=False)[0]

    def partition(self, order: Sequence[int], caps: np.ndarray | None = None) -> tuple[float, list[int]]:
        """The bottleneck and stage bounds [0, b1, ..., B] that achieve it."""
        return self._dp(order, _INF, caps, want_bounds=True)

    def _dp(self, order: Sequence[int], limit: float, caps: np.ndarray | None,
            want_bounds: bool) -> tuple[float, list[int]]:
        k = len(order)
        times = [self._capped(node, k, caps) for node in order]
        best = times[0][0].copy()         # best[e]: bottleneck with the current stage ending before e
        args = []
        for j in range(1, k):
            self.ops += 1
            reach = np.maximum(best, self.link_times(order[j - 1], order[j]))
            if reach.min() >= limit:
                return _INF, []
            cand = np.maximum(reach[:, None], times[j])
            if want_bounds:
                arg = cand.argmin(axis=0)
                args.append(arg)
                best = cand[arg, np.arange(self.B + 1)]
            else:
                best = cand.min(axis=0)
        value = float(best[self.B])
        if not want_bounds or not math.isfinite(value):
            return value, []
        bounds = [self.B]
        for arg in reversed(args):
            bounds.append(int(arg[bounds[-1]]))
        bounds.append(0)
        return value, bounds[::-1]

    def _capped(self, node: int, k: int, caps: np.ndarray | None) -> np.ndarray:
        t = self.stage_times(node, k)
        if caps is None or not math.isfinite(caps[node]):
            return t
        return np.where(self.param_span <= caps[node], t, _INF)

    def min_link_out(self, clusters: Sequence[Sequence[int]]) -> np.ndarray:
        """Per node: slowest symmetric link to a node of another cluster (inf with one cluster)."""
        owner = np.full(self.n, -1)
        for c, members in enumerate(clusters):
            owner[list(members)] = c
        out = np.full(self.n, _INF)
        used = owner >= 0
        for c, members in enumerate(clusters):
            others = used & (owner != c)
            if others.any():
                out[list(members)] = self.bw_sym[np.ix_(list(members), np.flatnonzero(others))].min(axis=1)
        return out

    def ring_factor(self, clusters: int) -> float:
        return 2 * (clusters - 1) / clusters if clusters > 1 else 0.0

    def samples_per_s(self, rates: Sequence[float], averaging_s: float) -> float:
        s = self.sync_every
        total = 0.0
        for r in rates:
            if r <= 0:
                continue
            period = s / r
            total += s / (max(period, averaging_s) if self.overlap_averaging else period + averaging_s)
        return self.micro_batch * total


def _spans(values: np.ndarray) -> np.ndarray:
    """spans[s, e] = sum(values[s:e]) for e > s, inf otherwise."""
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    span = prefix[None, :] - prefix[:, None]
    return np.where(np.triu(np.ones_like(span, dtype=bool), k=1), span, _INF)


def _lookup(nodes: Sequence[NodeProfile], a: int, b: int, attr: str) -> float:
    """Measurement a -> b, else b -> a (links assumed symmetric when one side was not measured)."""
    if a == b:
        return 0.0
    mine = getattr(nodes[a], attr).get(nodes[b].name)
    if mine is not None:
        return float(mine)
    theirs = getattr(nodes[b], attr).get(nodes[a].name)
    return float(theirs) if theirs is not None else 0.0


def _check_inputs(nodes: Sequence[NodeProfile], blocks: Sequence[BlockProfile], micro_batch: int,
                  sync_every: int) -> None:
    if not nodes:
        raise PlanError("nodes: no node profiles given")
    if not blocks:
        raise PlanError("blocks: the model profile has no blocks")
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise PlanError(f"nodes: duplicate node names in {names}")
    for n in nodes:
        if not n.flops > 0:
            raise PlanError(f"node {n.name}: flops must be > 0, got {n.flops}")
    if micro_batch < 1 or sync_every < 1:
        raise PlanError(f"micro_batch and sync_every must be >= 1, got {micro_batch} and {sync_every}")


# ----------------------------------------------------------------------------------------------------
# Layouts and their score


@dataclass(frozen=True, slots=True)
class _Layout:
    """One cluster: node order, stage bounds [0, b1, ..., B] and the bottleneck time they achieve."""

    order: tuple[int, ...]
    bounds: tuple[int, ...]
    bottleneck: float


def _averaging_s(p: _Problem, layouts: Sequence[_Layout]) -> float:
    """T_avg: the slowest node's 2(C-1)/C x held parameter bytes over its slowest cross-cluster link."""
    if len(layouts) < 2:
        return 0.0
    factor = p.ring_factor(len(layouts))
    slowest = p.min_link_out([lay.order for lay in layouts])
    worst = 0.0
    for lay in layouts:
        for j, node in enumerate(lay.order):
            held = p.param_span[lay.bounds[j], lay.bounds[j + 1]]
            worst = max(worst, factor * held / slowest[node] if slowest[node] > 0 else _INF)
    return worst


def _score(p: _Problem, layouts: Sequence[_Layout]) -> float:
    rates = [1.0 / max(lay.bottleneck, 1e-12) for lay in layouts]
    return p.samples_per_s(rates, _averaging_s(p, layouts))


# ----------------------------------------------------------------------------------------------------
# The search


class _Search:
    """Deterministic heuristic search over partitions, orders and cuts, within a budget of DP steps."""

    EXHAUSTIVE_ORDERS = 5
    """Clusters up to this many nodes try every order."""

    def __init__(self, p: _Problem, *, max_clusters: int | None, allow_idle: bool, effort: float) -> None:
        self.p, self.allow_idle = p, allow_idle
        self.budget = int(effort * 4e8 / max((p.B + 1) ** 2, 4000))
        self._best: dict[tuple[int, ...], _Layout | None] = {}
        self._full: set[tuple[int, ...]] = set()
        self.idle_reasons: dict[int, str] = {}
        self.usable = self._usable_nodes()
        need = float(p.mem_span(1)[0, p.B])
        fits = int(p.mem[self.usable].sum() // need) if self.usable else 0
        self.max_clusters = max(1, min(len(self.usable), fits, max_clusters or len(self.usable)))

    def _usable_nodes(self) -> list[int]:
        p = self.p
        smallest = np.diagonal(p.mem_span(1), offset=1)
        usable = []
        for i in range(p.n):
            if p.mem[i] >= smallest.min():
                usable.append(i)
            else:
                self.idle_reasons[i] = (f"cannot hold even the smallest block ({smallest.min() / _GIB:.3g} GiB "
                                        f"needed, {p.mem[i] / _GIB:.3g} GiB available)")
        return usable

    # --- one cluster

    def layout(self, members: Sequence[int], full: bool = True) -> _Layout | None:
        """Best layout found for this set of nodes (searching orders further when ``full``)."""
        key = tuple(sorted(members))
        if key in self._full or (not full and key in self._best):
            return self._best[key]
        best = self._best.get(key)
        orders = self._seed_orders(key) + ([best.order] if best else [])
        if len(key) <= self.EXHAUSTIVE_ORDERS:
            orders = list(itertools.permutations(key)) if full or len(key) <= 3 else orders
        value, order = self._best_of(orders)
        if full and len(key) > self.EXHAUSTIVE_ORDERS and order is not None:
            value, order = self._improve_order(order, value)
        if full:
            self._full.add(key)
        self._store(key, order, value)
        return self._best[key]

    def offer(self, order: tuple[int, ...], limit: float = _INF) -> float:
        """Evaluate one order of a set and keep it if it beats what is known for that set."""
        key = tuple(sorted(order))
        known = self._best.get(key)
        if key in self._best and known is None:
            return _INF
        bound = min(limit, known.bottleneck) if known else limit
        value = self.p.bottleneck(order, bound)
        if value < bound:
            self._store(key, order, value)
        return value

    def _store(self, key: tuple[int, ...], order: tuple[int, ...] | None, value: float) -> None:
        known = self._best.get(key)
        if order is None or not math.isfinite(value):
            self._best.setdefault(key, None)
            return
        if known is None or value < known.bottleneck:
            bottleneck, bounds = self.p.partition(order)
            self._best[key] = _Layout(order=tuple(order), bounds=tuple(bounds), bottleneck=bottleneck)

    def _best_of(self, orders: Sequence[tuple[int, ...]]) -> tuple[float, tuple[int, ...] | None]:
        best, best_order = _INF, None
        for order in dict.fromkeys(orders):
            value = self.p.bottleneck(order, best)
            if value < best:
                best, best_order = value, order
        return best, best_order

    def _seed_orders(self, key: tuple[int, ...]) -> list[tuple[int, ...]]:
        p = self.p
        by_flops = tuple(sorted(key, key=lambda i: (-p.flops[i], i)))
        by_mem = tuple(sorted(key, key=lambda i: (-p.mem[i], i)))
        chain = [by_mem[0]]
        rest = set(key) - {by_mem[0]}
        while rest:
            nxt = max(sorted(rest), key=lambda i: p.bw_sym[chain[-1], i])
            chain.append(nxt)
            rest.discard(nxt)
        return [by_mem, by_flops, tuple(chain), by_mem[::-1]]

    def _improve_order(self, order: tuple[int, ...], value: float) -> tuple[float, tuple[int, ...]]:
        """First-improvement swaps (all pairs for small clusters, neighbours for large ones)."""
        k = len(order)
        pairs = list(itertools.combinations(range(k), 2)) if k <= 12 else [(i, i + 1) for i in range(k - 1)]
        improved = True
        while improved and self.p.ops < self.budget:
            improved = False
            for i, j in pairs:
                cand = list(order)
                cand[i], cand[j] = cand[j], cand[i]
                v = self.p.bottleneck(cand, value * (1 - 1e-9))
                if v < value:
                    value, order, improved = v, tuple(cand), True
        return value, order

    # --- partitions

    def value(self, clusters: Sequence[tuple[int, ...]], full: bool = False) -> float:
        layouts = [self.layout(c, full) for c in clusters]
        if not clusters or any(lay is None for lay in layouts):
            return 0.0
        return _score(self.p, [lay for lay in layouts if lay is not None])

    def construct(self, count: int, deficit_first: bool) -> list[tuple[int, ...]]:
        """``count`` clusters seeded far apart in link speed, grown with their best-linked nodes."""
        p = self.p
        need = float(p.mem_span(1)[0, p.B])
        nodes = sorted(self.usable, key=lambda i: (-p.mem[i], -p.flops[i], i))
        seeds = [nodes[0]]
        while len(seeds) < count:
            rest = [i for i in nodes if i not in seeds]
            seeds.append(min(rest, key=lambda i: (_bucket(p.bw_sym[i, seeds].max()), -p.mem[i], i)))
        clusters = [[s] for s in seeds]
        for x in nodes:
            if x in seeds:
                continue

            def key(c: list[int]) -> tuple[float, ...]:
                link = _bucket(p.bw_sym[x, c].min())
                short = float(p.mem[c].sum() < need)
                return (short, link, -p.flops[c].sum()) if deficit_first else (link, short, -p.flops[c].sum())
            max(clusters, key=key).append(x)
        return sorted(tuple(sorted(c)) for c in clusters)

    def improve(self, clusters: list[tuple[int, ...]]) -> tuple[float, list[tuple[int, ...]]]:
        """Move single nodes between clusters, to idle and to new clusters while that helps."""
        best = self.value(clusters, full=True)
        improved = True
        while improved and self.p.ops < self.budget:
            improved = False
            for x in self.usable:
                for cand in self._moves(clusters, x):
                    v = self.value(cand)
                    if v > best * (1 + 1e-9):
                        v_full = self.value(cand, full=True)
                        if v_full > best * (1 + 1e-9):
                            best, clusters, improved = v_full, cand, True
                            break
                if self.p.ops >= self.budget:
                    break
        return best, clusters

    def _moves(self, clusters: list[tuple[int, ...]], x: int) -> list[list[tuple[int, ...]]]:
        p = self.p
        src = next((c for c in clusters if x in c), None)
        rest = [c for c in clusters if c is not src]
        left = tuple(i for i in src if i != x) if src else ()
        base = rest + ([left] if left else [])
        targets = sorted(rest, key=lambda c: (-p.bw_sym[x, list(c)].min(), c))
        if len(self.usable) > 12:
            targets = targets[:3]
        moves = []
        for t in targets:
            grown = self._insert(t, x)
            if grown is not None:
                moves.append(sorted([grown] + [c for c in base if c is not t]))
        if src is not None and left and len(clusters) < self.max_clusters:
            moves.append(sorted(base + [(x,)]))
        if src is not None and left and self.allow_idle:
            moves.append(sorted(base))
        return moves

    def _insert(self, members: tuple[int, ...], x: int) -> tuple[int, ...] | None:
        """Try ``x`` at every position of the known order of ``members``; return the grown set."""
        grown = tuple(sorted(members + (x,)))
        if grown in self._best or len(grown) <= self.EXHAUSTIVE_ORDERS:
            return grown
        base = self.layout(members, full=False)
        if base is None:
            return grown
        for pos in range(len(base.order) + 1):
            self.offer(base.order[:pos] + (x,) + base.order[pos:])
        self._best.setdefault(grown, None)
        return grown

    def tune_averaging(self, clusters: list[tuple[int, ...]]) -> list[_Layout]:
        """Give up pipeline speed for a shorter averaging round where the total gains."""
        p = self.p
        layouts = [self.layout(c) for c in clusters]
        assert all(lay is not None for lay in layouts)
        best_layouts = [lay for lay in layouts if lay is not None]
        best = _score(p, best_layouts)
        t0 = _averaging_s(p, best_layouts)
        if len(clusters) < 2 or not 0 < t0 < _INF:
            return best_layouts
        slowest = p.min_link_out(clusters)
        factor = p.ring_factor(len(clusters))
        for scale in (0.9, 0.75, 0.6, 0.45, 0.3, 0.2, 0.1, 0.05):
            caps = t0 * scale * slowest / factor
            cand = []
            for lay in best_layouts:
                value, bounds = p.partition(lay.order, caps)
                if not bounds:
                    break
                cand.append(_Layout(order=lay.order, bounds=tuple(bounds), bottleneck=value))
            if len(cand) == len(best_layouts) and _score(p, cand) > best * (1 + 1e-9):
                best, best_layouts = _score(p, cand), cand
        return best_layouts


def _bucket(bandwidth: float) -> float:
    """Link speeds within a factor 1.5 of each other count as equal when grouping nodes."""
    return round(math.log(bandwidth) / math.log(1.5)) if 0 < bandwidth < _INF else (-1e9 if bandwidth <= 0 else 1e9)


def _cluster_counts(limit: int) -> list[int]:
    counts = set(range(1, min(limit, 8) + 1))
    c = 8.0
    while c < limit:
        c *= 1.3
        counts.add(min(limit, int(c)))
    return sorted(counts)


# ----------------------------------------------------------------------------------------------------
# Public entry points


def make_plan(nodes: Sequence[NodeProfile], blocks: Sequence[BlockProfile], *, micro_batch: int,
              sync_every: int, max_clusters: int | None = None, max_inflight: int | None = None,
              overlap_averaging: bool = False, allow_idle: bool = True,
              effort: float = 1.0) -> tuple[Plan, Explanation]:
    """Clusters, node order and cuts maximising predicted samples/s; every stage fits its node's memory.

    ``max_inflight`` None: a k-stage cluster keeps k micro-batches in flight.  ``allow_idle``: nodes may be
    left out when that predicts more samples/s (nodes that cannot hold any block always are).  ``effort``
    scales the search budget.  Raises PlanError, saying how much memory is missing, when nothing fits.
    """
    p = _Problem(nodes, blocks, max_inflight=max_inflight, micro_batch=micro_batch, sync_every=sync_every,
                 overlap_averaging=overlap_averaging)
    search = _Search(p, max_clusters=max_clusters, allow_idle=allow_idle, effort=effort)
    if not search.usable or (search.idle_reasons and not allow_idle):
        raise _memory_error(p)
    screened: dict[tuple[tuple[int, ...], ...], float] = {}
    for count in _cluster_counts(search.max_clusters):
        for deficit_first in (False, True):
            clusters = search.construct(count, deficit_first)
            screened[tuple(clusters)] = search.value(clusters)
    ranked = sorted(screened.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
    best, best_clusters = 0.0, list(ranked[0][0])
    for clusters, _ in ranked:
        value, improved = search.improve(list(clusters))
        if value > best:
            best, best_clusters = value, improved
    if best <= 0:
        raise _memory_error(p)
    layouts = search.tune_averaging(best_clusters)
    idle = dict(search.idle_reasons)
    used = {i for lay in layouts for i in lay.order}
    for i in search.usable:
        if i not in used:
            idle[i] = "leaving it out predicts more samples/s"
    return _result(p, layouts, idle)


def evaluate_plan(plan: Plan, nodes: Sequence[NodeProfile], blocks: Sequence[BlockProfile], *,
                  micro_batch: int, sync_every: int, max_inflight: int | None = None,
                  overlap_averaging: bool = False) -> Explanation:
    """The cost model's verdict on any plan (hand-written, even or Ravnest's); PlanError if it does not fit."""
    p = _Problem(nodes, blocks, max_inflight=max_inflight, micro_batch=micro_batch, sync_every=sync_every,
                 overlap_averaging=overlap_averaging)
    index = {name: i for i, name in enumerate(p.names)}
    block_index = {b.name: i for i, b in enumerate(blocks)}
    layouts = []
    for c, cluster in enumerate(plan.clusters):
        missing = [n for n in cluster.nodes if n not in index] + [b for b in cluster.cuts if b not in block_index]
        if missing:
            raise PlanError(f"clusters[{c}]: no profile for {missing[0]!r}")
        bounds = (0, *(block_index[b] for b in cluster.cuts), p.B)
        if any(b >= e for b, e in zip(bounds, bounds[1:])):
            raise PlanError(f"clusters[{c}].cuts: cuts must be increasing and leave every stage a block")
        layouts.append(_fixed_layout(p, tuple(index[n] for n in cluster.nodes), bounds))
    idle = {i: "not in the plan" for i in range(p.n) if not any(i in lay.order for lay in layouts)}
    return _result(p, layouts, idle)[1]


def _fixed_layout(p: _Problem, order: tuple[int, ...], bounds: tuple[int, ...]) -> _Layout:
    k = len(order)
    worst = 0.0
    for j, node in enumerate(order):
        s, e = bounds[j], bounds[j + 1]
        if p.mem_span(k)[s, e] > p.mem[node]:
            raise PlanError(f"node {p.names[node]}: stage of blocks {s}-{e - 1} needs "
                            f"{p.mem_span(k)[s, e] / _GIB:.3g} GiB, the node has {p.mem[node] / _GIB:.3g} GiB")
        worst = max(worst, p.work_span[s, e] / p.flops[node])
        if j < k - 1:
            worst = max(worst, float(p.link_times(node, order[j + 1])[e]))
    return _Layout(order=order, bounds=bounds, bottleneck=worst)


def _result(p: _Problem, layouts: Sequence[_Layout], idle: dict[int, str]) -> tuple[Plan, Explanation]:
    layouts = sorted(layouts, key=lambda lay: p.names[lay.order[0]])
    reports = []
    for lay in layouts:
        k = len(lay.order)
        stages = []
        for j, node in enumerate(lay.order):
            s, e = lay.bounds[j], lay.bounds[j + 1]
            link = float(p.link_times(node, lay.order[j + 1])[e]) if j < k - 1 else None
            stages.append(StageReport(
                node=p.names[node], first_block=s, last_block=e - 1,
                compute_s=float(p.work_span[s, e] / p.flops[node]), link_s=link,
                memory_bytes=int(p.mem_span(k)[s, e]), memory_available=int(p.mem[node]),
                param_bytes=int(p.param_span[s, e])))
        reports.append(ClusterReport(nodes=[p.names[i] for i in lay.order], stages=stages,
                                     rate_micro_batches_per_s=1.0 / max(lay.bottleneck, 1e-12)))
    averaging = _averaging_s(p, layouts)
    rates = [r.rate_micro_batches_per_s for r in reports]
    explanation = Explanation(
        clusters=reports, block_names=[b.name for b in p.blocks], micro_batch=p.micro_batch,
        sync_every=p.sync_every, idle={p.names[i]: why for i, why in sorted(idle.items())},
        averaging_s=averaging, samples_per_s_without_averaging=p.micro_batch * sum(rates),
        samples_per_s=p.samples_per_s(rates, averaging))
    plan = Plan(clusters=[ClusterPlan(nodes=[p.names[i] for i in lay.order],
                                      cuts=[p.blocks[b].name for b in lay.bounds[1:-1]]) for lay in layouts],
                predicted_samples_per_s=explanation.samples_per_s)
    return plan, explanation


def _memory_error(p: _Problem) -> PlanError:
    blocks = np.diagonal(p.mem_span(1), offset=1)
    big = int(np.argmax(blocks))
    largest = int(np.argmax(p.mem))
    if blocks[big] > p.mem[largest]:
        return PlanError(
            f"no plan fits in memory: block {p.blocks[big].name!r} alone needs {blocks[big] / _GIB:.3g} GiB "
            f"(parameters, gradients, optimizer state, stashes) but the largest node, {p.names[largest]}, has "
            f"{p.mem[largest] / _GIB:.3g} GiB: {(blocks[big] - p.mem[largest]) / _GIB:.3g} GiB missing")
    mems = np.sort(p.mem)[::-1]
    shortfall = min(float(p.mem_span(k)[0, p.B]) - float(mems[:k].sum()) for k in range(1, p.n + 1))
    if shortfall > 0:
        need = float(p.mem_span(1)[0, p.B])
        return PlanError(
            f"no plan fits in memory: the model needs at least {need / _GIB:.3g} GiB (parameters, gradients, "
            f"optimizer state, stashed activations) and the nodes have {p.mem.sum() / _GIB:.3g} GiB in all: "
            f"{shortfall / _GIB:.3g} GiB missing")
    extra = _packing_shortfall(p)
    return PlanError(
        f"no plan fits in memory: the nodes have enough memory in total ({p.mem.sum() / _GIB:.3g} GiB) but the "
        f"blocks cannot be cut into contiguous stages that fit: about {extra / _GIB:.3g} GiB more on each node "
        f"is missing")


def _packing_shortfall(p: _Problem) -> float:
    """Smallest extra memory per node that lets a greedy packing (largest node first) hold the model."""
    order = sorted(range(p.n), key=lambda i: (-p.mem[i], i))
    span = p.mem_span(p.n)

    def fits(extra: float) -> bool:
        start = 0
        for node in order:
            end = start
            while end < p.B and span[start, end + 1] <= p.mem[node] + extra:
                end += 1
            start = end
        return start == p.B

    lo, hi = 0.0, float(np.diagonal(span, offset=1).max()) + float(span[0, p.B])
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def topology_clusters(topology: object) -> list[list[str]]:
    """Node names per cluster in stage order, from a ravq.config.Topology (one cluster when none is set)."""
    nodes = list(getattr(topology, "nodes"))
    if all(n.cluster is None for n in nodes):
        return [[n.name for n in nodes]]
    clusters: dict[int, list[tuple[int, int, str]]] = {}
    for i, n in enumerate(nodes):
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
    return Plan(clusters=clusters)


# ----------------------------------------------------------------------------------------------------
# Ravnest's rule, for comparison


def ravnest_plan(nodes: Sequence[NodeProfile], blocks: Sequence[BlockProfile], *, micro_batch: int,
                 sync_every: int, seed: int = 0, max_clusters: int = 5, population: int = 200,
                 generations: int = 500, mutation_rate: float = 0.01, max_inflight: int | None = None,
                 overlap_averaging: bool = False) -> tuple[Plan, Explanation]:
    """Ravnest's planner reimplemented: a genetic algorithm assigns nodes to clusters so that each cluster
    has the model's RAM (penalty 100 x GiB short) and clusters have similar "speed" (sum of RAM/bandwidth);
    each cluster then cuts the model into stages of equal parameter size, nodes in listing order.
    Scored with this module's cost model; PlanError when its stages do not fit in memory."""
    p = _Problem(nodes, blocks, max_inflight=max_inflight, micro_batch=micro_batch, sync_every=sync_every,
                 overlap_averaging=overlap_averaging)
    rng = np.random.default_rng(seed)
    ram = p.mem / _GIB
    links = np.where(np.isfinite(p.bw_sym), p.bw_sym, np.nan)
    bandwidth = np.nan_to_num(np.nanmedian(links, axis=1) if p.n > 1 else np.ones(1), nan=1.0) / 1e6
    need = float(p.mem_span(1)[0, p.B]) / _GIB
    genes = _ravnest_ga(ram, ram / np.maximum(bandwidth, 1e-9), need, rng, max_clusters=max_clusters,
                        population=population, generations=generations, mutation_rate=mutation_rate)
    layouts = []
    for c in sorted(set(genes.tolist())):
        order = tuple(int(i) for i in np.flatnonzero(genes == c))
        if len(order) > p.B:
            raise PlanError(f"ravnest rule: a cluster of {len(order)} nodes cannot split {p.B} blocks")
        layouts.append(_fixed_layout(p, order, _equal_param_bounds(p, len(order))))
    return _result(p, layouts, {})


def _ravnest_ga(ram: np.ndarray, speed: np.ndarray, need: float, rng: np.random.Generator, *,
                max_clusters: int, population: int, generations: int, mutation_rate: float) -> np.ndarray:
    n = len(ram)
    if n == 1:
        return np.zeros(1, dtype=int)
    pop = rng.integers(0, max_clusters, size=(population, n))
    best, best_fit = pop[0], _INF
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
    spread = (np.where(present, cluster_speed, -_INF).max(axis=1)
              - np.where(present, cluster_speed, _INF).min(axis=1))
    return 100 * short + spread


def _equal_param_bounds(p: _Problem, stages: int) -> tuple[int, ...]:
    """Cut where the cumulative parameter bytes are closest to i/stages of the total."""
    cum = np.concatenate([[0.0], np.cumsum(p.param)])
    bounds = [0]
    for i in range(1, stages):
        lo, hi = bounds[-1] + 1, p.B - (stages - i)
        target = cum[-1] * i / stages
        bounds.append(lo + int(np.argmin(np.abs(cum[lo:hi + 1] - target))))
    return (*bounds, p.B)


# ----------------------------------------------------------------------------------------------------
# The exhaustive optimum, to check the planner on small inputs


def optimum_plan(nodes: Sequence[NodeProfile], blocks: Sequence[BlockProfile], *, micro_batch: int,
                 sync_every: int, max_inflight: int | None = None, overlap_averaging: bool = False,
                 allow_idle: bool = True) -> tuple[Plan, Explanation]:
    """The best plan under the cost model by enumerating every partition of the nodes into clusters (and
    idle nodes), every node order and every set of cuts.  Exponential: for about 8 nodes and 10 blocks."""
    p = _Problem(nodes, blocks, max_inflight=max_inflight, micro_batch=micro_batch, sync_every=sync_every,
                 overlap_averaging=overlap_averaging)
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
        raise _memory_error(p)
    used = {i for lay in best_layouts for i in lay.order}
    return _result(p, best_layouts, {i: "left out by the optimum" for i in range(p.n) if i not in used})


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


def _layout_chunks(p: _Problem, members: tuple[int, ...], chunk: int = 4096):
    """(rates, meta) per chunk of every (order, cuts) of a cluster; meta = (orders, bounds) arrays."""
    k = len(members)
    cuts = np.array(list(itertools.combinations(range(1, p.B), k - 1)), dtype=int).reshape(-1, k - 1)
    if len(cuts) == 0:
        return
    bounds = np.concatenate([np.zeros((len(cuts), 1), int), cuts, np.full((len(cuts), 1), p.B)], axis=1)
    s, e = bounds[:, :-1], bounds[:, 1:]
    work, memory = p.work_span[s, e], p.mem_span(k)[s, e]                 # (cuts, k)
    act, grad = p.act[cuts], p.grad[cuts]                                    # (cuts, k - 1)
    perms = np.array(list(itertools.permutations(members)), dtype=int)
    per_chunk = max(1, chunk // len(cuts))
    for lo in range(0, len(perms), per_chunk):
        o = perms[lo:lo + per_chunk]                                         # (orders, k)
        t = work[None] / p.flops[o][:, None, :]
        fits = (memory[None] <= p.mem[o][:, None, :]).all(axis=2)
        worst = t.max(axis=2)
        if k > 1:
            a, b = o[:, :-1], o[:, 1:]
            link = (act[None] * p.fwd_s_per_byte[a, b][:, None, :] + grad[None] * p.bwd_s_per_byte[a, b][:, None, :]
                    + p.lat[a, b][:, None, :])
            worst = np.maximum(worst, link.max(axis=2))
        rates = np.where(fits, 1.0 / np.maximum(worst, 1e-12), 0.0)
        yield rates.ravel(), (np.repeat(o, len(cuts), axis=0), np.tile(bounds, (len(o), 1)))


def _best_for_partition(p: _Problem, clusters: list[tuple[int, ...]]) -> tuple[float, list[_Layout]]:
    """Exact best layouts for a fixed partition: a Pareto front of (averaging time, rate) per cluster,
    then the best averaging-time threshold."""
    slowest = p.min_link_out(clusters)
    factor = p.ring_factor(len(clusters))
    fronts = []
    for members in clusters:
        front: list[tuple[float, float, _Layout]] = []
        for rates, (orders, bounds) in _layout_chunks(p, members):
            held = p.param_span[bounds[:, :-1], bounds[:, 1:]]
            with np.errstate(divide="ignore", invalid="ignore"):
                t = (factor * held / slowest[orders]).max(axis=1) if factor else np.zeros(len(rates))
            t = np.nan_to_num(t, nan=0.0)
            keep = np.flatnonzero(rates > 0)
            idx = keep[np.lexsort((-rates[keep], t[keep]))]
            better = rates[idx] > np.maximum.accumulate(np.concatenate([[0.0], rates[idx]]))[:-1]
            front = _pareto(front + [
                (float(t[i]), float(rates[i]), _Layout(order=tuple(int(x) for x in orders[i]),
                                                       bounds=tuple(int(x) for x in bounds[i]),
                                                       bottleneck=1.0 / rates[i]))
                for i in idx[better]])
        fronts.append(front)
    best, best_layouts = 0.0, []
    for threshold in sorted({t for front in fronts for t, _, _ in front}):
        chosen = [max((f for f in front if f[0] <= threshold), key=lambda f: f[1], default=None) for front in fronts]
        if any(c is None for c in chosen):
            continue
        value = p.samples_per_s([c[1] for c in chosen if c], threshold)
        if value > best:
            best, best_layouts = value, [c[2] for c in chosen if c]
    return best, best_layouts


def _pareto(points: list[tuple[float, float, _Layout]]) -> list[tuple[float, float, _Layout]]:
    """Points with a strictly higher rate than every point of smaller or equal averaging time."""
    front: list[tuple[float, float, _Layout]] = []
    for point in sorted(points, key=lambda f: (f[0], -f[1])):
        if not front or point[1] > front[-1][1]:
            front.append(point)
    return front
