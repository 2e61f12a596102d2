"""How large a frame a node accepts: derived from what its stage can legitimately receive.

ZeroMQ allocates a frame of the size its sender announces before a byte of it arrives, and drops the
connection instead when the size is over ZMQ_MAXMSGSIZE.  A limit far above any real message (1 GiB)
let any host that can reach a port make a node allocate that much per connection; the limit a node
sets is twice the largest tensor frame its stage can be sent (activations and model inputs from its
producers, gradients of its outputs from its consumers, targets for the last stage, ring pieces).
"""

from __future__ import annotations

import math
from typing import Any

from ravq.cut.split import StageSpec
from ravq.net.options import CONTROL_FRAME_BYTES

MARGIN = 2
"""Factor over the largest legitimate frame (a task's shapes are fixed per micro-batch size)."""


def _nbytes(shape: Any, dtype: Any) -> int:
    return math.prod(shape) * dtype.itemsize


def largest_inbound_frame(specs: list[StageSpec], input_specs: list[list[tuple[Any, Any]]], stage: int,
                          target_example: Any = None) -> int:
    """Bytes of the largest tensor frame ``stage`` can receive on its pipeline link.

    ``specs`` are the cluster's StageSpecs, ``input_specs`` every stage's (shape, dtype) inputs from
    ``ravq.cut.split.stage_input_specs``; a stage's output gradient has the shape of the consumer input
    it feeds, and a tied weight's gradient (a TIED message) that of the weight."""
    sizes = [_nbytes(shape, dtype) for shape, dtype in input_specs[stage]]
    for s, spec in enumerate(specs):
        sizes += [_nbytes(shape, dtype)
                  for ref, (shape, dtype) in zip(spec.received, input_specs[s]) if ref.stage == stage]
    if stage == len(specs) - 1 and stage > 0:
        sizes += [_nbytes(t.shape, t.dtype) for t in _tensors(target_example)]
    for group in getattr(specs[stage], "tied", []):  # a tied weight's gradient from another holder
        weight = specs[stage].module.get_parameter(group.names[0])
        sizes.append(weight.numel() * weight.element_size())
    return max(sizes, default=0)


def _tensors(value: Any) -> list[Any]:
    """The tensors in a (nested) tuple, list or dict of targets."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def derived_max_message_bytes(largest_frame: int, ring_piece_bytes: int = 0) -> int:
    """limits.max_message_bytes when the topology leaves it out."""
    return max(CONTROL_FRAME_BYTES, MARGIN * largest_frame, MARGIN * ring_piece_bytes)
