"""Large worlds for projections: PCs spread over the regions of a published inter-region link table,
with mixed hardware drawn from a stated distribution, and a transformer-like model.

The link table is DT-FM's (``data/aws_regions.json``: delay and bandwidth between AWS regions, with
its source and licence).  A PC's stream to another PC runs at most at the slower of its own access
uplink and the two regions' bandwidth; its latency is the regions' delay (one way, as DT-FM applies it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ravq.config import ClusterPlan, Plan
from ravq.planner import BlockProfile, NodeProfile, make_plan, regional_plan

GIB = 1 << 30
DATA = Path(__file__).with_name("data") / "aws_regions.json"


@dataclass(frozen=True, slots=True)
class HardwareClass:
    name: str
    share: float
    flops: float
    """Achieved FLOP/s on training steps."""
    memory_gib: float


HARDWARE = (
    HardwareClass("cpu-only desktop or laptop", 0.35, 0.2e12, 16),
    HardwareClass("mid-range GPU (RTX 3060 class)", 0.35, 6e12, 12),
    HardwareClass("high-end GPU (RTX 4090 class)", 0.22, 30e12, 24),
    HardwareClass("workstation GPU (A6000 class)", 0.08, 45e12, 48),
)
"""The PCs' mix; each PC's FLOP/s is also scaled by a uniform 0.8-1.25 (clocks, cooling, drivers)."""

UPLINKS_MBIT = ((20.0, 0.3), (100.0, 0.4), (1000.0, 0.3))
"""Access upload speeds (Mbit/s) and their shares."""


def link_table(
    path: Path = DATA,
) -> tuple[list[str], dict[tuple[str, str], tuple[float, float]], tuple[float, float]]:
    """(regions of DT-FM's worldwide case, {(a, b): (one-way s, bytes/s)} both ways, within-region pair)."""
    data = json.loads(path.read_text())
    pairs: dict[tuple[str, str], tuple[float, float]] = {}
    for a, b, delay_ms, gbps in data["pairs"]:
        pairs[a, b] = pairs[b, a] = (delay_ms / 1e3, gbps * 1e9 / 8)
    inside = data["within_region"]
    return (
        list(data["worldwide_regions"]),
        pairs,
        (inside["delay_ms"] / 1e3, inside["bandwidth_gbps"] * 1e9 / 8),
    )


def worldwide_nodes(count: int, seed: int = 0) -> tuple[list[NodeProfile], list[str]]:
    """``count`` PCs spread evenly over DT-FM's 8 worldwide regions (in listing order: region by region),
    hardware and uplinks drawn from ``HARDWARE`` and ``UPLINKS_MBIT``; returns profiles and regions."""
    if count < 1:
        raise ValueError(f"count: must be >= 1, got {count}")
    rng = np.random.default_rng(seed)
    regions, pairs, inside = link_table()
    where = [regions[i * len(regions) // count] for i in range(count)]
    kinds = rng.choice(len(HARDWARE), size=count, p=[h.share for h in HARDWARE])
    scale = rng.uniform(0.8, 1.25, size=count)
    speeds, shares = zip(*UPLINKS_MBIT)
    uplinks = rng.choice(np.array(speeds), size=count, p=np.array(shares)) * 1e6 / 8
    names = [f"pc{i:04d}" for i in range(count)]
    region_index = {r: i for i, r in enumerate(regions)}
    lat = np.full((len(regions), len(regions)), inside[0])
    bw = np.full((len(regions), len(regions)), inside[1])
    for (a, b), (delay, rate) in pairs.items():
        if a in region_index and b in region_index:
            lat[region_index[a], region_index[b]], bw[region_index[a], region_index[b]] = delay, rate
    r = np.array([region_index[x] for x in where])
    nodes = []
    for i in range(count):
        rate = np.minimum(bw[r[i], r], uplinks[i]).tolist()
        delay = lat[r[i], r].tolist()
        nodes.append(NodeProfile(
            name=names[i], flops=float(HARDWARE[kinds[i]].flops * scale[i]),
            memory_bytes=int(HARDWARE[kinds[i]].memory_gib * GIB * 0.9),
            bandwidth_bytes_per_s={names[j]: rate[j] for j in range(count) if j != i},
            latency_s={names[j]: delay[j] for j in range(count) if j != i}))
    return nodes, where


def transformer_blocks(layers: int = 24, d_model: int = 1024, vocab: int = 50257, tokens: int = 2048,
                       max_inflight: int = 2) -> list[BlockProfile]:
    """A GPT-2-medium-like model as planner blocks: embedding, ``layers`` equal layers, head; float32
    weights and Adam (16 bytes per parameter with gradients and moments); ``tokens`` per micro-batch."""
    act = tokens * d_model * 4
    stash = tokens * d_model * 4 * 12           # saved activations of one layer per micro-batch

    def block(name: str, params: int, flops_fwd: float, act_out: int, inflight: int) -> BlockProfile:
        return BlockProfile(name=name, param_bytes=4 * params, fwd_flops=flops_fwd, bwd_flops=2 * flops_fwd,
                            act_bytes_out=act_out, memory_bytes=16 * params + max_inflight * inflight,
                            inflight_bytes=inflight, max_inflight=max_inflight)

    layer_params = 12 * d_model * d_model
    out = [block("embed", vocab * d_model, 2.0 * tokens * d_model, act, act)]
    out += [block(f"layers.{i}", layer_params, 2.0 * tokens * layer_params + 4.0 * tokens * tokens * d_model,
                  act, stash) for i in range(layers)]
    out.append(block("head", vocab * d_model, 2.0 * tokens * vocab * d_model, 4, tokens * vocab * 4))
    return out


def naive_plan(nodes: list[NodeProfile], blocks: list[BlockProfile], max_inflight: int | None) -> Plan:
    """Clusters and stages in listing order, even cuts: each cluster takes the next nodes until equal runs
    of blocks fit each node's memory; nodes left over stay idle."""
    B = len(blocks)
    clusters, i = [], 0
    while i < len(nodes):
        for k in range(1, min(B, len(nodes) - i) + 1):
            bounds = [round(j * B / k) for j in range(k + 1)]
            inflight = max_inflight or k
            fits = all(
                sum(
                    b.memory_bytes - b.max_inflight * b.inflight_bytes + inflight * b.inflight_bytes
                    for b in blocks[bounds[j] : bounds[j + 1]]
                )
                <= nodes[i + j].memory_bytes
                for j in range(k)
            )
            if fits:
                clusters.append(ClusterPlan(nodes=[n.name for n in nodes[i:i + k]],
                                            cuts=[blocks[b].name for b in bounds[1:-1]]))
                i += k
                break
        else:
            break
    if not clusters:
        raise ValueError("naive plan: no run of nodes in listing order holds the model with even cuts")
    return Plan(epoch=0, clusters=clusters)


def utilisation(flops_used: float, nodes: list[NodeProfile]) -> float:
    """Share of all PCs' FLOP/s a run uses (model FLOPs per second over the sum of the PCs' FLOP/s)."""
    total = sum(n.flops for n in nodes)
    return flops_used / total if total > 0 and math.isfinite(flops_used) else 0.0


FULL_PLANNER_PCS = 256
"""Up to this many PCs a projection plans with ``make_plan`` over all PCs; above, ``regional_plan``
(the full search takes minutes at 1,024 PCs)."""


def projection_plan(nodes: list[NodeProfile], regions: list[str], blocks: list[BlockProfile], *,
                    full_planner: bool = False, effort: float = 1.0, **settings: Any) -> tuple[Plan, str]:
    """The planner's plan of a projection (``benchmarks/project_scale.py``) and which planner made it."""
    if len(nodes) <= FULL_PLANNER_PCS or full_planner:
        return make_plan(nodes, blocks, effort=effort, **settings)[0], "make_plan"
    return regional_plan(nodes, regions, blocks, effort=effort, **settings), "regional_plan"
