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

The search (``make_plan``), deterministic, its work counted in DP steps rather than wall time:

1. Starting points, from every pool of well-linked nodes (all nodes, and the groups joined by links of at
   least each speed present): clusters for several cluster counts (seeded far apart in link speed and
   grown with their best-linked nodes, or memory first, or dealt out in snake order), as many clusters as
   memory allows ("fill"), and one cluster grown fastest node first, best prefix kept ("ladder").
2. A cluster's cuts come from an exact dynamic programme on the bottleneck time under every node's
   memory limit; its node order is exhaustive when small, else seed orders improved by moving single
   nodes to their best position (one forward and one backward pass price every position at once).
3. Local search from the best starting points: nodes move or swap between clusters, start a cluster or
   go idle; clusters merge or go idle.  Models of more than 24 blocks are searched first with runs of
   blocks merged into 24, then refined on the real blocks.
4. Finally, pipeline speed is traded for a shorter averaging round where the total gains.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ravq.config import ClusterPlan, Plan, Topology

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
        slowest_link = self.slowest_link()
        if slowest_link is not None:
            lines.append(f"slowest link: {slowest_link[0]} {_ms(slowest_link[1])}")
        lines.append(f"averaging: {_ms(self.averaging_s)} per round every {self.sync_every} steps, "
                     f"costs {self.averaging_cost_samples_per_s:.4g} samples/s")
        lines.append(f"predicted: {self.samples_per_s:.4g} samples/s "
                     f"({self.samples_per_s_without_averaging:.4g} without averaging, "
                     f"micro_batch {self.micro_batch})")
        return "\n".join(lines)


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} bytes"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if math.isfinite(seconds) else "inf"


# ----------------------------------------------------------------------------------------------------
# The problem in arrays


class _Problem:
    """Nodes and blocks as arrays, and the per-cluster dynamic programme over cut points."""

    TIMES_CACHED = 256
    """Stage-time matrices kept (each (blocks + 1)^2 floats)."""

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
        self.fwd_s_per_byte = np.where(bw > 0, 1.0 / np.where(bw > 0, bw, 1.0), _SLOW_S_PER_BYTE)
        self.bwd_s_per_byte = self.fwd_s_per_byte.T
        self.lat = (lat + lat.T) / 2
        self.param = np.array([b.param_bytes for b in blocks], dtype=float)
        self.act = np.full(self.B + 1, _INF)       # act[e]: bytes crossing a cut before block e
        self.grad = np.full(self.B + 1, _INF)
        self.act[1:self.B] = [b.act_bytes_out for b in blocks[:-1]]
        self.grad[1:self.B] = [b.act_bytes_out if b.grad_bytes_out is None else b.grad_bytes_out
                               for b in blocks[:-1]]
        self.work_span = _spans(np.array([b.fwd_flops + b.bwd_flops for b in blocks], dtype=float))
        self.param_span = _spans(self.param)
        self.static_span = _spans(np.array([b.memory_bytes - b.max_inflight * b.inflight_bytes for b in blocks],
                                           dtype=float))
        self.inflight_span = _spans(np.array([b.inflight_bytes for b in blocks], dtype=float))
        self._mem_span: dict[int, np.ndarray] = {}
        self._times: dict[tuple[int, int], np.ndarray] = {}
        self._links: dict[tuple[int, int], np.ndarray] = {}
        self._min_link: dict[tuple[tuple[int, ...], ...], np.ndarray] = {}
        self.ops = 0
        """Stage steps of the dynamic programme run so far: the unit of the search budget."""
        self.op_cost_s = 15e-6 + 3.5e-9 * (self.B + 1) ** 2
        """Rough time of one stage step, to turn a time budget into a (deterministic) step budget."""

    def inflight_for(self, stages: int) -> int:
        return self.max_inflight if self.max_inflight is not None else stages

    def mem_span(self, stages: int) -> np.ndarray:
        """mem_span[s, e]: memory of a stage holding blocks [s, e) in a cluster of ``stages`` stages."""
        k = self.inflight_for(stages)
        if k not in self._mem_span:
            self._mem_span[k] = self.static_span + k * self.inflight_span
        return self._mem_span[k]

    def model_memory(self, stages: int) -> float:
        return float(self.mem_span(stages)[0, self.B])

    def stage_times(self, node: int, stages: int) -> np.ndarray:
        """times[s, e]: compute time of blocks [s, e) on ``node``; inf where it does not fit."""
        key = (node, self.inflight_for(stages))
        t = self._times.get(key)
        if t is None:
            t = np.where(self.mem_span(stages) <= self.mem[node], self.work_span / self.flops[node], _INF)
            if len(self._times) >= self.TIMES_CACHED:
                del self._times[next(iter(self._times))]
            self._times[key] = t
        return t

    def link_times(self, a: int, b: int) -> np.ndarray:
        """link[e]: time of the link a -> b when the cut is before block e (inf at 0 and B)."""
        t = self._links.get((a, b))
        if t is None:
            t = self.act * self.fwd_s_per_byte[a, b] + self.grad * self.bwd_s_per_byte[a, b] + self.lat[a, b]
            self._links[(a, b)] = t
        return t

    def bottleneck(self, order: Sequence[int], limit: float = _INF) -> float:
        """Smallest achievable max(stage time, link time) for this node order; inf if it does not fit in
        memory or cannot beat ``limit``."""
        return self._dp(order, limit, None, want_bounds=False)[0]

    def partition(self, order: Sequence[int], caps: np.ndarray | None = None) -> tuple[float, list[int]]:
        """The bottleneck and stage bounds [0, b1, ..., B] achieving it (``caps[node]``: most parameter
        bytes the node may hold); bounds are empty when nothing fits."""
        return self._dp(order, _INF, caps, want_bounds=True)

    def _dp(self, order: Sequence[int], limit: float, caps: np.ndarray | None,
            want_bounds: bool) -> tuple[float, list[int]]:
        k = len(order)
        best = self._capped(order[0], k, caps)[0]    # best[e]: bottleneck so far, current stage ending before e
        args = []
        for j in range(1, k):
            self.ops += 1
            reach = np.maximum(best, self.link_times(order[j - 1], order[j]))
            if reach.min() >= limit:
                return _INF, []
            cand = np.maximum(reach[:, None], self._capped(order[j], k, caps))
            if want_bounds:
                args.append(cand.argmin(axis=0))
                best = cand[args[-1], np.arange(self.B + 1)]
            else:
                best = cand.min(axis=0)
        value = float(best[self.B])
        if not want_bounds or not math.isfinite(value):
            return value, []
        bounds = [self.B]
        for arg in reversed(args):
            bounds.append(int(arg[bounds[-1]]))
        return value, [0, *bounds[::-1]] if k > 1 else [0, self.B]

    def insertions(self, order: Sequence[int], x: int) -> list[float]:
        """Bottleneck of ``order`` with ``x`` inserted before position j, for every j in 0..len(order):
        one pass forward and one backward over the order, then one step per position."""
        k, last = len(order) + 1, self.B
        times, own = [self.stage_times(node, k) for node in order], self.stage_times(x, k)
        if not order:
            return [float(own[0, last])]
        heads = [times[0][0]]                 # heads[j][e]: order[:j + 1] holds blocks [0, e)
        for j in range(1, len(order)):
            reach = np.maximum(heads[-1], self.link_times(order[j - 1], order[j]))
            heads.append(np.maximum(reach[:, None], times[j]).min(axis=0))
        tails = [times[-1][:, last]]          # tails[j][s]: order[j:] holds blocks [s, B)
        for j in range(len(order) - 2, -1, -1):
            onward = np.maximum(self.link_times(order[j], order[j + 1]), tails[0])
            tails.insert(0, np.maximum(times[j], onward[None, :]).min(axis=1))
        start, end = np.full(last + 1, _INF), np.full(last + 1, _INF)
        start[0], end[last] = 0.0, 0.0
        values = []
        for j in range(k):
            before = np.maximum(heads[j - 1], self.link_times(order[j - 1], x)) if j > 0 else start
            after = np.maximum(self.link_times(x, order[j]), tails[j]) if j < len(order) else end
            values.append(float(np.maximum(np.maximum(before[:, None], own), after[None, :]).min()))
        self.ops += 3 * len(order)
        return values

    def _capped(self, node: int, k: int, caps: np.ndarray | None) -> np.ndarray:
        t = self.stage_times(node, k)
        if caps is None or not math.isfinite(caps[node]):
            return t
        return np.where(self.param_span <= caps[node], t, _INF)

    def min_link_out(self, clusters: Sequence[Sequence[int]]) -> np.ndarray:
        """Per node: slowest symmetric link to a node of another cluster (inf with one cluster)."""
        key = tuple(sorted(tuple(sorted(c)) for c in clusters))
        out = self._min_link.get(key)
        if out is None:
            if len(self._min_link) >= 4096:
                self._min_link.clear()
            out = self._min_link[key] = self._min_link_out(key)
        return out

    def _min_link_out(self, clusters: Sequence[Sequence[int]]) -> np.ndarray:
        owner = np.full(self.n, -1)
        for c, members in enumerate(clusters):
            owner[list(members)] = c
        out = np.full(self.n, _INF)
        for c, members in enumerate(clusters):
            others = np.flatnonzero((owner >= 0) & (owner != c))
            if len(others):
                rows = np.array(members, dtype=int)
                out[rows] = self.bw_sym[np.ix_(rows, others)].min(axis=1)
        return out

    def ring_factor(self, clusters: int) -> float:
        return 2 * (clusters - 1) / clusters

    def samples_per_s(self, rates: Sequence[float], averaging_s: float) -> float:
        s, total = self.sync_every, 0.0
        for r in rates:
            if r > 0:
                period = s / r
                total += s / (max(period, averaging_s) if self.overlap_averaging else period + averaging_s)
        return self.micro_batch * total


def _spans(values: np.ndarray) -> np.ndarray:
    """spans[s, e] = sum(values[s:e]) for e > s, inf otherwise."""
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    span = prefix[None, :] - prefix[:, None]
    return np.where(np.triu(np.ones_like(span, dtype=bool), k=1), span, _INF)


def _lookup(nodes: Sequence[NodeProfile], a: int, b: int, attr: str) -> float:
    """Measurement a -> b, else b -> a (a link measured from one side only is taken as symmetric)."""
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


def _coarsen(blocks: Sequence[BlockProfile], groups: int) -> list[BlockProfile]:
    """Runs of consecutive blocks merged into ``groups`` blocks, for a cheaper first search."""
    bounds = [round(i * len(blocks) / groups) for i in range(groups + 1)]
    merged = []
    for lo, hi in itertools.pairwise(bounds):
        run, last = blocks[lo:hi], blocks[hi - 1]
        inflight = sum(b.inflight_bytes for b in run)
        static = sum(b.memory_bytes - b.max_inflight * b.inflight_bytes for b in run)
        merged.append(BlockProfile(
            name=run[0].name, param_bytes=sum(b.param_bytes for b in run), fwd_flops=sum(b.fwd_flops for b in run),
            bwd_flops=sum(b.bwd_flops for b in run), act_bytes_out=last.act_bytes_out,
            grad_bytes_out=last.grad_bytes_out, memory_bytes=static + inflight, inflight_bytes=inflight))
    return merged


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
    return p.samples_per_s([1.0 / max(lay.bottleneck, 1e-12) for lay in layouts], _averaging_s(p, layouts))


# ----------------------------------------------------------------------------------------------------
# The search

Clusters = list[tuple[int, ...]]


class _Search:
    """Deterministic heuristic search over partitions, orders and cuts of one problem.

    ``layout`` caches, per set of nodes, the best order found so far; ``improve`` moves nodes between
    clusters.  Work is counted in DP stage steps against a budget, never in wall time, so the same input
    always gives the same plan."""

    def __init__(self, p: _Problem, *, usable: list[int], max_clusters: int, allow_idle: bool,
                 budget_s: float, hints: dict[tuple[int, ...], tuple[int, ...]] | None = None) -> None:
        self.p, self.usable, self.max_clusters, self.allow_idle = p, usable, max_clusters, allow_idle
        self.budget = p.ops + int(budget_s / p.op_cost_s)
        self.exhaustive = 5 if p.op_cost_s < 25e-6 else 4
        """Clusters up to this many nodes try every order."""
        self.hints = hints or {}
        self._best: dict[tuple[int, ...], _Layout | None] = {}
        self._full: set[tuple[int, ...]] = set()
        self.need = [0.0] + [p.model_memory(k) for k in range(1, p.n + 1)]

    def known_orders(self) -> dict[tuple[int, ...], tuple[int, ...]]:
        """The best order found for every set of nodes that fits."""
        return {key: lay.order for key, lay in self._best.items() if lay is not None}

    def spent(self) -> bool:
        return self.p.ops >= self.budget

    # --- one cluster

    def layout(self, members: Sequence[int], full: bool = False) -> _Layout | None:
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
        value = self.p.bottleneck(order, known.bottleneck if known else _INF)
        self._store(key, order, value)

    def _store(self, key: tuple[int, ...], order: tuple[int, ...] | None, value: float) -> None:
        known = self._best.get(key)
        if order is not None and math.isfinite(value) and (known is None or value < known.bottleneck):
            bottleneck, bounds = self.p.partition(order)
            self._best[key] = _Layout(order=tuple(order), bounds=tuple(bounds), bottleneck=bottleneck)
        else:
            self._best.setdefault(key, None)

    def _best_of(self, orders: Sequence[tuple[int, ...]]) -> tuple[float, tuple[int, ...] | None]:
        best, best_order = _INF, None
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
        return _score(self.p, fitting)

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
            seeds.append(min((i for i in nodes if i not in seeds), key=lambda i: (_bucket(nearest[i]), -p.mem[i])))
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
        linked = {i: _bucket(float(np.median(p.bw_sym[i, [j for j in pool if j != i]]))) if len(pool) > 1 else 0
                  for i in pool}
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
        others = sorted((c for c in clusters if c is not src), key=lambda c: (-_bucket(p.bw_sym[x, list(c)].min()), c))
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

    def tune_averaging(self, clusters: Clusters) -> list[_Layout]:
        """Give up pipeline speed for a shorter averaging round where the total gains."""
        p = self.p
        clusters = self.fitting(clusters)
        layouts = [lay for lay in (self.layout(c, full=True) for c in clusters) if lay is not None]
        best, t0 = _score(p, layouts), _averaging_s(p, layouts)
        if len(clusters) < 2 or not 0 < t0 < _INF:
            return layouts
        caps_per_s = p.min_link_out(clusters) / p.ring_factor(len(clusters))
        for scale in (0.9, 0.75, 0.6, 0.45, 0.3, 0.2, 0.1, 0.05):
            cand = []
            for lay in layouts:
                value, bounds = p.partition(lay.order, t0 * scale * caps_per_s)
                if bounds:
                    cand.append(_Layout(order=lay.order, bounds=tuple(bounds), bottleneck=value))
            if len(cand) == len(layouts) and _score(p, cand) > best * (1 + 1e-9):
                best, layouts = _score(p, cand), cand
        return layouts


def _bucket(bandwidth: float) -> float:
    """Link speeds within a factor 1.5 of each other count as equal when grouping nodes."""
    if bandwidth <= 0:
        return -1e9
    return round(math.log(bandwidth) / math.log(1.5)) if bandwidth < _INF else 1e9


def _cluster_counts(limit: int) -> list[int]:
    counts = set(range(1, min(limit, 8) + 1))
    c = 8.0
    while c < limit:
        c *= 1.3
        counts.add(min(limit, int(c)))
    return sorted(counts)


def _explore(search: _Search) -> list[tuple[float, Clusters]]:
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
            screened[tuple(clusters)] = search.value(clusters)
    ranked = sorted(((v, list(c)) for c, v in screened.items()), key=lambda r: (-r[0], r[1]))
    results = ranked[:1]
    for i, (_, clusters) in enumerate(ranked):
        if search.spent():
            break
        share = (search.budget - p.ops) // max(1, 3 - i)
        results.append(search.improve(clusters, p.ops + share))
    return sorted(results, key=lambda r: (-r[0], r[1]))


def _link_pools(p: _Problem, usable: list[int], most: int = 8) -> list[list[int]]:
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


# ----------------------------------------------------------------------------------------------------
# Public entry points


def make_plan(nodes: Sequence[NodeProfile], blocks: Sequence[BlockProfile], *, micro_batch: int,
              sync_every: int, max_clusters: int | None = None, max_inflight: int | None = None,
              overlap_averaging: bool = False, allow_idle: bool = True,
              effort: float = 1.0) -> tuple[Plan, Explanation]:
    """Clusters, node order and cuts maximising predicted samples/s; every stage fits its node's memory.

    ``max_inflight`` None: a k-stage cluster keeps k micro-batches in flight.  ``allow_idle``: nodes may be
    left out when that predicts more samples/s (nodes that cannot hold any block always are).  ``effort``
    scales the search budget (about one second at 1.0).  Deterministic.  Raises PlanError, saying how
    much memory is missing, when nothing fits.
    """
    p = _Problem(nodes, blocks, max_inflight=max_inflight, micro_batch=micro_batch, sync_every=sync_every,
                 overlap_averaging=overlap_averaging)
    usable, idle = _usable_nodes(p)
    if not usable or (idle and not allow_idle):
        raise _memory_error(p)
    fits = int(p.mem[usable].sum() // p.model_memory(1))
    limit = max(1, min(len(usable), fits, max_clusters or len(usable)))
    if p.B > _COARSE_BLOCKS:
        coarse = _Problem(nodes, _coarsen(blocks, _COARSE_BLOCKS), max_inflight=max_inflight,
                          micro_batch=micro_batch, sync_every=sync_every, overlap_averaging=overlap_averaging)
        rough = _Search(coarse, usable=usable, max_clusters=limit, allow_idle=allow_idle, budget_s=0.8 * effort)
        found = [c for v, c in _explore(rough) if v > 0] or [rough.fill(usable)]
        search = _Search(p, usable=usable, max_clusters=limit, allow_idle=allow_idle, budget_s=0.8 * effort,
                         hints=rough.known_orders())
        results = [search.improve(c, search.p.ops + (search.budget - search.p.ops) // (2 - i))
                   for i, c in enumerate(found[:2])]
    else:
        search = _Search(p, usable=usable, max_clusters=limit, allow_idle=allow_idle, budget_s=1.5 * effort)
        results = _explore(search)
    value, clusters = max(results, key=lambda r: (r[0], [(-len(c), c) for c in r[1]]))
    if value <= 0:
        raise _memory_error(p)
    layouts = search.tune_averaging(clusters)
    used = {i for lay in layouts for i in lay.order}
    idle.update({i: "leaving it out predicts more samples/s" for i in usable if i not in used})
    return _result(p, layouts, idle)


_COARSE_BLOCKS = 24
"""Models with more blocks are first searched with runs of blocks merged into this many."""


def _usable_nodes(p: _Problem) -> tuple[list[int], dict[int, str]]:
    smallest = float(np.diagonal(p.mem_span(1), offset=1).min())
    usable = [i for i in range(p.n) if p.mem[i] >= smallest]
    idle = {i: f"cannot hold even the smallest block ({smallest / _GIB:.3g} GiB needed, "
               f"{p.mem[i] / _GIB:.3g} GiB available)" for i in range(p.n) if p.mem[i] < smallest}
    return usable, idle


def cut_plan(clusters: Sequence[Sequence[str]], nodes: Sequence[NodeProfile], blocks: Sequence[BlockProfile], *,
             micro_batch: int, sync_every: int, max_inflight: int | None = None,
             overlap_averaging: bool = False) -> tuple[Plan, Explanation]:
    """The best cuts for clusters and stage orders the user fixed (node names in stage order)."""
    p = _Problem(nodes, blocks, max_inflight=max_inflight, micro_batch=micro_batch, sync_every=sync_every,
                 overlap_averaging=overlap_averaging)
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
            raise PlanError(f"cluster {c} ({', '.join(names)}): its blocks do not fit in its nodes' memory in this "
                            f"order: the model needs {_size(need)}, the nodes have {_size(have)}"
                            + (f": {_size(need - have)} missing" if need > have else ""))
        layouts.append(_Layout(order=order, bounds=tuple(bounds), bottleneck=bottleneck))
    used = {i for lay in layouts for i in lay.order}
    return _result(p, layouts, {i: "not in any cluster of the topology" for i in range(p.n) if i not in used})


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
        if any(b >= e for b, e in itertools.pairwise(bounds)):
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
    plan = Plan(epoch=0, clusters=[ClusterPlan(nodes=[p.names[i] for i in lay.order],
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
    shortfall = min(p.model_memory(k) - float(mems[:k].sum()) for k in range(1, p.n + 1))
    if shortfall > 0:
        return PlanError(
            f"no plan fits in memory: the model needs at least {p.model_memory(1) / _GIB:.3g} GiB (parameters, "
            f"gradients, optimizer state, stashes for in-flight micro-batches) and the nodes have "
            f"{p.mem.sum() / _GIB:.3g} GiB in all, less than any pipeline of them needs: "
            f"{_size(shortfall)} missing")
    extra = min(_packing_shortfall(p, k) for k in range(1, p.n + 1))
    return PlanError(
        f"no plan fits in memory: the nodes have {p.mem.sum() / _GIB:.3g} GiB in all but the blocks cannot be "
        f"cut into contiguous stages that fit: about {_size(extra)} more on each node is missing")


def _packing_shortfall(p: _Problem, k: int) -> float:
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


def topology_clusters(topology: Topology) -> list[list[str]]:
    """Node names per cluster in stage order, from the topology (one cluster when none is set)."""
    nodes = topology.nodes
    if all(n.cluster is None for n in nodes):
        return [[n.name for n in nodes]]
    clusters: dict[int, list[tuple[int, int, str]]] = {}
    for i, n in enumerate(nodes):
        assert n.cluster is not None   # the topology sets it on every node or on none
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


# ----------------------------------------------------------------------------------------------------
# Ravnest's rule, for comparison


def ravnest_plan(nodes: Sequence[NodeProfile], blocks: Sequence[BlockProfile], *, micro_batch: int,
                 sync_every: int, seed: int = 0, max_clusters: int = 5, population: int = 200,
                 generations: int = 500, mutation_rate: float = 0.01, split: str = "memory",
                 max_inflight: int | None = None, overlap_averaging: bool = False) -> tuple[Plan, Explanation]:
    """Ravnest's planner reimplemented: a genetic algorithm assigns nodes to clusters so that each cluster
    has the model's RAM (penalty 100 x GiB short) and clusters have similar "speed" (sum of RAM/bandwidth);
    each cluster then cuts the model, nodes in listing order, into stages sized in proportion to the
    nodes' RAM (``split="memory"``, as Ravnest's split percentages) or of equal parameter size
    (``split="equal"``, as pippy's split_into_equal_size).  Scored with this module's cost model;
    PlanError when its stages do not fit in memory."""
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
        if split == "equal":
            weights, shares = p.param, np.ones(len(order))
        else:
            weights, shares = np.diagonal(p.mem_span(len(order)), offset=1), p.mem[list(order)]
        layouts.append(_fixed_layout(p, order, _proportional_bounds(weights, shares)))
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
