"""The model's profile per candidate block, for the planner: bytes, FLOPs and memory.

The model is built on ``meta`` and cut at every candidate cut (``ravq.cut.split.split_model``, torch's
pipelining tracer); each piece is a block, given real weights only while it is measured, so profiling
never holds more than one block.  One real micro-batch (the task's first training batch) runs through
the blocks one by one, each block forward and backward under torch's ``FlopCounterMode``, each block's
inputs detached so its backward is counted alone.  Per block:

- ``param_bytes``: its parameters and floating-point buffers;
- ``act_bytes_out``: every tensor crossing a cut right after the block (outputs of this and earlier
  blocks, and model inputs, read by later blocks), per micro-batch; ``grad_bytes_out`` the floating ones;
- memory: parameters and buffers, gradients, optimizer state (measured by one step of the task's own
  optimizer, or ``optimizer_state_factor`` x parameters), plus per in-flight micro-batch the tensors
  autograd saves for backward, the block's stashed inputs and one weight snapshot (the pipeline stashes
  a copy of the weights per version in flight).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ravq.cut.materialize import materialize
from ravq.cut.meta import build_meta_model, retarget_device
from ravq.cut.split import StageSpec, candidate_cuts, model_output, split_model
from ravq.planner import BlockProfile
from ravq.stage.recipe import build_optimizer


@dataclass(kw_only=True, slots=True)
class _Measured:
    outputs: tuple[torch.Tensor, ...]
    fwd_flops: float
    bwd_flops: float
    saved_bytes: int
    optimizer_bytes: int


def profile_blocks(
    task: Any,
    micro_batch: int,
    *,
    max_inflight: int = 1,
    optimizer_state_factor: float | None = None,
    cuts: Sequence[str] | None = None,
    seed: int = 0,
) -> list[BlockProfile]:
    """One BlockProfile per candidate block of the task's model, in model order."""
    if micro_batch < 1 or max_inflight < 1:
        raise ValueError(f"micro_batch and max_inflight must be >= 1, got {micro_batch} and {max_inflight}")
    model = build_meta_model(task, seed).model  # one block at a time gets real weights, then loses them
    torch.manual_seed(seed)
    cuts = list(cuts) if cuts is not None else candidate_cuts(model, task)
    specs = split_model(model, _as_tuple(task.example_inputs(micro_batch)), cuts)
    inputs, targets = next(iter(task.train_batches(micro_batch, 0, 1, seed)))
    inputs = _as_tuple(inputs)
    outputs: list[tuple[torch.Tensor, ...]] = []
    measured = []
    for spec in specs:
        args = [
            inputs[ref.index] if ref.stage < 0 else outputs[ref.stage][ref.index] for ref in spec.received
        ]
        loss = task.loss_fn if spec.index == len(specs) - 1 else None
        materialize(spec.module, task, seed)
        retarget_device(spec.module, "meta", "cpu")
        m = _measure(
            spec, args, loss, targets, task.make_optimizer if optimizer_state_factor is None else None
        )
        spec.module.to("meta")
        outputs.append(tuple(o.detach() for o in m.outputs if isinstance(o, torch.Tensor)))
        measured.append(m)
    first = next(iter(dict(model.named_children())), "input")
    names = [first, *cuts]
    profiles = []
    for i, (spec, m) in enumerate(zip(specs, measured)):
        crossing = _crossing(specs, inputs, outputs, after=i)
        state = _state_bytes(spec.module)
        grads = sum(_nbytes(p) for p in spec.module.parameters() if p.requires_grad)
        optimizer = (
            m.optimizer_bytes if optimizer_state_factor is None else int(optimizer_state_factor * grads)
        )
        stashed_inputs = sum(_nbytes(inputs[r.index] if r.stage < 0 else outputs[r.stage][r.index])
                             for r in spec.received)
        inflight = m.saved_bytes + stashed_inputs + state
        profiles.append(BlockProfile(
            name=names[i], param_bytes=state, fwd_flops=m.fwd_flops, bwd_flops=m.bwd_flops,
            act_bytes_out=sum(_nbytes(t) for t in crossing),
            grad_bytes_out=sum(_nbytes(t) for t in crossing if t.is_floating_point()),
            memory_bytes=state + grads + optimizer + max_inflight * inflight,
            inflight_bytes=inflight, max_inflight=max_inflight))
    return profiles


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _state_bytes(module: nn.Module) -> int:
    """Parameters and floating-point buffers: what a stage holds and the rings average."""
    return (sum(_nbytes(p) for p in module.parameters())
            + sum(_nbytes(b) for b in module.buffers() if b.is_floating_point()))


def _measure(
    spec: StageSpec, args: list[torch.Tensor], loss_fn: Any, targets: Any, make_optimizer: Any
) -> _Measured:
    """Forward and backward of one block, each under a FLOP counter; saved activations; optimizer state."""
    module = spec.module
    leaves = [a.detach().requires_grad_(a.is_floating_point() and ref.stage >= 0)
              for a, ref in zip(args, spec.received)]
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    params = [p for p in module.parameters() if p.requires_grad]
    own = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            saved[ptr] = max(saved.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with FlopCounterMode(display=False) as fwd, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        raw = module(*leaves[: len(spec.inputs)])
        out = _as_tuple(raw)
        value = loss_fn(model_output(spec, raw, leaves), targets) if loss_fn is not None else None
    roots = [value] if value is not None else [o for o in out if o.requires_grad]
    wrt = params + [x for x in leaves if x.requires_grad]
    with FlopCounterMode(display=False) as bwd:
        if roots and wrt:
            grads = torch.autograd.grad(roots, wrt, [None if value is not None else torch.ones_like(r)
                                                      for r in roots], allow_unused=True)
        else:
            grads = ()
    return _Measured(
        outputs=out,
        fwd_flops=float(fwd.get_total_flops()),
        bwd_flops=float(bwd.get_total_flops()),
        saved_bytes=sum(saved.values()),
        optimizer_bytes=_optimizer_bytes(make_optimizer, names, params, grads) if make_optimizer else 0,
    )


def _optimizer_bytes(
    make_optimizer: Any, names: list[str], params: list[nn.Parameter], grads: Sequence[Any]
) -> int:
    """State the task's optimizer keeps for these parameters after one step (on copies; a
    ``make_optimizer(named_params)`` gets their names)."""
    if not params:
        return 0
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    for c, g in zip(copies, grads):
        c.grad = torch.zeros_like(c) if g is None else g.detach().clone()
    optimizer = build_optimizer(make_optimizer, dict(zip(names, copies)))
    optimizer.step()
    return sum(_nbytes(v) for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def _crossing(
    specs: list[StageSpec],
    inputs: tuple[torch.Tensor, ...],
    outputs: list[tuple[torch.Tensor, ...]],
    after: int,
) -> list[torch.Tensor]:
    """Tensors made at or before block ``after`` (or model inputs) that a later block reads."""
    refs = {(ref.stage, ref.index) for spec in specs[after + 1:] for ref in spec.received
            if ref.stage <= after}
    return [inputs[i] if s < 0 else outputs[s][i] for s, i in sorted(refs)]
