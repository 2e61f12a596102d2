"""One node: the composition root (``ravq.node.root``) and the socket-owning adapters it wires."""

from ravq.node.root import Node, NodeOptions, run_node

__all__ = ["Node", "NodeOptions", "run_node"]
