"""A backward split in two without computing anything twice (``training.schedule: zero_bubble``, ZB-H1).

The input pass runs autograd from the stage's outputs to its inputs only.  On its way it passes every node
where a path to a weight leaves the path to the inputs (a linear layer's matmul, a norm, the add of a bias
that never saw the inputs): the gradient arriving there is kept.  The weight pass later starts autograd at
those nodes with those gradients and runs only the weights' side, so the gradients of the activations are
computed once, as in Zero Bubble PP (Qi et al., ICLR 2024).  This works on any module's autograd graph:
nodes are found by walking it, never by knowing the module.  A node at the split runs twice, once for each
side; the built-in ones compute only the side asked each time, a custom ``autograd.Function`` computes both.
Where two split nodes reach one weight (a layer applied twice) the stage's weight pass is a walk from the
outputs instead, as without reuse (``WeightPass.fallback``), and ``Passes`` stops looking for the split; so
are the weights under a node that never ran in the input pass.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node


def grad_node(t: torch.Tensor) -> Node | None:
    """The node autograd starts from for ``t``: its ``grad_fn``, or a leaf's gradient accumulator."""
    if t.grad_fn is not None or not t.requires_grad:
        return t.grad_fn
    with torch.enable_grad():  # a leaf's accumulator, the one a graph that uses it holds
        return t.view_as(t).grad_fn.next_functions[0][0]


def leaves_under(roots: list[torch.Tensor]) -> list[torch.Tensor]:
    """The leaves a backward from ``roots`` would accumulate gradients into (``ravq check``: the weights as
    the fake tensors of its forward hold them)."""
    graph = _Graph([n for n in map(grad_node, roots) if n is not None])
    return [n.variable for n in graph.order if hasattr(n, "variable")]


INPUTS, WEIGHTS = 1, 2
"""``_Graph.reach`` bits: the node has a path to an input, to a weight."""


class _Graph:
    """The nodes under a backward's roots, children before parents, and each node's children."""

    def __init__(self, roots: list[Node]) -> None:
        order: list[Node] = []
        children: dict[Node, list[Node]] = {}
        done: set[Node] = set()
        stack = list(roots)
        while stack:  # depth first; a node is listed once all its children are
            node = stack[-1]
            kids = children.get(node)
            if kids is None:
                kids = children[node] = [c for c, _ in node.next_functions if c is not None]
                stack.extend([c for c in kids if c not in children])
            else:
                stack.pop()
                if node not in done:
                    done.add(node)
                    order.append(node)
        self.order, self.children = order, children

    def reach(self, inputs: set[Node], weights: set[Node]) -> dict[Node, int]:
        """Per node, ``INPUTS`` | ``WEIGHTS``: whether it has a path to one of ``inputs``, of ``weights``."""
        bits: dict[Node, int] = {}
        children = self.children
        for node in self.order:  # children first: one sweep settles every node
            b = (INPUTS if node in inputs else 0) | (WEIGHTS if node in weights else 0)
            for c in children[node]:
                b |= bits[c]
            bits[node] = b
        return bits

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
    and the weights its side reaches; and the outputs themselves for the weights it could not split off
    (``fallback``)."""

    starts: list[Start] = field(default_factory=list)
    """Per node at the split: the edges into it, the gradients that arrived on them, the weights under it."""
    fallback: tuple[list[torch.Tensor], list[torch.Tensor | None], list[torch.Tensor]] | None = None
    """The outputs, their gradients and the weights a walk from the outputs gives theirs (``input_pass``)."""
    shared: bool = False
    """Two split nodes reach one weight: the stage's graph does not split (see ``input_pass``)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the kept gradients (the graph's saved tensors besides)."""
        return sum(g.numel() * g.element_size() for _, grads, _ in self.starts for g in grads)

    def run(self) -> None:
        """Add each weight's gradient to its ``.grad`` (autograd's accumulation); frees the graph."""
        if self.fallback is not None:  # first, keeping the nodes at the split for their own walks
            roots, root_grads, weights = self.fallback
            if roots and weights:
                torch.autograd.backward(roots, root_grads, inputs=weights, retain_graph=bool(self.starts))
        for edges, grads, reached in self.starts:  # one walk each: a walk never enters the inputs' side
            torch.autograd.backward(edges, grads, inputs=reached)
        self.starts, self.fallback = [], None


def input_pass(roots: list[torch.Tensor], root_grads: list[torch.Tensor | None], inputs: list[torch.Tensor],
               weights: list[torch.Tensor], *, reuse: bool = True
               ) -> tuple[tuple[torch.Tensor | None, ...], WeightPass]:
    """Gradients of ``roots`` (weighted by ``root_grads``) for ``inputs`` (leaves), and the weight pass that
    gives ``weights`` (leaves) theirs later without going over the inputs' side again.

    Exact where no two split nodes reach one weight (each weight serves one operation: any module but one
    that reuses a layer).  A weight used at two places with the inputs' side between them (a layer applied
    twice, T5's position bias shared by its layers) would be reached again through the inputs' side, so
    there (``WeightPass.shared``), and without ``reuse``, the weight pass is a walk from the outputs
    (``fallback``) as in a split without reuse: measured, that is cheaper than reuse for part of a stage."""
    if not roots or not inputs:
        return (None,) * len(inputs), WeightPass(fallback=(roots, root_grads, weights))
    if not reuse:
        return _whole_pass(roots, root_grads, inputs), WeightPass(fallback=(roots, root_grads, weights))
    root_nodes = [n for n in map(grad_node, roots) if n is not None]
    of_weight = {n: w for w in weights if (n := grad_node(w)) is not None}
    graph = _Graph(root_nodes)
    bits = graph.reach({n for n in map(grad_node, inputs) if n is not None}, set(of_weight))
    to_inputs = {n for n, b in bits.items() if b & INPUTS}
    weight_side = {n for n, b in bits.items() if b == WEIGHTS}
    split = [n for n in graph.order if n in to_inputs and any(c in weight_side for c in graph.children[n])]
    split += [n for n in root_nodes if n in weight_side and n not in split]  # outputs the inputs never reach
    sides = {node: graph.side(node, weight_side) for node in split}
    seen = Counter(n for side in sides.values() for n in side)
    if any(count > 1 for count in seen.values()):
        walk = WeightPass(fallback=(roots, root_grads, weights), shared=True)
        return _whole_pass(roots, root_grads, inputs), walk
    arrived: dict[Node, list[torch.Tensor | None]] = {}

    def keep(node: Node) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        def hook(grads: tuple[torch.Tensor | None, ...]) -> None:
            arrived[node] = list(grads)
        return hook

    handles = [node.register_prehook(keep(node)) for node in split if node in to_inputs]
    try:
        grads = _whole_pass(roots, root_grads, inputs)
    finally:
        for handle in handles:
            handle.remove()
    for root, g in zip(roots, root_grads):  # an output the inputs never reach: its weights start from it
        node = grad_node(root)
        if node is not None and node in weight_side:
            got, slot = arrived.setdefault(node, []), root.output_nr if root.grad_fn is not None else 0
            got += [None] * (slot + 1 - len(got))
            g = torch.ones_like(root) if g is None else g
            got[slot] = g if got[slot] is None else got[slot] + g
    missed = [node for node in split if node not in arrived]  # never ran: its weights by the walk
    kept = WeightPass()
    for node in split:
        slots = [(slot, g) for slot, g in enumerate(arrived.get(node, ())) if g is not None]
        if slots:
            edges, kept_grads = [GradientEdge(node, slot) for slot, _ in slots], [g for _, g in slots]
            kept.starts.append((edges, kept_grads, _weights(sides[node], of_weight)))
    if missed:
        walked = set().union(*(sides[node] for node in missed))
        kept.fallback = (roots, root_grads, _weights(walked, of_weight))
    return grads, kept


def _weights(side: set[Node], of_weight: dict[Node, torch.Tensor]) -> list[torch.Tensor]:
    return [w for n, w in of_weight.items() if n in side]


def _whole_pass(roots: list[torch.Tensor], root_grads: list[torch.Tensor | None], inputs: list[torch.Tensor]
                ) -> tuple[torch.Tensor | None, ...]:
    """The inputs' gradients, the graph kept for the weight pass."""
    return torch.autograd.grad(roots, inputs, root_grads, retain_graph=True, allow_unused=True)
