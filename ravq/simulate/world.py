"""What the simulator runs on: clusters of stages with their compute times and message sizes, the
network between nodes, the hosts whose cores nodes share, and ravq's training settings.

``build_world`` makes one from what the planner has (node and block profiles) and a plan; stage
compute times come from each node's FLOP/s, or from measured per-stage times when given.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from ravq.config import Plan
from ravq.config.averaging import AveragingConfig
from ravq.config.batch import default_inflight
from ravq.planner import BlockProfile, NodeProfile
from ravq.planner.pacing import round_steps
from ravq.planner.types import message_seconds

INF = math.inf


@dataclass(kw_only=True, slots=True, frozen=True)
class StageSpec:
    node: str
    fwd_s: float
    """Compute seconds of one micro-batch's forward on this node (alone on its cores)."""
    bwd_s: float
    """Compute seconds of its backward, optimizer step included."""
    act_bytes: float
    """Bytes sent to the next stage per micro-batch (0 on the last stage)."""
    grad_bytes: float
    """Bytes sent back to the previous stage per micro-batch (0 on the first stage)."""
    param_bytes: float
    blocks: tuple[int, int]
    """Blocks [first, end) this stage holds."""
    cv: float | None = None
    """Coefficient of variation of this stage's compute times; None: ``Settings.jitter``."""


@dataclass(kw_only=True, slots=True, frozen=True)
class SegmentSpec:
    """A run of blocks held by the same node in every cluster: one ring."""

    blocks: tuple[int, int]
    nbytes: float
    holders: tuple[str, ...]
    """The holder in each cluster, in cluster order."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Settings:
    steps: int = 200
    """Micro-batches each cluster trains on (training.steps)."""
    micro_batch: int = 16
    max_inflight: int | None = None
    """Micro-batches in flight per cluster; None: as its nodes take it (``window``)."""
    inflight_warmup_steps: int = 0
    """Stage 0 keeps one micro-batch in flight until its version reaches this
    (training.inflight_warmup_steps)."""
    update_every: int = 1
    sync_every: int = 10
    overlap_averaging: bool = True
    averaging_lead: int = 1
    piece_bytes: int = 4 << 20
    """ring_chunk_bytes: the piece size rings stream in."""
    pending_rounds: int = 2
    """Rounds a node queues behind the running one before its compute thread waits
    (``ravq.average.round_queue.PENDING_ROUNDS``)."""
    ring_timeout_s: float = 30.0
    """timeouts.ring_step_s: a ring with a dead member aborts after this long."""
    lost_s: float = 6.0
    """timeouts.lost_s: a failed node's cluster leaves the rings this long after it failed (a new plan
    epoch, which abandons every open round); it is let back in (another epoch) when it trains again."""
    hold_s: float = 1.5
    """A stage holding back for a round stops waiting once a cluster of the round has been silent this long
    (``Averager.hold_s``: 1.5 heartbeat intervals) and trains on."""
    averaging_mode: str = "global"
    """averaging.mode: "global" (one set of rings over every live cluster) or "groups"
    (``ravq.average.groups``: a grid of groups of at most ``group_size`` clusters, a new axis each round)."""
    group_size: int = 2
    group_rates: tuple[float, ...] | None = None
    """Per cluster, the plan's predicted rate: groups place clusters by it (fastest first); None: shuffled."""
    round_steps: tuple[int, ...] | None = None
    """Per cluster, optimizer steps between its rounds (rate pacing, ``ravq.planner.pacing.round_steps``):
    each cluster then trains ``steps`` x its share / ``sync_every`` micro-batches, as many rounds as the
    others; None: every cluster ``sync_every`` (steps pacing)."""
    round_period_s: float | None = None
    """Rate pacing by time (``AveragingConfig.period_s``): round k is ended by a node's first step once
    (k + 1) x this many seconds have passed since its first step in the plan epoch; None: ``round_steps``."""
    every: tuple[int, ...] | None = None
    """Per cluster, pacing by link (``ravq.planner.pacing``): it takes part in every k-th round only, the
    others' groups formed without it; None: every round."""
    finish_poll_s: float = 0.0
    """A later stage done with its micro-batches learns that stage 0 finished when its compute thread
    next wakes: at a message or an averaging round, else after this long (``ravq.stage.schedule.WAIT_S``);
    its wall time runs until then.  0: at once."""
    churn_per_hour: float = 0.0
    """Failures per node per hour (exponential); 0: none."""
    restart_s: float = 30.0
    """From a failure to the node process running again (systemd restart, start-up)."""
    jitter: float = 0.0
    """Coefficient of variation of compute times (lognormal); 0: every micro-batch takes the same time."""
    seed: int = 0
    fluid_ring_pieces: int = 20_000
    """Rings whose round would move more pieces than this are simulated as flows, not piece by piece."""
    state_factor: float = 1.0
    """Averaged bytes per parameter byte (1 + optimizer state when that is averaged)."""
    message_overhead_s: float = 0.0
    """Compute-thread seconds each forward and backward spends besides the model (snapshots, calls)."""
    pipeline_wire: float = 1.0
    """Wire bytes per float32 byte of activations and gradients (training.compress.pipeline, ``Wire``)."""
    ring_wire: float = 1.0
    """Wire bytes per float32 byte of ring pieces (training.compress.ring)."""

    def window(self, stages: int) -> int:
        """Micro-batches in flight in a cluster of ``stages`` stages: ``max_inflight``, else the nodes'
        default (``ravq.config.batch.default_inflight``: one update stale at most)."""
        return self.max_inflight or default_inflight(stages, self.update_every)

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batch", "update_every", "sync_every", "averaging_lead", "piece_bytes",
                     "pending_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_inflight is not None and self.max_inflight < 1:
            raise ValueError(f"max_inflight: must be >= 1, got {self.max_inflight}")
        for name in ("churn_per_hour", "restart_s", "jitter", "ring_timeout_s", "message_overhead_s",
                     "inflight_warmup_steps", "lost_s", "finish_poll_s", "hold_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.averaging_mode not in ("global", "groups") or self.group_size < 2:
            raise ValueError(f"averaging: mode global or groups and group_size >= 2, got "
                             f"{self.averaging_mode!r} and {self.group_size}")
        if self.round_steps is not None and min(self.round_steps, default=1) < 1:
            raise ValueError(f"round_steps: every cluster's must be >= 1, got {self.round_steps}")
        if self.round_period_s is not None and not self.round_period_s > 0:
            raise ValueError(f"round_period_s: must be > 0, got {self.round_period_s}")
        if self.every is not None and min(self.every, default=1) < 1:
            raise ValueError(f"every: each cluster's k must be >= 1, got {self.every}")
        for name in ("pipeline_wire", "ring_wire"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(
                    f"{name}: wire bytes per float32 byte must be in (0, 1], got {getattr(self, name)}"
                )



def averaging_settings(settings: Settings, averaging: AveragingConfig) -> Settings:
    """``settings`` averaging as ``averaging`` says (a topology's, or the plan's own): mode, group size and,
    paced by rate with the plan's rates, each cluster's steps between its rounds."""
    paced = averaging.pace == "rate" and averaging.rates is not None
    return replace(settings, averaging_mode=averaging.mode, group_size=averaging.group_size,
                   round_steps=tuple(round_steps(settings.sync_every, averaging.rates)) if paced else None,
                   round_period_s=averaging.period_s if paced else None,
                   every=None if averaging.every is None else tuple(averaging.every))

@dataclass(kw_only=True, slots=True)
class Network:
    """Per node: upload capacity; per pair: the path's bandwidth (a cap per stream) and one-way latency."""

    nodes: Mapping[str, NodeProfile]
    uplink: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, n in self.nodes.items():
            if name not in self.uplink:
                self.uplink[name] = max(n.bandwidth_bytes_per_s.values(), default=INF)

    def bandwidth(self, a: str, b: str) -> float:
        bw = self.nodes[a].bandwidth_bytes_per_s.get(b)
        if bw is None:
            bw = self.nodes[b].bandwidth_bytes_per_s.get(a)
        return INF if bw is None or bw <= 0 else float(bw)

    def latency(self, a: str, b: str) -> float:
        lat = self.nodes[a].latency_s.get(b)
        if lat is None:
            lat = self.nodes[b].latency_s.get(a, 0.0)
        return float(lat)


@dataclass(kw_only=True, slots=True)
class World:
    clusters: list[list[StageSpec]]
    segments: list[SegmentSpec]
    network: Network
    settings: Settings
    hosts: dict[str, str] = field(default_factory=dict)
    """Node -> host, for nodes that share a host's cores (all others have their own)."""
    host_cores: dict[str, float] = field(default_factory=dict)
    """Host -> cores its nodes share (processor sharing, one core at most per node)."""
    block_names: list[str] = field(default_factory=list)
    start_at: dict[str, float] = field(default_factory=dict)
    """Node -> when it is ready to compute (default 0): nodes of a real run start at different times."""


def plan_bounds(plan: Plan, blocks: Sequence[BlockProfile]) -> list[tuple[int, ...]]:
    """Stage bounds [0, b1, ..., B] of every cluster of the plan; ValueError naming a bad cut."""
    index = {b.name: i for i, b in enumerate(blocks)}
    out = []
    for c, cluster in enumerate(plan.clusters):
        unknown = [cut for cut in cluster.cuts if cut not in index]
        if unknown:
            raise ValueError(
                f"plan.clusters[{c}].cuts: {unknown[0]!r} is not a block of the model "
                f"(blocks: {', '.join(b.name for b in blocks[:8])}{', ...' if len(blocks) > 8 else ''})"
            )
        bounds = (0, *(index[cut] for cut in cluster.cuts), len(blocks))
        if any(a >= b for a, b in itertools.pairwise(bounds)) or len(bounds) != len(cluster.nodes) + 1:
            raise ValueError(f"plan.clusters[{c}]: {len(cluster.nodes)} nodes need {len(cluster.nodes) - 1} "
                             f"increasing cuts, got {cluster.cuts}")
        out.append(bounds)
    return out


def stage_averaging_s(node: NodeProfile, blocks: Sequence[BlockProfile], s: int, e: int, clusters: int,
                      micro_batches_per_round: int, state_factor: float = 1.0) -> float:
    """CPU seconds per micro-batch a stage of blocks [s, e) on ``node`` gives to averaging rounds among
    ``clusters`` clusters (``NodeProfile.ring_s_per_byte`` x the values averaged per parameter, as the
    cost model charges)."""
    if clusters < 2:
        return 0.0
    held = state_factor * sum(b.param_bytes for b in blocks[s:e])
    return node.ring_s_per_byte * 2 * (clusters - 1) / clusters * held / micro_batches_per_round


def stage_message_s(node: NodeProfile, blocks: Sequence[BlockProfile], s: int, e: int) -> float:
    """CPU seconds per micro-batch a stage of blocks [s, e) on ``node`` spends on messages: half of the
    activation's and half of the gradient's message at each cut it borders, and for the last stage the
    loss's extra work (``NodeProfile.loss_s``), and for a stage of a pipeline what a node adds around it
    (``NodeProfile.pipeline_stage_s``), as the cost model charges."""
    total = node.loss_s if e == len(blocks) else 0.0
    if (s, e) != (0, len(blocks)):
        total += node.pipeline_stage_s
    for cut in (s, e):
        if 0 < cut < len(blocks):
            block = blocks[cut - 1]
            total += (message_seconds(node.message_s, block.act_bytes_out)
                      + message_seconds(node.message_s, _grad_bytes(block))) / 2
    return total


def build_world(
    plan: Plan,
    nodes: Sequence[NodeProfile],
    blocks: Sequence[BlockProfile],
    settings: Settings,
    *,
    stage_times: Mapping[str, tuple[float, float]] | None = None,
    stage_cv: Mapping[str, float] | None = None,
    hosts: Mapping[str, str] | None = None,
    host_cores: Mapping[str, float] | None = None,
    uplink: Mapping[str, float] | None = None,
    start_at: Mapping[str, float] | None = None,
) -> World:
    """The world of ``plan`` on these profiles.  ``stage_times``: node -> (forward s, backward s) measured,
    instead of block FLOPs over the node's FLOP/s; ``stage_cv``: node -> measured spread of its compute
    times.  ``hosts``/``host_cores``: nodes that share cores."""
    if not plan.clusters:
        raise ValueError("plan: no clusters")
    by_name = {n.name: n for n in nodes}
    seen: set[str] = set()
    for c, cluster in enumerate(plan.clusters):
        for name in cluster.nodes:
            if name not in by_name:
                raise ValueError(f"plan.clusters[{c}]: no profile for node {name!r}")
            if name in seen:
                raise ValueError(f"plan.clusters[{c}]: node {name!r} appears twice in the plan")
            seen.add(name)
            if not by_name[name].flops > 0 and not (stage_times and name in stage_times):
                raise ValueError(f"node {name}: flops must be > 0, got {by_name[name].flops}")
    all_bounds = plan_bounds(plan, blocks)
    clusters = []
    for cluster, bounds in zip(plan.clusters, all_bounds):
        stages = []
        for j, name in enumerate(cluster.nodes):
            s, e = bounds[j], bounds[j + 1]
            fwd = sum(b.fwd_flops for b in blocks[s:e])
            bwd = sum(b.bwd_flops for b in blocks[s:e])
            if stage_times and name in stage_times:
                fwd_s, bwd_s = stage_times[name]
            else:
                # FLOPs, and the CPU time of messages, the loss and averaging rounds split between the passes
                overhead = stage_message_s(by_name[name], blocks, s, e) + stage_averaging_s(
                    by_name[name],
                    blocks,
                    s,
                    e,
                    len(plan.clusters),
                    settings.sync_every * settings.update_every,
                    settings.state_factor,
                )
                fwd_s = fwd / by_name[name].flops + overhead / 2
                bwd_s = bwd / by_name[name].flops + overhead / 2
            last = e == len(blocks)
            act = 0.0 if last else float(blocks[e - 1].act_bytes_out) * settings.pipeline_wire
            grad = 0.0 if s == 0 else float(_grad_bytes(blocks[s - 1])) * settings.pipeline_wire
            stages.append(StageSpec(node=name, fwd_s=fwd_s, bwd_s=bwd_s, act_bytes=act, grad_bytes=grad,
                                    param_bytes=float(sum(b.param_bytes for b in blocks[s:e])), blocks=(s, e),
                                    cv=(stage_cv or {}).get(name)))
        clusters.append(stages)
    segments = ring_segments(clusters, blocks, settings.state_factor * settings.ring_wire)
    network = Network(nodes=by_name, uplink=dict(uplink or {}))
    hosts = dict(hosts or {})
    cores = dict(host_cores or {})
    for node, host in hosts.items():
        if host not in cores:
            raise ValueError(f"hosts: node {node} is on host {host!r}, which has no core count")
        if not cores[host] > 0:
            raise ValueError(f"host_cores[{host!r}]: must be > 0, got {cores[host]}")
    return World(clusters=clusters, segments=segments, network=network, settings=settings, hosts=hosts,
                 host_cores=cores, block_names=[b.name for b in blocks], start_at=dict(start_at or {}))


def _grad_bytes(block: BlockProfile) -> int:
    return block.act_bytes_out if block.grad_bytes_out is None else block.grad_bytes_out


def ring_segments(clusters: Sequence[Sequence[StageSpec]], blocks: Sequence[BlockProfile],
                  state_factor: float = 1.0) -> list[SegmentSpec]:
    """Runs of blocks with the same holder in every cluster (the union of all clusters' cuts), as
    ``ravq.average.segments.plan_segments`` groups named tensors; one ring each (none with one
    cluster).  A segment's bytes are its parameter bytes x ``state_factor`` (averaged bytes, on the
    wire, per parameter byte)."""
    if len(clusters) < 2:
        return []
    holder = [[""] * len(blocks) for _ in clusters]
    for c, stages in enumerate(clusters):
        for st in stages:
            for b in range(*st.blocks):
                holder[c][b] = st.node
    segments: list[SegmentSpec] = []
    start = 0
    for b in range(1, len(blocks) + 1):
        if b == len(blocks) or any(h[b] != h[start] for h in holder):
            nbytes = state_factor * sum(x.param_bytes for x in blocks[start:b])
            segments.append(SegmentSpec(blocks=(start, b), nbytes=float(nbytes),
                                        holders=tuple(h[start] for h in holder)))
            start = b
    return segments
