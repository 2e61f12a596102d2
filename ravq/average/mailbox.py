"""The receiving side of ring rounds: pieces as they arrive, sorted by ring, round, step and piece.

The node's ring socket reader decodes each RING_CHUNK (``received_piece``) and hands it to the
``Mailbox``, which keeps it until the ring's round takes it; a round that cannot finish raises
``RingAborted`` from its pending wait.  Nothing here touches sockets, so rings run in one process in tests.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from ravq.codec.compress import Packed


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


BUSY_WAITS = 20
"""A ring step whose piece is late waits another ``ring_step_s`` while its predecessor is still delivering
(pieces of this node's other rings: one link carries them all, in order), at most this many times over."""


def loop_time() -> float:
    """The running event loop's clock (the one ring timeouts run on; virtual in tests), else the monotonic."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


class RingAborted(Exception):
    """A ring round that cannot finish: a silent peer, a peer's abort, or a piece that does not fit."""

    def __init__(self, ring_id: int, round_id: int, reason: str, peer: str = "", *,
                 from_peer: bool = False) -> None:
        by = f" ({peer})" if peer else ""
        super().__init__(f"ring {ring_id} round {round_id} aborted: {reason}{by}")
        self.ring_id, self.round_id, self.reason, self.peer = ring_id, round_id, reason, peer
        self.from_peer = from_peer
        """True when a peer's RING_ABORT ended the round; False when this node detected the failure."""


@dataclass(eq=False, slots=True)
class OpenRound:
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

    def __init__(self, *, max_future_bytes: int = 1 << 30, max_future_messages: int = 4096,
                 refuse: Callable[[str, int, int], None] = lambda peer, ring_id, round_id: None,
                 clock: Callable[[], float] = loop_time) -> None:
        self.max_future_bytes, self.max_future_messages = max_future_bytes, max_future_messages
        self.clock = clock
        self.heard: dict[str, tuple[float, int]] = {}
        """Per peer, when its last ring piece arrived (any ring) and of which round: a step whose piece is
        late waits on while its predecessor still delivers pieces of that round or older ones (``take``)."""
        self.refuse = refuse
        """Called with (peer, ring, round) once per round a peer sends to after ``finish``: tell it at once
        (RING_ABORT "finished") rather than let it wait ``ring_step_s`` for pieces that will never come."""
        self.finished = False
        self._refused: dict[tuple[str, int], int] = {}
        self.stale_dropped = 0
        """Messages for rounds already finished or aborted."""
        self.overflow_dropped = 0
        """Messages for future rounds dropped because the future buffer was full."""
        self.unexpected_dropped = 0
        """Messages from a non-member or predecessor, duplicates, or out of the round's schedule."""
        self.future_bytes = self.future_messages = 0
        self._open: dict[int, OpenRound] = {}
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
        self.heard[sender] = (self.clock(), round_id)
        current = self._open.get(ring_id)
        if current is not None and current.round_id == round_id:
            self._put(current, sender, step, piece, tensor)
            return
        if current is not None and current.round_id < round_id:
            self._moved_on(current, sender)
        if self.finished:
            self._refuse(sender, ring_id, round_id)
        elif self._is_stale(ring_id, round_id):
            self.stale_dropped += 1
        elif (self.future_bytes + tensor.nbytes > self.max_future_bytes
              or self.future_messages >= self.max_future_messages):
            self.overflow_dropped += 1
        else:
            self._future.setdefault((ring_id, round_id), []).append((sender, step, piece, tensor))
            self.future_bytes += tensor.nbytes
            self.future_messages += 1

    def finish(self) -> None:
        """This node runs no more rounds (its training ended and its last round is done): every peer waiting
        on it, now or later, is refused at once (group averaging decouples the clusters' paces, so a
        cluster may finish while its partners still train)."""
        self.finished = True
        waiting = [(sender, *key) for key, msgs in self._future.items() for sender, *_ in msgs]
        self._future.clear()
        self.future_bytes = self.future_messages = 0
        for sender, ring_id, round_id in waiting:
            self._refuse(sender, ring_id, round_id)

    def _refuse(self, sender: str, ring_id: int, round_id: int) -> None:
        self.stale_dropped += 1
        if self._refused.get((sender, ring_id), -1) < round_id:
            self._refused[sender, ring_id] = round_id
            self.refuse(sender, ring_id, round_id)

    @staticmethod
    def _moved_on(rnd: OpenRound, sender: str) -> None:
        """The predecessor sent a piece of a newer round while this one still waits for its pieces.

        Pieces of one link arrive in order, so it left this round unfinished (it aborted or skipped
        it: a cluster that was away joins at the rounds the others are at): end the round now rather
        than wait for ``timeout_s``."""
        if sender == rnd.predecessor and rnd.expecting:
            rnd.abort(RingAborted(rnd.ring_id, rnd.round_id, "peer_moved_on", sender))

    def abort_open(self, reason: str, reaching: Collection[str] | None = None) -> int:
        """Abort every open round at once (e.g. the plan dropped a member: no round of the old plan can
        finish), or only those whose ring reaches a node of ``reaching`` (group averaging: the groups a
        change touched).  Every member sees the same plan change, so none is told; returns how many."""
        doomed = [r for r in self._open.values() if reaching is None or not r.members.isdisjoint(reaching)]
        for rnd in doomed:
            rnd.abort(RingAborted(rnd.ring_id, rnd.round_id, reason, from_peer=True))
        return len(doomed)

    def _put(self, rnd: OpenRound, sender: str, step: int, piece: int, tensor: Piece) -> None:
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
             pieces_per_step: list[int]) -> OpenRound:
        """Start receiving a round; messages that arrived early move in, older buffered ones are dropped."""
        assert ring_id not in self._open, f"ring {ring_id}: round {self._open[ring_id].round_id} is open"
        assert not self._is_stale(ring_id, round_id), f"ring {ring_id} round {round_id} is not newer"
        rank = members.index(me)
        rnd = OpenRound(ring_id, round_id, members[rank - 1], frozenset(members) - {me}, pieces_per_step)
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

    def close(self, rnd: OpenRound) -> None:
        """Finish a round (done or aborted): anything still arriving for it is stale from now on."""
        del self._open[rnd.ring_id]
        self._closed[rnd.ring_id] = max(self._closed.get(rnd.ring_id, -1), rnd.round_id)
        self.stale_dropped += len(rnd.pieces)
        rnd.pieces.clear()

    async def take(self, rnd: OpenRound, step: int, piece: int, timeout_s: float) -> Piece:
        """The given piece of an open round; RingAborted on a peer's abort, or after ``timeout_s`` in which
        the predecessor delivered nothing.  While it delivers pieces of this node's other rings of this round
        or older (queued ahead of this one on the one link: a large stage over a slow uplink), it waits on,
        up to ``BUSY_WAITS`` more times ``timeout_s``: a busy peer is not a dead one."""
        tensor, waits = None, 0
        while tensor is None:
            if rnd.aborted is not None:
                raise rnd.aborted
            if (tensor := rnd.pieces.pop((step, piece), None)) is not None:
                break
            rnd.want, rnd.waiter = (step, piece), (waiter := asyncio.get_running_loop().create_future())
            try:
                async with asyncio.timeout(timeout_s):
                    tensor = await waiter
            except TimeoutError:
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    tensor = waiter.result()  # it came as the window closed: the timeout cancelled the await
                    continue
                at, newest = self.heard.get(rnd.predecessor, (-math.inf, -1))
                # busy only with pieces of this round or older ones (queued ahead of ours); a newer round's
                # means it moved on, and ours will not come
                quiet = self.clock() - at >= timeout_s or newest > rnd.round_id
                if quiet or waits >= BUSY_WAITS:
                    raise RingAborted(rnd.ring_id, rnd.round_id, "timeout", rnd.predecessor) from None
                waits += 1
            finally:
                rnd.want, rnd.waiter = None, None
        rnd.taken = (step, piece)
        return tensor
