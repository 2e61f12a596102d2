"""What a simulation found: per node and per cluster, as a table and as JSON."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ravq.simulate.training import Simulation
from ravq.simulate.world import World


@dataclass(kw_only=True, slots=True)
class NodeResult:
    name: str
    cluster: int
    stage: int
    busy_fraction: float
    """Compute seconds over the node's wall time (first work to last work or round)."""
    busy_s: float
    wall_s: float
    averaging_wait_s: float
    """Compute thread waiting for averaging (hold-back, a full round queue, or the round)."""
    staleness_mean: float
    staleness_max: int
    updates: int
    version: int
    forwards: int
    backwards: int
    uplink_bytes_per_s: float
    link_utilisation: float
    """Bytes sent (pipeline and ring) over the uplink's capacity and the run's wall time; 0 when the
    uplink has no measured capacity."""
    pipe_bytes: float
    ring_bytes: float
    allreduce_rounds: int
    allreduce_aborts: int
    allreduce_seconds_mean: float
    failures: int
    down_s: float


@dataclass(kw_only=True, slots=True)
class ClusterResult:
    cluster: int
    nodes: list[str]
    samples: int
    wall_s: float
    samples_per_s: float
    """Samples over the cluster's own training time."""


@dataclass(kw_only=True, slots=True)
class SimResult:
    samples: int
    wall_s: float
    samples_per_s: float
    """All clusters' samples over the longest wall time of any node (how bench_prediction measures)."""
    busy_fraction_mean: float
    allreduce_seconds_mean: float
    clusters: list[ClusterResult]
    nodes: list[NodeResult]
    events: int
    settings: dict[str, Any]
    plan_epochs: int = 0
    """Changes of the rings' membership (failures taken out, clusters taken back): each abandoned every
    open round."""

    def to_json(self) -> dict[str, Any]:
        return _finite(asdict(self))

    def format(self) -> str:
        lines = [f"{'cluster':>7} {'nodes':>5} {'samples':>8} {'wall s':>9} {'samples/s':>10}"]
        for c in self.clusters:
            lines.append(
                f"{c.cluster:>7} {len(c.nodes):>5} {c.samples:>8} {c.wall_s:>9.3f} {c.samples_per_s:>10.2f}"
            )
        lines.append("")
        lines.append(
            f"{'node':<14} {'cl':>3} {'st':>3} {'busy':>5} {'avg wait s':>10} {'stale':>6} "
            f"{'uplink MB/s':>11} {'link util':>9} {'rounds':>6} {'allreduce s':>11} {'failures':>8}"
        )
        for n in self.nodes:
            lines.append(
                f"{n.name[:14]:<14} {n.cluster:>3} {n.stage:>3} {n.busy_fraction:>5.2f} "
                f"{n.averaging_wait_s:>10.3f} {n.staleness_mean:>6.2f} {n.uplink_bytes_per_s / 1e6:>11.3g} "
                f"{n.link_utilisation:>9.3f} {n.allreduce_rounds:>6} {n.allreduce_seconds_mean:>11.4f} "
                f"{n.failures:>8}"
            )
        lines.append("")
        lines.append(
            f"simulated: {self.samples_per_s:.4g} samples/s ({self.samples} samples in {self.wall_s:.4g} s), "
            f"busy {self.busy_fraction_mean:.2f} on average, all-reduce round "
            f"{self.allreduce_seconds_mean:.4g} s on average ({self.events} events)"
        )
        return "\n".join(lines)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def collect(sim: Simulation) -> SimResult:
    s = sim.settings
    nodes = []
    walls = []
    for stages in sim.clusters:
        for n in stages:
            start = n.first_work or 0.0
            walls.append(max(0.0, n.end - start))
    wall = max(walls, default=0.0)
    for stages in sim.clusters:
        for n in stages:
            own = max(0.0, n.end - (n.first_work or 0.0))
            sent = n.pipe_bytes + n.ring_bytes
            cap = sim.world.network.uplink[n.name]
            nodes.append(
                NodeResult(
                    name=n.name,
                    cluster=n.cluster,
                    stage=n.stage,
                    busy_s=n.busy_s,
                    wall_s=own,
                    busy_fraction=n.busy_s / own if own > 0 else 0.0,
                    averaging_wait_s=n.wait_s,
                    staleness_mean=n.staleness_sum / n.backwards_total if n.backwards_total else 0.0,
                    staleness_max=n.staleness_max,
                    updates=n.updates,
                    version=n.version,
                    forwards=n.forwards_total,
                    backwards=n.backwards_total,
                    uplink_bytes_per_s=sent / wall if wall > 0 else 0.0,
                    link_utilisation=sent / (cap * wall) if wall > 0 and math.isfinite(cap) else 0.0,
                    pipe_bytes=n.pipe_bytes,
                    ring_bytes=n.ring_bytes,
                    allreduce_rounds=n.rounds_done,
                    allreduce_aborts=n.rounds_aborted,
                    allreduce_seconds_mean=n.round_s_sum / n.rounds_done if n.rounds_done else 0.0,
                    failures=n.failures,
                    down_s=n.down_s,
                )
            )
    clusters = []
    total = 0
    for c, stages in enumerate(sim.clusters):
        samples = stages[0].backwards * s.micro_batch
        total += samples
        start = min((n.first_work for n in stages if n.first_work is not None), default=0.0)
        own = max((n.end for n in stages), default=0.0) - start
        clusters.append(ClusterResult(cluster=c, nodes=[n.name for n in stages], samples=samples, wall_s=own,
                                      samples_per_s=samples / own if own > 0 else 0.0))
    rounds = [n for n in nodes if n.allreduce_rounds]
    return SimResult(
        samples=total, wall_s=wall, samples_per_s=total / wall if wall > 0 else 0.0,
        busy_fraction_mean=sum(n.busy_fraction for n in nodes) / len(nodes) if nodes else 0.0,
        allreduce_seconds_mean=sum(n.allreduce_seconds_mean for n in rounds) / len(rounds) if rounds else 0.0,
        clusters=clusters, nodes=nodes, events=sim.q.events, settings=asdict(s), plan_epochs=sim.plan_epoch)


def simulate(world: World, until: float = math.inf) -> SimResult:
    """Run ``world`` (a ``World``) to the end (or ``until`` simulated seconds) and collect the results."""
    sim = Simulation(world)
    sim.run(until)
    return collect(sim)
