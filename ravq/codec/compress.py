"""Tensor compression for the wire: bf16/fp16 casts and blockwise-absmax int8, pure torch.

A floating-point tensor leaves a node as a ``Packed``: the cast tensor, or int8 values with one
float32 scale per block of ``block`` values (scale = the block's largest magnitude / 127, so every
value of a block is off by at most scale / 2).  The receiver restores the original dtype and shape
with ``unpack``.  Integer and bool tensors (token ids, masks, targets) are never packed; neither is a
tensor with a non-finite value (it goes as it is, so a divergence shows as it would uncompressed,
and every scale on the wire is finite).

No sockets here: ``ravq.net.wire`` turns a ``Packed`` into frames and back, the pipeline packs what it
sends and unpacks what it receives in its compute thread, the ring packs its pieces.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
from torch import Tensor

MIN_BLOCK, MAX_BLOCK = 64, 256
"""Values per int8 scale: 64-256 (a float32 scale per 64 values adds 6% to int8's bytes, per 256 1.6%)."""
DEFAULT_BLOCK = 128
QMAX = 127
"""int8 values lie in [-127, 127]: symmetric, so -x packs to the negation of x."""

_LARGEST = torch.finfo(torch.float32).max * (1 - 1e-6)
"""Beyond this 127 x (value / 127) may round to inf in float32: such a tensor goes uncompressed."""

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
"""The dtypes a packed tensor may restore to."""


class Format(enum.StrEnum):
    NONE = "none"
    BF16 = "bf16"
    FP16 = "fp16"
    INT8 = "int8"


_CAST = {Format.BF16: torch.bfloat16, Format.FP16: torch.float16}


def check_block(block: int) -> int:
    if not MIN_BLOCK <= block <= MAX_BLOCK:
        raise ValueError(f"int8_block: must be {MIN_BLOCK}-{MAX_BLOCK} values, got {block}")
    return block


def num_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


@dataclass(frozen=True, slots=True)
class Packed:
    """A compressed floating-point tensor: what goes on the wire in place of it."""

    format: Format
    """BF16/FP16: ``data`` is the cast tensor; INT8: ``data`` holds int8 values, ``scales`` one per block."""
    data: Tensor
    dtype: torch.dtype
    """The dtype ``unpack`` restores."""
    shape: torch.Size
    scales: Tensor | None = None
    block: int = 0

    @property
    def wire_bytes(self) -> int:
        """Bytes on the wire (payload and scales)."""
        scales = self.scales.numel() * 4 if self.scales is not None else 0
        return self.data.numel() * self.data.element_size() + scales

    @property
    def logical_bytes(self) -> int:
        """Bytes of the tensor it stands for."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def device(self) -> torch.device:
        return self.data.device


def packs(t: Tensor, fmt: Format) -> bool:
    """Whether ``pack`` would compress ``t`` under ``fmt`` (before looking at its values)."""
    if fmt is Format.NONE or not t.is_floating_point() or t.numel() == 0:
        return False
    if fmt is Format.INT8:  # a scale per block: one value alone would grow
        return t.numel() * (t.dtype.itemsize - 1) > 4 * num_blocks(t.numel(), MIN_BLOCK)
    return t.dtype.itemsize > _CAST[fmt].itemsize


def pack(t: Tensor, fmt: Format, block: int = DEFAULT_BLOCK) -> Tensor | Packed:
    """``t`` compressed under ``fmt``, or ``t`` itself where it is not compressed (see the module doc)."""
    if not packs(t, fmt):
        return t
    if fmt is not Format.INT8:
        cast = t.detach().to(_CAST[fmt])
        if not torch.isfinite(cast).all():  # overflow to inf in fp16, or a NaN/inf already there
            return t
        return Packed(fmt, cast, t.dtype, t.shape)
    return _quantize(t, block)


def _quantize(t: Tensor, block: int) -> Tensor | Packed:
    """Blockwise absmax int8: reshape to blocks, amax, scale, round, clamp (one pass each, vectorised)."""
    flat = t.detach().reshape(-1)
    if flat.dtype is not torch.float32:
        flat = flat.float()
    n = flat.numel()
    nb = num_blocks(n, block)
    if nb * block != n:
        flat = torch.nn.functional.pad(flat, (0, nb * block - n))
    blocks = flat.view(nb, block)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    if not torch.isfinite(amax).all() or float(amax.max()) > _LARGEST:
        return t
    scales = amax / QMAX
    inverse = torch.where(amax > 0, QMAX / amax, torch.zeros_like(amax))
    q = torch.mul(blocks, inverse).round_().clamp_(-QMAX, QMAX).to(torch.int8).view(-1)
    return Packed(Format.INT8, q[:n] if nb * block != n else q, t.dtype, t.shape, scales.view(-1), block)


def unpack(p: Tensor | Packed, dtype: torch.dtype | None = None) -> Tensor:
    """The tensor ``p`` stands for (a plain tensor is returned as it is), in ``dtype`` if given."""
    if isinstance(p, Tensor):
        return p if dtype is None or p.dtype == dtype else p.to(dtype)
    dtype = dtype or p.dtype
    if p.format is not Format.INT8:
        return p.data.to(dtype)
    assert p.scales is not None
    n, nb = p.data.numel(), p.scales.numel()
    values = p.data.to(torch.float32)
    if nb * p.block != n:
        values = torch.nn.functional.pad(values, (0, nb * p.block - n))
    values = values.view(nb, p.block).mul_(p.scales.view(nb, 1).to(torch.float32)).view(-1)
    values = values[:n] if nb * p.block != n else values
    return values.view(p.shape).to(dtype)


def error_bound(t: Tensor, fmt: Format, block: int = DEFAULT_BLOCK) -> Tensor:
    """Per element, the most ``unpack(pack(t))`` may differ from ``t`` (float32 arithmetic)."""
    x = t.detach().reshape(-1).float()
    if fmt is Format.NONE or not packs(t, fmt):
        return torch.zeros_like(x).view(t.shape)
    if fmt is Format.INT8:
        nb = num_blocks(x.numel(), block)
        blocks = torch.nn.functional.pad(x.abs(), (0, nb * block - x.numel())).view(nb, block)
        amax = blocks.amax(dim=1, keepdim=True)
        # half a step, plus float32 rounding in scaling and restoring (a few ulps of the block's largest)
        bound = (amax / QMAX / 2 + amax * 2.0**-20).expand(nb, block).reshape(-1)[: x.numel()]
        return bound.view(t.shape)
    mantissa = {Format.BF16: 8, Format.FP16: 11}[fmt]  # significant bits, the implicit one included
    tiny = torch.finfo(_CAST[fmt]).smallest_normal * 2.0 ** (1 - mantissa)  # subnormal spacing
    return (x.abs() * 2.0 ** -mantissa + tiny).view(t.shape)


class ErrorFeedback:
    """One sender's compression with error feedback: what its compression lost is added to its next input.

    ``pack`` compresses ``x + residual`` and keeps the new residual, so the sum over calls of what was
    sent equals the sum of the inputs minus the last residual: nothing is lost, only delayed.
    """

    def __init__(self, fmt: Format, block: int = DEFAULT_BLOCK) -> None:
        self.fmt, self.block = fmt, block
        self.residual: Tensor | None = None

    def pack(self, x: Tensor) -> Tensor | Packed:
        target = x.float() if self.residual is None else x.float() + self.residual
        packed = pack(target, self.fmt, self.block)
        self.residual = target - unpack(packed, torch.float32)
        return packed
