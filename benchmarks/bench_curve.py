"""First rounds and CURVE: ravq's ring over ZeroMQ, plaintext and CURVE, beside gloo, same processes (issue #26).

4 OS processes average one float32 tensor (default 100 MB) with ravq's float32 ring
(ravq.average.ring.ring_allreduce over ravq.net.transport Inbox/Outlink, as a node's RingPort wires it)
on several socket sets made side by side in every process, and with gloo's all_reduce:

  plain        plaintext, 1 ZeroMQ I/O thread (a node's context), ring pieces of --piece-mb (a node's 4 MiB)
  curve        CURVE (libsodium, every frame encrypted by ZeroMQ's I/O thread), same pieces
  curve_small  the curve sockets, pieces of --small-piece-kb (each frame's copies and encryption stay in cache)
  curve_io2    CURVE on a context with 2 I/O threads (sending and receiving connections encrypt in parallel)
  cold_plain / cold_curve   sockets made right before their first round (what a round pays when its links
               were not connected beforehand: the TCP connect and handshake)

Every socket set but the cold ones is connected when the process starts, as a node connects its ring
links when it knows its plan (ravq.node.ring_port.RingPort).  The first round of each set is timed
(``first``), then --repeats rounds of each, interleaved, whose median is ``steady``; a round's time is
the slowest process's.  Printed in one run: first / steady for every ravq set and for gloo; CURVE over
plaintext throughput (plain's steady time over the CURVE set's); the CPU seconds per GB averaged.

Loopback by default; ``--link-mbit R`` puts every process in its own network namespace with a tc tbf
uplink of R Mbit/s (benchmarks/_netns.py; needs root), as bench_allreduce.py does.

    python benchmarks/bench_curve.py [--mb 100] [--repeats 3] [--link-mbit R] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _netns
import torch
from bench_allreduce import ZmqRingLink, cpu_seconds, free_ports, pump

from ravq.average.mailbox import Mailbox
from ravq.average.ring import ring_allreduce
from ravq.config import TrainingConfig

WORLD = 4
SETS = ("plain", "curve", "curve_io2")
"""Socket sets connected at start-up; curve_small rides on curve's sockets."""
COLD = ("cold_plain", "cold_curve")
TIMED = ("plain", "curve", "curve_small", "curve_io2")


class SocketSet:
    """One process's ring sockets of one kind: a bound ROUTER, a DEALER to every peer, a mailbox, a reader."""

    def __init__(self, ctx: Any, rank: int, port: list[int], hosts: list[str], curve: Any) -> None:
        from ravq.metrics import Metrics
        from ravq.net.options import SocketOptions, endpoint
        from ravq.net.transport import Inbox, Outlink
        from ravq.net.wire import DecodeLimits

        me, metrics, limits = f"n{rank}", Metrics(f"n{rank}"), DecodeLimits()
        opts = SocketOptions(linger_ms=0, curve=curve)
        self.inbox = Inbox.bind(ctx, endpoint(hosts[rank], port[rank]), "ring", metrics, limits, opts)
        self.outlinks = {f"n{r}": Outlink.connect(ctx, endpoint(hosts[r], port[r]), "ring", f"n{r}", metrics,
                                                  limits, opts, identity=me) for r in range(WORLD) if r != rank}
        self.link, self.mailbox = ZmqRingLink(me, self.outlinks), Mailbox()

    def close(self) -> None:
        for sock in (self.inbox, *self.outlinks.values()):
            sock.close()


class Worker:
    def __init__(self, rank: int, args: argparse.Namespace, ports: dict[str, list[int]], hosts: list[str],
                 keys: dict[str, tuple[str, str]]) -> None:
        import torch.distributed as dist
        self.dist, self.rank, self.args, self.ports, self.hosts = dist, rank, args, ports, hosts
        self.me, self.members = f"n{rank}", [f"n{r}" for r in range(WORLD)]
        self.keys, self.round_id = keys, 0
        self.x = torch.randn(int(args.mb * 1e6) // 4, generator=torch.Generator().manual_seed(rank))
        self.buf = torch.empty_like(self.x)
        self.sets: dict[str, SocketSet] = {}
        self.contexts: list[Any] = []
        self.curves: list[Any] = []
        self.tg: asyncio.TaskGroup | None = None
        self.readers: list[asyncio.Task[Any]] = []

    def make_set(self, name: str) -> SocketSet:
        import zmq.asyncio

        from ravq.metrics import Metrics
        from ravq.net.security import Curve
        ctx = zmq.asyncio.Context(io_threads=2 if name.endswith("io2") else 1)
        self.contexts.append(ctx)
        curve = None
        if "curve" in name:
            publics = {n: k[0] for n, k in self.keys.items()}
            curve = Curve(name=self.me, public=self.keys[self.me][0], secret=self.keys[self.me][1], peers=publics,
                          metrics=Metrics(self.me))
            self.curves.append(curve)
        made = self.sets[name] = SocketSet(ctx, self.rank, self.ports[name], self.hosts, curve)
        assert self.tg is not None
        self.readers.append(self.tg.create_task(pump(made.inbox, made.mailbox)))
        if curve is not None:
            self.readers.append(self.tg.create_task(curve.serve_zap()))
        return made

    async def ring(self, name: str) -> tuple[float, float]:
        """(wall, CPU) seconds of one round on socket set ``name`` (made now if it is a cold one)."""
        self.buf.copy_(self.x)
        self.dist.barrier()
        t0, c0 = time.perf_counter(), cpu_seconds()
        sockets = self.sets.get("curve" if name == "curve_small" else name) or self.make_set(name)
        piece = int(self.args.small_piece_kb * 1024) if name == "curve_small" else int(self.args.piece_mb * (1 << 20))
        self.round_id += 1
        await ring_allreduce(self.buf, ring_id=0, round_id=self.round_id, members=self.members, me=self.me,
                             link=sockets.link, mailbox=sockets.mailbox, piece_bytes=piece, timeout_s=120.0,
                             inplace=True)
        return time.perf_counter() - t0, cpu_seconds() - c0

    def gloo(self) -> tuple[float, float]:
        self.buf.copy_(self.x)
        self.dist.barrier()
        t0, c0 = time.perf_counter(), cpu_seconds()
        self.dist.all_reduce(self.buf)
        self.buf /= WORLD
        return time.perf_counter() - t0, cpu_seconds() - c0

    async def run(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with asyncio.TaskGroup() as self.tg:
            for name in SETS:  # connected at start-up, as a node's RingPort is
                self.make_set(name)
            self.dist.barrier()
            out["first_gloo"] = self.gloo()
            for name in (*TIMED, *COLD):
                out[f"first_{name}"] = await self.ring(name)
            reference = self.buf.clone()
            for name in ("gloo", *TIMED):
                out[name] = []
            for _ in range(self.args.repeats):
                out["gloo"].append(self.gloo())
                for name in TIMED:
                    out[name].append(await self.ring(name))
                    out.setdefault(f"diff_{name}", 0.0)
                    out[f"diff_{name}"] = max(out[f"diff_{name}"], float((self.buf - reference).abs().max()))
            self.dist.barrier()  # nobody closes sockets while a peer may still read from them
            for task in self.readers:
                task.cancel()
        for made in self.sets.values():
            made.close()
        for curve in self.curves:
            curve.close()
        for ctx in self.contexts:
            ctx.term()
        return out


def worker(rank: int, args: argparse.Namespace, ports: dict[str, list[int]], keys: dict[str, tuple[str, str]],
           results: Any, links: list[_netns.Link] | None) -> None:
    if links is not None:
        _netns.join_netns(links[rank])
        os.environ["GLOO_SOCKET_IFNAME"] = links[rank].ifname
    hosts = [link.address for link in links] if links is not None else ["127.0.0.1"] * WORLD
    import torch.distributed as dist

    from ravq.net.socket_io import install_uvloop
    from ravq.tuning import tune_process

    torch.set_num_threads(1)
    tune_process()
    install_uvloop()
    dist.init_process_group("gloo", init_method=f"tcp://{hosts[0]}:{ports['gloo'][0]}", rank=rank, world_size=WORLD)
    try:
        results.put((rank, asyncio.run(Worker(rank, args, ports, hosts, keys).run())))
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, links: list[_netns.Link] | None) -> dict[int, dict[str, Any]]:
    import zmq
    names = ("gloo", *SETS, *COLD)
    flat = free_ports(len(names) * WORLD)
    ports = {n: flat[i * WORLD:(i + 1) * WORLD] for i, n in enumerate(names)}
    keys = {f"n{r}": tuple(k.decode() for k in zmq.curve_keypair()) for r in range(WORLD)}
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, ports, keys, results, links), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        return dict(results.get(timeout=args.timeout_s) for _ in range(WORLD))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def summarize(reports: dict[int, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    def slowest(key: str, i: int | None = None) -> float:
        return max((r[key] if i is None else r[key][i])[0] for r in reports.values())

    def steady(key: str) -> float:
        return statistics.median(slowest(key, i) for i in range(args.repeats))

    gb = int(args.mb * 1e6) // 4 * 4 / 1e9
    out: dict[str, Any] = {"mb": args.mb, "repeats": args.repeats, "link_mbit": args.link_mbit,
                           "piece_mb": args.piece_mb, "small_piece_kb": args.small_piece_kb}
    for name in ("gloo", *TIMED):
        out[f"{name}_first_s"], out[f"{name}_steady_s"] = slowest(f"first_{name}"), steady(name)
        out[f"{name}_first_over_steady"] = out[f"{name}_first_s"] / out[f"{name}_steady_s"]
        cpu = statistics.median(sum(r[name][i][1] for r in reports.values()) for i in range(args.repeats))
        out[f"{name}_cpu_s_per_gb"] = cpu / gb
    for name in COLD:
        out[f"{name}_first_s"] = slowest(f"first_{name}")
        out[f"{name}_first_over_steady"] = out[f"{name}_first_s"] / out[f"{name.removeprefix('cold_')}_steady_s"]
    for name in ("curve", "curve_small", "curve_io2"):
        out[f"{name}_over_plain_throughput"] = out["plain_steady_s"] / out[f"{name}_steady_s"]
    out["max_abs_diff"] = max(r.get(f"diff_{n}", 0.0) for r in reports.values() for n in TIMED)
    return out


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=100.0, help="tensor size in MB (float32; default 100)")
    parser.add_argument("--repeats", type=int, default=3)
    node_piece_mb = TrainingConfig.model_fields["ring_chunk_bytes"].default / (1 << 20)
    parser.add_argument("--piece-mb", type=float, default=node_piece_mb, help="ring piece in MiB (a node's default)")
    parser.add_argument("--small-piece-kb", type=float, default=256.0, help="curve_small's ring piece in KiB")
    parser.add_argument("--link-mbit", type=float, default=None, metavar="R",
                        help="each process in its own network namespace, uplink shaped to R Mbit/s (root)")
    parser.add_argument("--netns-prefix", default="rqc")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--quick", action="store_true", help="a smoke run (4 MB, 1 repeat)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if args.quick:
        args.mb, args.repeats = 4.0, 1
    if args.repeats < 1 or args.mb <= 0:
        parser.error("--repeats and --mb must be positive")
    if args.link_mbit is None:
        reports = run(args, None)
    else:
        if reason := _netns.unavailable_reason():
            sys.exit(f"bench_curve.py: --link-mbit needs root, ip netns and tc tbf: {reason}")
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        with _netns.shaped_links(WORLD, args.link_mbit, args.netns_prefix) as links:
            reports = run(args, links)
    s = summarize(reports, args)
    where = "loopback" if args.link_mbit is None else f"{args.link_mbit:g} Mbit/s tbf links"
    print(f"{args.mb:g} MB float32, {WORLD} processes, {where}, median of {args.repeats}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"  {'':12} {'first s':>8} {'steady s':>9} {'first/steady':>13} {'CPU s/GB':>9} {'/plain thr.':>11}")
    for name in ("gloo", *TIMED):
        ratio = f"{s[f'{name}_over_plain_throughput']:11.3f}" if f"{name}_over_plain_throughput" in s else " " * 11
        print(f"  {name:12} {s[f'{name}_first_s']:8.3f} {s[f'{name}_steady_s']:9.3f} "
              f"{s[f'{name}_first_over_steady']:13.2f} {s[f'{name}_cpu_s_per_gb']:9.2f} {ratio}")
    for name in COLD:
        print(f"  {name:12} {s[f'{name}_first_s']:8.3f} {'':9} {s[f'{name}_first_over_steady']:13.2f}   "
              f"(links made right before the round)")
    print(f"  max |average - first average| over all sets: {s['max_abs_diff']:.1e}")
    if args.json:
        print(json.dumps(s))


if __name__ == "__main__":
    main()
