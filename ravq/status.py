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
    lines.append(f"{'node':<16}{'state':<7}{'c/s':<6}{'version':>8}{'samples':>9}{'busy':>7}{'stale':>7}{'loss':>8}"
                 "  waiting")
    for name, m in sorted(status.get("members", {}).items()):
        st = m.get("stats", {})
        loss = st.get("loss")
        lines.append(f"{name:<16}{m['state']:<7}{st.get('cluster', '?')}/{st.get('stage', '?'):<4}"
                     f"{st.get('version', 0):>8}{st.get('samples', 0):>9}{st.get('busy_fraction', 0):>7.2f}"
                     f"{st.get('staleness_mean', 0):>7.2f}{'-' if loss is None else f'{loss:.3f}':>8}"
                     f"  {waiting_text(st)}")
    return "\n".join(lines)


def waiting_text(stats: dict[str, Any]) -> str:
    """Share of the stage's time spent waiting, by reason, largest first ("averaging 0.55 input 0.10"):
    busy is compute only, so busy plus these is about 1."""
    wall, waits = stats.get("wall_s") or 0.0, stats.get("wait_s") or {}
    if wall <= 0:
        return "-"
    shares = sorted(((s / wall, r) for r, s in waits.items() if s / wall >= 0.005), reverse=True)
    return " ".join(f"{r} {share:.2f}" for share, r in shares) or "-"
