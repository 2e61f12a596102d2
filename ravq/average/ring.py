"""The float32 ring: one ring's reduce-scatter + all-gather over its members, pieces streamed.

The nodes holding one segment (one per cluster) form its *ring* and average it with reduce-scatter +
all-gather, every node sending 2(C-1)/C of the segment's bytes.  ``RingRun`` is a member's send and
receive loops over that schedule, written once: the float32 ring here and the compressed ring
(``ravq.average.ring_compression``) say only what a piece is and how a received one is worked on, and
``drive_ring`` runs either's loops and turns a failure into RING_ABORTs.  This module never touches ZeroMQ:
the node implements ``RingLink`` (sending) and feeds a ``Mailbox`` (receiving) from its ring socket,
so everything here is testable in one process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from ravq.average.mailbox import Mailbox, OpenRound, RingAborted
from ravq.average.segments import chunk_bounds
from ravq.codec.compress import Packed

log = logging.getLogger(__name__)


class RingLink(Protocol):
    """Sending side of ring traffic; the node implements it over its ring DEALER sockets."""

    async def send(self, peer: str, meta: dict[str, int], tensor: Tensor | Packed) -> None:
        """Send one RING_CHUNK piece; ``meta`` holds ring, round, step and piece (all int), and for a
        compressed round ``base`` (see ``ravq.average.ring_compression``), with ``tensor`` packed or raw.

        It may send without copying and return before the bytes have left: ``ring_allreduce`` never
        writes to a sent tensor until the ring proves it arrived (see ``_PlainRun``).
        """

    async def send_abort(self, peer: str, ring_id: int, round_id: int, reason: str) -> None:
        """Send one RING_ABORT."""


def ring_plan(numel: int, size: int, rank: int, piece_numel: int) -> tuple[list[list[tuple[int, int]]],
                                                                       list[list[tuple[int, int]]]]:
    """A ring member's schedule over 2(size - 1) steps (reduce-scatter, then all-gather): the element
    ranges [a, b) it sends at each step and those it receives, in pieces of ``piece_numel`` elements."""
    bounds = chunk_bounds(numel, size)

    def pieces(k: int) -> list[tuple[int, int]]:
        return _pieces(bounds[k % size], bounds[k % size + 1], piece_numel)
    steps = 2 * (size - 1)
    return [pieces(rank - t) for t in range(steps)], [pieces(rank - t - 1) for t in range(steps)]


def _pieces(lo: int, hi: int, piece_numel: int) -> list[tuple[int, int]]:
    """[lo, hi) in near-equal pieces of at most ``piece_numel``: no short tail piece to wait on."""
    count = -(-(hi - lo) // piece_numel)
    return [(lo + i * (hi - lo) // count, lo + (i + 1) * (hi - lo) // count) for i in range(count)]


def ring_bytes_sent(numel: int, element_size: int, ring_size: int, rank: int) -> int:
    """Bytes member ``rank`` sends in one round: every chunk but one in each phase, 2(C-1)/C overall."""
    if ring_size == 1:
        return 0
    b = chunk_bounds(numel, ring_size)
    size = [b[i + 1] - b[i] for i in range(ring_size)]
    return element_size * (2 * numel - size[(rank + 1) % ring_size] - size[(rank + 2) % ring_size])


class RingRun:
    """One member's half of one round: a sender and a receiver that overlap piece by piece.

    With chunk k = (rank - step) mod C sent and chunk (rank - step - 1) mod C received at every step,
    the chunk sent at step t is exactly the one received at step t-1; so piece j of step t can leave as
    soon as piece j of step t-1 has been handled, and a segment streams round the ring like a pipeline.
    The first ``size - 1`` steps reduce (a received partial sum gets this member's values added), the
    rest gather (finished sums pass on); at step ``size - 2`` and after, a piece's full sum is known.

    A subclass says what step 0 sends of this member's own values (``own_piece``, then ``sent_own``),
    what a received piece becomes (``take``: checked, summed, the piece to forward) and what is kept of
    it (``finish``); the schedule, the waits and their timeouts are here.
    """

    def __init__(self, numel: int, members: Sequence[str], me: str, piece_numel: int) -> None:
        self.size, self.rank = len(members), list(members).index(me)
        self.successor, self.predecessor = members[(self.rank + 1) % self.size], members[self.rank - 1]
        self.send_plan, self.recv_plan = ring_plan(numel, self.size, self.rank, piece_numel)
        self.last_reduce = self.size - 2
        """The last step that adds this member's values; from it on, a piece holds its full sum."""
        self.received = [0] * len(self.send_plan)
        self.progress = asyncio.Event()
        self.forward: dict[tuple[int, int], Tensor | Packed] = {}
        """(step, piece) -> what to send for that piece (steps 1 and later)."""

    def own_piece(self, a: int, b: int) -> Tensor | Packed:
        """What step 0 sends of this member's elements [a, b)."""
        raise NotImplementedError

    def sent_own(self, piece: Tensor | Packed, a: int, b: int) -> None:
        """Step 0's piece of [a, b) is on its way (nothing to do by default)."""

    def take(self, piece: object, rnd: OpenRound, step: int, a: int, b: int,
             ) -> tuple[Tensor | Packed, Tensor | None]:
        """A received piece of [a, b) at ``step``, checked (RingAborted if it is not one) and worked on:
        (what to forward, this member's partial sum when it added its values, else None)."""
        raise NotImplementedError

    def finish(self, forwarded: Tensor | Packed, summed: Tensor | None, step: int, a: int, b: int) -> None:
        """Once the piece is forwarded: keep what this member keeps of it (``take``'s two results)."""
        raise NotImplementedError

    async def send_loop(self, link: RingLink, meta: dict[str, int], timeout_s: float) -> None:
        for step, plan in enumerate(self.send_plan):
            for j, (a, b) in enumerate(plan):
                while step > 0 and self.received[step - 1] <= j:
                    self.progress.clear()
                    await self.progress.wait()
                piece = self.forward.pop((step, j)) if step else self.own_piece(a, b)
                try:
                    async with asyncio.timeout(timeout_s):
                        await link.send(self.successor, {**meta, "step": step, "piece": j}, piece)
                except TimeoutError:
                    raise RingAborted(meta["ring"], meta["round"], "send_timeout", self.successor) from None
                if step == 0:
                    self.sent_own(piece, a, b)

    async def recv_loop(self, mailbox: Mailbox, rnd: OpenRound, timeout_s: float) -> None:
        last = len(self.recv_plan) - 1
        for step, plan in enumerate(self.recv_plan):
            for j, (a, b) in enumerate(plan):
                forwarded, summed = self.take(await mailbox.take(rnd, step, j, timeout_s), rnd, step, a, b)
                if step < last:
                    self.forward[step + 1, j] = forwarded
                    self.received[step] = j + 1
                    self.progress.set()
                    await asyncio.sleep(0)  # the send loop queues it: it leaves while this member works on
                self.finish(forwarded, summed, step, a, b)


class _PlainRun(RingRun):
    """The float32 ring's run.

    Every pass over memory counts (on loopback the ring is bound by memory bandwidth), so a received
    piece is worked on where it arrived and forwarded from there: reduce-scatter adds this member's
    ``flat`` into it, and the member that completes a chunk sends the plain sum on.  Each member
    divides by C as it writes a finished piece into ``out``, the only writes ``out`` gets: identical
    sums divided alike give every member the same bits.  ``flat`` is only read, so ``out`` may be
    ``flat`` itself (in place) or an uninitialised tensor, never a copy of it.

    A link may send without copying and return before the bytes have left.  Only step 0 sends from
    ``flat``, the chunk whose finished sum comes back at step C-1 (piece j after piece j arrived at the
    successor), before anything is written there; every other piece sent is a received buffer that
    only this member holds.  Hence once ``ring_allreduce`` returns, the caller may reuse ``flat`` and
    the result while sends are in flight.
    """

    def __init__(self, flat: Tensor, out: Tensor, members: Sequence[str], me: str, piece_bytes: int) -> None:
        super().__init__(flat.numel(), members, me, max(1, piece_bytes // flat.element_size()))
        self.flat, self.out = flat, out

    def own_piece(self, a: int, b: int) -> Tensor:
        return self.flat[a:b]

    def take(self, piece: object, rnd: OpenRound, step: int, a: int, b: int) -> tuple[Tensor, Tensor]:
        if not isinstance(piece, Tensor) or piece.dtype != self.out.dtype or piece.numel() != b - a:
            raise RingAborted(rnd.ring_id, rnd.round_id, "bad_piece", self.predecessor)
        piece = piece.reshape(-1)
        if step <= self.last_reduce:
            piece.add_(self.flat[a:b])
        return piece, piece

    def finish(self, forwarded: Tensor | Packed, summed: Tensor | None, step: int, a: int, b: int) -> None:
        if step >= self.last_reduce:  # the full sum of this piece: finished into out
            assert isinstance(forwarded, Tensor)
            torch.div(forwarded, self.size, out=self.out[a:b])


async def ring_allreduce(flat: Tensor, *, ring_id: int, round_id: int, members: Sequence[str], me: str,
                         link: RingLink, mailbox: Mailbox, piece_bytes: int, timeout_s: float,
                         inplace: bool = False) -> Tensor:
    """The elementwise average of ``flat`` over ``members`` (every member passes its own ``flat``).

    Reduce-scatter then all-gather over C chunks, each streamed in near-equal pieces of at most
    ``piece_bytes``.  Every member divides the same sums by C, so every member ends with the same bits.
    A wait (receive or send) longer than ``timeout_s`` aborts the round: RingAborted here and a
    RING_ABORT to every other member, whose pending wait then raises RingAborted too.  With
    ``inplace`` the result overwrites ``flat`` (whose contents are undefined after an abort).  Once this
    returns, ``flat`` and the result are the caller's to modify, even with sends still in flight.
    """
    if len(members) == 1:
        return flat
    assert flat.dim() == 1 and flat.is_floating_point(), "ring_allreduce averages a flat float tensor"
    run = _PlainRun(flat, flat if inplace else torch.empty_like(flat), members, me, piece_bytes)
    await drive_ring(run, {"ring": ring_id, "round": round_id}, members=members, me=me, link=link,
                     mailbox=mailbox, timeout_s=timeout_s)
    return run.out


async def drive_ring(run: RingRun, meta: dict[str, int], *, members: Sequence[str], me: str, link: RingLink,
                     mailbox: Mailbox, timeout_s: float) -> None:
    """Run one ring's send and receive loops (``run``: the float32 ring's or a compressed one) to the end;
    on an abort, tell the other members (unless a peer told us) and raise RingAborted."""
    ring_id, round_id = meta["ring"], meta["round"]
    rnd = mailbox.open(ring_id, round_id, members=members, me=me,
                       pieces_per_step=[len(p) for p in run.recv_plan])
    failure: RingAborted | None = None
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(run.send_loop(link, meta, timeout_s))
            tg.create_task(run.recv_loop(mailbox, rnd, timeout_s))
    except* RingAborted as group:
        first = group.exceptions[0]
        assert isinstance(first, RingAborted)
        failure = first
    finally:
        mailbox.close(rnd)
    if failure is None:
        return
    log.warning("%s: %s", me, failure)
    if not failure.from_peer:
        await _broadcast_abort(link, members, me, ring_id, round_id, failure.reason, timeout_s)
    raise failure


async def _broadcast_abort(link: RingLink, members: Sequence[str], me: str, ring_id: int, round_id: int,
                           reason: str, timeout_s: float) -> None:
    """Tell every other member to stop waiting; best effort, as a dead peer cannot be told anything."""
    peers = [p for p in members if p != me]
    sends = (asyncio.wait_for(link.send_abort(p, ring_id, round_id, reason), timeout_s) for p in peers)
    outcomes = await asyncio.gather(*sends, return_exceptions=True)
    for peer, outcome in zip(peers, outcomes):
        if isinstance(outcome, Exception):
            log.debug("ring %d round %d: abort not sent to %s: %r", ring_id, round_id, peer, outcome)
