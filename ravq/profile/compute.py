"""Measuring a PC's compute and memory for the planner.

FLOP/s of matmuls and of training steps of the task's own model (its forward + backward FLOPs,
counted with the same ``FlopCounterMode`` as the model profile, over the time of forward, backward and
optimizer step), measured in several windows so that two runs on the same PC agree
(``measure_compute``), and the memory a stage may use: the device's free memory, or on a CPU the
available memory capped by the memory cgroup's limit, less some headroom
(``ravq.tuning.usable_memory_bytes``).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from ravq.stage.recipe import build_optimizer
from ravq.tuning import usable_memory_bytes

log = logging.getLogger(__name__)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def measure_matmul_flops(device: str = "cpu", seconds: float = 1.0, size: int = 1024) -> float:
    """Achieved FLOP/s of square float32 matmuls."""
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    a @ b
    _sync(device)
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or count < 2:
        a @ b
        count += 1
        _sync(device)
    return 2 * size ** 3 * count / (time.perf_counter() - t0)


def _training_step(task: Any, micro_batch: int, device: str,
                   optimizer: bool) -> tuple[Callable[[], None], float, bool]:
    """One training step of the task's model (whole, or its largest block when the whole does not fit in
    half of the usable memory: ``ravq.profile.step``) on one real micro-batch, and its forward + backward
    FLOPs (counted as the block profile counts them), and whether the step computes the task's loss."""
    from ravq.profile.step import timed_step

    torch.manual_seed(0)
    params, forward, with_loss = timed_step(task, micro_batch, device, usable_memory_bytes(device) // 2)
    # a make_optimizer(named_params) gets placeholder names here: only the optimizer's cost is measured
    update = (
        build_optimizer(task.make_optimizer, {str(i): p for i, p in enumerate(params)}) if optimizer else None
    )

    def forward_backward() -> None:
        for p in params:
            p.grad = None
        forward().backward()

    def step() -> None:
        forward_backward()
        if update is not None:
            update.step()
        _sync(device)

    with FlopCounterMode(display=False) as counter:
        forward_backward()
    _sync(device)
    return step, float(counter.get_total_flops()), with_loss


def _timed_steps(step: Callable[[], None], seconds: float, min_steps: int = 2) -> tuple[int, float]:
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or count < min_steps:
        step()
        count += 1
    return count, time.perf_counter() - t0


def measure_model_flops(task: Any, micro_batch: int, device: str = "cpu", seconds: float = 1.5,
                        optimizer: bool = True) -> float:
    """Achieved FLOP/s of training the task's whole model on one real micro-batch: the forward + backward
    FLOPs (counted as the block profile counts them) over the time of forward, backward and, with
    ``optimizer``, the task's optimizer step, which every stage also runs per micro-batch (it counts no
    FLOPs but takes time: about a tenth of a step for the demo's model on a CPU)."""
    step, flops, _ = _training_step(task, micro_batch, device, optimizer)
    count, elapsed = _timed_steps(step, seconds)
    return flops * count / elapsed


WINDOW_STEPS = 4
"""Training steps a compute window holds at least (``measure_compute``)."""


@dataclass(kw_only=True, slots=True)
class ComputeSample:
    """Training FLOP/s measured over several windows, and how much the windows disagree."""

    flops: float
    """The median window's FLOP/s: one window disturbed by other work does not move it."""
    window_flops: list[float]
    spread: float
    """(max - min) / flops over the windows: 0.05 means the windows were within 5% of each other."""
    cpu_share: float
    """CPU seconds this process got per wall second over the windows: 1.0 for a core to itself, less
    under a CPU quota or when other work shares the core (then the figure holds only while it does)."""
    step_flops: float = 0.0
    """Forward + backward FLOPs of one timed step."""
    with_loss: bool = False
    """Whether the timed step computed the task's loss (the whole model, or a largest block that is last)."""


def measure_compute(
    task: Any,
    micro_batch: int,
    device: str = "cpu",
    *,
    window_s: float = 1.2,
    windows: int = 5,
    warmup_s: float = 0.3,
    window_steps: int = WINDOW_STEPS,
) -> ComputeSample:
    """``measure_model_flops`` done so that two runs on the same PC agree: a warm-up (first calls,
    allocator, lazy initialisation) that is not counted, then ``windows`` windows of ``window_s`` and
    at least ``window_steps`` training steps each, and the median window kept.  On a slow PC a step
    takes most of a second: windows of two steps (the earlier minimum) were within 9-20% of each other
    on the testbed's 0.14-core PCs, and their profiles moved ~10% from run to run.

    One short sample misjudges a PC whose CPU time comes in slices (a cgroup quota runs a process for
    its share of every 100 ms period, then stops it; another process may take the core for a while):
    a single 1.5 s sample judged one PC 2.2x off.  Windows of a second or more hold several such
    periods, the median ignores a window that other work disturbed, and the spread says how far to
    trust the figure."""
    step, flops, with_loss = _training_step(task, micro_batch, device, optimizer=True)
    _timed_steps(step, warmup_s)
    rates = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(max(1, windows)):
        count, elapsed = _timed_steps(step, window_s, window_steps)
        rates.append(flops * count / elapsed)
    share = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    middle = statistics.median(rates)
    return ComputeSample(flops=middle, window_flops=rates, spread=(max(rates) - min(rates)) / middle,
                         cpu_share=share, step_flops=flops, with_loss=with_loss)


def model_param_bytes(task: Any) -> int:
    """Float32 bytes of the task's model's parameters (0 when it cannot be built here)."""
    try:
        from ravq.cut.meta import build_meta_model

        return sum(4 * p.numel() for p in build_meta_model(task, 0).model.parameters())
    except (RuntimeError, ValueError, TypeError) as err:
        log.warning("profile: the task's model could not be built (%s)", err)
        return 0
