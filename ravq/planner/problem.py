"""The planning problem in arrays: node and block profiles turned into the tables the cost model reads
(stage times, link times, memory, held parameter bytes), and the exact dynamic programme that cuts one
cluster's pipeline under every node's memory limit.

What the numbers mean, and how a layout's rate follows from them: ``ravq.planner.cost``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ravq.config.batch import default_inflight
from ravq.planner.types import BlockProfile, NodeProfile, PlanError, Wire, message_seconds

INF = math.inf
_SLOW_S_PER_BYTE = 1e9
"""Time per byte charged on a link with no measured bandwidth: unusable in practice."""


class Problem:
    """Nodes and blocks as arrays, and the per-cluster dynamic programme over cut points."""

    TIMES_CACHED = 256
    """Stage-time matrices kept (each (blocks + 1)^2 floats)."""

    def __init__(self, nodes: Sequence[NodeProfile], blocks: Sequence[BlockProfile], *,
                 micro_batch: int, sync_every: int, max_inflight: int | None = None,
                 overlap_averaging: bool = False, averaging_lead: int | None = None,
                 wire: Wire | None = None, update_every: int = 1) -> None:
        _check_inputs(nodes, blocks, micro_batch, sync_every)
        self.wire = wire or Wire()
        """Compression of pipeline messages and ring pieces: link times and rounds count wire bytes."""
        self.nodes, self.blocks = list(nodes), list(blocks)
        self.names = [n.name for n in nodes]
        self.n, self.B = len(nodes), len(blocks)
        self.max_inflight, self.micro_batch = max_inflight, micro_batch
        self.update_every = update_every
        """Micro-batches a cluster's optimizer step sums: with ``max_inflight`` unset it bounds the window."""
        self.sync_every = sync_every * update_every
        """Micro-batches between averaging rounds (``sync_every`` optimizer steps of ``update_every``): the
        cost model's step is a micro-batch (its rates are micro-batches/s), and so is its lead."""
        self.overlap_averaging = overlap_averaging
        lead = sync_every if averaging_lead is None else min(averaging_lead, sync_every)
        self.averaging_lead = lead * update_every
        """Micro-batches a stage trains past a round's snapshot before it waits for the round (overlapped
        averaging)."""
        self.flops = np.array([n.flops for n in nodes], dtype=float)
        self.mem = np.array([n.memory_bytes for n in nodes], dtype=float)
        bw = np.array([[_lookup(nodes, a, b, "bandwidth_bytes_per_s") for b in range(self.n)]
                       for a in range(self.n)], dtype=float)
        lat = np.array([[_lookup(nodes, a, b, "latency_s") for b in range(self.n)]
                        for a in range(self.n)], dtype=float)
        self.bw_sym = np.minimum(bw, bw.T)
        np.fill_diagonal(self.bw_sym, INF)
        finite = np.where(np.isfinite(self.bw_sym), self.bw_sym, 0.0).max(axis=1, initial=0.0)
        self.uplink = np.where(finite > 0, finite, INF)
        """Per node, its uplink as its fastest link to another node measures it (inf with none known):
        pipeline and rings share it (``ravq.planner.cost.ring_bandwidth``)."""
        self.fwd_s_per_byte = np.where(bw > 0, 1.0 / np.where(bw > 0, bw, 1.0), _SLOW_S_PER_BYTE)
        self.bwd_s_per_byte = self.fwd_s_per_byte.T
        self.lat = (lat + lat.T) / 2
        self.param = np.array([b.param_bytes for b in blocks], dtype=float)
        self.act = np.full(self.B + 1, INF)       # act[e]: bytes crossing a cut before block e
        self.grad = np.full(self.B + 1, INF)
        self.act[1:self.B] = [b.act_bytes_out for b in blocks[:-1]]
        self.grad[1:self.B] = [b.act_bytes_out if b.grad_bytes_out is None else b.grad_bytes_out
                               for b in blocks[:-1]]
        self.message = np.zeros((self.n, self.B + 1))
        """message[node, c]: CPU time of a stage on ``node`` for the messages crossing a cut before block c
        (its half of the activation's and of the gradient's); 0 at c = 0, which no message crosses..."""
        for i, node in enumerate(nodes):
            if node.message_s:
                self.message[i, 1:self.B] = [(message_seconds(node.message_s, self.act[c])
                                              + message_seconds(node.message_s, self.grad[c])) / 2
                                             for c in range(1, self.B)]
        self.message[:, self.B] = [n.loss_s for n in nodes]
        """...and at c = B, the loss stage's extra work (``NodeProfile.loss_s``): the stage ending there
        pays it."""
        self.pipelined = np.array([n.pipeline_stage_s for n in nodes], dtype=float)
        """Seconds per micro-batch a stage of a pipeline costs a node beyond FLOPs, messages and loss
        (``NodeProfile.pipeline_stage_s``): every stage but a whole copy, blocks [0, B), pays it."""
        self.piece = np.ones((self.B + 1, self.B + 1))
        self.piece[0, self.B] = 0.0
        """piece[s, e]: 1 when a stage of blocks [s, e) is one of several (pays ``pipelined``), else 0."""
        self.ring_cpu = np.array([n.ring_s_per_byte for n in nodes], dtype=float)
        """Seconds of a node's CPU per parameter byte it holds for one averaging round in a ring of two."""
        self.act[1:self.B] *= self.wire.pipeline
        self.grad[1:self.B] *= self.wire.pipeline
        self.work_span = _spans(np.array([b.fwd_flops + b.bwd_flops for b in blocks], dtype=float))
        self.param_span = _spans(self.param)
        self.static_span = _spans(
            np.array([b.memory_bytes - b.max_inflight * b.inflight_bytes for b in blocks], dtype=float)
        )
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
        """Micro-batches in flight in a ``stages``-stage cluster: ``max_inflight``, else the window of
        its stage 0 (``ravq.config.batch.default_inflight``: one per stage, at most ``update_every``)."""
        if self.max_inflight is not None:
            return self.max_inflight
        return default_inflight(stages, self.update_every)

    def mem_span(self, stages: int) -> np.ndarray:
        """mem_span[s, e]: memory of a stage holding blocks [s, e) in a cluster of ``stages`` stages."""
        k = self.inflight_for(stages)
        if k not in self._mem_span:
            self._mem_span[k] = self.static_span + k * self.inflight_span
        return self._mem_span[k]

    def model_memory(self, stages: int) -> float:
        return float(self.mem_span(stages)[0, self.B])

    def stage_s(self, node: int, s: int, e: int) -> float:
        """Time per micro-batch of a stage on ``node`` holding blocks [s, e): its FLOPs at the node's speed,
        its messages' CPU time, for the last stage (e = B) the loss's, and for a stage of a pipeline what a
        node adds around it (``pipelined``)."""
        return float(self.work_span[s, e] / self.flops[node] + self.message[node, s] + self.message[node, e]
                     + self.pipelined[node] * self.piece[s, e])

    def stage_times(self, node: int, stages: int) -> np.ndarray:
        """times[s, e]: ``stage_s`` of blocks [s, e) on ``node``; inf where it does not fit."""
        key = (node, self.inflight_for(stages))
        t = self._times.get(key)
        if t is None:
            seconds = (
                self.work_span / self.flops[node]
                + self.message[node][:, None]
                + self.message[node][None, :]
                + self.pipelined[node] * self.piece
            )
            t = np.where(self.mem_span(stages) <= self.mem[node], seconds, INF)
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

    def bottleneck(self, order: Sequence[int], limit: float = INF) -> float:
        """Smallest achievable time per micro-batch, max(stage time, link time, cycle / in-flight), for
        this node order; inf if it does not fit in memory or cannot beat ``limit``."""
        value = self._dp(order, limit, None, want_bounds=False)[0]
        if len(order) == 1 or not math.isfinite(value):
            return value
        return self._with_cycle(order, value, None)[0]

    def partition(self, order: Sequence[int], caps: np.ndarray | None = None) -> tuple[float, list[int]]:
        """That time per micro-batch and stage bounds [0, b1, ..., B] achieving it (``caps[node]``: most
        parameter bytes the node may hold); bounds are empty when nothing fits."""
        value, bounds = self._dp(order, INF, caps, want_bounds=True)
        if len(order) == 1 or not bounds:
            return value, bounds
        return self._with_cycle(order, value, caps)

    CYCLE_SLACK = (1.0, 1.1, 1.25, 1.5, 2.0, 3.0)
    """Stage-time limits tried, as multiples of the smallest bottleneck, when the in-flight cap binds."""

    def _with_cycle(self, order: Sequence[int], bottleneck: float,
                    caps: np.ndarray | None) -> tuple[float, list[int]]:
        """Cuts minimising max(bottleneck, cycle / in-flight): for a few limits on the stage and link
        times (the smallest bottleneck and multiples of it), the cuts of the shortest cycle within the
        limit; a shorter cycle may be worth a slower slowest stage when few micro-batches are in flight."""
        m = self.inflight_for(len(order))
        best: tuple[float, list[int]] = (INF, [])
        for slack in self.CYCLE_SLACK:
            limit = bottleneck * slack
            if limit >= best[0]:
                break
            cycle, bounds = self._min_cycle(order, limit, caps)
            if bounds:
                value = max(self._bounds_bottleneck(order, bounds), cycle / m)
                if value < best[0]:
                    best = (value, bounds)
                if cycle / m <= limit:  # the cap no longer binds: a larger limit cannot do better
                    break
        return best

    def _min_cycle(
        self, order: Sequence[int], limit: float, caps: np.ndarray | None
    ) -> tuple[float, list[int]]:
        """Shortest cycle (every stage's time plus every link's time with its latency both ways) over
        cuts whose stage and link times are all within ``limit``; its bounds (empty: none)."""
        k = len(order)
        first = self._capped(order[0], k, caps)[0]
        best = np.where(first <= limit, first, INF)
        args = []
        for j in range(1, k):
            self.ops += 1
            a, b = order[j - 1], order[j]
            link = self.link_times(a, b)
            reach = np.where(link <= limit, best + link + self.lat[a, b], INF)
            t = self._capped(b, k, caps)
            cand = reach[:, None] + np.where(t <= limit, t, INF)
            args.append(cand.argmin(axis=0))
            best = cand[args[-1], np.arange(self.B + 1)]
        value = float(best[self.B])
        if not math.isfinite(value):
            return INF, []
        bounds = [self.B]
        for arg in reversed(args):
            bounds.append(int(arg[bounds[-1]]))
        return value, [0, *bounds[::-1]]

    def _bounds_bottleneck(self, order: Sequence[int], bounds: Sequence[int]) -> float:
        k = len(order)
        worst = 0.0
        for j, node in enumerate(order):
            worst = max(worst, float(self.stage_times(node, k)[bounds[j], bounds[j + 1]]))
            if j < k - 1:
                worst = max(worst, float(self.link_times(node, order[j + 1])[bounds[j + 1]]))
        return worst

    def _dp(self, order: Sequence[int], limit: float, caps: np.ndarray | None,
            want_bounds: bool) -> tuple[float, list[int]]:
        k = len(order)
        # best[e]: bottleneck so far, current stage ending before e
        best = self._capped(order[0], k, caps)[0]
        args = []
        for j in range(1, k):
            self.ops += 1
            reach = np.maximum(best, self.link_times(order[j - 1], order[j]))
            if reach.min() >= limit:
                return INF, []
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
        start, end = np.full(last + 1, INF), np.full(last + 1, INF)
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
        return np.where(self.param_span <= caps[node], t, INF)

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
        out = np.full(self.n, INF)
        for c, members in enumerate(clusters):
            others = np.flatnonzero((owner >= 0) & (owner != c))
            if len(others):
                rows = np.array(members, dtype=int)
                out[rows] = self.bw_sym[np.ix_(rows, others)].min(axis=1)
        return out

    def ring_factor(self, clusters: int) -> float:
        """Wire bytes a ring member sends per parameter byte it holds in one round: 2(C-1)/C, compressed."""
        return 2 * (clusters - 1) / clusters * self.wire.ring * self.wire.state

    def averaging_cpu_s(self, node: int, s: int, e: int, clusters: int) -> float:
        """CPU time per micro-batch a stage of blocks [s, e) on ``node`` gives to averaging rounds among
        ``clusters`` clusters: its part of a round (2(C-1)/C x ``ring_cpu`` per parameter byte held)
        spread over the ``sync_every`` steps between rounds."""
        if clusters < 2:
            return 0.0
        return (
            float(
                self.ring_cpu[node] * 2 * (clusters - 1) / clusters * self.wire.state * self.param_span[s, e]
            )
            / self.sync_every
        )

    def samples_per_s(self, rates: Sequence[float], averaging_s: float) -> float:
        """micro_batch * C * S / (the slowest cluster's period of S steps): see ravq.planner.cost."""
        live = [r for r in rates if r > 0]
        if not live:
            return 0.0
        if len(live) == 1:  # nothing to average with: the cluster runs at its own rate
            return self.micro_batch * live[0]
        s, lead = self.sync_every, self.averaging_lead
        slowest = min(live)
        period = s / slowest
        if self.overlap_averaging:  # rounds run one after another; a stage waits lead steps in
            period = max(period, averaging_s, period + averaging_s - lead / slowest)
        else:
            period += averaging_s
        return self.micro_batch * len(live) * s / period


def _spans(values: np.ndarray) -> np.ndarray:
    """spans[s, e] = sum(values[s:e]) for e > s, inf otherwise."""
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    span = prefix[None, :] - prefix[:, None]
    return np.where(np.triu(np.ones_like(span, dtype=bool), k=1), span, INF)


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
