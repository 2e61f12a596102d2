"""`ravq status` and the demo's live view: ask the broker for membership and live statistics.

Runs on any PC of the deployment: with CURVE it speaks with a key pair found on this PC (the broker's
on the broker's PC, a node's on a node's PC), so it never needs a secret copied elsewhere.  It never
imports torch.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import zmq.asyncio

from ravq.config import ConfigError, Topology
from ravq.metrics import Metrics
from ravq.net.options import SocketOptions, endpoint
from ravq.net.security import BROKER, key_paths, socket_options_for
from ravq.net.transport import request
from ravq.net.wire import DecodeLimits, Message, MsgType


def status_identity(topology: Topology, key_dir: str | None, name: str | None) -> tuple[str, str | None]:
    """(name, key_dir) whose CURVE key pair ``ravq status`` uses on this PC.

    Without ``name``: the broker's key when its secret is in the key directory, else the first node of
    the topology whose secret is there.  ConfigError (one line, with what to pass) when none is."""
    if not topology.security.curve:
        return name or "ravq-status", key_dir
    directory = key_dir if key_dir is not None else topology.security.key_dir
    if directory is None:
        raise ConfigError("security.key_dir: not set; pass --key-dir (the directory with this PC's "
                          "NAME.key_secret)")
    if name is not None:
        return name, directory
    for candidate in [BROKER, *(n.name for n in topology.nodes)]:
        if key_paths(candidate, directory)[1].exists():
            return candidate, directory
    raise ConfigError(f"{directory}: no secret key of the broker or of any node of the topology on this PC; "
                      "run `ravq status` on a PC of the deployment, or pass --key-dir DIR and --name NODE "
                      "with a key pair listed in the topology")


STATUS_MAX_HEADER_BYTES = 64 << 20
"""The STATUS reply names every member and its stats in one header (about 0.5 KiB each): ``ravq status``
asked for it, so it reads up to this, far above a node's 64 KiB, which a swarm of a few hundred members
passes."""


async def fetch_status(topology: Topology, timeout_s: float, key_dir: str | None = None,
                       name: str | None = None) -> dict[str, Any]:
    """One STATUS round trip; raises TimeoutError when the broker does not answer.  With a backup
    (``broker.backup``), the active one's status: the other is asked when the first is passive or silent.

    With CURVE the request is made with a listed key pair found on this PC (see status_identity)."""
    name, key_dir = status_identity(topology, key_dir, name)
    ctx = zmq.asyncio.Context()
    metrics = Metrics()
    opts = (
        socket_options_for(topology, name, key_dir, metrics) if topology.security.curve else SocketOptions()
    )
    b = topology.broker
    addresses = [endpoint(b.host, b.router_port)]
    if b.backup is not None:
        addresses.append(endpoint(b.backup.host, b.backup.router_port))
    passive: dict[str, Any] | None = None
    try:
        for address in addresses:
            try:
                reply = await request(ctx, address, Message(type=MsgType.STATUS_REQ, sender=name), timeout_s,
                                      metrics, DecodeLimits(max_header_bytes=STATUS_MAX_HEADER_BYTES), opts)
            except TimeoutError:
                continue
            if not reply.meta.get("passive"):
                return reply.meta
            passive = reply.meta
        if passive is None:
            raise TimeoutError(f"no broker answered within {timeout_s:.1f}s")
        return passive
    finally:
        if opts.monitor is not None:
            opts.monitor.close()
        ctx.term()


def _num(value: Any, spec: str, width: int) -> str:
    """``value`` formatted with ``spec``, or '-' when it is missing (None: e.g. a stage without a loss)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{'-':>{width}}"
    return f"{value:>{width}{spec}}"


def node_state(member: dict[str, Any]) -> str:
    """What ``ravq status`` shows: lost/missing/done, or for a node that is up what it does
    (alive = training, paused, catching-up, standby, finishing)."""
    if member.get("state") != "up":
        return str(member.get("state", "?"))
    phase = str(member.get("phase", "training"))
    return {"training": "alive", "catching_up": "catching-up", "starting": "alive"}.get(phase, phase)


def pair_lines(status: dict[str, Any]) -> list[str]:
    """Which broker of a Binary Star pair answered, its state and failovers, and its peer as it hears it."""
    pair = status.get("pair")
    if not isinstance(pair, dict):
        return []
    return [(f"broker: the {pair.get('role')} is {pair.get('state')} (term {pair.get('term')}, "
            f"{pair.get('failovers', 0)} failovers here); the other ({pair.get('peer_address')}) is "
            f"{pair.get('peer') or 'not heard'}, last heard {pair.get('peer_silent_s')}s ago")]


def format_status(status: dict[str, Any]) -> str:
    clusters = status.get("plan", {}).get("clusters", [])
    lines = [f"broker sequence {status.get('seq')}; run {status.get('run_id', '?')}; clusters: "
             + " | ".join(" -> ".join(c.get("nodes", [])) for c in clusters), *pair_lines(status)]
    for c, cs in enumerate(status.get("clusters", [])):
        why = f": {cs['reason']}" if cs.get("reason") else ""
        why += f" [{cs['note']}]" if cs.get("note") else ""
        lines.append(f"cluster {c}: {cs.get('state')} (generation {cs.get('generation', 0)}){why}")
    lines.append(
        f"{'node':<16}{'state':<12}{'c/s':<6}{'version':>8}{'samples':>9}{'busy':>7}{'stale':>7}{'loss':>8}"
        f"{'val':>8}{'age':>5}{'group':>8}  waiting"
    )
    freshest = max((v for m in status.get("members", {}).values()  # age: versions behind the freshest
                    if isinstance(v := (m.get("stats") or {}).get("version"), int)), default=0)
    for name, m in sorted(status.get("members", {}).items()):
        st = m.get("stats") or {}
        age = freshest - st["version"] if isinstance(st.get("version"), int) else None
        group = ",".join(str(c) for c in st.get("averaging_group") or []) or "-"  # the newest round's
        where = f"{st.get('cluster', '?')}/{st.get('stage', '?')}"
        lines.append(f"{name:<16}{node_state(m):<12}{where:<6}{_num(st.get('version'), 'd', 8)}"
                     f"{_num(st.get('samples'), 'd', 9)}{_num(st.get('busy_fraction'), '.2f', 7)}"
                     f"{_num(st.get('staleness_updates', st.get('staleness_mean')), '.2f', 7)}"
                     f"{_num(st.get('loss'), '.3f', 8)}"
                     f"{_num(st.get('eval_loss'), '.3f', 8)}{_num(age, 'd', 5)}{group:>8}"
                     f"  {waiting_text(st)}")
        if st.get("failure"):
            lines.append(f"{'':<16}failure: {st['failure']}")
        if st.get("asynchrony_warning"):
            cosine = _num(st.get("stale_cosine"), ".2f", 0).strip()
            lines.append(f"{'':<16}asynchrony hurts: stale and fresh gradients disagree (cosine {cosine}); "
                         "set training.max_inflight: 1 or a larger training.batch")
    lines += reach_lines(status)
    return "\n".join(lines)


def reach_lines(status: dict[str, Any]) -> list[str]:
    """Who is behind NAT (the broker's dial-back, or the topology) and which links go how (issue #24)."""
    reach = status.get("reach") or {}
    if not reach:
        return []
    behind = sorted(n for n, v in reach.items() if v != "reachable")
    lines = [(f"reachable: {', '.join(sorted(n for n, v in reach.items() if v == 'reachable')) or 'none'}; "
             f"behind NAT: {', '.join(behind) or 'none'}")]
    relayed: dict[tuple[str, str, str], str] = {}
    reversed_: set[tuple[str, str, str]] = set()
    for name, m in status.get("members", {}).items():
        routes = (m.get("stats") or {}).get("routes") or {}
        for socket, peers in routes.items() if isinstance(routes, dict) else ():
            for peer, how in peers.items() if isinstance(peers, dict) else ():
                lo, hi = sorted((str(name), str(peer)))
                key = (str(socket), lo, hi)
                if str(how).startswith("relay:"):
                    relayed[key] = str(how)[len("relay:"):]
                elif how in ("accept", "dial"):
                    reversed_.add(key)
    for (socket, a, b), relay in sorted(relayed.items()):
        lines.append(f"relayed {socket} link {a} <-> {b} via {relay}")
    if reversed_:
        lines.append(f"{len(reversed_)} link(s) dialled from behind NAT: "
                     + ", ".join(f"{s} {a}<->{b}" for s, a, b in sorted(reversed_)))
    return lines


def waiting_text(stats: dict[str, Any]) -> str:
    """Share of the stage's time spent waiting, by reason, largest first ("averaging 0.55 input 0.10"):
    busy is compute only, so busy plus these is about 1."""
    wall, waits = stats.get("wall_s") or 0.0, stats.get("wait_s") or {}
    if wall <= 0:
        return "-"
    shares = sorted(((s / wall, r) for r, s in waits.items() if s / wall >= 0.005), reverse=True)
    return " ".join(f"{r} {share:.2f}" for share, r in shares) or "-"


def status_once(topology: Topology, key_dir: Path | None, timeout_s: float = 2.0) -> dict[str, Any] | None:
    """The broker's status, or None when it did not answer in ``timeout_s`` (the demo polls it)."""
    try:
        return asyncio.run(fetch_status(topology, timeout_s, str(key_dir) if key_dir else None))
    except (TimeoutError, OSError):
        return None
