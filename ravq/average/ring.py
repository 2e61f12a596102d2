"""Parallel multi-ring all-reduce: average parameter segments across clusters.

Clusters may cut the model at different places, so the union of their cut points splits the named
tensors into *segments*; the nodes holding one segment (one per cluster) form its *ring* and average
it with reduce-scatter + all-gather, every node sending 2(C-1)/C of the segment's bytes.  All rings of
a node run at once.  This module never touches ZeroMQ: the node implements ``RingLink`` (sending) and
feeds a ``Mailbox`` (receiving) from its ring socket, so everything here is testable in one process.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from ravq.net.compress import Packed

if TYPE_CHECKING:
    from ravq.average.ring_compression import RingCompression

log = logging.getLogger(__name__)

OPTIM_SEP = "::"
"""Separates a parameter's name from an optimizer-state key: ``layer.weight::exp_avg``."""


@dataclass(frozen=True, slots=True)
class Segment:
    """A maximal run of consecutive named tensors held by the same node in every included cluster."""

    ring_id: int
    """Index of the segment in the plan; the same on every node that computed the same plan."""
    names: tuple[str, ...]
    numel: int
    ring: tuple[str, ...]
    """The holder of this segment in each included cluster, in cluster order: the ring's members."""


def averaged_names(model: nn.Module) -> list[str]:
    """Parameters and floating-point buffers of the unsplit model, in ``state_dict`` order.

    Integer buffers (``num_batches_tracked``) are counters, not weights, and are left alone.  A tensor
    tied under two names is averaged once, under its first name, or its delta would be applied twice.
    """
    seen: set[int] = set()
    names: list[str] = []
    for name, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, Tensor) or id(value) in seen:
            continue
        if isinstance(value, nn.Parameter) or value.is_floating_point():
            seen.add(id(value))
            names.append(name)
    return names


def param_name_of(name: str) -> str:
    """The parameter an averaged name belongs to (optimizer-state names carry a ``::key`` suffix)."""
    return name.split(OPTIM_SEP, 1)[0]


def plan_segments(names: Sequence[str], numels: Sequence[int], owners_per_cluster: Sequence[Mapping[str, str]],
                  excluded_clusters: Sequence[int] = ()) -> list[Segment]:
    """Split ``names`` (in model order) into segments, one ring each.

    ``owners_per_cluster[c][name]`` is the node of cluster c holding ``name``; optimizer-state names
    inherit their parameter's holder.  Excluded clusters (a dead member) take no part in any ring.
    Every node computing this from the same plan gets the same segments and ring ids.
    """
    if len(names) != len(numels):
        raise ValueError(f"numels: {len(numels)} numels for {len(names)} names")
    clusters = [c for c in range(len(owners_per_cluster)) if c not in set(excluded_clusters)]
    if not clusters:
        raise ValueError(f"excluded_clusters: all {len(owners_per_cluster)} clusters are excluded")
    try:
        rings = [tuple(owners_per_cluster[c][param_name_of(n)] for c in clusters) for n in names]
    except KeyError as err:
        raise ValueError(f"owners_per_cluster: {err.args[0]!r} has no holder in some cluster") from None
    segments: list[Segment] = []
    for ring, run in itertools.groupby(range(len(names)), key=rings.__getitem__):
        idx = list(run)
        segments.append(Segment(ring_id=len(segments), names=tuple(names[i] for i in idx),
                                numel=sum(numels[i] for i in idx), ring=ring))
    return segments


def segments_for(node: str, segments: Sequence[Segment]) -> list[Segment]:
    """The segments whose ring includes ``node``; it serves all of them."""
    return [s for s in segments if node in s.ring]


def chunk_bounds(numel: int, parts: int) -> list[int]:
    """``parts + 1`` boundaries splitting ``numel`` elements into near-equal chunks (some may be empty)."""
    return [i * numel // parts for i in range(parts + 1)]


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


@dataclass(frozen=True, slots=True)
class CompressedPiece:
    """A piece of a compressed round (``ravq.average.ring_compression``) as received: packed, or raw where the
    sender could not pack it (a non-finite value), with the round id of the sender's anchor."""

    base: int
    value: Tensor | Packed

    @property
    def nbytes(self) -> int:
        return self.value.nbytes if isinstance(self.value, Tensor) else self.value.wire_bytes


Piece = Tensor | CompressedPiece


def received_piece(meta: Mapping[str, Any], tensors: Mapping[str, Tensor], packed: Mapping[str, Packed]
                   ) -> Piece | None:
    """The piece a decoded RING_CHUNK carries, or None if it is not one: exactly one tensor "piece",
    raw in a plain round; raw or packed, with an int ``base`` in meta, in a compressed round."""
    if len(tensors) + len(packed) != 1:
        return None
    base = meta.get("base")
    if base is None:
        return tensors.get("piece")
    value = tensors.get("piece", packed.get("piece"))
    if type(base) is not int or value is None:
        return None
    return CompressedPiece(base, value)


class RingAborted(Exception):
    """A ring round that cannot finish: a silent peer, a peer's abort, or a piece that does not fit."""

    def __init__(self, ring_id: int, round_id: int, reason: str, peer: str = "", *, from_peer: bool = False) -> None:
        super().__init__(f"ring {ring_id} round {round_id} aborted: {reason}" + (f" ({peer})" if peer else ""))
        self.ring_id, self.round_id, self.reason, self.peer = ring_id, round_id, reason, peer
        self.from_peer = from_peer
        """True when a peer's RING_ABORT ended the round; False when this node detected the failure."""


class RingLink(Protocol):
    """Sending side of ring traffic; the node implements it over its ring DEALER sockets."""

    async def send(self, peer: str, meta: dict[str, int], tensor: Tensor | Packed) -> None:
        """Send one RING_CHUNK piece; ``meta`` holds ring, round, step and piece (all int), and for a
        compressed round ``base`` (see ``ravq.average.ring_compression``), with ``tensor`` packed or raw.

        It may send without copying and return before the bytes have left: ``ring_allreduce`` never
        writes to a sent tensor until the ring proves it arrived (see ``_RingRun``).
        """

    async def send_abort(self, peer: str, ring_id: int, round_id: int, reason: str) -> None:
        """Send one RING_ABORT."""


@dataclass(eq=False, slots=True)
class _Round:
    """Receiving state of one open round of one ring."""

    ring_id: int
    round_id: int
    predecessor: str
    members: frozenset[str]
    pieces_per_step: list[int]
    pieces: dict[tuple[int, int], Piece] = field(default_factory=dict)
    taken: tuple[int, int] = (-1, -1)
    want: tuple[int, int] | None = None
    waiter: asyncio.Future[Piece] | None = None
    aborted: RingAborted | None = None
    arrived: int = 0
    """Pieces accepted from the predecessor so far."""

    @property
    def expecting(self) -> bool:
        """Whether pieces from the predecessor are still to come."""
        return self.arrived < sum(self.pieces_per_step)

    def expects(self, step: int, piece: int) -> bool:
        key = (step, piece)
        return (0 <= step < len(self.pieces_per_step) and 0 <= piece < self.pieces_per_step[step]
                and key > self.taken and key not in self.pieces)

    def abort(self, error: RingAborted) -> None:
        if self.aborted is None:
            self.aborted = error
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(error)


Buffered = tuple[str, int, int, Piece]  # sender, step, piece, tensor of a round not open yet


class Mailbox:
    """Ring messages received by one node, sorted by (ring, round, step, piece) for ``ring_allreduce``.

    Round ids must not decrease from one averaging round to the next on a node (every ring of one
    averaging round shares its round id); so a message for a round older than the newest one opened,
    or for a round of a ring that already closed, is stale: dropped and counted.  A message for a round
    not opened yet is kept until it opens, because rings start at slightly different times on different
    nodes; those are bounded by ``max_future_bytes``/``max_future_messages`` (beyond: dropped, counted).
    """

    def __init__(self, *, max_future_bytes: int = 1 << 30, max_future_messages: int = 4096) -> None:
        self.max_future_bytes, self.max_future_messages = max_future_bytes, max_future_messages
        self.stale_dropped = 0
        """Messages for rounds already finished or aborted."""
        self.overflow_dropped = 0
        """Messages for future rounds dropped because the future buffer was full."""
        self.unexpected_dropped = 0
        """Messages from a non-member or predecessor, duplicates, or out of the round's schedule."""
        self.future_bytes = self.future_messages = 0
        self._open: dict[int, _Round] = {}
        self._closed: dict[int, int] = {}
        self._newest_round = -1
        self._future: dict[tuple[int, int], list[Buffered]] = {}
        self._future_aborts: dict[tuple[int, int], tuple[str, str]] = {}

    def _is_stale(self, ring_id: int, round_id: int) -> bool:
        return round_id < self._newest_round or round_id <= self._closed.get(ring_id, -1)

    def deliver(self, sender: str, meta: Mapping[str, Any], tensor: Piece) -> None:
        """Accept one RING_CHUNK piece (meta already validated by ``ravq.net.wire``).

        The round takes ``tensor`` over: it adds into it and sends it on, so it must be writable and
        held by nobody else, as a ZeroMQ frame received without a copy is.
        """
        ring_id, round_id, step, piece = meta["ring"], meta["round"], meta["step"], meta["piece"]
        current = self._open.get(ring_id)
        if current is not None and current.round_id == round_id:
            self._put(current, sender, step, piece, tensor)
            return
        if current is not None and current.round_id < round_id:
            self._moved_on(current, sender)
        if self._is_stale(ring_id, round_id):
            self.stale_dropped += 1
        elif (self.future_bytes + tensor.nbytes > self.max_future_bytes
              or self.future_messages >= self.max_future_messages):
            self.overflow_dropped += 1
        else:
            self._future.setdefault((ring_id, round_id), []).append((sender, step, piece, tensor))
            self.future_bytes += tensor.nbytes
            self.future_messages += 1

    @staticmethod
    def _moved_on(rnd: _Round, sender: str) -> None:
        """The predecessor sent a piece of a newer round while this one still waits for its pieces.

        Pieces of one link arrive in order, so it left this round unfinished (it aborted or skipped
        it: a cluster that was away joins at the rounds the others are at): end the round now rather
        than wait for ``timeout_s``."""
        if sender == rnd.predecessor and rnd.expecting:
            rnd.abort(RingAborted(rnd.ring_id, rnd.round_id, "peer_moved_on", sender))

    def abort_open(self, reason: str) -> int:
        """Abort every open round at once (e.g. the plan dropped a member: no round of the old plan can
        finish).  Every member sees the same plan change, so none is told; returns how many."""
        for rnd in self._open.values():
            rnd.abort(RingAborted(rnd.ring_id, rnd.round_id, reason, from_peer=True))
        return len(self._open)

    def _put(self, rnd: _Round, sender: str, step: int, piece: int, tensor: Piece) -> None:
        if sender != rnd.predecessor or not rnd.expects(step, piece):
            self.unexpected_dropped += 1
            return
        rnd.arrived += 1
        if rnd.waiter is not None and rnd.want == (step, piece) and not rnd.waiter.done():
            rnd.waiter.set_result(tensor)
        else:
            rnd.pieces[step, piece] = tensor

    def deliver_abort(self, sender: str, ring_id: int, round_id: int, reason: str = "") -> None:
        """Accept one RING_ABORT: the pending (or next) wait of that round raises RingAborted."""
        current = self._open.get(ring_id)
        if current is not None and current.round_id == round_id:
            if sender in current.members:
                current.abort(RingAborted(ring_id, round_id, reason or "peer_abort", sender, from_peer=True))
            else:
                self.unexpected_dropped += 1
        elif self._is_stale(ring_id, round_id):
            self.stale_dropped += 1
        elif len(self._future_aborts) >= self.max_future_messages:
            self.overflow_dropped += 1
        else:
            self._future_aborts[ring_id, round_id] = (sender, reason)

    def open(self, ring_id: int, round_id: int, *, members: Sequence[str], me: str,
             pieces_per_step: list[int]) -> _Round:
        """Start receiving a round; messages that arrived early move in, older buffered ones are dropped."""
        assert ring_id not in self._open, f"ring {ring_id} already has round {self._open[ring_id].round_id} open"
        assert not self._is_stale(ring_id, round_id), f"ring {ring_id} round {round_id} is not newer"
        rank = members.index(me)
        rnd = _Round(ring_id, round_id, members[rank - 1], frozenset(members) - {me}, pieces_per_step)
        self._open[ring_id] = rnd
        self._newest_round = max(self._newest_round, round_id)
        for key in [k for k in self._future if self._is_stale(*k) or k == (ring_id, round_id)]:
            for sender, step, piece, tensor in self._future.pop(key):
                self.future_bytes -= tensor.nbytes
                self.future_messages -= 1
                if key == (ring_id, round_id):
                    self._put(rnd, sender, step, piece, tensor)
                else:
                    self.stale_dropped += 1
        for key in [k for k in self._future_aborts if self._is_stale(*k) or k == (ring_id, round_id)]:
            sender, reason = self._future_aborts.pop(key)
            if key == (ring_id, round_id):
                self.deliver_abort(sender, ring_id, round_id, reason)
        if any(k[0] == ring_id and k[1] > round_id and any(m[0] == rnd.predecessor for m in msgs)
               for k, msgs in self._future.items()):
            self._moved_on(rnd, rnd.predecessor)
        return rnd

    def close(self, rnd: _Round) -> None:
        """Finish a round (done or aborted): anything still arriving for it is stale from now on."""
        del self._open[rnd.ring_id]
        self._closed[rnd.ring_id] = max(self._closed.get(rnd.ring_id, -1), rnd.round_id)
        self.stale_dropped += len(rnd.pieces)
        rnd.pieces.clear()

    async def take(self, rnd: _Round, step: int, piece: int, timeout_s: float) -> Piece:
        """The given piece of an open round; RingAborted on a peer's abort or after ``timeout_s``."""
        if rnd.aborted is not None:
            raise rnd.aborted
        tensor = rnd.pieces.pop((step, piece), None)
        if tensor is None:
            rnd.want, rnd.waiter = (step, piece), asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(timeout_s):
                    tensor = await rnd.waiter
            except TimeoutError:
                raise RingAborted(rnd.ring_id, rnd.round_id, "timeout", rnd.predecessor) from None
            finally:
                rnd.want, rnd.waiter = None, None
        rnd.taken = (step, piece)
        return tensor


class _RingRun:
    """One member's half of one round: a sender and a receiver that overlap piece by piece.

    With chunk k = (rank - step) mod C sent and chunk (rank - step - 1) mod C received at every step,
    the chunk sent at step t is exactly the one received at step t-1; so piece j of step t can leave as
    soon as piece j of step t-1 has been handled, and a segment streams round the ring like a pipeline.

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
        self.flat, self.out, self.size, self.rank = flat, out, len(members), list(members).index(me)
        self.successor, self.predecessor = members[(self.rank + 1) % self.size], members[self.rank - 1]
        self.send_plan, self.recv_plan = ring_plan(flat.numel(), self.size, self.rank,
                                                   max(1, piece_bytes // flat.element_size()))
        self.received = [0] * len(self.send_plan)
        self.progress = asyncio.Event()
        self.forward: dict[tuple[int, int], Tensor] = {}
        """(step, piece) -> the received buffer to send for that piece (steps 1 and later)."""

    async def send_loop(self, link: RingLink, meta: dict[str, int], timeout_s: float) -> None:
        for step, plan in enumerate(self.send_plan):
            for j, (a, b) in enumerate(plan):
                while step > 0 and self.received[step - 1] <= j:
                    self.progress.clear()
                    await self.progress.wait()
                tensor = self.forward.pop((step, j)) if step else self.flat[a:b]
                try:
                    async with asyncio.timeout(timeout_s):
                        await link.send(self.successor, {**meta, "step": step, "piece": j}, tensor)
                except TimeoutError:
                    raise RingAborted(meta["ring"], meta["round"], "send_timeout", self.successor) from None

    async def recv_loop(self, mailbox: Mailbox, rnd: _Round, timeout_s: float) -> None:
        last_reduce, last = self.size - 2, len(self.recv_plan) - 1
        for step, plan in enumerate(self.recv_plan):
            for j, (a, b) in enumerate(plan):
                piece = await mailbox.take(rnd, step, j, timeout_s)
                if not isinstance(piece, Tensor) or piece.dtype != self.out.dtype or piece.numel() != b - a:
                    raise RingAborted(rnd.ring_id, rnd.round_id, "bad_piece", self.predecessor)
                piece = piece.reshape(-1)
                if step <= last_reduce:
                    piece.add_(self.flat[a:b])
                if step < last:
                    self.forward[step + 1, j] = piece
                    self.received[step] = j + 1
                    self.progress.set()
                    await asyncio.sleep(0)  # the send loop queues it: it leaves while this member divides
                if step >= last_reduce:  # the full sum of this piece: finished into out
                    torch.div(piece, self.size, out=self.out[a:b])


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
    run = _RingRun(flat, flat if inplace else torch.empty_like(flat), members, me, piece_bytes)
    await drive_ring(run, {"ring": ring_id, "round": round_id}, members=members, me=me, link=link,
                     mailbox=mailbox, timeout_s=timeout_s)
    return run.out


async def drive_ring(run: Any, meta: dict[str, Any], *, members: Sequence[str], me: str, link: RingLink,
                     mailbox: Mailbox, timeout_s: float) -> None:
    """Run one ring's send and receive loops (``run``: a _RingRun or a compressed run) to the end; on an
    abort, tell the other members (unless a peer told us) and raise RingAborted."""
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
    outcomes = await asyncio.gather(*(asyncio.wait_for(link.send_abort(p, ring_id, round_id, reason), timeout_s)
                                      for p in peers), return_exceptions=True)
    for peer, outcome in zip(peers, outcomes):
        if isinstance(outcome, Exception):
            log.debug("ring %d round %d: abort not sent to %s: %r", ring_id, round_id, peer, outcome)


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
        assert flat.numel() == seg.numel, f"ring {seg.ring_id}: {flat.numel()} elements, plan says {seg.numel}"
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
            per_element = compression.wire_bytes_per_element if compression is not None else flat.element_size()
            result.bytes_sent[seg.ring_id] = int(ring_bytes_sent(seg.numel, 1, len(seg.ring), seg.ring.index(me))
                                                 * per_element)

    async with asyncio.TaskGroup() as tg:
        for seg in segments:
            tg.create_task(one(seg))
    result.seconds = time.perf_counter() - t0
    return result


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """A new 1-D CPU tensor holding ``tensors`` back to back: a snapshot later updates do not touch."""
    if not tensors:
        return torch.empty(0)
    with torch.no_grad():
        return torch.cat([t.detach().reshape(-1).to("cpu") for t in tensors])


def _slices(flat: Tensor, tensors: Sequence[Tensor]) -> list[Tensor]:
    out, offset = [], 0
    for t in tensors:
        out.append(flat[offset:offset + t.numel()].view(t.shape).to(t.device, t.dtype))
        offset += t.numel()
    assert offset == flat.numel(), f"flat has {flat.numel()} elements, tensors {offset}"
    return out


def unflatten_into(flat: Tensor, tensors: Sequence[Tensor]) -> None:
    """Copy ``flat`` back into ``tensors`` in place (the inverse of ``flatten``)."""
    with torch.no_grad():
        for t, part in zip(tensors, _slices(flat, tensors)):
            t.copy_(part)


def apply_average_delta(live_tensors: Sequence[Tensor], snapshot_flat: Tensor, averaged_flat: Tensor) -> Tensor:
    """Add (averaged - snapshot) to the live tensors in place; returns that difference (flat).

    Averaging runs on a snapshot taken at version v while the stage keeps training; applying the
    difference rather than the average keeps the updates made during the round.  Call it from the
    thread that updates the weights (the compute thread), not concurrently with an optimizer step.
    """
    delta = averaged_flat - snapshot_flat
    with torch.no_grad():
        for t, part in zip(live_tensors, _slices(delta, live_tensors)):
            t.add_(part)
    return delta


def snapshot_segments(tensors: Mapping[str, Tensor], segments: Sequence[Segment]) -> dict[int, Tensor]:
    """ring_id -> flat snapshot of this node's tensors of that segment."""
    return {s.ring_id: flatten([tensors[n] for n in s.names]) for s in segments}


def apply_round(tensors: Mapping[str, Tensor], segments: Sequence[Segment], snapshots: Mapping[int, Tensor],
                result: RoundResult) -> dict[int, Tensor]:
    """Apply the average's delta to every segment whose ring finished; aborted ones stay as they are.

    Returns ring_id -> the flat delta applied, for callers that keep track of it."""
    return {s.ring_id: apply_average_delta([tensors[n] for n in s.names], snapshots[s.ring_id],
                                           result.averaged[s.ring_id])
            for s in segments if s.ring_id in result.averaged}


def optimizer_state_tensors(optimizer: torch.optim.Optimizer, params_by_name: Mapping[str, Tensor]
                            ) -> dict[str, Tensor]:
    """Per-element floating-point optimizer state (e.g. Adam's exp_avg, exp_avg_sq) by averaged name.

    Names are ``<parameter name>::<state key>``, keys sorted, so every cluster names them alike.
    Scalars such as Adam's ``step`` are left out: they count local steps, they are not weights.
    """
    out: dict[str, Tensor] = {}
    for name, p in params_by_name.items():
        state = optimizer.state.get(p, {})
        for key in sorted(state):
            value = state[key]
            if isinstance(value, Tensor) and value.is_floating_point() and value.shape == p.shape:
                out[f"{name}{OPTIM_SEP}{key}"] = value
    return out


def with_optimizer_state(names: Sequence[str], numels: Sequence[int], stateful: Sequence[str],
                         state_keys: Sequence[str]) -> tuple[list[str], list[int]]:
    """``names``/``numels`` with each stateful parameter's state names right after it.

    Placing them next to their parameter keeps a holder's names contiguous, so they join its segment.
    ``stateful`` are the parameters the optimizer updates; ``state_keys`` its per-element state keys.
    """
    wanted, keys = set(stateful), sorted(state_keys)
    pairs = [(full, numel) for name, numel in zip(names, numels)
             for full in [name, *(f"{name}{OPTIM_SEP}{k}" for k in keys if name in wanted)]]
    return [n for n, _ in pairs], [k for _, k in pairs]
