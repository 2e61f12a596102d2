"""Measuring a node for the planner: ``measure_node`` runs every measurement in the order that makes
them agree across the PCs of a deployment, and gathers them into one ``Measurement``.

Links (``ravq.profile.links``), then compute (``ravq.profile.compute``), then the CPU cost of
pipeline messages and averaging rounds (``ravq.profile.messages``), what a node adds around a stage of a
pipeline (``ravq.profile.stage_cost``), averaging as a node runs it (``ravq.profile.averaging_cost``), and
memory.  ``ravq profile``
(``ravq.cli.profile``) writes the result to ``profile-NAME.json`` (``ravq.profile.store``).
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import gc
import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from ravq.config import Topology, resolve_task_module
from ravq.planner.types import message_seconds
from ravq.profile.averaging_cost import MEMORY_FACTOR, measure_averaging_cpu
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
from ravq.profile.stage_cost import StageCostConfig, StageCpu, measure_stage_cpu
from ravq.profile.store import Measurement
from ravq.tuning import cpu_budget, peak_rss_bytes, rss_bytes

log = logging.getLogger(__name__)

T = TypeVar("T")

FIT_SHARE = 0.8
"""Share of the usable memory two stages timed at a smaller micro-batch may take (``_stage_cpu``): what a
training step takes is not all in proportion to the micro-batch."""


def measure_node(topology: Topology, name: str, *, wait_s: float, config: ProbeConfig | None = None,
                 compute_s: float = 6.0, windows: int = 5, messages: MessageConfig | None = None,
                 stages: StageCostConfig | None = None) -> Measurement:
    """Links, then compute over ``windows`` windows totalling ``compute_s`` (see ``measure_compute``), the
    loss stage's extra work (``measure_loss``: taken out of the FLOP/s when the timed step computed the
    loss, charged to the last stage instead), the CPU cost of pipeline messages (``measure_messages``) and
    of averaging rounds (``measure_ring``: the bare ring; ``measure_averaging_cpu``: rounds as a node runs
    them, the planner's figure), what a node adds around a stage of a pipeline (``measure_stage_cpu``: the
    model as two stages over the node's sockets against one stage), and memory (see below).
    torch gets the threads a node gets (``cpu_budget``: the CPU affinity and the cgroup quota), so every
    figure is measured as the node will run.

    Links come first: this node serves probes until every peer has measured its link to it, so the
    compute that follows starts on every PC at about the same moment, once the whole deployment is up.
    PCs that share a host (nodes of one machine, the testbed's emulated PCs) then measure while the
    others compute too, as they will train.  Measured before the links, the slowest PCs (a seventh of
    a core: torch alone takes them tens of seconds to import) computed while the faster ones had
    finished and sat waiting, and read up to 15% faster than they trained (issue #14, compute_bound).

    Memory is read last, once the profile has built and trained the task's model (and, where two fit, two
    stages of it, traced and split as a node builds its stage): what a node holds besides its stage grows
    by as much.  Read right after the links instead (issue #26, third session), before any model was
    built, a 350 MB PC read 0.17 GiB, the planner gave it half of charlm with four micro-batches in
    flight, and its node was killed for memory while training.  Read last it also counts what the
    measurements left in the process, so it errs low (0.01-0.07 GiB on 450 MB PCs from run to run), not
    high."""
    me = topology.node(name)
    task = resolve_task_module(topology.task, topology.task_options)
    if cpu_budget() < torch.get_num_threads():
        # as a node does: torch sizes its pool by the cores, not the quota
        torch.set_num_threads(cpu_budget())
    links = asyncio.run(profile_links(topology, name, wait_s=wait_s, config=config or ProbeConfig()))
    matmul = measure_matmul_flops(me.device, seconds=0.5)
    sample: ComputeSample | None
    step_bytes = 0
    try:
        sample, step_bytes = working_set(me.device, lambda: measure_compute(
            task, topology.training.micro_batch, me.device, window_s=compute_s / windows, windows=windows))
    except (RuntimeError, ValueError, TypeError) as err:  # a model that cannot run here: matmuls only
        log.warning("profile: forward + backward of the task's model failed (%s); using matmul FLOP/s", err)
        sample = None
    loss_cpu = measure_loss(task, topology.training.micro_batch, me.device)
    message_cpu = measure_messages(topology, name, messages)
    ring_bytes = min(max(model_param_bytes(task), RING_BYTES[0]), RING_BYTES[1])
    ring_cpu = measure_ring(topology, name, ring_bytes)
    stage_cpu = _stage_cpu(topology, name, task, stages, step_bytes)
    stage_extra = stage_cpu_s(stage_cpu, message_cpu) if stage_cpu else 0.0
    averaging = _averaging_cpu(topology, name, task, stages)
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
        averaging_s=[model_param_bytes(task), averaging / share] if averaging is not None else [],
        averaging_cpu_s=[model_param_bytes(task), averaging] if averaging is not None else [],
        loss_s=loss_cpu / share, loss_cpu_s=loss_cpu, stage_s=stage_extra / share, stage_cpu_s=stage_extra,
        pipeline_cpu_s=stage_cpu.pipeline_cpu_s if stage_cpu else 0.0,
        single_cpu_s=stage_cpu.single_cpu_s if stage_cpu else 0.0)


def _stage_cpu(topology: Topology, name: str, task: object, config: StageCostConfig | None,
               step_bytes: int = 0) -> StageCpu | None:
    """``measure_stage_cpu``, or None (nothing charged) for a model too large to run whole here or one that
    cannot be cut in two.  Too large: its weights, gradients and optimizer state (4x the parameters) over
    half of the usable memory.  Two stages hold the whole model and the micro-batches in flight: where
    twice what the timed training step took (``step_bytes``, activations included) is over the usable
    memory, they run at a micro-batch small enough to fit (what a stage adds is taken to be per
    micro-batch; its messages are charged by their size apart), and not at all below one sample.  The
    parameters alone let the profile of a 350 MB PC (charlm, 0.17 GiB usable) be killed for memory."""
    usable = usable_memory_bytes(topology.node(name).device)
    config = config or StageCostConfig()
    micro_batch = config.micro_batch or topology.training.micro_batch
    if 2 * step_bytes > usable:
        micro_batch = int(FIT_SHARE * micro_batch * usable / (2 * step_bytes))
    if 4 * model_param_bytes(task) > usable // 2 or micro_batch < 1:
        log.info(
            "profile: the model is too large to time as two stages here (%.0f MB a training step, %.0f MB "
            "usable); no per-stage cost measured",
            step_bytes / 1e6,
            usable / 1e6,
        )
        return None
    if micro_batch < topology.training.micro_batch:
        log.info(
            "profile: two stages timed at %d samples a micro-batch (%.0f MB a training step of %d, %.0f MB "
            "usable)",
            micro_batch,
            step_bytes / 1e6,
            topology.training.micro_batch,
            usable / 1e6,
        )
        config = dataclasses.replace(config, micro_batch=micro_batch)
    try:
        return measure_stage_cpu(topology, name, task, config)
    except Exception as err:  # noqa: BLE001 - the task's code in a pipeline: the profile goes on without it
        log.warning(
            "profile: the model could not be timed as two stages (%s); no per-stage cost measured", err
        )
        return None


def _averaging_cpu(
    topology: Topology, name: str, task: object, config: StageCostConfig | None
) -> float | None:
    """``measure_averaging_cpu``, or None (the planner then charges the bare ring, ``measure_ring``) when two
    copies of the model do not fit in half of the usable memory, or when the rounds fail."""
    if MEMORY_FACTOR * model_param_bytes(task) > usable_memory_bytes(topology.node(name).device) // 2:
        log.info("profile: two copies of the model do not fit here; averaging charged as the bare ring costs")
        return None
    try:
        return measure_averaging_cpu(topology, name, task, config)
    except Exception as err:  # noqa: BLE001 - the task's code averaging: the profile goes on without it
        log.warning(
            "profile: averaging rounds could not be timed as a node runs them (%s); charging the bare "
            "ring's CPU",
            err,
        )
        return None


def stage_cpu_s(stage: StageCpu, message_cpu: list[list[float]]) -> float:
    """CPU seconds per micro-batch a stage of a pipeline costs beyond its share of the model's work, its
    messages and the loss: the two-stage pipeline less the one stage, less the two messages crossing the
    cut (which the profile charges apart, ``message_s``), shared by the two stages; never below 0."""
    table = tuple((int(size), float(cpu)) for size, cpu in message_cpu)
    messages = message_seconds(table, stage.act_bytes) + message_seconds(table, stage.grad_bytes)
    return max(0.0, (stage.pipeline_cpu_s - stage.single_cpu_s - messages) / 2)


def working_set(device: str, measure: Callable[[], T]) -> tuple[T, int]:
    """``measure()`` and the memory it took at its peak beyond what the process held before: on a CPU the
    peak resident size (reset first where Linux allows, ``/proc/self/clear_refs``; else an upper bound when
    an earlier peak was higher; 0 where the kernel does not say) over the resident size before, garbage
    collected and the allocator's free memory given back first (in a process that had run most of the
    test suite, a collection during the measurement hid all but 15 of 64 MiB); on cuda the device's peak
    allocation."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = measure()
        return result, max(0, torch.cuda.max_memory_allocated(device) - before)
    gc.collect()  # garbage freed during the measurement would hide as much of what it allocates
    _trim()  # and memory freed earlier but still resident would take its allocations unseen
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident size (VmHWM)
    except OSError:
        pass
    before = rss_bytes()
    result = measure()
    peak = peak_rss_bytes()
    return result, 0 if before is None or peak is None else max(0, peak - before)


def _trim() -> None:
    """Give the C allocator's free memory back to the system (glibc's ``malloc_trim``; nothing elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
