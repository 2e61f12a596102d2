"""One averaging round of a node: every ring of its segments at once, float32 or compressed.

``average_segments`` runs each of the node's rings (``ravq.average.ring``, or
``ravq.average.ring_compression`` when the node compresses its ring traffic); a ring that aborts does not
stop the others.  ``apply_round`` then moves the finished segments' live tensors by the average's
difference from their snapshot.  Round ids: see ``ravq.average.averager``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from ravq.average.mailbox import Mailbox, RingAborted
from ravq.average.ring import RingLink, ring_allreduce, ring_bytes_sent
from ravq.average.ring_compression import RingCompression
from ravq.average.segments import Segment, apply_average_delta

ROUNDS_PER_EPOCH = 1 << 20
"""Round ids are ``epoch * ROUNDS_PER_EPOCH + k``: the plan epoch, then a count of steps in it."""
FINAL_ROUND = ROUNDS_PER_EPOCH - 1
"""The last round of a run in which a cluster was disrupted: once every member finished, it brings
every cluster to the same weights (clusters that were away end at different step counts)."""


@dataclass(slots=True)
class RoundResult:
    """What one averaging round did on one node."""

    averaged: dict[int, Tensor] = field(default_factory=dict)
    """ring_id -> averaged flat segment, for the rings that finished."""
    aborted: dict[int, RingAborted] = field(default_factory=dict)
    """ring_id -> why, for the rings that did not; those segments keep their unaveraged weights."""
    bytes_sent: dict[int, int] = field(default_factory=dict)
    """ring_id -> segment bytes this node sent, for the rings that finished (compressed: on the wire)."""
    seconds: float = 0.0


async def average_segments(flats: Mapping[int, Tensor], segments: Sequence[Segment], *, me: str,
                           round_id: int, link: RingLink, mailbox: Mailbox, piece_bytes: int,
                           timeout_s: float, inplace: bool = False,
                           compression: RingCompression | None = None) -> RoundResult:
    """Run every ring of ``segments`` (this node's, ``flats`` keyed by ring id) at once.

    A ring that aborts does not stop the others: each finishes or aborts on its own, and the caller
    keeps the unaveraged weights of the aborted segments.  With ``compression`` the rings send their
    pieces compressed, with error feedback kept in it from round to round (``ravq.average.ring_compression``).
    """
    result = RoundResult()
    t0 = time.perf_counter()

    async def one(seg: Segment) -> None:
        flat = flats[seg.ring_id]
        assert flat.numel() == seg.numel, f"ring {seg.ring_id}: {flat.numel()} elements, not {seg.numel}"
        try:
            if compression is not None:
                result.averaged[seg.ring_id] = await compression.average(
                    flat, seg, round_id=round_id, me=me, link=link, mailbox=mailbox, piece_bytes=piece_bytes,
                    timeout_s=timeout_s)
            else:
                result.averaged[seg.ring_id] = await ring_allreduce(
                    flat, ring_id=seg.ring_id, round_id=round_id, members=seg.ring, me=me, link=link,
                    mailbox=mailbox, piece_bytes=piece_bytes, timeout_s=timeout_s, inplace=inplace)
        except RingAborted as err:
            result.aborted[seg.ring_id] = err
        else:
            per_element = (compression.wire_bytes_per_element if compression is not None
                           else flat.element_size())
            elements = ring_bytes_sent(seg.numel, 1, len(seg.ring), seg.ring.index(me))
            result.bytes_sent[seg.ring_id] = int(elements * per_element)

    async with asyncio.TaskGroup() as tg:
        for seg in segments:
            tg.create_task(one(seg))
    result.seconds = time.perf_counter() - t0
    return result


def apply_round(tensors: Mapping[str, Tensor], segments: Sequence[Segment], snapshots: Mapping[int, Tensor],
                result: RoundResult) -> dict[int, Tensor]:
    """Apply the average's delta to every segment whose ring finished; aborted ones stay as they are.

    Returns ring_id -> the flat delta applied, for callers that keep track of it."""
    return {s.ring_id: apply_average_delta([tensors[n] for n in s.names], snapshots[s.ring_id],
                                           result.averaged[s.ring_id])
            for s in segments if s.ring_id in result.averaged}
