"""torch's pipelining tracer, with the one repair real models need: no-grad regions inlined.

A ``@torch.no_grad()`` forward inside a training-mode model (Llama's rotary embedding, most position or
mask builders) is captured by ``torch.export`` as a ``wrap_with_set_grad_enabled`` call on a body
sub-graph.  torch's pipelining then unflattens the stage holding it wrongly (the body is passed where
the module expects its inputs), so the stage fails at its first forward.  Before splitting, each such
region is replaced by its body run on detached inputs: the same values, and no gradient flows through,
exactly as under ``no_grad``.
"""

from __future__ import annotations

import operator
import threading
import warnings
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.pipelining import SplitPoint, pipeline
from torch.distributed.pipelining._IR import Pipe

from ravq.cut.modules import pipe_export_trace, set_pipe_export_trace

_PATCH_LOCK = threading.Lock()
_WRAP = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
_LEAFSPEC_NOTICE = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
"""torch's tracer deep-copies its own pytree specs and warns about its own deprecated class, once per
stage: nothing a user can act on, so it is kept off their terminal."""


def split_pipe(model: nn.Module, example_args: tuple[Any, ...], cuts: list[str]) -> Pipe:
    """``torch.distributed.pipelining.pipeline`` cut before each module in ``cuts``, no-grad regions
    inlined."""
    trace = pipe_export_trace()

    def traced(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
        exported = trace(mod, args, kwargs)
        inline_no_grad_regions(exported.graph_module)
        return exported

    with _PATCH_LOCK:
        set_pipe_export_trace(traced)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_LEAFSPEC_NOTICE, category=FutureWarning)
                spec = {c: SplitPoint.BEGINNING for c in cuts}
                return pipeline(model, mb_args=example_args, split_spec=spec)
        finally:
            set_pipe_export_trace(trace)


def inline_no_grad_regions(gm: fx.GraphModule) -> int:
    """Replace every top-level ``wrap_with_set_grad_enabled(False, body, *args)`` by ``body``'s nodes on
    ``detach(args)``; returns how many were replaced."""
    if _WRAP is None:
        return 0
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _WRAP or node.args[0] is not False:
            continue
        body_ref, args = node.args[1], node.args[2:]
        assert isinstance(body_ref, fx.Node) and body_ref.op == "get_attr"
        body: fx.GraphModule = getattr(gm, str(body_ref.target))
        with graph.inserting_before(node):
            inputs = [_detached(graph, a, node) for a in args]
            placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
            result = graph.graph_copy(body.graph, dict(zip(placeholders, inputs)))
        outputs = list(result) if isinstance(result, (tuple, list)) else [result]
        for user in list(node.users):
            assert user.target is operator.getitem, (
                f"unexpected use of a no-grad region: {user.format_node()}"
            )
            user.replace_all_uses_with(outputs[user.args[1]])  # type: ignore[index]
            graph.erase_node(user)
        graph.erase_node(node)
        if not body_ref.users:
            graph.erase_node(body_ref)
            delattr(gm, str(body_ref.target))
        count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count


def _detached(graph: fx.Graph, value: Any, region: fx.Node) -> Any:
    if not isinstance(value, fx.Node):
        return value
    node = graph.call_function(torch.ops.aten.detach.default, (value,))
    node.meta = {k: v for k, v in region.meta.items() if k != "val"}
    if "val" in value.meta:
        node.meta["val"] = value.meta["val"]
    return node
