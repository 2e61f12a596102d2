"""The few places where ravq reaches into ``nn.Module``'s own tables and torch's tracer.

Cutting a model swaps tensors in and out of modules it did not build: a materialized weight in place of
a meta one, a tied weight shared between stages, a training stage's weights inside its eval graph.
torch's public setters (``setattr``, ``register_parameter``, ``register_buffer``) run registration hooks
and checks and reset a buffer's persistence; torch offers no public way for the plain swap, for reading
or marking which buffers are non-persistent, or for a module's raw tables (``None`` entries included).
The tracer's graph modules are rebuilt in place from a cache, and the tracer itself is wrapped (see
``ravq/cut/trace.py``).  Every such access is here, each marked ``# noqa: SLF001``, so the rest of ravq
touches modules only through these names.  Dotted ``name`` arguments are relative to ``module``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn


def _owner_and_leaf(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, leaf = name.rpartition(".")
    return (module.get_submodule(prefix) if prefix else module), leaf


def set_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Put ``param`` in the parameter table of the submodule owning ``name`` (added if absent)."""
    owner, leaf = _owner_and_leaf(module, name)
    owner._parameters[leaf] = param  # noqa: SLF001


def set_buffer(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put ``tensor`` in the buffer table of the submodule owning ``name``; its persistence is kept."""
    owner, leaf = _owner_and_leaf(module, name)
    owner._buffers[leaf] = tensor  # noqa: SLF001


def replace_tensor(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put ``tensor`` in place of the parameter or buffer ``name`` (whichever the module holds)."""
    owner, leaf = _owner_and_leaf(module, name)
    if leaf in owner._parameters:  # noqa: SLF001
        owner._parameters[leaf] = tensor  # type: ignore[assignment]  # noqa: SLF001
    else:
        assert leaf in owner._buffers, name  # noqa: SLF001
        owner._buffers[leaf] = tensor  # noqa: SLF001


def is_parameter(module: nn.Module, name: str) -> bool:
    owner, leaf = _owner_and_leaf(module, name)
    return leaf in owner._parameters  # noqa: SLF001


def delete_parameter(module: nn.Module, name: str) -> None:
    owner, leaf = _owner_and_leaf(module, name)
    del owner._parameters[leaf]  # noqa: SLF001


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module``'s own parameter table, in registration order, ``None`` entries included."""
    return dict(module._parameters)  # noqa: SLF001


def own_buffers(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """``module``'s own buffer table, in registration order, ``None`` entries included."""
    return dict(module._buffers)  # noqa: SLF001


def child_names(module: nn.Module) -> list[str]:
    """Every registered child's name, in order (``None`` children and repeated modules included)."""
    return list(module._modules)  # noqa: SLF001


def child(module: nn.Module, name: str) -> nn.Module | None:
    """The child registered as ``name``, or None."""
    return module._modules.get(name)  # noqa: SLF001


def holds(module: nn.Module, leaf: str) -> bool:
    """Whether ``module`` itself registers a parameter, buffer or child called ``leaf``."""
    tables = (module._parameters, module._buffers, module._modules)  # noqa: SLF001
    return any(leaf in table for table in tables)


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """The names of ``module``'s own buffers that ``state_dict`` leaves out."""
    return set(module._non_persistent_buffers_set)  # noqa: SLF001


def mark_non_persistent(module: nn.Module, name: str) -> None:
    """Make the buffer ``name`` non-persistent without re-registering it."""
    owner, leaf = _owner_and_leaf(module, name)
    owner._non_persistent_buffers_set.add(leaf)  # noqa: SLF001


def adopt_members(target: nn.Module, source: nn.Module) -> None:
    """Give ``target`` copies of ``source``'s tables (children, parameters, buffers, persistence), in
    ``source``'s order: a rebuilt graph module keeps only what its graph reads."""
    target._modules = dict(source._modules)  # noqa: SLF001
    target._parameters = dict(source._parameters)  # noqa: SLF001
    target._buffers = dict(source._buffers)  # noqa: SLF001
    target._non_persistent_buffers_set = set(source._non_persistent_buffers_set)  # noqa: SLF001


def graph_pytree_spec(graph: fx.Graph, name: str) -> Any:
    """The pytree spec ``name`` (``in_spec`` or ``out_spec``) of a graph's generated code."""
    return getattr(graph._codegen.pytree_info, name)  # type: ignore[attr-defined]  # noqa: SLF001


def hf_init_weights(model: nn.Module, module: nn.Module) -> None:
    """A Hugging Face model's own initialisation of one of its submodules."""
    model._init_weights(module)  # type: ignore[operator]  # noqa: SLF001


def pipe_export_trace() -> Callable[..., Any]:
    """The function torch's pipelining traces a model with."""
    from torch.distributed.pipelining._IR import Pipe  # seconds to import: only where a model is cut

    return Pipe._trace_with_export  # noqa: SLF001


def set_pipe_export_trace(trace: Callable[..., Any]) -> None:
    """Make torch's pipelining trace with ``trace`` (callers hold a lock and restore the previous one)."""
    from torch.distributed.pipelining._IR import Pipe

    Pipe._trace_with_export = staticmethod(trace)  # type: ignore[method-assign, assignment]  # noqa: SLF001
