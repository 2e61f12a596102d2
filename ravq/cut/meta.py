"""The task's model without its weights: parameters on the ``meta`` device, so no PC ever holds the model.

``build_meta_model`` runs the task's ``build_model`` with every parameter swapped for a ``meta`` tensor
the moment a module registers it (so a layer's own initialisation in ``__init__`` costs nothing), then
moves the buffers to ``meta`` too, keeping their values aside: buffers are small and often computed in
``__init__`` (rotary frequencies, position ids) where no initialiser could recompute them.  The model is
put in train mode: a ``from_pretrained`` model arrives in eval mode and must not train with dropout off.

Tracing, the planner's block profile, averaging owners and ``ravq plan`` all work on this model;
``ravq.cut.materialize`` gives one stage real weights.  ``shape_pass`` runs the model (or a stage) on
fake tensors, for what a pass over example inputs reveals: output structure, shapes, dtypes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class Blueprint:
    model: nn.Module
    """The task's model, every parameter and buffer on ``meta``, in train mode."""
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    """Each buffer's value as the model's constructor left it (qualified name -> CPU tensor)."""
    pretrained: str | None = None
    """A checkpoint the model's constructor named (a ``from_pretrained`` model's path), if any."""


def _param_to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
    if param is None or param.is_meta:
        return None
    return nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)


_VALUE_OPS = frozenset({
    "normal_", "uniform_", "trunc_normal_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
    "kaiming_normal_", "orthogonal_", "sparse_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "exponential_", "log_normal_", "cauchy_", "geometric_", "random_", "bernoulli_", "fill_", "zero_",
    "copy_", "erfinv_", "mul_", "add_", "sub_", "div_", "clamp_", "clamp_min_", "clamp_max_"})
"""In-place ops that only set values (what initialisers do): nothing to do on a meta tensor."""


class SkipMetaInPlace(TorchFunctionMode):
    """Value-setting in-place ops on ``meta`` tensors while the model is built (``nn.init``'s ``normal_``,
    ``uniform_``, ``zero_``...) are skipped: a meta tensor has no values, and torch runs several of them
    through Python references that import torch._dynamo on first use (seconds of a node's start).  Ops that
    change a tensor's metadata (``requires_grad_``, ``unsqueeze_``...) run as always."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # nn.init passes its tensor by keyword
        if (
            getattr(func, "__name__", "") in _VALUE_OPS
            and isinstance(target, torch.Tensor)
            and target.is_meta
        ):
            return target
        return func(*args, **kwargs)


def example_args(task: Any, micro_batch: int) -> tuple[Any, ...]:
    """``task.example_inputs(micro_batch)`` as the tuple the tracer takes (a bare tensor is one input, never a
    tuple of its rows)."""
    example = task.example_inputs(micro_batch)
    return tuple(example) if isinstance(example, (tuple, list)) else (example,)


def build_meta_model(task: Any, seed: int) -> Blueprint:
    """The task's model on ``meta``, built with the run's seed (buffers made at random stay reproducible)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        handle = register_module_parameter_registration_hook(_param_to_meta)
        try:
            with SkipMetaInPlace():
                model = task.build_model()
        finally:
            handle.remove()
    if not isinstance(model, nn.Module):
        raise TypeError(f"the task's build_model() returned {type(model).__name__}, not a torch.nn.Module")
    buffers = {
        name: b.detach().to("cpu", copy=True)
        for name, b in model.named_buffers(remove_duplicate=False)
        if not b.is_meta
    }
    with torch.no_grad():
        model.to("meta")  # parameters registered outside __setattr__ (rare) and every buffer
    model.train()
    return Blueprint(model=model, buffers=buffers, pretrained=_named_checkpoint(model))


def _named_checkpoint(model: nn.Module) -> str | None:
    """The directory a transformers ``from_pretrained`` read (its weights are not kept: every stage reads
    its own tensors from there instead)."""
    config = getattr(model, "config", None)
    path = getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None)
    if not path:
        return None
    from pathlib import Path

    if not Path(path).is_dir():
        return None
    log.warning("the task's build_model() loaded a pretrained model from %s: each stage reads only its own "
                "tensors from there; build the model from its config and name the checkpoint (the task's "
                "`pretrained`) so that no PC reads the whole checkpoint at start", path)
    return str(path)


def is_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def to_meta(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)


@contextlib.contextmanager
def shape_pass(modules: list[nn.Module], example_args: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
    """The example inputs to run ``modules`` on for shapes, dtypes and structure: as they are for real
    modules; fake tensors (on ``meta``) for a meta model, which libraries such as transformers treat as
    tracing (no data-dependent checks)."""
    if not any(is_meta(m) for m in modules):
        yield example_args
        return
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in to_meta(example_args))


def retarget_device(module: nn.Module, old: torch.device | str, new: torch.device | str) -> int:
    """Rewrite the ``device`` that tracing baked into a stage graph's ops
    (``torch.arange(t, device=x.device)`` traced on ``meta`` makes meta tensors) from ``old`` to ``new``;
    returns how many ops changed."""
    old, new = torch.device(old), torch.device(new)

    swapped = [0]

    def swap(value: Any) -> Any:  # positional (aten.to.device) or keyword (arange, _to_copy) devices alike
        if isinstance(value, torch.device) and value == old:
            swapped[0] += 1
            return new
        return value

    changed = 0
    for sub in module.modules():
        gm = getattr(sub, "graph_module", sub)  # torch's InterpreterModule keeps its graph there
        graph = getattr(gm, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        count = 0
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            before = swapped[0]
            args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), swap)
            if swapped[0] > before:
                node.args, node.kwargs = args, kwargs
                count += 1
        if count:
            gm.recompile()
            changed += count
    return changed
