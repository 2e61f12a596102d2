"""What ``ravq check`` found: each problem named with its fix, and what each stage will hold."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Level = Literal["error", "warning", "info"]

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Finding:
    level: Level
    """``error``: training would fail (the check exits non-zero); ``warning``: it runs, but not as the user
    likely means; ``info``: what the user should know (ties, buffers, evaluation mode)."""
    topic: str
    """What was checked: ``interface``, ``split``, ``numerics``, ``tied``, ``eval``, ``memory``..."""
    message: str
    fix: str = ""
    """What to change; empty for an ``info``."""

    def format(self) -> str:
        fix = f"\n    fix: {self.fix}" if self.fix else ""
        return f"{self.level}: [{self.topic}] {self.message}{fix}"


@dataclass(kw_only=True, slots=True)
class StageMemory:
    """One stage's memory, in bytes, as a node of the run will hold it."""

    stage: int
    first: str
    """The module the stage begins at."""
    weights: int
    """Parameters and buffers."""
    grads: int
    optimizer: int
    """The task's optimizer's state after a step, and the step's parameter-sized temporary when it has
    state."""
    stash: int
    """Weight snapshots of versions still in flight (``ravq.stage.stash``) and predicted weights."""
    activations: int
    """Per in-flight micro-batch: tensors autograd saves, the stage's inputs and outputs; times in flight."""
    runtime: int
    """The process around the stage (Python, torch, the tracer, ZeroMQ): this process's resident memory
    after tracing on ``meta``, before any weight was made real."""
    node: str = ""
    """The planned PC; empty with ``--stages``."""
    available: int | None = None
    """That PC's memory (its profile, the topology's ``memory_bytes``, or this PC's); None: unknown."""
    available_from: str = ""

    @property
    def stage_bytes(self) -> int:
        return self.weights + self.grads + self.optimizer + self.stash + self.activations

    @property
    def total(self) -> int:
        """What the node's process will peak at: the stage and the runtime around it."""
        return self.stage_bytes + self.runtime

    def format(self) -> str:
        where = f" on {self.node}" if self.node else ""
        avail = (
            f" of {self.available / GIB:.2f} GiB ({self.available_from})"
            if self.available is not None
            else ""
        )
        return (
            f"  stage {self.stage} (from {self.first}){where}: {self.total / GIB:.3f} GiB{avail} = in MiB: "
            f"weights {self.weights / MIB:.1f} + grads {self.grads / MIB:.1f} + optimizer "
            f"{self.optimizer / MIB:.1f} + stash {self.stash / MIB:.1f} + activations "
            f"{self.activations / MIB:.1f} + runtime {self.runtime / MIB:.0f}"
        )


@dataclass(kw_only=True, slots=True)
class Report:
    task: str
    cuts: list[str]
    stages: int
    """Stages asked for (``cuts`` holds their cuts once ``planned``)."""
    planned: bool = False
    """Whether ``cuts`` are known: not when the task did not import or could not be cut."""
    micro_batch: int
    max_inflight: int
    findings: list[Finding] = field(default_factory=list)
    memory: list[StageMemory] = field(default_factory=list)
    largest_difference: float | None = None
    """Largest absolute difference of the loss and any gradient, split stages against the unsplit model;
    None: not compared (the model is too large for this PC, or it could not be split)."""
    eval_difference: float | None = None
    """Absolute difference of one held-out micro-batch's loss, the split eval graphs against the unsplit
    model in eval mode; None: not compared (no eval_batches, or no real weights)."""
    seconds: float = 0.0

    def add(self, level: Level, topic: str, message: str, fix: str = "") -> None:
        self.findings.append(Finding(level, topic, message, fix))

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def failed(self) -> bool:
        """Training would fail as planned."""
        return bool(self.errors)

    def format(self) -> str:
        layout = (
            f"{len(self.cuts) + 1} stage(s) cut at {self.cuts or 'nothing'}, micro-batch {self.micro_batch}, "
            f"{self.max_inflight} in flight"
            if self.planned
            else f"{self.stages} stage(s) asked for, not cut (see below), micro-batch {self.micro_batch}"
        )
        head = f"ravq check: task {self.task}, {layout}"
        lines = [head]
        order = {"error": 0, "warning": 1, "info": 2}
        lines += [f.format() for f in sorted(self.findings, key=lambda f: order[f.level])]
        if self.memory:
            lines.append("memory per stage (a node's peak):")
            lines += [m.format() for m in self.memory]
        if self.largest_difference is not None:
            lines.append(
                f"split vs unsplit model: largest difference {self.largest_difference:.3g} "
                "(loss and every gradient, one micro-batch)"
            )
        if self.eval_difference is not None:
            lines.append(
                f"split vs unsplit eval graphs: held-out loss difference {self.eval_difference:.3g} "
                "(eval mode, one held-out micro-batch)"
            )
        verdict = (
            f"FAILED: {len(self.errors)} error(s); training would fail as planned"
            if self.failed
            else "OK: the task should train as planned"
        )
        warnings = sum(f.level == "warning" for f in self.findings)
        lines.append(
            f"{verdict}" + (f" ({warnings} warning(s))" if warnings else "") + f" [{self.seconds:.1f}s]"
        )
        return "\n".join(lines)
