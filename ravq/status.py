"""`ravq status` and the demo's live view: ask the broker for membership and live statistics."""

from __future__ import annotations

from typing import Any

import zmq.asyncio

from ravq.config import Topology
from ravq.metrics import Metrics
from ravq.security import socket_options_for
from ravq.transport import SocketOptions, endpoint, request
from ravq.wire import DecodeLimits, Message, MsgType


async def fetch_status(topology: Topology, timeout_s: float, key_dir: str | None = None,
                       name: str = "broker") -> dict[str, Any]:
    """One STATUS round trip; raises TimeoutError when the broker does not answer.

    With CURVE the request is made with ``name``'s listed key pair (the broker's own by default)."""
    ctx = zmq.asyncio.Context()
    metrics = Metrics()
    opts = socket_options_for(topology, name, key_dir, metrics) if topology.security.curve else SocketOptions()
    sender = name if topology.security.curve else "ravq-status"
    try:
        b = topology.broker
        reply = await request(ctx, endpoint(b.host, b.router_port), Message(type=MsgType.STATUS_REQ, sender=sender),
                              timeout_s, metrics, DecodeLimits(), opts)
        return reply.meta
    finally:
        if opts.curve is not None:
            opts.curve.close()
        ctx.term()


def format_status(status: dict[str, Any]) -> str:
    lines = [f"broker sequence {status.get('seq')}; clusters: "
             + " | ".join(" -> ".join(c["nodes"]) for c in status.get("plan", {}).get("clusters", []))]
    lines.append(f"{'node':<16}{'state':<7}{'c/s':<6}{'version':>8}{'samples':>9}{'busy':>7}{'stale':>7}{'loss':>8}")
    for name, m in sorted(status.get("members", {}).items()):
        st = m.get("stats", {})
        loss = st.get("loss")
        lines.append(f"{name:<16}{m['state']:<7}{st.get('cluster', '?')}/{st.get('stage', '?'):<4}"
                     f"{st.get('version', 0):>8}{st.get('samples', 0):>9}{st.get('busy_fraction', 0):>7.2f}"
                     f"{st.get('staleness_mean', 0):>7.2f}{loss if loss is None else f'{loss:.3f}':>8}")
    return "\n".join(lines)
