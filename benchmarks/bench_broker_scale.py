"""The broker at scale (issue #37): N emulated members against a real broker process, this tree's broker
and another tree's (today's code, e.g. ``git worktree add /tmp/ravq/old d9fc8b3``) in the same run.

Each emulated member has its own sockets to the broker (a DEALER and a SUB, CURVE on, its own key), many
per process; it registers, follows the published state as a node does (sequence numbers, snapshots on a
gap) without applying it, and sends a heartbeat every interval like a training node's, with its
checkpoints (three points, a new one every ``--checkpoint-s``).  Nothing trains.  Printed per tree and
size, over a window after every member joined: the broker's CPU (cores), PUB bytes per second (what
all SUBs received), the largest frame a SUB received, and the worst member's staleness: the longest a
member went without knowing its view current (new: a tick of the global topic with the number it holds,
or a snapshot; old: a full-state update), sampled twice a second.  The load average is printed beside.

    python benchmarks/bench_broker_scale.py --members 1000 10000 --old /tmp/ravq/old [--window-s 30]

Run timed figures under ``flock /tmp/ravq/bench.lock``.  Each tree's code runs from its own checkout
(its broker and its members' wire), so the emulator below uses only what both trees share
(``ravq.net.wire``, ``ravq.net.transport.Outlink``, ``ravq.net.pubsub.Subscriber``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
import zmq

REPO = Path(__file__).resolve().parents[1]
STAGES = 2


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _emulate(tree: str, topo_path: str, names: list[str], keys: dict[str, tuple[str, str]], broker_key: str,
             interval_s: float, checkpoint_s: float, join_by: float, end_at: float, window_at: float,
             old_header_bytes: int, max_subs: int, conn: Any) -> None:
    """One emulator process: ``names`` members; sends (bytes received, largest frame, worst staleness, joined,
    gaps) on ``conn`` at the end."""
    sys.path.insert(0, tree)
    import zmq.asyncio as zasync

    from ravq.config import load_topology
    from ravq.metrics import Metrics
    from ravq.net.options import SocketOptions, endpoint
    from ravq.net.protocol import Heartbeat, Register
    from ravq.net.pubsub import Subscriber
    from ravq.net.security import Curve
    from ravq.net.transport import Outlink
    from ravq.net.wire import DecodeLimits, Message, MsgType

    topology = load_topology(topo_path)
    new = "topics" in Subscriber.connect.__code__.co_varnames
    header = topology.limits.max_header_bytes if new else old_header_bytes
    limits = DecodeLimits(max_header_bytes=header, max_frames=topology.limits.max_frames)
    metrics = Metrics("node")
    b = topology.broker
    peers = {"broker": broker_key}
    stats = {"bytes": 0, "largest": 0, "stale": 0.0, "joined": 0, "gaps": 0, "late": 0}
    where = {n: int(n[1:]) // STAGES for n in names}
    views: dict[str, dict[str, Any]] = {}
    """Each joined member's view: when it last knew it current."""

    async def member(ctx: zasync.Context, name: str) -> None:
        public, secret = keys[name]
        opts = SocketOptions(linger_ms=0, curve=Curve(name=name, public=public, secret=secret, peers=peers,
                                                       metrics=metrics))
        topics = ["g.", f"c{where[name]}."]
        follows = int(name[1:]) < max_subs  # the broker's file limit: 20,000 with a DEALER each
        pub = endpoint(b.host, b.pub_port)
        sub = (None if not follows else Subscriber.connect(ctx, pub, metrics, limits, opts, topics) if new
               else Subscriber.connect(ctx, pub, metrics, limits, opts))
        link = Outlink.connect(ctx, endpoint(b.host, b.router_port), name, "broker", metrics, limits, opts,
                               identity=name)
        if sub is not None:
            sub._io = _Counting(sub._io, stats, window_at)  # every frame, before it is decoded (or dropped)
        held: dict[str, int] = {}
        state: dict[str, Any] = {"seq": -1, "incarnation": None, "synced": time.monotonic()}

        async def ask(kind: MsgType, meta: dict[str, Any]) -> None:
            await link.send(Message(type=kind, sender=name, meta=meta))
            while True:
                reply = await link.recv(60.0)
                if reply.type != MsgType.SNAPSHOT:
                    continue
                m = reply.meta
                if new:
                    if m["part"] == 0:
                        held.clear()
                        held.update(m["seqs"])
                        state["incarnation"] = m["incarnation"]
                    if m["part"] == m["parts"] - 1:
                        state["synced"] = time.monotonic()
                        return
                else:
                    state["seq"], state["incarnation"] = m["seq"], m["incarnation"]
                    state["synced"] = time.monotonic()
                    return

        incarnation = f"{name}-{random.random()}"
        await asyncio.sleep(random.uniform(0, max(0.0, join_by - time.time())))
        await ask(MsgType.REGISTER, Register(incarnation=incarnation).meta())
        stats["joined"] += 1
        if sub is not None:
            views[name] = state

        async def follow() -> None:
            while True:
                msg = await sub.recv()
                m = msg.meta
                if new:
                    topic, seq = m.get("topic"), m.get("seq")
                    if topic not in held:
                        continue
                    if m.get("kind") == "tick":
                        ok = seq <= held[topic] and m.get("incarnation") == state["incarnation"]
                        if seq == held[topic] and topic == "g.":
                            state["synced"] = time.monotonic()
                    elif seq <= held[topic]:
                        ok = True
                    else:
                        ok = seq == held[topic] + 1
                        if ok:
                            held[topic] = seq
                    if not ok:
                        stats["gaps"] += 1
                        await ask(MsgType.SNAPSHOT_REQ, {"mine": True})
                elif m.get("kind") != "silence" and isinstance(m.get("state"), dict) \
                        and m["seq"] > state["seq"]:
                    state["seq"], state["synced"] = m["seq"], time.monotonic()

        async def beat() -> None:
            points = [{"version": v, "trained": v, "window": 2} for v in (30, 20, 10)]
            next_point = time.monotonic() + random.uniform(0, checkpoint_s)
            await asyncio.sleep(random.uniform(0, interval_s))
            due = time.monotonic()
            while True:  # on a fixed cadence, as a node beats (ravq.node.membership.beat_on_cadence)
                if time.monotonic() >= next_point:
                    v = points[0]["version"] + 10
                    points = [{"version": v, "trained": v, "window": 2}, *points[:2]]
                    next_point += checkpoint_s
                hb = Heartbeat(incarnation=incarnation, phase="training", trained=points[0]["trained"],
                               stage_bytes=1 << 28, checkpoints=points,
                               stats={"loss": 2.5, "samples_per_s": 12.0, "rss_bytes": 1 << 30})
                await link.send(Message(type=MsgType.HEARTBEAT, sender=name, meta=hb.meta()))
                if time.time() >= window_at and time.monotonic() - due > 0.25 * interval_s:
                    stats["late"] += 1  # this emulator's loop was late: the broker may see it silent
                due = max(due + interval_s, time.monotonic())
                await asyncio.sleep(due - time.monotonic())

        async with asyncio.TaskGroup() as tg:
            if sub is not None:
                tg.create_task(follow())
            tg.create_task(beat())

    async def main() -> None:
        ctx = zasync.Context()
        ctx.set(zmq.MAX_SOCKETS, 65536)
        tasks = [asyncio.create_task(member(ctx, n)) for n in names]
        while time.time() < end_at:
            await asyncio.sleep(0.5)
            if time.time() >= window_at and views:
                now = time.monotonic()
                stats["stale"] = max(stats["stale"], max(now - v["synced"] for v in views.values()))
        for t in tasks:
            t.cancel()
        failed = [r for r in await asyncio.gather(*tasks, return_exceptions=True)
                  if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
        if failed:
            print(f"{len(failed)} members failed, e.g. {failed[0]!r}", file=sys.stderr)
        ctx.destroy(linger=0)

    asyncio.run(main())
    conn.send(stats)


class _Counting:
    """A SUB's socket reader that counts what arrives in the window (bytes, the largest frame)."""

    def __init__(self, io: Any, stats: dict[str, Any], window_at: float) -> None:
        self._io, self._stats, self._window_at = io, stats, window_at

    async def recv(self) -> list[Any]:
        frames = await self._io.recv()
        if time.time() >= self._window_at:
            sizes = [len(memoryview(f)) for f in frames]
            self._stats["bytes"] += sum(sizes)
            self._stats["largest"] = max(self._stats["largest"], *sizes)
        return frames

    def __getattr__(self, name: str) -> Any:
        return getattr(self._io, name)


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def measure(tree: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """One broker of ``tree`` and ``n`` emulated members; the window's figures."""
    from ravq.net.security import keygen

    tmp = Path(tempfile.mkdtemp(prefix="ravq-scale-"))
    key_dir = tmp / "keys"
    key_dir.mkdir(mode=0o700)
    broker_key = keygen("broker", key_dir)
    pairs = {f"m{i}": tuple(k.decode() for k in zmq.curve_keypair()) for i in range(n)}
    ports = _free_ports(2)
    nodes = [{"name": f"m{i}", "host": f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}", "pipeline_port": 5000,
              "ring_port": 5001,  # never dialled (reachable: true); distinct hosts, so no port is shared
              "reachable": True, "public_key": pairs[f"m{i}"][0], "cluster": i // STAGES, "stage": i % STAGES}
             for i in range(n)]
    topology = {"task": "tests.sgd_task", "nodes": nodes,
                "training": {"checkpoint_dir": str(tmp / "ckpt")},
                "broker": {"host": "127.0.0.1", "pub_port": ports[0], "router_port": ports[1],
                           "public_key": broker_key, "state_dir": str(tmp / "state")},
                "security": {"curve": True, "key_dir": str(key_dir)},
                "timeouts": {"heartbeat_interval_s": args.interval_s, "lost_s": 10 * args.interval_s}}
    path = tmp / "topology.yaml"
    path.write_text(yaml.safe_dump(topology))
    env = {**os.environ, "PYTHONPATH": tree}
    run_cli = "import sys; from ravq.cli.main import main; sys.exit(main())"
    with (tmp / "broker.log").open("w") as log:
        argv = [sys.executable, "-c", run_cli, "broker", "--topology", str(path), "--new-run"]
        broker = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=log)
    time.sleep(3.0)
    t0 = time.time()
    join_by, window_at = t0 + args.join_s, t0 + args.join_s + args.settle_s
    end_at = window_at + args.window_s
    names = [f"m{i}" for i in range(n)]
    spawn = mp.get_context("spawn")
    procs, conns = [], []
    per = -(-n // args.procs)
    for k in range(args.procs):
        mine = names[k * per:(k + 1) * per]
        parent, child = spawn.Pipe()
        proc = spawn.Process(target=_emulate, daemon=True, args=(
            tree, str(path), mine, {m: pairs[m] for m in mine}, broker_key, args.interval_s,
            args.checkpoint_s, join_by, end_at, window_at, args.old_header_kib * 1024, args.max_subs, child))
        proc.start()
        procs.append(proc)
        conns.append(parent)
    time.sleep(max(0.0, window_at - time.time()))
    cpu0, w0 = _cpu_s(broker.pid), time.time()
    time.sleep(max(0.0, end_at - time.time()))
    cpu1, w1 = _cpu_s(broker.pid), time.time()
    load = Path("/proc/loadavg").read_text().split()[0]
    lost = {"bytes": 0, "largest": 0, "stale": float("inf"), "joined": 0, "gaps": 0, "late": 0}
    stats = [c.recv() if c.poll(120) else lost for c in conns]
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    broker.terminate()
    try:
        broker.wait(20)
    except subprocess.TimeoutExpired:
        broker.kill()
    seconds = w1 - w0
    return {"tree": tree, "members": n, "subscribers": min(n, args.max_subs),
            "joined": sum(s["joined"] for s in stats), "broker_cores": (cpu1 - cpu0) / seconds,
            "pub_mb_s": sum(s["bytes"] for s in stats) / seconds / 1e6,
            "largest_frame_kib": max(s["largest"] for s in stats) / 1024,
            "worst_stale_intervals": max(s["stale"] for s in stats) / args.interval_s,
            "gaps": sum(s["gaps"] for s in stats), "late_beats": sum(s["late"] for s in stats),
            "loadavg": float(load), "window_s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--old", help="a checkout of the code to compare with (e.g. a worktree of d9fc8b3)")
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("--checkpoint-s", type=float, default=30.0)
    parser.add_argument("--join-s", type=float, default=20.0, help="members join spread over this")
    parser.add_argument("--settle-s", type=float, default=10.0)
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--procs", type=int, default=4, help="emulator processes")
    parser.add_argument("--old-header-kib", type=int, default=64 * 1024,
                        help="the old tree's members decode headers up to this (a node's 64 KiB drops the "
                             "whole-state updates past ~245 members: they never join; this measures its "
                             "broker)")
    parser.add_argument("--max-subs", type=int, default=9800,
                        help="members past this many send heartbeats only (the broker may hold 20,000 files)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    rows = []
    for n in args.members:
        for tree in [str(REPO), *([args.old] if args.old else [])]:
            r = measure(tree, n, args)
            rows.append(r)
            label = "new" if tree == str(REPO) else "old"
            print(f"{label} {n:>6} members ({r['subscribers']} subscribed, {r['joined']} joined): "
                  f"broker {r['broker_cores']:.3f} cores, "
                  f"PUB {r['pub_mb_s']:.2f} MB/s, largest frame {r['largest_frame_kib']:.1f} KiB, worst view "
                  f"{r['worst_stale_intervals']:.2f} intervals stale, {r['gaps']} gaps, "
                  f"{r['late_beats']} late beats  "
                  f"[load {r['loadavg']:.2f}, window {r['window_s']:.0f}s]", flush=True)
    for n in args.members:
        new, old = ([r for r in rows if r["members"] == n and (r["tree"] == str(REPO)) == want]
                    for want in (True, False))
        if new and old:
            a, b = new[0], old[0]
            cpu = b["broker_cores"] / max(a["broker_cores"], 1e-9)
            print(f"{n} members, old/new: broker CPU {cpu:.1f}x, "
                  f"PUB {b['pub_mb_s'] / max(a['pub_mb_s'], 1e-9):.1f}x")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
