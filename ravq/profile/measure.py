"""Measuring a node for the planner: ``measure_node`` runs every measurement in the order that makes
them agree across the PCs of a deployment, and gathers them into one ``Measurement``.

Links (``ravq.profile.links``), then compute (``ravq.profile.compute``), then the CPU cost of
pipeline messages and averaging rounds (``ravq.profile.messages``), and memory.  ``ravq profile``
(``ravq.cli.profile``) writes the result to ``profile-NAME.json`` (``ravq.profile.store``).
"""

from __future__ import annotations

import asyncio
import logging

from ravq.config import Topology, resolve_task_module
from ravq.profile.compute import (
    ComputeSample,
    measure_compute,
    measure_matmul_flops,
    model_param_bytes,
    usable_memory_bytes,
)
from ravq.profile.links import ProbeConfig, profile_links
from ravq.profile.loss import flops_without_loss, measure_loss
from ravq.profile.messages import RING_BYTES, MessageConfig, measure_messages, measure_ring
from ravq.profile.store import Measurement

log = logging.getLogger(__name__)


def measure_node(topology: Topology, name: str, *, wait_s: float, config: ProbeConfig | None = None,
                 compute_s: float = 6.0, windows: int = 5, messages: MessageConfig | None = None) -> Measurement:
    """Links, then compute over ``windows`` windows totalling ``compute_s`` (see ``measure_compute``), the
    loss stage's extra work (``measure_loss``: taken out of the FLOP/s when the timed step computed the
    loss, charged to the last stage instead), the CPU cost of pipeline messages (``measure_messages``) and of averaging rounds (``measure_ring``), memory.

    Links come first: this node serves probes until every peer has measured its link to it, so the
    compute that follows starts on every PC at about the same moment, once the whole deployment is up.
    PCs that share a host (nodes of one machine, the testbed's emulated PCs) then measure while the
    others compute too, as they will train.  Measured before the links, the slowest PCs (a seventh of
    a core: torch alone takes them tens of seconds to import) computed while the faster ones had
    finished and sat waiting, and read up to 15% faster than they trained (issue #14, compute_bound)."""
    me = topology.node(name)
    task = resolve_task_module(topology.task)
    links = asyncio.run(profile_links(topology, name, wait_s=wait_s, config=config or ProbeConfig()))
    matmul = measure_matmul_flops(me.device, seconds=0.5)
    try:
        sample: ComputeSample | None = measure_compute(task, topology.training.micro_batch, me.device,
                                                       window_s=compute_s / windows, windows=windows)
    except (RuntimeError, ValueError, TypeError) as err:  # a model that cannot run here: matmuls only
        log.warning("profile: forward + backward of the task's model failed (%s); using matmul FLOP/s", err)
        sample = None
    loss_cpu = measure_loss(task, topology.training.micro_batch, me.device)
    message_cpu = measure_messages(topology, name, messages)
    ring_bytes = min(max(model_param_bytes(task), RING_BYTES[0]), RING_BYTES[1])
    ring_cpu = measure_ring(topology, name, ring_bytes)
    share = sample.cpu_share if sample and sample.cpu_share > 0 else 1.0
    flops = sample.flops if sample else matmul
    if sample and sample.with_loss:  # the loss stage pays the loss apart (NodeProfile.loss_s)
        flops = flops_without_loss(flops, sample.step_flops, loss_cpu / share)
    return Measurement(
        name=name, device=me.device, flops=flops, matmul_flops=matmul,
        model_flops=sample.flops if sample else None, memory_bytes=usable_memory_bytes(me.device),
        bandwidth_bytes_per_s={p: link.bandwidth_bytes_per_s for p, link in links.items()},
        latency_s={p: link.latency_s for p, link in links.items()},
        flops_windows=sample.window_flops if sample else [], flops_spread=sample.spread if sample else None,
        cpu_share=sample.cpu_share if sample else None,
        message_s=[[size, cpu / share] for size, cpu in message_cpu], message_cpu_s=message_cpu,
        ring_s=[ring_bytes, ring_cpu / share], ring_cpu_s=[ring_bytes, ring_cpu],
        loss_s=loss_cpu / share, loss_cpu_s=loss_cpu)
