"""What the averager uses of its node's ring sockets: ``Port``, given to it at construction.

The node owns the sockets (``ravq.node.ring_port.RingPort``: a ROUTER its ring peers send to, a link to
each of them) and builds them before the averager; everything in ``ravq.average`` sees them through
this Protocol only, so averaging never imports ZeroMQ and runs in one process over fakes in tests.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Protocol

from ravq.average.catchup import CatchupLink
from ravq.average.mailbox import Mailbox
from ravq.average.ring import RingLink
from ravq.net.wire import Message


class Port(Protocol):
    """A node's ring sockets, as its averager uses them."""

    @property
    def link(self) -> RingLink:
        """What the rings send their pieces and aborts through."""

    @property
    def outlinks(self) -> Mapping[str, CatchupLink]:
        """Ring peer -> this node's link to it (a catch-up asks its holders over them)."""

    @property
    def routes(self) -> dict[str, str]:
        """Ring peer -> how its link goes (dialled, over this ROUTER, relayed), for the node's stats."""

    async def serve(self, mailbox: Mailbox,
                    answer_catchup: Callable[[bytes, Message], Awaitable[None]]) -> None:
        """Read the ring socket for good: pieces and aborts to ``mailbox``, catch-up requests to
        ``answer_catchup`` (with the identity to reply to)."""

    async def reply(self, identity: bytes, msg: Message, peer: str) -> None:
        """Answer the peer whose request came with ``identity``."""

    def ensure(self, peers: Iterable[str]) -> int:
        """Link to each of ``peers`` not linked yet, keeping every other link; how many were new."""

    def rename(self, renamed: Mapping[str, str], is_peer: Callable[[str], bool]) -> None:
        """Drop the links to nodes replaced by others (standbys) and link to each new one ``is_peer``."""

    def close(self) -> None:
        """Close every socket."""
