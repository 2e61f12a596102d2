"""A backward split in two without computing anything twice (``training.schedule: zero_bubble``, ZB-H1).

The input pass runs autograd from the stage's outputs to its inputs only.  On its way it passes every node
where a path to a weight leaves the path to the inputs (a linear layer's matmul, a norm, the add of a bias
that never saw the inputs): the gradient arriving there is kept.  The weight pass later starts autograd at
those nodes with those gradients and runs only the weights' side, so the gradients of the activations are
computed once, as in Zero Bubble PP (Qi et al., ICLR 2024).  This works on any module's autograd graph:
nodes are found by walking it, never by knowing the module.  A node at the split runs twice, once for each
side; the built-in ones compute only the side asked each time, a custom ``autograd.Function`` computes both.
If a node at the split never ran in the input pass (an engine that prunes what we expected it to run), the
weight pass falls back to a whole walk from the outputs: slower, still exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node


def grad_node(t: torch.Tensor) -> Node | None:
    """The node autograd starts from for ``t``: its ``grad_fn``, or a leaf's gradient accumulator."""
    if t.grad_fn is not None or not t.requires_grad:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]  # a leaf's accumulator exists once a graph uses it


class _Graph:
    """The nodes under a backward's roots, children before parents, and each node's children."""

    def __init__(self, roots: list[Node]) -> None:
        self.order: list[Node] = []
        self.children: dict[Node, list[Node]] = {}
        stack: list[tuple[Node, bool]] = [(n, False) for n in roots]
        while stack:
            node, done = stack.pop()
            if done:
                self.order.append(node)
            elif node not in self.children:
                kids = [c for c, _ in node.next_functions if c is not None]
                self.children[node] = kids
                stack.append((node, True))
                stack.extend((c, False) for c in kids if c not in self.children)

    def reaching(self, targets: set[Node]) -> set[Node]:
        """The nodes with a path to one of ``targets`` (themselves included)."""
        reach = set()
        for node in self.order:  # children first: one sweep settles every node
            if node in targets or any(c in reach for c in self.children[node]):
                reach.add(node)
        return reach

    def side(self, node: Node, weight_side: set[Node]) -> set[Node]:
        """The nodes on the weights' side under ``node`` (the node itself only if it is on that side)."""
        side = {node} if node in weight_side else set()
        stack = [c for c in self.children[node] if c in weight_side]
        while stack:
            n = stack.pop()
            if n not in side:
                side.add(n)
                stack.extend(c for c in self.children[n] if c in weight_side)
        return side


Start = tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor]]


@dataclass(slots=True)
class WeightPass:
    """What the input pass kept for the weight pass: per node at the split, the gradients that arrived there
    and the weights its side reaches; or the outputs themselves for a whole walk (``fallback``)."""

    starts: list[Start] = field(default_factory=list)
    """Per node at the split: the edges into it, the gradients that arrived on them, the weights under it."""
    fallback: tuple[list[torch.Tensor], list[torch.Tensor | None]] | None = None
    """The outputs and their gradients, where the split is not exact (``input_pass``): a whole walk."""

    @property
    def nbytes(self) -> int:
        """Bytes of the kept gradients (the graph's saved tensors besides)."""
        return sum(g.numel() * g.element_size() for _, grads, _ in self.starts for g in grads)

    def run(self, weights: list[torch.Tensor]) -> None:
        """Add each weight's gradient to its ``.grad`` (autograd's accumulation); frees the graph."""
        if self.fallback is not None:
            roots, root_grads = self.fallback
            if roots and weights:
                torch.autograd.backward(roots, root_grads, inputs=weights)
        for edges, grads, reached in self.starts:  # one walk each: a walk never enters the inputs' side
            torch.autograd.backward(edges, grads, inputs=reached)
        self.starts, self.fallback = [], None


def input_pass(roots: list[torch.Tensor], root_grads: list[torch.Tensor | None], inputs: list[torch.Tensor],
               weights: list[torch.Tensor]) -> tuple[tuple[torch.Tensor | None, ...], WeightPass]:
    """Gradients of ``roots`` (weighted by ``root_grads``) for ``inputs`` (leaves), and the weight pass that
    gives ``weights`` (leaves) theirs later without going over the inputs' side again.

    Exact where the weights' sides of the split nodes share no node (each weight is reached from one place:
    any module whose parameters each serve one operation, or a chain of them); a weight used at two places
    with the inputs' side between them (a layer applied twice) would be reached again through the inputs'
    side, so there the weight pass walks the whole graph again (``fallback``), as a split without reuse."""
    whole = WeightPass(fallback=(roots, root_grads))
    if not roots or not inputs:
        return (None,) * len(inputs), whole
    root_nodes = [n for n in map(grad_node, roots) if n is not None]
    of_weight = {n: w for w in weights if (n := grad_node(w)) is not None}
    graph = _Graph(root_nodes)
    to_inputs = graph.reaching({n for n in map(grad_node, inputs) if n is not None})
    weight_side = graph.reaching(set(of_weight)) - to_inputs
    split = [n for n in graph.order if n in to_inputs and any(c in weight_side for c in graph.children[n])]
    split += [n for n in root_nodes if n in weight_side and n not in split]  # outputs the inputs never reach
    sides, taken = [], set()
    for node in split:
        side = graph.side(node, weight_side)
        if side & taken:
            return _whole_pass(roots, root_grads, inputs), whole
        taken |= side
        sides.append([of_weight[n] for n in side if n in of_weight])
    arrived: dict[Node, tuple[torch.Tensor | None, ...]] = {}

    def keep(node: Node) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        def hook(grads: tuple[torch.Tensor | None, ...]) -> None:
            arrived[node] = grads
        return hook

    handles = [node.register_prehook(keep(node)) for node in split if node in to_inputs]
    try:
        grads = torch.autograd.grad(roots, inputs, root_grads, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    for root, g in zip(roots, root_grads):  # an output the inputs never reach: its weights start from it
        node = grad_node(root)
        if node is not None and node in weight_side:
            slot = root.output_nr if root.grad_fn is not None else 0
            got = list(arrived.get(node, ()))
            got += [None] * (slot + 1 - len(got))
            got[slot] = torch.ones_like(root) if g is None else g if got[slot] is None else got[slot] + g
            arrived[node] = tuple(got)
    if any(node not in arrived for node in split):
        return grads, whole
    kept = WeightPass()
    for node, reached in zip(split, sides):
        edges = [(GradientEdge(node, slot), g) for slot, g in enumerate(arrived[node]) if g is not None]
        if edges:
            kept.starts.append(([e for e, _ in edges], [g for _, g in edges], reached))
    return grads, kept


def _whole_pass(roots: list[torch.Tensor], root_grads: list[torch.Tensor | None], inputs: list[torch.Tensor]
                ) -> tuple[torch.Tensor | None, ...]:
    return torch.autograd.grad(roots, inputs, root_grads, retain_graph=True, allow_unused=True)
