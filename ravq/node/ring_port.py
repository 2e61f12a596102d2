"""A node's ring sockets: sending ring pieces and aborts to its peers, and reading what they send.

``RingLinks`` is the ``ravq.average.ring.RingLink`` the rings send through, one DEALER per ring peer;
``RingPort`` owns those DEALERs and the ROUTER peers send to, and its one reader hands pieces and aborts
to the ``Mailbox`` and catch-up requests to the averager.  The node builds the port and gives it to its
``ravq.average.averager.Averager`` (typed there by ``ravq.average.port.Port``), which never touches ZeroMQ.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping

import torch
import zmq

from ravq.average.mailbox import Mailbox, received_piece
from ravq.codec.compress import Packed
from ravq.config import Topology
from ravq.config.routes import relays, route
from ravq.metrics import Metrics
from ravq.net.options import SocketOptions, endpoint
from ravq.net.routed import Links, RoutedLink
from ravq.net.transport import Context, Inbox, Outlink
from ravq.net.wire import DecodeLimits, Message, MsgType

log = logging.getLogger(__name__)


class RingLinks:
    """``ravq.average.ring.RingLink`` over one DEALER per ring peer."""

    def __init__(self, me: str, outlinks: dict[str, Outlink | RoutedLink]) -> None:
        self.me, self.outlinks = me, outlinks

    async def send(self, peer: str, meta: dict[str, int], tensor: torch.Tensor | Packed) -> None:
        await self.outlinks[peer].send(ring_chunk(self.me, meta, tensor))

    async def send_abort(self, peer: str, ring_id: int, round_id: int, reason: str) -> None:
        await self.outlinks[peer].send(Message(type=MsgType.RING_ABORT, sender=self.me,
                                               meta={"ring": ring_id, "round": round_id, "reason": reason}))


def ring_chunk(sender: str, meta: dict[str, int], piece: torch.Tensor | Packed) -> Message:
    """The RING_CHUNK message of one piece (a plain tensor or a packed one)."""
    if isinstance(piece, Packed):
        return Message(type=MsgType.RING_CHUNK, sender=sender, meta=meta, packed={"piece": piece})
    return Message(type=MsgType.RING_CHUNK, sender=sender, meta=meta, tensors={"piece": piece})


class RingPort:
    """This node's ring sockets: the ROUTER its ring peers send to, and a link to each of them (a DEALER
    to its ROUTER, or over this ROUTER when one end is behind NAT: ``ravq.net.routed``).

    The ROUTER binds at once (the broker dials it back); ``connect`` links to every ring peer as soon as
    their reachability is known (ZeroMQ starts connecting, CURVE handshake included, long before the
    first round); ``ensure`` adds the links a later plan needs and keeps every existing one (a plan epoch
    never reconnects a peer it keeps).  ``connect`` (peer -> Outlink), the constructor's, replaces the
    route-following factory (tests count connects with it).
    """

    def __init__(self, ctx: Context, topology: Topology, me: str, peers: Iterable[str], metrics: Metrics,
                 limits: DecodeLimits, sock_opts: SocketOptions,
                 connect: Callable[[str], Outlink] | None = None, authenticate: bool = True) -> None:
        """``authenticate``: with CURVE, a message's sender must be the name its key was given
        (``ravq.net.transport.Inbox``); the profiler's two ring members share one node's key and turn it
        off."""
        self.ctx, self.topology, self.me, self.metrics = ctx, topology, me, metrics
        self.limits, self.sock_opts = limits, sock_opts
        self._hook = connect
        self._open = False
        """Whether ``connect`` ran: before, links wait for the peers' reachability."""
        bind = topology.node(me).bind_host or topology.node(me).host
        self.inbox = Inbox.bind(ctx, endpoint(bind, topology.node(me).ring_port), "ring", metrics, limits,
                                sock_opts, me=me, authenticate=authenticate)
        self.peers = sorted(peers)
        self.reach: dict[str, bool] = {}
        self._links = Links(ctx=ctx, inbox=self.inbox, me=me, socket="ring", metrics=metrics, limits=limits,
                            opts=sock_opts, port_of={n.name: (n.host, n.ring_port) for n in topology.nodes})
        self.outlinks: dict[str, Outlink | RoutedLink] = {}
        self.link = RingLinks(me, self.outlinks)

    def connect(self, reach: Mapping[str, bool]) -> None:
        """Link to every ring peer along its route (``reach``: who can be dialled)."""
        self.reach, self._open = dict(reach), True
        self.ensure(self.peers)

    @property
    def routes(self) -> dict[str, str]:
        return dict(self._links.routes)

    @property
    def address(self) -> str:
        """The endpoint the ROUTER is bound to (its port once the system chose one)."""
        return self.inbox.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _connect(self, peer: str) -> Outlink | RoutedLink:
        if self._hook is not None:
            return self._hook(peer)
        return self._links.open(peer, route(self.me, peer, self.reach, relays(self.topology)))

    def ensure(self, peers: Iterable[str]) -> int:
        """Connect to each of ``peers`` not linked yet (a new plan's ring members); links to peers already
        linked stay as they are.  Returns how many were connected."""
        new = [p for p in dict.fromkeys(peers) if p != self.me and p not in self.outlinks]
        if not self._open:  # reachability not known yet: ``connect`` links them with the rest
            self.peers = sorted({*self.peers, *new})
            return 0
        for peer in new:
            self.outlinks[peer] = self._connect(peer)
        if new:
            log.info("%s: new ring link(s) to %s", self.me, ", ".join(new))
        return len(new)

    async def serve(self, mailbox: Mailbox,
                    answer_catchup: Callable[[bytes, Message], Awaitable[None]]) -> None:
        """The ring socket's one reader: pieces and aborts go to ``mailbox``, catch-up requests to
        ``answer_catchup``; anything else is counted as a bad message."""
        while True:
            identity, msg = await self.inbox.recv()
            piece = received_piece(msg.meta, msg.tensors, msg.packed)
            if msg.type == MsgType.RING_CHUNK and piece is not None:
                mailbox.deliver(msg.sender, msg.meta, piece)
            elif msg.type == MsgType.RING_ABORT:
                mailbox.deliver_abort(msg.sender, msg.meta["ring"], msg.meta["round"],
                                      str(msg.meta.get("reason", ""))[:64])
            elif msg.type == MsgType.CATCHUP_REQ:
                await answer_catchup(identity, msg)
            elif msg.type == MsgType.CATCHUP and msg.sender in self._links.routed:
                self._links.routed[msg.sender].deliver(msg)  # a reply over this ROUTER (a routed link)
            else:
                self.metrics.bad_messages.labels("ring", "unexpected_message").inc()

    async def reply(self, identity: bytes, msg: Message, peer: str) -> None:
        """Answer the peer whose message came with ``identity`` (a catch-up reply), over the ROUTER."""
        await self.inbox.reply(identity, msg, peer)

    def rename(self, renamed: Mapping[str, str], is_peer: Callable[[str], bool]) -> None:
        """Nodes that took over other nodes' stages (standbys): close the links to the old ones and
        connect to each new one that ``is_peer`` (holds tensors this node averages)."""
        for old, new in renamed.items():
            if old in self.outlinks:
                self.outlinks.pop(old).close()
                self._links.forget(old)
            if is_peer(new):
                self.ensure([new])

    def close(self) -> None:
        for link in self.outlinks.values():
            link.close()
        self.inbox.close()
