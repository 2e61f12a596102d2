"""A node's measurement on disk (``profile-NAME.json``) and as the planner's ``NodeProfile``s.

``save_profile`` writes what ``ravq profile`` measured; ``load_profiles`` reads every node's file back
as planner profiles with the topology's overrides applied (a node without a file is accepted when
its overrides give memory, flops and bandwidth).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ravq.config import ConfigError, Topology
from ravq.planner import NodeProfile


@dataclass(kw_only=True, slots=True)
class Measurement:
    name: str
    device: str
    flops: float
    """FLOP/s the planner uses: training steps of the task's model (matmul FLOP/s without a task)."""
    matmul_flops: float
    model_flops: float | None
    memory_bytes: int
    bandwidth_bytes_per_s: dict[str, float] = field(default_factory=dict)
    latency_s: dict[str, float] = field(default_factory=dict)
    flops_windows: list[float] = field(default_factory=list)
    """The model FLOP/s of each measurement window (``measure_compute``)."""
    flops_spread: float | None = None
    """(max - min) / flops over those windows: how far to trust ``flops`` (None: not measured)."""
    cpu_share: float | None = None
    """CPU seconds per wall second the compute measurement got (see ``ComputeSample.cpu_share``)."""
    message_s: list[list[float]] = field(default_factory=list)
    """[tensor bytes, seconds] of one pipeline message at this PC's compute speed: the CPU seconds of
    ``message_cpu_s`` over ``cpu_share`` (``measure_messages``); the planner's ``NodeProfile.message_s``."""
    message_cpu_s: list[list[float]] = field(default_factory=list)
    """[tensor bytes, CPU seconds] of one message, packed, sent, received and unpacked, as measured."""
    ring_s: list[float] = field(default_factory=list)
    """[parameter bytes, seconds] of this node's part of one averaging round in a ring of two at this
    PC's compute speed: ``ring_cpu_s`` over ``cpu_share`` (``measure_ring``); the planner's
    ``NodeProfile.ring_s_per_byte``.  Empty: not measured."""
    ring_cpu_s: list[float] = field(default_factory=list)
    """[parameter bytes, CPU seconds] of that round as measured."""
    averaging_s: list[float] = field(default_factory=list)
    """[parameter bytes, seconds] of this node's part of one averaging round of the whole model in a ring of
    two as a node runs it (snapshot, queue, ring, reader, apply; ``ravq.profile.averaging_cost``) at this
    PC's compute speed.  When present the planner's ``NodeProfile.ring_s_per_byte`` (else ``ring_s``)."""
    averaging_cpu_s: list[float] = field(default_factory=list)
    """[parameter bytes, CPU seconds] of that round as measured."""
    loss_s: float = 0.0
    """Seconds per micro-batch of the loss stage's extra work (loss forward and backward, metrics) at
    this PC's compute speed: ``loss_cpu_s`` over ``cpu_share``; the planner's ``NodeProfile.loss_s``.
    ``flops`` leaves it out.  0: not measured (profiles made before issue #26)."""
    loss_cpu_s: float = 0.0
    """CPU seconds of that work as measured (``ravq.profile.loss.measure_loss``)."""
    stage_s: float = 0.0
    """Seconds per micro-batch a stage of a pipeline costs this PC beyond its FLOPs, its messages and the
    loss, at this PC's compute speed: ``stage_cpu_s`` over ``cpu_share``; the planner's
    ``NodeProfile.pipeline_stage_s``.  0: not measured (profiles made before it)."""
    stage_cpu_s: float = 0.0
    """CPU seconds of that: (two-stage pipeline - one stage - the two messages at the cut) / 2, from
    ``pipeline_cpu_s``, ``single_cpu_s`` and ``message_cpu_s`` (``ravq.profile.stage_cost``)."""
    pipeline_cpu_s: float = 0.0
    """CPU seconds per micro-batch of the task's model as two stages over this node's sockets, as measured."""
    single_cpu_s: float = 0.0
    """CPU seconds per micro-batch of the task's model as one stage, as measured."""


def profile_path(out_dir: str | Path, name: str) -> Path:
    return Path(out_dir) / f"profile-{name}.json"


def save_profile(measurement: Measurement, out_dir: str | Path) -> Path:
    path = profile_path(out_dir, measurement.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {f: getattr(measurement, f) for f in Measurement.__dataclass_fields__}
    path.write_text(json.dumps({"version": 1, **data}, indent=2, sort_keys=True))
    return path


def load_profile(path: str | Path) -> Measurement:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        data.pop("version", None)
        return Measurement(**data)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no profile (run `ravq profile` on that node)") from None
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(f"{path}: not a ravq profile: {err}") from None


def load_profiles(topology: Topology, profiles_dir: str | Path) -> list[NodeProfile]:
    """Planner profiles of every topology node; the topology's overrides win over measurements.  A node
    without a profile file is accepted when its overrides give memory, flops and bandwidth."""
    names = [n.name for n in topology.nodes]
    profiles = []
    for node in topology.nodes:
        path = profile_path(profiles_dir, node.name)
        overridden = None not in (node.memory_bytes, node.flops, node.bandwidth_bytes_per_s)
        m = load_profile(path) if path.exists() or not overridden else None
        bandwidth = dict(m.bandwidth_bytes_per_s) if m else {}
        if node.bandwidth_bytes_per_s is not None:
            bandwidth = {peer: node.bandwidth_bytes_per_s for peer in names if peer != node.name}
        flops = node.flops if node.flops is not None else m.flops if m else 0.0
        memory = node.memory_bytes if node.memory_bytes is not None else m.memory_bytes if m else 0
        profiles.append(
            NodeProfile(
                name=node.name,
                flops=flops,
                memory_bytes=memory,
                bandwidth_bytes_per_s=bandwidth,
                latency_s=dict(m.latency_s) if m else {},
                message_s=message_table(m) if m else (),
                ring_s_per_byte=ring_s_per_byte(m) if m else 0.0,
                loss_s=m.loss_s if m else 0.0,
                pipeline_stage_s=m.stage_s if m else 0.0,
            )
        )
    return profiles


def ring_s_per_byte(measurement: Measurement) -> float:
    """Seconds of averaging per parameter byte in a ring of two: rounds as a node runs them when measured,
    else the bare ring (profiles made before them), else 0."""
    for figure in (measurement.averaging_s, measurement.ring_s):
        if figure and figure[0]:
            return figure[1] / figure[0]
    return 0.0


def message_table(measurement: Measurement) -> tuple[tuple[int, float], ...]:
    """The planner's ``NodeProfile.message_s`` from a profile (empty for profiles made before it)."""
    return tuple((int(size), float(seconds)) for size, seconds in measurement.message_s)
