"""Mistakes that used to pass silently, caught where they can be named: a device this PC does not
have, a measured-value override that makes the planner idle the other nodes."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from ravq.config import ConfigError, Plan, Topology

log = logging.getLogger(__name__)

OVERRIDE_FIELDS = ("flops", "memory_bytes", "bandwidth_bytes_per_s")


def check_device(topology: Topology, name: str) -> None:
    """ConfigError (one line) when torch on this PC cannot use node ``name``'s device."""
    import torch

    index, node = next((i, n) for i, n in enumerate(topology.nodes) if n.name == name)
    device, where = node.device, f"nodes[{index}].device"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            why = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
                   else f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU")
            raise ConfigError(f"{where}: {device!r} for {name}, but {why} on this PC; set device: cpu "
                              "(or install a CUDA build of torch)")
        wanted = int(device.partition(":")[2] or 0)
        if wanted >= torch.cuda.device_count():
            raise ConfigError(f"{where}: {device!r} for {name}, but this PC has {torch.cuda.device_count()} "
                              "CUDA device(s)")
    elif device == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(
            f"{where}: 'mps' for {name}, but torch finds no Apple GPU on this PC; set device: cpu"
        )


class NamedProfile(Protocol):
    """A node's profile as the checks read it (``ravq.planner.NodeProfile``, a layer above): its name,
    and the measured fields of ``OVERRIDE_FIELDS`` read by name."""

    @property
    def name(self) -> str: ...


def override_warnings(topology: Topology, plan: Plan, profiles: Sequence[NamedProfile]) -> list[str]:
    """Warnings for a plan that leaves nodes idle while some node's speed or memory is typed in.

    An override copied from an example (``flops: 2e12`` on a PC that does 5e10) makes one node look
    so fast that the planner gives it everything; the others then sit idle with no word of why."""
    planned = {n for c in plan.clusters for n in c.nodes}
    idle = [n.name for n in topology.nodes if n.name not in planned]
    overridden = {n.name: [f for f in OVERRIDE_FIELDS if getattr(n, f) is not None] for n in topology.nodes}
    overridden = {k: v for k, v in overridden.items() if v}
    if not idle or not overridden:
        return []
    details = []
    for name, fields in overridden.items():
        node = topology.node(name)
        parts = []
        for field in fields:
            value = getattr(node, field)
            others = (
                [getattr(p, field) for p in profiles if p.name != name]
                if field != "bandwidth_bytes_per_s"
                else []
            )
            ratio = (
                f", {value / max(others):.3g}x the largest other node's" if others and max(others) > 0 else ""
            )
            parts.append(f"{field}: {value:g}{ratio}")
        details.append(f"{name} ({'; '.join(parts)})")
    return [(f"the plan leaves {len(idle)} node(s) idle ({', '.join(idle)}) while the topology overrides "
             f"measured values of {', '.join(details)}: check that these overrides describe those PCs "
             "(an override copied from an example makes a node look faster or bigger than it is)")]
