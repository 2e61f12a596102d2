"""A stage's tensors in its messages: their names, the checks on arrival, and gathering them for compute.

Names in a FORWARD message: ``x{k}`` model input k (from stage 0), ``o{i}`` output i of the sending
stage, and for the last stage ``t`` (one target) or ``t{i}`` (several), sent by stage 0.  In a BACKWARD
message: ``g{i}``, the gradient for output i of the receiving stage.  Only ``o`` and ``g`` tensors may
arrive packed (``ravq.codec.compress``); model inputs and targets never are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ravq.codec import compress
from ravq.codec.compress import Packed
from ravq.cut.split import StageSpec

Expected = dict[str, tuple[torch.Size, torch.dtype | None]]
"""Tensor name -> the shape and dtype it must have (a packed one: once restored); dtype None: any of
``AUTOCAST_DTYPES`` (an activation under autocast, whose dtype depends on the op that made it)."""
AUTOCAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
Parts = dict[int, dict[str, Any]]
"""Source stage -> the tensors it sent for one micro-batch."""


def model_input_needs(specs: list[StageSpec]) -> dict[int, list[int]]:
    """Stage index -> the model inputs it reads directly (sent to it by stage 0)."""
    return {s.index: s.model_inputs for s in specs if s.index > 0 and s.model_inputs}


def forward_sources(spec: StageSpec, num_stages: int) -> list[int]:
    """Stages that send this one a FORWARD message per micro-batch (stage 0 for model inputs and targets)."""
    sources = set(spec.producer_stages)
    first, last = spec.index == 0, spec.index == num_stages - 1
    if not first and (spec.model_inputs or last):
        sources.add(0)
    return sorted(sources)


def expected_forward(spec: StageSpec, num_stages: int,
                     input_specs: list[tuple[torch.Size, torch.dtype]] | None,
                     target_example: Any) -> dict[int, Expected]:
    """Source stage -> what its FORWARD messages hold; empty without ``input_specs`` (nothing checked)."""
    expected: dict[int, Expected] = {s: {} for s in forward_sources(spec, num_stages)}
    if input_specs is None:
        return {}
    for ref, shape_dtype in zip(spec.received, input_specs):
        name = f"x{ref.index}" if ref.stage < 0 else f"o{ref.index}"
        expected.setdefault(max(ref.stage, 0), {})[name] = shape_dtype
    if spec.index == num_stages - 1 and spec.index != 0 and target_example is not None:
        targets = target_example if isinstance(target_example, (tuple, list)) else (target_example,)
        several = isinstance(target_example, (tuple, list))
        names = [f"t{i}" for i in range(len(targets))] if several else ["t"]
        expected[0].update({n: (t.shape, t.dtype) for n, t in zip(names, targets)})
    return expected


def expected_backward(spec: StageSpec, outputs: tuple[torch.Tensor, ...], source: int) -> Expected:
    """What a BACKWARD message from ``source`` may hold: gradients for the outputs it reads."""
    return {f"g{i}": (outputs[i].shape, outputs[i].dtype)
            for i, users in spec.consumers.items() if source in users}


def check_tensors(tensors: dict[str, torch.Tensor | Packed], expected: Expected, exact: bool) -> str | None:
    """None if ``tensors`` are as ``expected`` (all of them with ``exact``), else why not."""
    if exact and set(tensors) != set(expected):
        return "unexpected_tensors"
    for name, t in tensors.items():
        want = expected.get(name)
        if want is None:
            return "unexpected_tensors"
        if isinstance(t, Packed) and name[0] not in "og":  # model inputs and targets go uncompressed
            return "unexpected_tensors"
        dtype_ok = t.dtype == want[1] if want[1] is not None else t.dtype in AUTOCAST_DTYPES
        if t.shape != want[0] or not dtype_ok:
            return "bad_tensor_shape"
    return None


def gather_inputs(spec: StageSpec, parts: Parts) -> list[torch.Tensor]:
    """What the stage received (``StageSpec.received``), in order, unpacked."""
    args = []
    for ref in spec.received:
        if ref.stage < 0:
            args.append(compress.unpack(parts[0][f"x{ref.index}"]))
        else:
            args.append(compress.unpack(parts[ref.stage][f"o{ref.index}"]))
    return args


def data_for(dest: int, inputs: Sequence[Any], targets: Any, needs: dict[int, list[int]],
             num_stages: int) -> dict[str, torch.Tensor]:
    """What stage 0 sends ``dest`` from the data: the model inputs it reads, and the targets to the last."""
    tensors: dict[str, torch.Tensor] = {}
    for k in needs.get(dest, ()):
        tensors[f"x{k}"] = inputs[k]
    if dest == num_stages - 1:
        tgt = targets if isinstance(targets, (tuple, list)) else (targets,)
        tensors.update({f"t{i}": t for i, t in enumerate(tgt)})
        if not isinstance(targets, (tuple, list)):
            tensors["t"] = tensors.pop("t0")
    return tensors


def targets_of(tensors: dict[str, torch.Tensor]) -> Any:
    """The targets stage 0 sent (as ``data_for`` named them): one tensor or a tuple."""
    if "t" in tensors:
        return tensors["t"]
    return tuple(tensors[f"t{i}"] for i in range(sum(1 for k in tensors if k.startswith("t"))))


def to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return type(value)(v.to(device) for v in value)


def output_grads(parts: Parts, outputs: tuple[torch.Tensor, ...],
                 device: torch.device) -> list[torch.Tensor | None]:
    """The gradient for each output, summed over the stages that read it (None: no reader sent one)."""
    grads: list[torch.Tensor | None] = [None] * len(outputs)
    for tensors in parts.values():
        for name, packed in tensors.items():
            i = int(name[1:])
            g, prev = compress.unpack(packed, outputs[i].dtype).to(device), grads[i]
            grads[i] = g if prev is None else prev + g
    return grads


def input_grads(spec: StageSpec, inputs: list[torch.Tensor], grad_of: dict[int, torch.Tensor | None]
                ) -> dict[int, dict[str, torch.Tensor]]:
    """Producer stage -> the gradients for the outputs it sent (``grad_of``: by ``id`` of the input leaf)."""
    per_producer: dict[int, dict[str, torch.Tensor]] = {s: {} for s in spec.producer_stages}
    for x, ref in zip(inputs, spec.received):
        if ref.stage < 0:
            continue
        g = grad_of.get(id(x))
        if g is not None:
            name = f"g{ref.index}"
            prev = per_producer[ref.stage].get(name)
            per_producer[ref.stage][name] = g if prev is None else prev + g
    return per_producer
