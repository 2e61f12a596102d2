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

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ravq.average.mailbox import CompressedPiece, Mailbox, OpenRound, RingAborted
from ravq.average.ring import RingLink, drive_ring, ring_plan
from ravq.average.segments import Segment
from ravq.codec import compress
from ravq.codec.compress import Format, Packed

log = logging.getLogger(__name__)

RING_FORMATS = (Format.BF16, Format.INT8)


class _CompressedRun:
    """One member's half of one compressed round; the schedule is ``ravq.average.ring._RingRun``'s.

    ``x`` is this member's input (float32, residual already added), ``out`` the averaged result and
    ``residual`` what this member's compressions lost, both written chunk by chunk."""

    def __init__(self, x: Tensor, members: Sequence[str], me: str, piece_bytes: int, fmt: Format, block: int,
                 base: int, out: Tensor | None, residual: Tensor | None) -> None:
        self.x, self.size, self.rank = x, len(members), list(members).index(me)
        self.fmt, self.block, self.base = fmt, block, base
        # Every element of both is written (each chunk is compressed once by every member, and every
        # chunk's average is written once), so buffers from an earlier round serve as they are: fresh
        # pages for a segment's worth cost more than the round's own work on a slow link's clock.
        self.out = out if out is not None else torch.empty_like(x)
        self.residual = residual if residual is not None else torch.empty_like(x)
        self.successor, self.predecessor = members[(self.rank + 1) % self.size], members[self.rank - 1]
        # pieces cover as many elements as uncompressed ones
        self.send_plan, self.recv_plan = ring_plan(x.numel(), self.size, self.rank, max(1, piece_bytes // 4))
        self.received = [0] * len(self.send_plan)
        self.progress = asyncio.Event()
        self.forward: dict[tuple[int, int], Tensor | Packed] = {}

    def _keep_residual(self, values: Tensor, packed: Tensor | Packed, a: int, b: int) -> Tensor:
        """What compressing ``values`` (elements [a, b)) lost goes into this member's residual; returns the
        restored values.  Called once a piece is on its way: it is not on the ring's critical path."""
        restored = compress.unpack(packed, torch.float32).view(-1)
        torch.sub(values, restored, out=self.residual[a:b])
        return restored

    async def send_loop(self, link: RingLink, meta: dict[str, int], timeout_s: float) -> None:
        for step, plan in enumerate(self.send_plan):
            for j, (a, b) in enumerate(plan):
                while step > 0 and self.received[step - 1] <= j:
                    self.progress.clear()
                    await self.progress.wait()
                piece = self.forward.pop((step, j)) if step else compress.pack(self.x[a:b], self.fmt, self.block)
                try:
                    async with asyncio.timeout(timeout_s):
                        await link.send(self.successor, {**meta, "step": step, "piece": j}, piece)
                except TimeoutError:
                    raise RingAborted(meta["ring"], meta["round"], "send_timeout", self.successor) from None
                if step == 0:
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

    async def recv_loop(self, mailbox: Mailbox, rnd: OpenRound, timeout_s: float) -> None:
        last_reduce, last = self.size - 2, len(self.recv_plan) - 1
        for step, plan in enumerate(self.recv_plan):
            for j, (a, b) in enumerate(plan):
                received = self._check(await mailbox.take(rnd, step, j, timeout_s), rnd, b - a)
                if step <= last_reduce:  # a partial sum: add this member's values in float32, pack again
                    # (a buffer of this member's own: restored, or received raw)
                    values = compress.unpack(received, torch.float32).view(-1).add_(self.x[a:b])
                    send = compress.pack(values, self.fmt, self.block)
                else:
                    send = received  # the all-gather forwards the finished piece as it came
                if step < last:
                    self.forward[step + 1, j] = send
                    self.received[step] = j + 1
                    self.progress.set()
                    await asyncio.sleep(0)  # the send loop queues it: it leaves while this member works on
                if step <= last_reduce:
                    finished = self._keep_residual(values, send, a, b)
                else:
                    finished = compress.unpack(send, torch.float32).view(-1)
                if step >= last_reduce:  # every member restores the same bytes of the full sum
                    torch.div(finished, self.size, out=self.out[a:b])


async def compressed_ring_allreduce(x: Tensor, *, ring_id: int, round_id: int, members: Sequence[str], me: str,
                                    link: RingLink, mailbox: Mailbox, piece_bytes: int, timeout_s: float,
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
    await drive_ring(run, {"ring": ring_id, "round": round_id, "base": base}, members=members, me=me, link=link,
                     mailbox=mailbox, timeout_s=timeout_s)
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
                x, ring_id=seg.ring_id, round_id=round_id, members=seg.ring, me=me, link=link, mailbox=mailbox,
                piece_bytes=piece_bytes, timeout_s=timeout_s, fmt=self.fmt, block=self.block, base=state.base,
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
