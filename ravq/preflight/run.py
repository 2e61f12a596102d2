"""``ravq check``'s pre-flight, in order: import the task, check its interface and first batches, build and
trace the model at the planned cuts on ``meta``, describe it (ties, unused weights, buffers, evaluation
mode), estimate each stage's memory against its PC's, then compare the split stages with the unsplit model
on a materialized copy when two copies fit this PC (else the eval graphs are checked on ``meta`` alone).
Every problem is a ``Finding`` with its fix; ``Report.failed`` says whether training would fail."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ravq.config import ConfigError, Topology, resolve_task_module
from ravq.config.batch import default_inflight
from ravq.preflight import interface, memory, model, numerics
from ravq.preflight.report import GIB, Report, StageMemory
from ravq.tuning import rss_bytes, usable_memory_bytes


@dataclass(frozen=True, slots=True)
class PlacedMemory:
    """The memory of the PC a stage is planned on."""

    node: str
    available: int | None
    source: str
    """Where ``available`` comes from: ``profile``, ``topology``, ``this PC``."""


@dataclass(kw_only=True, slots=True)
class CheckSettings:
    micro_batch: int = 16
    stages: int = 1
    """Stages to cut evenly into when ``cuts`` is None."""
    cuts: list[str] | None = None
    """The planned cuts; None: ``stages`` stages, cut evenly."""
    max_inflight: int | None = None
    """None: the window a node takes (``ravq.config.batch.default_inflight``: one per stage, at most
    ``update_every`` when that is above 1)."""
    update_every: int = 1
    """Micro-batches an optimizer step sums (a topology's ``batch`` over its micro-batch and clusters)."""
    seed: int = 0
    predict_weights: float = 0.0
    extrapolate_gradients: float = 0.0
    stale_correction: str = "none"
    inflight_warmup_steps: int = 0
    """With ``update_every``: which stale stages keep compensation's last gradient (``MemorySettings``)."""
    split_backward: bool = False
    """``training.schedule: zero_bubble``: graphs kept for deferred weight passes count (``update_every``)."""
    synchronous: bool = False
    """``training.schedule: sync`` or ``zero_bubble``: nothing stale, no stash copies (``MemorySettings``)."""
    evaluate: bool = True
    """Check the eval graphs (when the task has ``eval_batches``)."""
    placed: list[PlacedMemory] = field(default_factory=list)
    """Per stage, its PC's memory; missing: this PC's."""
    compare_budget_bytes: int | None = None
    """Largest materialized comparison (two copies of the model, their gradients and one micro-batch) to
    run; None: half of this PC's usable memory."""
    meta_only: bool = False
    """Make no weight real (the comparison is skipped)."""
    task_options: dict[str, Any] | None = None
    """A topology's ``task_options`` (the task's ``configure(**options)``)."""
    runtime_bytes: int | None = None
    """The process around a stage; None: this process's resident memory after tracing."""


def run_checks(spec: str, settings: CheckSettings) -> Report:
    """Every check of ``ravq check`` on the task ``spec``; stops at the first step that cannot go on."""
    t0 = time.monotonic()
    report = Report(
        task=spec,
        cuts=settings.cuts or [],
        stages=len(settings.cuts) + 1 if settings.cuts is not None else settings.stages,
        planned=settings.cuts is not None,
        micro_batch=settings.micro_batch,
        max_inflight=settings.max_inflight or 0,
    )
    try:
        _run(spec, settings, report)
    finally:
        report.seconds = time.monotonic() - t0
    return report


def _run(spec: str, settings: CheckSettings, report: Report) -> None:
    try:
        task = resolve_task_module(spec, settings.task_options)
    except ConfigError as err:
        fix = (
            "define them, as the task interface in docs/tasks.md says"
            if " lacks " in str(err)
            else "name a task after ':' (one the message lists), or drop the ':' part"
            if "not a task" in str(err) or "has no attribute" in str(err)
            else "correct the option it names (--task-option, or the topology's task_options)"
            if str(err).startswith("task_options:")
            else "make the task importable: a module on sys.path, a module in the current folder, or a "
            "file path (docs/tasks.md)"
        )
        report.add("error", "import", str(err), fix)
        return
    batches = interface_checks(task, settings.micro_batch, settings.seed, report)
    built = model.meta_model(task, settings.seed, report)
    if built is None:
        return
    whole, on_meta = built
    cuts = (
        settings.cuts
        if settings.cuts is not None
        else model.planned_cuts(whole, task, settings.stages, report)
    )
    if cuts is None or batches is None:
        return
    window = settings.max_inflight or default_inflight(len(cuts) + 1, settings.update_every)
    report.cuts, report.max_inflight, report.planned = cuts, window, True
    example, train, held_out = batches
    specs = model.split(whole, example, cuts, report, task if on_meta else None, settings.seed)
    if specs is None:
        return
    model.describe(whole, specs, report)
    runtime = settings.runtime_bytes if settings.runtime_bytes is not None else rss_bytes() or 0
    firsts = [next(iter(dict(whole.named_children())), "input"), *cuts]
    mem = memory.MemorySettings(
        micro_batch=settings.micro_batch,
        max_inflight=report.max_inflight,
        predict_weights=settings.predict_weights,
        extrapolate_gradients=settings.extrapolate_gradients,
        update_every=settings.update_every,
        stale_correction=settings.stale_correction,
        inflight_warmup_steps=settings.inflight_warmup_steps,
        synchronous=settings.synchronous or settings.split_backward,
        split_graphs=settings.update_every if settings.split_backward else 0,
        runtime_bytes=runtime,
    )
    try:
        report.memory = memory.estimate(specs, example, train[1], task, mem, report, firsts)
    except Exception as err:  # noqa: BLE001 - user code runs in the pass
        report.add(
            "error",
            "memory",
            f"a pass over the stages on fake tensors failed: {type(err).__name__}: {str(err)[:300]}",
            "make forward and loss_fn run on example_inputs and a batch's targets",
        )
    _against_pcs(report.memory, settings.placed, report)
    evaluate = settings.evaluate and callable(getattr(task, "eval_batches", None))
    _compare(task, settings, report, whole, on_meta, example, train, held_out if evaluate else None, specs)


def interface_checks(
    task: Any, micro_batch: int, seed: int, report: Report
) -> tuple[tuple[Any, ...], tuple[tuple[Any, ...], Any], Any] | None:
    """Signatures and first batches (what ``ravq node`` and ``ravq demo`` check at start): the example
    inputs, the first training batch and the first held-out one (or None), or None when they are wrong."""
    interface.check_signatures(task, report)
    if report.failed:
        return None
    found = interface.check_batches(task, micro_batch, seed, report)
    if found is None or report.failed:
        return None
    return found


def start_problems(task: Any, micro_batch: int, seed: int) -> str | None:
    """What ``ravq node`` and ``ravq demo`` check at start (the interface and first batches, no trace): the
    errors with their fixes as one message, or None."""
    report = Report(task="", cuts=[], stages=1, micro_batch=micro_batch, max_inflight=0)
    interface_checks(task, micro_batch, seed, report)
    if not report.failed:
        return None
    return "the task would fail: " + "; ".join(f"{f.message} (fix: {f.fix})" for f in report.errors) + \
        " [ravq check --task ... says more]"


def check_at_start(topology: Topology) -> None:
    """ConfigError naming every problem of the topology's task that ``start_problems`` finds: what ``ravq
    node`` and ``ravq demo`` run before anything starts (a swarm's nodes would each fail on it later)."""
    task = resolve_task_module(topology.task, topology.task_options)
    problems = start_problems(task, topology.training.micro_batch, topology.seed)
    if problems:
        raise ConfigError(f"task {topology.task}: {problems}")


def _against_pcs(stages: list[StageMemory], placed: list[PlacedMemory], report: Report) -> None:
    here = usable_memory_bytes("cpu")
    for stage in stages:
        pc = placed[stage.stage] if stage.stage < len(placed) else PlacedMemory("", None, "")
        stage.node = pc.node
        stage.available, stage.available_from = (
            (pc.available, pc.source) if pc.available is not None else (here, "this PC")
        )
        if stage.available is not None and stage.total > stage.available:
            where = f" on {pc.node}" if pc.node else ""
            report.add(
                "error",
                "memory",
                f"stage {stage.stage}{where} needs {stage.total / GIB:.2f} GiB, its PC has "
                f"{stage.available / GIB:.2f} GiB ({stage.available_from})",
                "cut into more stages (more PCs per cluster, or `ravq plan` with profiles), a smaller "
                "training.micro_batch, or a lower training.max_inflight",
            )


def _compare(
    task: Any,
    settings: CheckSettings,
    report: Report,
    whole: nn.Module,
    on_meta: bool,
    example: tuple[Any, ...],
    train: tuple[tuple[Any, ...], Any],
    held_out: Any,
    specs: list[Any],
) -> None:
    weights = sum(s.weights + s.grads for s in report.memory)
    needed = 2 * weights + sum(s.activations for s in report.memory)
    budget = settings.compare_budget_bytes
    budget = budget if budget is not None else (usable_memory_bytes("cpu") or 0) // 2
    if settings.meta_only or needed > budget:
        why = (
            "--meta-only"
            if settings.meta_only
            else (
                f"two copies of the model need {needed / GIB:.2f} GiB, "
                f"over the {budget / GIB:.2f} GiB allowed"
            )
        )
        report.add("info", "numerics", f"split vs unsplit not compared ({why}); checked on meta only")
        if held_out is not None and on_meta:
            model.eval_graph_on_meta(task, settings.seed, example, report.cuts, specs, report)
        return
    try:
        numerics.compare(task, settings.seed, example, report.cuts, train, report, held_out)
    except Exception as err:  # noqa: BLE001 - user code runs in forward, backward and loss_fn
        report.add(
            "error",
            "numerics",
            f"one micro-batch forward and backward failed: {type(err).__name__}: {str(err)[:300]}",
            "run the model and loss_fn on a batch of train_batches in Python first",
        )
