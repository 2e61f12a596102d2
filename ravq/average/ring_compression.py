"""Compressed ring all-reduce with error feedback.

Reduce-scatter pieces go out compressed (bf16 or blockwise int8, ``ravq.codec.compress``); a member restores
what it receives, adds its own values in float32 and compresses the sum again to forward it.  The
member that completes a chunk's sum compresses it once, and the all-gather passes those bytes on
unchanged, so every member restores the same bytes into the same result, bit for bit.

Error feedback: each member keeps what its own compressions lost in a round (one residual element
per element of the segment: every member compresses each chunk exactly once) and adds it to its input
of the next round.  The sum of the round's result over the members is the sum of their inputs minus
the sum of their residuals, so over rounds nothing is lost, only delayed by a round.

Anchors: weights are large next to what changes between two averages, and a compression's error
grows with the magnitude it compresses.  So a segment is averaged as its difference from the previous
round's result (the *anchor*, the same bits on every member) and the anchor is added back: the ring
compresses a few steps' progress, not the weights.  Every piece names the round of its sender's anchor
(``base``, -1 for no anchor: the first round, or after an abort); a member whose anchor differs aborts
the round and every member drops its anchor, so the next round starts again from absolute values.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ravq.average.mailbox import CompressedPiece, Mailbox, OpenRound, RingAborted
from ravq.average.ring import RingLink, RingRun, drive_ring
from ravq.average.segments import Segment
from ravq.codec import compress
from ravq.codec.compress import Format, Packed

log = logging.getLogger(__name__)

RING_FORMATS = (Format.BF16, Format.INT8)


class _CompressedRun(RingRun):
    """One member's half of one compressed round, over ``ravq.average.ring.RingRun``'s schedule.

    ``x`` is this member's input (float32, residual already added), ``out`` the averaged result and
    ``residual`` what this member's compressions lost, both written chunk by chunk."""

    def __init__(self, x: Tensor, members: Sequence[str], me: str, piece_bytes: int, fmt: Format, block: int,
                 base: int, out: Tensor | None, residual: Tensor | None) -> None:
        super().__init__(x.numel(), members, me, max(1, piece_bytes // 4))  # as many elements as float32's
        self.x, self.fmt, self.block, self.base = x, fmt, block, base
        # Every element of both is written (each chunk is compressed once by every member, and every
        # chunk's average is written once), so buffers from an earlier round serve as they are: fresh
        # pages for a segment's worth cost more than the round's own work on a slow link's clock.
        self.out = out if out is not None else torch.empty_like(x)
        self.residual = residual if residual is not None else torch.empty_like(x)

    def _keep_residual(self, values: Tensor, packed: Tensor | Packed, a: int, b: int) -> Tensor:
        """What compressing ``values`` (elements [a, b)) lost goes into this member's residual; returns the
        restored values.  Called once a piece is on its way: it is not on the ring's critical path."""
        restored = compress.unpack(packed, torch.float32).view(-1)
        torch.sub(values, restored, out=self.residual[a:b])
        return restored

    def own_piece(self, a: int, b: int) -> Tensor | Packed:
        return compress.pack(self.x[a:b], self.fmt, self.block)

    def sent_own(self, piece: Tensor | Packed, a: int, b: int) -> None:
        self._keep_residual(self.x[a:b], piece, a, b)

    def _check(self, piece: object, rnd: OpenRound, numel: int) -> Tensor | Packed:
        if not isinstance(piece, CompressedPiece):
            raise RingAborted(rnd.ring_id, rnd.round_id, "bad_piece", self.predecessor)
        if piece.base != self.base:
            raise RingAborted(rnd.ring_id, rnd.round_id, "base_mismatch", self.predecessor)
        value = piece.value
        if (value.dtype != torch.float32 or value.data.numel() != numel
                or (isinstance(value, Packed) and value.format not in RING_FORMATS)):
            raise RingAborted(rnd.ring_id, rnd.round_id, "bad_piece", self.predecessor)
        return value

    def take(self, piece: object, rnd: OpenRound, step: int, a: int, b: int,
             ) -> tuple[Tensor | Packed, Tensor | None]:
        received = self._check(piece, rnd, b - a)
        if step > self.last_reduce:
            return received, None  # the all-gather forwards the finished piece as it came
        # a partial sum: add this member's values in float32 (a buffer of this member's own: restored, or
        # received raw) and pack it again
        values = compress.unpack(received, torch.float32).view(-1).add_(self.x[a:b])
        return compress.pack(values, self.fmt, self.block), values

    def finish(self, forwarded: Tensor | Packed, summed: Tensor | None, step: int, a: int, b: int) -> None:
        if summed is not None:
            finished = self._keep_residual(summed, forwarded, a, b)
        else:
            finished = compress.unpack(forwarded, torch.float32).view(-1)
        if step >= self.last_reduce:  # every member restores the same bytes of the full sum
            torch.div(finished, self.size, out=self.out[a:b])


async def compressed_ring_allreduce(x: Tensor, *, ring_id: int, round_id: int, members: Sequence[str],
                                    me: str, link: RingLink, mailbox: Mailbox, piece_bytes: int,
                                    timeout_s: float,
                                    fmt: Format, block: int = compress.DEFAULT_BLOCK, base: int = -1,
                                    out: Tensor | None = None, residual: Tensor | None = None,
                                    ) -> tuple[Tensor, Tensor]:
    """(average over ``members``, this member's residual) of the float32 ``x``, pieces sent compressed.

    ``out`` and ``residual``, when given, are written (every element) and returned; neither may be ``x``.
    Aborts as ``ravq.average.ring.ring_allreduce`` does, and with "base_mismatch" when a peer's anchor
    differs.
    """
    assert fmt in RING_FORMATS, fmt
    assert x.dim() == 1 and x.dtype == torch.float32, "the compressed ring averages a flat float32 tensor"
    if len(members) == 1:
        return x.clone(), torch.zeros_like(x)
    assert out is not x and residual is not x
    run = _CompressedRun(x, members, me, piece_bytes, fmt, block, base, out, residual)
    await drive_ring(run, {"ring": ring_id, "round": round_id, "base": base}, members=members, me=me,
                     link=link, mailbox=mailbox, timeout_s=timeout_s)
    return run.out, run.residual


@dataclass(slots=True)
class _SegmentState:
    anchor: Tensor | None = None
    """The previous round's result (the same bits on every member), or None: average absolute values."""
    base: int = -1
    """The round that produced ``anchor``."""
    residual: Tensor | None = None


@dataclass(slots=True)
class RingCompression:
    """A node's compression of its ring traffic, with its error feedback and anchors kept per segment."""

    fmt: Format
    block: int = compress.DEFAULT_BLOCK
    states: dict[tuple[tuple[str, ...], tuple[str, ...]], _SegmentState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.fmt not in RING_FORMATS:
            raise ValueError(f"compress.ring: must be one of none, bf16, int8, got {self.fmt!r}")
        compress.check_block(self.block)

    @property
    def wire_bytes_per_element(self) -> float:
        return 2.0 if self.fmt is Format.BF16 else 1.0 + 4.0 / self.block

    def state(self, seg: Segment) -> _SegmentState:
        """A segment's state; a new ring (other members after a plan change) starts afresh."""
        return self.states.setdefault((seg.names, seg.ring), _SegmentState())

    async def average(self, flat: Tensor, seg: Segment, *, round_id: int, me: str, link: RingLink,
                      mailbox: Mailbox, piece_bytes: int, timeout_s: float) -> Tensor:
        """The average of ``flat`` (this node's snapshot of ``seg``) over the ring, as float32."""
        state = self.state(seg)
        x = flat.to(torch.float32, copy=True)
        if state.anchor is not None:
            x -= state.anchor
        if state.residual is not None:
            x += state.residual
        try:
            average, residual = await compressed_ring_allreduce(
                x, ring_id=seg.ring_id, round_id=round_id, members=seg.ring, me=me, link=link,
                mailbox=mailbox, piece_bytes=piece_bytes, timeout_s=timeout_s, fmt=self.fmt, block=self.block,
                base=state.base,
                residual=state.residual)  # read into x above: its buffer takes this round's residual
        except RingAborted:
            # Other members may have finished this round and moved their anchors: start again from
            # absolute values.  The residual's buffer was being overwritten: drop it (at most one
            # round's compression error is lost, once, on an abort).
            state.anchor, state.base, state.residual = None, -1, None
            raise
        if state.anchor is not None:
            average += state.anchor
        state.anchor, state.base, state.residual = average.clone(), round_id, residual
        return average if flat.dtype == torch.float32 else average.to(flat.dtype)
