"""Each stage's memory as a node of the run will hold it, worked out on ``meta`` (no weight made real):
weights, gradients, the task's optimizer's state, weight snapshots of versions in flight, and per in-flight
micro-batch the tensors autograd saves, the stage's inputs and outputs; plus the process around the stage.
``training.schedule: zero_bubble`` keeps a graph past the input-gradients until its deferred weight pass, so
a split stage may hold up to an update's micro-batches (``MemorySettings.split_graphs``), each with the
gradients its input pass kept for the weight pass (``ravq.stage.split``).

The estimate is of the peak, so of the worst case the pipeline allows: every stage but the last may hold
all ``max_inflight`` micro-batches between their forward and their backward (a slower later stage queues
them), the last holds one (its forward and backward are back to back).  Weight snapshots: one per version
still in flight besides the live weights (``ravq.stage.stash``); on a stale stage (every one but the last)
weight prediction makes the current version's snapshot a copy too (made in the buffer of the last update,
which a stage with tied copies keeps besides), and delay compensation keeps the last gradient
(``ravq.stage.delay``); the last stage is never stale and holds neither.  Under a synchronous schedule
(``sync``, ``zero_bubble``) no stage is stale, and each steps with nothing in flight, so it holds no copy
at all (``MemorySettings.synchronous``).  An optimizer
with state also makes a parameter-sized temporary per step (torch's ``foreach`` implementations: Adam's
square roots of its second moments), counted with its state.  bench_check_memory.py compares the result
with a 1x4 run's measured peaks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ravq.cut.meta import to_meta
from ravq.cut.split import StageSpec, keep_buffers, model_output
from ravq.preflight.report import Report, StageMemory
from ravq.stage.delay import compensates, has_momentum
from ravq.stage.pipenag import uses_lookahead
from ravq.stage.recipe import build_optimizer
from ravq.stage.split import input_pass, leaves_under


@dataclass(frozen=True, kw_only=True, slots=True)
class MemorySettings:
    micro_batch: int
    max_inflight: int
    predict_weights: float = 0.0
    extrapolate_gradients: float = 0.0
    split_graphs: int = 0
    """``training.schedule: zero_bubble``: the micro-batches whose graphs a stage past the first may hold at
    once, in flight or kept for a deferred weight pass (its ``update_every``: the flush bounds them), each
    with the gradients kept for its weight pass besides; 0: not split.  Stages with tied copies run their
    backward whole."""
    runtime_bytes: int = 0
    """The process around a stage (``StageMemory.runtime``)."""
    update_every: int = 1
    stale_correction: str = "none"
    inflight_warmup_steps: int = 0
    """With ``update_every``: whether an Adam-family stage keeps compensation's last gradient
    (``ravq.stage.delay.compensates``: not under PipeNAG after the warm-up)."""
    synchronous: bool = False
    """``training.schedule: sync`` or ``zero_bubble``: no gradient is ever stale, so no stage keeps
    prediction's or compensation's copies, and a stage steps (its tied steps too: every forward waits for
    them) with nothing in flight, so its forwards' snapshot is the live weights
    (``WeightStash.before_change``)."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # noqa: SLF001 - one key per storage: views of one tensor count once


def optimizer_bytes(
    make_optimizer: Callable[..., Any], params: dict[str, nn.Parameter], report: Report
) -> int:
    """State the task's optimizer keeps after one step, stepped on ``meta`` copies of the parameters."""
    trained = {n: p for n, p in params.items() if p.requires_grad}
    if not trained:
        return 0
    copies = {n: nn.Parameter(torch.empty_like(p, device="meta")) for n, p in trained.items()}
    for c in copies.values():
        c.grad = torch.empty_like(c)
    try:
        optimizer = build_optimizer(make_optimizer, copies)
        optimizer.step()
    except Exception as err:  # noqa: BLE001 - user code; the estimate goes on without it
        grads = sum(_nbytes(p) for p in trained.values())
        report.add(
            "warning",
            "memory",
            f"make_optimizer's optimizer cannot step on the meta device "
            f"({type(err).__name__}: {str(err)[:160]}); its state is taken as Adam's, 2x the gradients",
            "none needed unless the optimizer keeps more or less state than Adam",
        )
        return 2 * grads
    return sum(
        _nbytes(v)
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )


def _fake(mode: FakeTensorMode, value: Any) -> Any:
    return pytree.tree_map(
        lambda x: mode.from_tensor(x.to("meta")) if isinstance(x, torch.Tensor) else x, value
    )


def activation_bytes(
    specs: list[StageSpec], example: tuple[Any, ...], targets: Any, loss_fn: Callable[[Any, Any], Any]
) -> list[int]:
    """Per stage, bytes one in-flight micro-batch holds: saved tensors of its forward (the loss's on the last
    stage), its inputs and its outputs, from one pass on fake tensors."""
    return [held for held, _ in stage_bytes(specs, example, targets, loss_fn)]


def stage_bytes(
    specs: list[StageSpec], example: tuple[Any, ...], targets: Any, loss_fn: Callable[[Any, Any], Any],
    *, split: bool = False,
) -> list[tuple[int, int]]:
    """Per stage, ``activation_bytes`` and, with ``split``, what a micro-batch past its input pass keeps for
    its deferred weight pass besides (``training.schedule: zero_bubble``): the gradients arriving where the
    weights' side leaves the inputs' (``ravq.stage.split``), from that input pass run on the fake graph (0 on
    stage 0, which runs its backward whole)."""
    result = []
    modules = [s.module for s in specs]
    outputs: dict[int, tuple[Any, ...]] = {}
    with (
        FakeTensorMode(allow_non_fake_inputs=True) as mode,
        keep_buffers(modules),
        torch.random.fork_rng(devices=[]),
    ):
        args = tuple(_fake(mode, a) for a in example)
        fake_targets = _fake(mode, targets)
        for spec in specs:
            got = [args[r.index] if r.stage < 0 else outputs[r.stage][r.index] for r in spec.received]
            leaves = [
                g.detach().requires_grad_(g.is_floating_point() and r.stage >= 0)
                for g, r in zip(got, spec.received)
            ]
            tensors = [*spec.module.parameters(), *spec.module.buffers()]
            # the weights as the fake mode sees them too (it converts a meta weight once, memoized as long
            # as the fake lives: kept alive here, or a storage's key could be reused by another tensor)
            tensors += [mode.from_tensor(t) for t in tensors if t.is_meta]
            own = {_key(t) for t in tensors}
            saved: dict[int, int] = {}

            def pack(t: torch.Tensor, own: set[int] = own, saved: dict[int, int] = saved) -> torch.Tensor:
                k = _key(t)
                if k not in own:
                    saved[k] = max(saved.get(k, 0), t.untyped_storage().nbytes())
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = spec.module(*leaves[: len(spec.inputs)])
                loss = loss_fn(model_output(spec, out, leaves), fake_targets) if spec is specs[-1] else None
            outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            outputs[spec.index] = tuple(o.detach() for o in outs)
            kept = {_key(x): _nbytes(x) for x in [*got, *outs] if isinstance(x, torch.Tensor)}
            held = sum(saved.values()) + sum(v for k, v in kept.items() if k not in saved)
            roots = [loss] if loss is not None else [o for o in outs if isinstance(o, torch.Tensor)]
            grads = _kept_gradients(roots, leaves, held) if split and spec.index > 0 else 0
            result.append((held, grads))
    return result


def _kept_gradients(roots: list[torch.Tensor], leaves: list[torch.Tensor], held: int) -> int:
    """Bytes of the gradients a split stage's input pass keeps for the weight pass (on the fake graph)."""
    roots = [r for r in roots if r.requires_grad]
    inputs = [x for x in leaves if x.requires_grad]
    try:
        weights = [w for w in leaves_under(roots) if all(w is not x for x in inputs)]
        _, weight_pass = input_pass(roots, [torch.ones_like(r) for r in roots], inputs, weights)
    except Exception:  # noqa: BLE001 - user code on fake tensors: count a second set of activations instead
        return held
    return weight_pass.nbytes


def _forecasts(make_optimizer: Callable[..., Any], params: dict[str, nn.Parameter],
               settings: MemorySettings) -> tuple[bool, bool]:
    """Whether a stale stage runs weight prediction and delay compensation with its optimizer, built on
    ``meta`` copies: prediction needs a momentum (``has_momentum``), compensation that and, for the Adam
    family, no PipeNAG after the warm-up (``compensates``).  Both when it cannot be built there (counted as
    before)."""
    trained = {n: p for n, p in params.items() if p.requires_grad}
    copies = {n: nn.Parameter(torch.empty_like(p, device="meta")) for n, p in trained.items()}
    if not copies:
        return True, True
    try:
        optimizer = build_optimizer(make_optimizer, copies)
    except Exception:  # noqa: BLE001 - user code; optimizer_bytes reports it
        return True, True
    try:
        lookahead = uses_lookahead(settings.stale_correction, optimizer, settings.update_every)
    except ValueError:  # pipenag for an optimizer it has no step for: the node refuses to start anyway
        lookahead = False
    return has_momentum(optimizer), compensates(optimizer, lookahead, settings.inflight_warmup_steps > 0)


def estimate(
    specs: list[StageSpec],
    example: tuple[Any, ...],
    targets: Any,
    task: Any,
    settings: MemorySettings,
    report: Report,
    first_names: list[str],
) -> list[StageMemory]:
    """Every stage's ``StageMemory`` (``available`` left for the caller to fill in)."""
    example = to_meta(example) if any(p.is_meta for s in specs for p in s.module.parameters()) else example
    per_micro_batch = stage_bytes(specs, example, targets, task.loss_fn, split=settings.split_graphs > 0)
    stages = len(specs)
    result = []
    for spec, (activations, kept), first in zip(specs, per_micro_batch, first_names):
        params = dict(spec.module.named_parameters())
        weights = sum(_nbytes(p) for p in params.values()) + sum(_nbytes(b) for b in spec.module.buffers())
        trained = sum(_nbytes(p) for p in params.values() if p.requires_grad)
        inflight = 1 if spec.index == stages - 1 else settings.max_inflight
        split = settings.split_graphs if spec.index > 0 and not spec.tied else 0
        state = optimizer_bytes(task.make_optimizer, params, report)
        copies = 0 if settings.synchronous else max(0, inflight - 1)
        # the last stage is never stale, nor is any under a synchronous schedule, and without a momentum
        # neither mechanism runs: none holds anything
        stale = inflight > 1 and not settings.synchronous
        predicts, compensated = _forecasts(task.make_optimizer, params, settings) if stale else (False, False)
        if settings.predict_weights > 0 and predicts:
            # the current version's snapshot is a copy, made in the last update's buffer; with tied copies
            # (which change the weights mid-version) the update is kept besides (WeightStash.step)
            copies += 2 if spec.tied else 1
        if settings.extrapolate_gradients > 0 and compensated:
            copies += 1  # the last gradient (GradientExtrapolation), written in place
        result.append(
            StageMemory(
                stage=spec.index,
                first=first,
                weights=weights,
                grads=trained,
                optimizer=state + (trained if state else 0),
                stash=copies * trained,
                activations=max(inflight, split) * activations + split * kept,
                runtime=settings.runtime_bytes,
            )
        )
    return result
