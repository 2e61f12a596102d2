"""What the planner takes and gives: node and block profiles in; per-stage reports and an explanation out."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

GIB = float(1 << 30)


@dataclass(frozen=True, slots=True)
class Wire:
    """Bytes that cross a link per float32 byte, as ``training.compress`` packs them
    (``ravq.codec.compress``): pipeline messages (activations and gradients) and ring pieces.
    1.0: uncompressed."""

    pipeline: float = 1.0
    ring: float = 1.0
    state: float = 1.0
    """Values a ring averages per parameter value: 1, or ``ADAM_STATE`` when
    ``training.average_optimizer_state`` also averages the optimizer's moments (its bytes and its CPU)."""

    @classmethod
    def of(
        cls, pipeline: str, ring: str, int8_block: int = 128, average_optimizer_state: bool = False
    ) -> Wire:
        return cls(pipeline=wire_fraction(pipeline, int8_block), ring=wire_fraction(ring, int8_block),
                   state=ADAM_STATE if average_optimizer_state else 1.0)


ADAM_STATE = 3.0
"""A parameter and Adam's two moments (the built-in tasks' optimizer): what a ring carries per parameter
with ``training.average_optimizer_state``; the planner and the simulator assume it for every task."""


def wire_fraction(fmt: str, int8_block: int = 128) -> float:
    """Wire bytes per float32 byte of a format of ``ravq.codec.compress``: none 1; bf16 and fp16 2 bytes a
    value; int8 one byte a value and a float32 scale per ``int8_block`` values."""
    if fmt == "none":
        return 1.0
    if fmt in ("bf16", "fp16"):
        return 0.5
    if fmt == "int8":
        return (1 + 4 / int8_block) / 4
    raise ValueError(f"compress: unknown format {fmt!r} (none, bf16, fp16 or int8)")


def message_seconds(table: tuple[tuple[int, float], ...], nbytes: float) -> float:
    """Seconds one message of ``nbytes`` float32 tensor bytes costs a node with this ``message_s`` table:
    piecewise linear between the measured sizes, the smallest size's figure below it (a message's fixed
    cost), the slope of the two largest sizes beyond the largest; 0 without a table."""
    if not table or not math.isfinite(nbytes):
        return 0.0
    points = sorted(table)
    if nbytes <= points[0][0]:
        return float(points[0][1])
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if nbytes <= x1:
            return float(y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0))
    if len(points) == 1:
        return float(points[0][1] * nbytes / points[0][0]) if points[0][0] > 0 else float(points[0][1])
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return float(y1 + max(0.0, (y1 - y0) / (x1 - x0) if x1 > x0 else 0.0) * (nbytes - x1))


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
    message_s: tuple[tuple[int, float], ...] = ()
    """(tensor bytes, seconds): how long this node's CPU takes to handle one pipeline message of a
    float32 tensor of that size, packing, sending, receiving and unpacking together (``ravq profile``
    measures a few sizes); empty: not measured, messages cost no compute time."""
    ring_s_per_byte: float = 0.0
    """Seconds of this node's CPU per parameter byte it holds, for its part in one averaging round in
    a ring of two as a node runs it (snapshot, packing, error feedback, sums, sockets, the ring socket's
    reader, applying the result: ``ravq.profile.averaging_cost``); a ring of C costs 2(C-1)/C times that
    (the share of the segment a member sends and receives).  0: not measured, averaging costs no compute."""
    loss_s: float = 0.0
    """Seconds per micro-batch this node spends on what only the loss-computing stage does (the task's
    loss forward and backward, its metrics), charged to the stage holding the last block; ``flops``
    leaves it out (``ravq profile`` measures both).  0: not measured."""
    pipeline_stage_s: float = 0.0
    """Seconds per micro-batch a stage of a pipeline (any stage but a whole copy of the model) costs this
    node beyond its FLOPs, its messages and the loss: what a node adds around a stage (compute thread and
    event loop handing work back and forth, send and read loops, the stage's bookkeeping), measured by
    ``ravq profile`` on a real two-stage pipeline over the node's sockets (``ravq.profile.stage_cost``).
    0: not measured."""


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
    """Seconds per micro-batch: the stage's FLOPs at the node's speed and its messages' CPU time."""
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
                mem = f"{s.memory_bytes / GIB:.2f}/{s.memory_available / GIB:.2f} GiB"
                lines.append(f"  {i:>5} {s.node:<16} {blocks[:28]:<28} {_ms(s.compute_s):>10} {link:>10} "
                             f"{mem:>24}")
        for name, reason in sorted(self.idle.items()):
            lines.append(f"idle: {name}: {reason}")
        node, t = self.slowest_stage()
        lines.append(f"slowest stage: {node} {_ms(t)}")
        slowest_link = self.slowest_link()
        if slowest_link is not None:
            lines.append(f"slowest link: {slowest_link[0]} {_ms(slowest_link[1])}")
        lines.append(f"averaging: {_ms(self.averaging_s)} per round every {self.sync_every} micro-batches, "
                     f"costs {self.averaging_cost_samples_per_s:.4g} samples/s (rounds, and every cluster "
                     "held to the slowest one's pace)")
        lines.append(f"predicted: {self.samples_per_s:.4g} samples/s "
                     f"({self.samples_per_s_without_averaging:.4g} without averaging, "
                     f"micro_batch {self.micro_batch})")
        return "\n".join(lines)


def size_text(nbytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} bytes"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if math.isfinite(seconds) else "inf"
