"""The cost model: how fast a layout of clusters trains, on the arrays of ``ravq.planner.problem``.

Per micro-batch (docs/design.md, "Planner and profiler"):

- A stage on node n holding blocks [s, e) computes for sum(fwd + bwd FLOPs) / n.flops seconds and needs
  sum(memory_bytes) bytes, a hard limit.  Its messages take CPU time too (``NodeProfile.message_s``,
  measured by ``ravq profile``): for each cut it borders, half of the activation's message (packing and
  sending, or receiving and unpacking) and half of the gradient's, so a middle stage pays two messages
  per micro-batch and the first and last one each.  On a PC of a seventh of a core the stages of a
  pipeline computed 1.22-1.33x what their FLOPs said (issue #14); int8 packing, CURVE and ZeroMQ's I/O,
  which share the CPU with the compute, are part of that (2 x ~8 ms of ~100 ms for a middle stage).
  The stage that holds the last block also pays the loss (``NodeProfile.loss_s``: the task's loss
  forward and backward and its metrics, which ``ravq profile`` times apart and leaves out of the
  FLOP/s; issue #26).  Every stage of a pipeline (not a whole copy) also pays what a node adds around
  a stage (``NodeProfile.pipeline_stage_s``: ``ravq profile`` times the model as two stages over the
  node's own sockets against one stage; 4-17 ms of CPU per micro-batch on issue #26's testbed).
  Averaging rounds take CPU too (``NodeProfile.ring_s_per_byte``: ``ravq profile`` times two copies of
  the model averaging every step over the node's own ring sockets, each with its own ``Averager``):
  among C clusters a stage holding H parameter bytes pays 2(C-1)/C x H x that per round, spread over
  the ``sync_every`` steps between rounds (``Problem.averaging_cpu_s``).  On the testbed's quarter-core
  PCs, six one-stage clusters averaging every 2 steps, the event loop and ZeroMQ's I/O thread took 11%
  of the process's CPU; charged the bare ring's 4-5 ms per round they ran at 0.83 of the prediction,
  charged rounds as a node runs them (3-4x that) at 1.01 (issue #26, docs/testbed.md).  When
  ``max_inflight`` is None every stage of a k-stage cluster stashes k micro-batches (the pipeline's
  default); each block's ``inflight_bytes`` scales with that.
- The link from stage a to stage b (cut before block e) carries the activations crossing the cut one way
  and their gradients back: act/bw(a->b) + grad/bw(b->a) + latency(a, b) seconds, counting the bytes
  as ``training.compress.pipeline`` packs them (``Wire``: int8 sends about a quarter of float32's).
- A cluster runs r = min(1 / max(slowest stage, slowest link), m / cycle) micro-batches per second.
  The first term is the steady state of a pipeline that always has work; the second is Little's law:
  with m = ``max_inflight`` micro-batches in flight (default: one per stage), each taking ``cycle`` =
  every stage's forward and backward plus every link both ways (transfer and latency each way), no
  more than m / cycle finish per second.  Without it the model missed the bubbles that message delays
  leave when m is the number of stages (issue #14: 3-stage pipelines on emulated PCs waited 20-33% of
  the time for inputs or credits and ran at 0.57-0.69x the bottleneck-only prediction).
- Averaging, every ``sync_every`` steps: each node sends 2(C-1)/C of the parameter bytes it holds (the
  sum over its segments, packed as ``training.compress.ring`` packs them) through its ring links.  Ring
  neighbours depend on every cluster's cuts, so the planner charges the node's slowest link to any node
  of another cluster (the worst ring order).  The round lasts as long as its slowest node: T_avg.
- Averaging ties the clusters together.  A round needs every cluster's snapshot at the same version,
  and a stage that is L = ``averaging_lead`` steps past an unfinished round's snapshot waits for it
  (with averaging that pauses training, every round waits for everyone), so no cluster gets more than
  about L steps ahead of the slowest: in the long run every cluster makes optimizer steps at the
  slowest cluster's pace.  One cluster's period for S = ``sync_every`` steps is P(r) = S/r + T_avg when
  averaging pauses training, and P(r) = max(S/r, T_avg, S/r + T_avg - L/r) when it overlaps (rounds
  run one after another; L = S: no wait before the next round).  With C clusters,
  samples/s = micro_batch * C * S / max over clusters of P(r).
  (Until issue #14 the model summed every cluster's own S / P(r), as if clusters were independent; on
  emulated PCs with a 2.5x faster cluster the fast one waited 55-61% of the time, and the plan ran at
  0.56x its prediction.)

A cluster's best cuts for a given node order come from an exact dynamic programme on the bottleneck time
under every node's memory limit (``ravq.planner.problem.Problem.partition``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from ravq.planner.problem import INF, Problem
from ravq.planner.types import GIB, BlockProfile, PlanError

# ----------------------------------------------------------------------------------------------------
# Layouts and their score


@dataclass(frozen=True, slots=True)
class Layout:
    """One cluster: node order, stage bounds [0, b1, ..., B] and the bottleneck time they achieve."""

    order: tuple[int, ...]
    bounds: tuple[int, ...]
    bottleneck: float


def cycle_s(p: Problem, lay: Layout, clusters: int = 1) -> float:
    """One micro-batch's round trip through a cluster: every stage's forward and backward (with its CPU
    time for averaging among ``clusters``), and every link's activations forward, gradients back and its
    latency both ways."""
    total = 0.0
    for j, node in enumerate(lay.order):
        s, e = lay.bounds[j], lay.bounds[j + 1]
        total += p.stage_s(node, s, e) + p.averaging_cpu_s(node, s, e, clusters)
        if j < len(lay.order) - 1:
            nxt = lay.order[j + 1]
            total += float(p.act[e] * p.fwd_s_per_byte[node, nxt] + p.grad[e] * p.bwd_s_per_byte[node, nxt]
                           + 2 * p.lat[node, nxt])
    return total


def cluster_rate(p: Problem, lay: Layout, clusters: int = 1) -> float:
    """Micro-batches per second of one cluster among ``clusters``: the bottleneck's rate (a stage's
    compute including its CPU time for averaging rounds), capped by Little's law."""
    bottleneck = lay.bottleneck
    if clusters > 1:
        for j, node in enumerate(lay.order):
            s, e = lay.bounds[j], lay.bounds[j + 1]
            bottleneck = max(bottleneck, p.stage_s(node, s, e) + p.averaging_cpu_s(node, s, e, clusters))
    rate = 1.0 / max(bottleneck, 1e-12)
    return min(rate, p.inflight_for(len(lay.order)) / max(cycle_s(p, lay, clusters), 1e-12))


def pipeline_bytes_per_s(p: Problem, lay: Layout) -> list[float]:
    """Per stage of ``lay``, the bytes/s its node sends down the pipeline at the cluster's rate (activations
    to the next stage, gradients to the previous): the part of its uplink that rings cannot have."""
    rate = cluster_rate(p, lay)
    return [rate * b for b in _sent_per_micro_batch(p, lay)]


def _sent_per_micro_batch(p: Problem, lay: Layout) -> list[float]:
    """Per stage of ``lay``, the bytes its node sends down the pipeline a micro-batch: its activation to the
    next stage and its gradient to the previous."""
    k = len(lay.order)
    return [(p.act[lay.bounds[j + 1]] if j < k - 1 else 0.0) + (p.grad[lay.bounds[j]] if j > 0 else 0.0)
            for j in range(k)]


def ring_bandwidth(p: Problem, lay: Layout, links: Sequence[float]) -> list[float]:
    """Per stage of ``lay``, what its rings get: its link (``links[j]``, bytes/s) or, when less, its
    uplink less the pipeline's traffic (``pipeline_bytes_per_s``), and never less than a fair share of the
    uplink: the ring's one stream beside the pipeline's streams out of the node (to the next stage, to the
    previous), as TCP and the simulator's water-filling share a saturated link.  Rings and pipeline share one
    uplink: counted at the whole link, a middle stage whose pipeline takes half of it averaged in half the
    time the simulator and the nodes take (issue #38); counted at what is left, a stage whose pipeline fills
    its uplink never averaged, where it averages at its share and the pipeline slows meanwhile
    (``shared_rate``)."""
    sent, k = pipeline_bytes_per_s(p, lay), len(lay.order)
    out = []
    for j, (n, link, pipe) in enumerate(zip(lay.order, links, sent)):
        uplink = float(p.uplink[n])
        streams = int(j < k - 1) + int(j > 0)
        out.append(min(link, max(uplink - pipe, uplink / (1 + streams))))
    return out


def shared_rate(p: Problem, lay: Layout, rate: float, ring_bytes: Sequence[float], every_s: float) -> float:
    """The cluster's micro-batches/s when each stage j's node also sends ``ring_bytes[j]`` of averaging every
    ``every_s`` seconds over its uplink: the uplink carries both, so the pipeline gets what the rings leave
    of it on average (``rate`` when that is enough)."""
    if not every_s > 0:
        return rate
    for j, (n, per_mb) in enumerate(zip(lay.order, _sent_per_micro_batch(p, lay), strict=True)):
        if per_mb > 0 and ring_bytes[j] > 0:
            left = float(p.uplink[n]) - ring_bytes[j] / every_s
            rate = min(rate, max(0.0, left) / per_mb)
    return rate


def averaging_round_s(p: Problem, layouts: Sequence[Layout]) -> float:
    """T_avg: the slowest node's 2(C-1)/C x held parameter bytes over its slowest cross-cluster link, or
    over what the pipeline leaves of its uplink when that is less (``ring_bandwidth``)."""
    if len(layouts) < 2:
        return 0.0
    factor = p.ring_factor(len(layouts))
    slowest = p.min_link_out([lay.order for lay in layouts])
    worst = 0.0
    for lay in layouts:
        bandwidth = ring_bandwidth(p, lay, [slowest[n] for n in lay.order])
        for j, bw in enumerate(bandwidth):
            held = p.param_span[lay.bounds[j], lay.bounds[j + 1]]
            worst = max(worst, factor * held / bw if bw > 0 else INF)
    return worst


def score(p: Problem, layouts: Sequence[Layout]) -> float:
    """Predicted samples/s of these clusters."""
    rates = [cluster_rate(p, lay, len(layouts)) for lay in layouts]
    return p.samples_per_s(rates, averaging_round_s(p, layouts))


def fixed_layout(p: Problem, order: tuple[int, ...], bounds: tuple[int, ...]) -> Layout:
    """The layout of given stage bounds; PlanError when a stage does not fit its node's memory."""
    k = len(order)
    worst = 0.0
    for j, node in enumerate(order):
        s, e = bounds[j], bounds[j + 1]
        if p.mem_span(k)[s, e] > p.mem[node]:
            raise PlanError(f"node {p.names[node]}: stage of blocks {s}-{e - 1} needs "
                            f"{p.mem_span(k)[s, e] / GIB:.3g} GiB, the node has {p.mem[node] / GIB:.3g} GiB")
        worst = max(worst, p.stage_s(node, s, e))
        if j < k - 1:
            worst = max(worst, float(p.link_times(node, order[j + 1])[e]))
    return Layout(order=order, bounds=bounds, bottleneck=worst)


# ----------------------------------------------------------------------------------------------------
# A coarser problem


def coarsen(blocks: Sequence[BlockProfile], groups: int) -> list[BlockProfile]:
    """Runs of consecutive blocks merged into ``groups`` blocks, for a cheaper first search."""
    bounds = [round(i * len(blocks) / groups) for i in range(groups + 1)]
    merged = []
    for lo, hi in itertools.pairwise(bounds):
        run, last = blocks[lo:hi], blocks[hi - 1]
        inflight = sum(b.inflight_bytes for b in run)
        static = sum(b.memory_bytes - b.max_inflight * b.inflight_bytes for b in run)
        merged.append(
            BlockProfile(
                name=run[0].name,
                param_bytes=sum(b.param_bytes for b in run),
                fwd_flops=sum(b.fwd_flops for b in run),
                bwd_flops=sum(b.bwd_flops for b in run),
                act_bytes_out=last.act_bytes_out,
                grad_bytes_out=last.grad_bytes_out,
                memory_bytes=static + inflight,
                inflight_bytes=inflight,
            )
        )
    return merged
