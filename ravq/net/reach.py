"""Reachability, measured: can a node's advertised address be dialled from outside? (issue #24)

A node that has bound its ports asks the broker (``REACH_REQ``) to dial them back.  The broker
(``brokers.reach``) opens a DEALER to each port and waits up to ``timeouts.reach_s`` for ZeroMQ's
handshake to succeed: with CURVE that is a full handshake with the broker's own listed key, so a node
behind NAT (the SYN never arrives), a firewall (refused or dropped) and an address that is someone
else's port all read ``behind_nat``.  Nothing is sent; the node's ROUTER sees one connection open and
close.  A node whose topology entry says ``reachable`` is not dialled.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

if TYPE_CHECKING:
    from ravq.net.security import Curve

REACHABLE, BEHIND_NAT = "reachable", "behind_nat"
_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


async def dial_back(ctx: zmq.asyncio.Context, addr: str, timeout_s: float, curve: Curve | None = None,
                    peer: str = "") -> bool:
    """Whether a ZeroMQ handshake with ``addr`` succeeds within ``timeout_s`` (``curve``: this process's
    ``Curve``, pinning ``peer``'s listed key)."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    if curve is not None:
        curve.make_client(sock, peer)
    monitor = sock.get_monitor_socket(_EVENTS)
    try:
        sock.connect(addr)
        async with asyncio.timeout(timeout_s):
            event = parse_monitor_message(await monitor.recv_multipart())
            # a handshake that failed: not this node, or not ravq, on that address
            return bool(event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED)
    except TimeoutError:
        return False
    finally:
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
