"""Ring all-reduce: ravq over ZeroMQ against torch.distributed.all_reduce on gloo, same processes.

(a) One float32 tensor (100 MB) averaged by 4 OS processes, alternately by gloo (all_reduce SUM) and by
    ravq's ring_allreduce with real ZeroMQ ring links (ravq.net.transport Inbox/Outlink on loopback,
    RING_CHUNK messages through ravq.net.wire).  A repeat's time is the slowest process's; the figure is
    the median over repeats.  ``ratio_ravq_over_gloo`` <= 1.0 means ravq is at least as fast.
(b) The same 4 processes as 2 clusters x 2 stages: two rings of 2, each averaging half the tensor, run
    at once; their aggregate bytes/s over one ring averaging one half alone.

Compressed rings (``--compress bf16 int8``, the default): in every repeat of (a), after gloo and the
float32 ring, the same processes average the same tensor with ravq.average.ring_compression's ring in each format
(pieces compressed on every hop; a first round, so no residual from an earlier one), timed the same way;
``ratio_<format>_over_gloo`` is its time over gloo's float32 time, ``max_rel_diff_<format>_vs_gloo`` how
far its average is from gloo's, over the largest value.

Every process is tuned as a node tunes itself (``ravq.tuning.tune_process``), which helps gloo alike.

By default all traffic crosses loopback, and on a 2-core machine the 4 processes are CPU-bound.  With
``--link-mbit R`` every process runs in a network namespace of its own, joined to a bridge by a veth
pair whose egress (the process's upload) is shaped by tc tbf to R Mbit/s (benchmarks/_netns.py): ravq's
ring sockets and gloo (GLOO_SOCKET_IFNAME) both use that link, so the links decide, as between PCs on
a switch.  Part (b) runs over the same links (each ring member's own uplink, so two rings should not
slow each other).  Needs root, ``ip netns`` and tc tbf.  Unless --mb / --repeats are given, the
repeats (3-5) and if need be the size are cut so a shaped run's transfers take about 150 s
(SHAPED_BUDGET_S); what was used is printed.  The namespaces are deleted on exit, also on Ctrl-C.
Busy is the whole machine's (all cores, other jobs included, /proc/stat) during rank 0's rounds.

    python benchmarks/bench_allreduce.py [--mb 100] [--repeats 5] [--piece-mb MiB] [--link-mbit R]
                                         [--compress [bf16] [int8]] [--netns-prefix P] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import resource
import signal
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _netns
import torch

from ravq.average.mailbox import Mailbox, received_piece
from ravq.average.ring import ring_allreduce
from ravq.average.ring_compression import compressed_ring_allreduce
from ravq.average.rounds import average_segments
from ravq.average.segments import plan_segments, segments_for
from ravq.codec.compress import Format
from ravq.config import TrainingConfig

WORLD = 4
DEFAULT_MB, DEFAULT_REPEATS, MIN_SHAPED_REPEATS = 100.0, 5, 3
SHAPED_BUDGET_S = 150.0
"""Seconds a shaped run's transfers may take at the links' rate (plus ~10-20 s of start-up)."""


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot (/proc/stat): the whole machine, other jobs too."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def busy_since(start: tuple[int, int]) -> float:
    """Fraction of all cores' time spent busy since ``start`` (machine_ticks)."""
    busy, total = machine_ticks()
    return (busy - start[0]) / max(1, total - start[1])


class ZmqRingLink:
    """The node's side of ring traffic, as the node would wire it: one DEALER per peer."""

    def __init__(self, me: str, outlinks: dict[str, Any]) -> None:
        self.me, self.outlinks = me, outlinks

    async def send(self, peer: str, meta: dict[str, int], tensor: Any) -> None:
        from ravq.node.ring_port import ring_chunk
        await self.outlinks[peer].send(ring_chunk(self.me, meta, tensor))

    async def send_abort(self, peer: str, ring_id: int, round_id: int, reason: str) -> None:
        from ravq.net.wire import Message, MsgType
        await self.outlinks[peer].send(Message(type=MsgType.RING_ABORT, sender=self.me,
                                               meta={"ring": ring_id, "round": round_id, "reason": reason}))


async def pump(inbox: Any, mailbox: Mailbox) -> None:
    """The ring socket's one reader: every RING_CHUNK / RING_ABORT goes to the mailbox."""
    from ravq.net.wire import MsgType
    while True:
        _, msg = await inbox.recv()
        if msg.type is MsgType.RING_CHUNK:
            piece = received_piece(msg.meta, msg.tensors, msg.packed)
            assert piece is not None
            mailbox.deliver(msg.sender, msg.meta, piece)
        elif msg.type is MsgType.RING_ABORT:
            mailbox.deliver_abort(msg.sender, msg.meta["ring"], msg.meta["round"], str(msg.meta.get("reason", "")))


class Bench:
    def __init__(self, rank: int, args: argparse.Namespace, link: ZmqRingLink, mailbox: Mailbox) -> None:
        import torch.distributed as dist
        self.dist, self.rank, self.args, self.link, self.mailbox = dist, rank, args, link, mailbox
        self.me, self.members = f"n{rank}", [f"n{r}" for r in range(WORLD)]
        self.round_id = 0
        self.numel = int(args.mb * 1e6) // 4
        self.x = torch.randn(self.numel, generator=torch.Generator().manual_seed(rank))
        self.buf = torch.empty_like(self.x)
        self.out, self.residual = torch.empty_like(self.x), torch.empty_like(self.x)
        self.piece_bytes = int(args.piece_mb * (1 << 20))

    def next_round(self) -> int:
        self.round_id += 1
        return self.round_id

    async def time_ring(self, members: list[str]) -> tuple[float, float, float]:
        """(wall, CPU) seconds of one ravq round on this process, CPU counting every thread (ZeroMQ's too),
        and the machine's busy fraction meanwhile."""
        self.buf.copy_(self.x)
        self.dist.barrier()
        m0, t0, c0 = machine_ticks(), time.perf_counter(), cpu_seconds()
        await ring_allreduce(self.buf, ring_id=0, round_id=self.next_round(), members=members, me=self.me,
                             link=self.link, mailbox=self.mailbox, piece_bytes=self.piece_bytes,
                             timeout_s=60.0, inplace=True)
        return time.perf_counter() - t0, cpu_seconds() - c0, busy_since(m0)

    async def time_compressed(self, fmt: Format) -> tuple[float, float, float, torch.Tensor]:
        """As time_ring, with pieces sent compressed (ravq.average.ring_compression; a first round: no residual)."""
        self.buf.copy_(self.x)
        self.dist.barrier()
        m0, t0, c0 = machine_ticks(), time.perf_counter(), cpu_seconds()
        out, _ = await compressed_ring_allreduce(
            self.buf, ring_id=0, round_id=self.next_round(), members=self.members, me=self.me, link=self.link,
            mailbox=self.mailbox, piece_bytes=self.piece_bytes, timeout_s=60.0, fmt=fmt, out=self.out,
            residual=self.residual)  # buffers kept from round to round, as a node's RingCompression keeps them
        return time.perf_counter() - t0, cpu_seconds() - c0, busy_since(m0), out

    def time_gloo(self, divide: bool) -> tuple[float, float, float]:
        self.buf.copy_(self.x)
        self.dist.barrier()
        m0, t0, c0 = machine_ticks(), time.perf_counter(), cpu_seconds()
        self.dist.all_reduce(self.buf)
        if divide:
            self.buf /= WORLD
        return time.perf_counter() - t0, cpu_seconds() - c0, busy_since(m0)

    async def phase_a(self) -> dict[str, Any]:
        await self.time_ring(self.members)  # warm-up: connections, allocations
        self.time_gloo(True)
        formats = [Format(f) for f in self.args.compress]
        for fmt in formats:
            await self.time_compressed(fmt)
        out: dict[str, Any] = {k: [] for k in ("ravq", "gloo", "gloo_avg", "ravq_cpu", "gloo_cpu",
                                               "ravq_busy", "gloo_busy")}
        results: dict[str, torch.Tensor] = {}
        for fmt in formats:
            out.update({fmt.value: [], f"{fmt.value}_cpu": [], f"{fmt.value}_busy": []})
        for _ in range(self.args.repeats):
            for fmt in formats:  # compressed rounds first: the plain ring's result is kept below
                wall, cpu, busy, result = await self.time_compressed(fmt)
                out[fmt.value].append(wall)
                out[f"{fmt.value}_cpu"].append(cpu)
                out[f"{fmt.value}_busy"].append(busy)
                results[fmt.value] = result.clone()
            wall, cpu, busy = self.time_gloo(False)
            out["gloo"].append(wall)
            out["gloo_cpu"].append(cpu)
            out["gloo_busy"].append(busy)
            out["gloo_avg"].append(self.time_gloo(True)[0])
            wall, cpu, busy = await self.time_ring(self.members)
            out["ravq"].append(wall)
            out["ravq_cpu"].append(cpu)
            out["ravq_busy"].append(busy)
        ravq_result = self.buf.clone()
        self.time_gloo(True)
        diff = float((ravq_result - self.buf).abs().max()) if self.numel else 0.0
        for name, result in results.items():
            out[f"{name}_diff"] = float((result - self.buf).abs().max()) if self.numel else 0.0
        out["average_abs_max"] = float(self.buf.abs().max()) if self.numel else 0.0
        return {**out, "diff": diff}

    async def phase_b(self) -> dict[str, Any]:
        half = self.numel // 2
        owners = [{"seg0": "n0", "seg1": "n1"}, {"seg0": "n2", "seg1": "n3"}]  # 2 clusters x 2 stages
        segments = plan_segments(["seg0", "seg1"], [half, self.numel - half], owners)
        mine = segments_for(self.me, segments)
        halves = {0: self.buf[:half], 1: self.buf[half:]}
        out: dict[str, list[float]] = {"single": [], "parallel": []}
        for _ in range(self.args.repeats + 1):
            self.buf.copy_(self.x)
            self.dist.barrier()
            t0 = time.perf_counter()
            if self.me in segments[0].ring:  # ring 0 alone; the other two processes stay idle
                await ring_allreduce(halves[0], ring_id=0, round_id=self.next_round(), members=list(segments[0].ring),
                                     me=self.me, link=self.link, mailbox=self.mailbox,
                                     piece_bytes=self.piece_bytes, timeout_s=60.0, inplace=True)
            out["single"].append(time.perf_counter() - t0)
            self.buf.copy_(self.x)
            self.dist.barrier()
            t0 = time.perf_counter()
            result = await average_segments({s.ring_id: halves[s.ring_id] for s in mine}, mine, me=self.me,
                                            round_id=self.next_round(), link=self.link, mailbox=self.mailbox,
                                            piece_bytes=self.piece_bytes, timeout_s=60.0, inplace=True)
            assert not result.aborted, result.aborted
            out["parallel"].append(time.perf_counter() - t0)
        return {k: v[1:] for k, v in out.items()}  # the first repeat warms up the new rings


async def run_worker(rank: int, args: argparse.Namespace, ports: list[int], hosts: list[str]) -> dict[str, Any]:
    import zmq
    import zmq.asyncio

    from ravq.metrics import Metrics
    from ravq.net.options import SocketOptions, endpoint
    from ravq.net.transport import Inbox, Outlink
    from ravq.net.wire import DecodeLimits

    ctx, metrics, limits, opts = zmq.asyncio.Context(), Metrics(f"n{rank}"), DecodeLimits(), SocketOptions()
    inbox = Inbox.bind(ctx, endpoint(hosts[rank], ports[rank]), "ring", metrics, limits, opts)
    outlinks = {f"n{r}": Outlink.connect(ctx, endpoint(hosts[r], ports[r]), "ring", f"n{r}", metrics, limits,
                                         opts, identity=f"n{rank}") for r in range(WORLD) if r != rank}
    mailbox = Mailbox()
    bench = Bench(rank, args, ZmqRingLink(f"n{rank}", outlinks), mailbox)
    try:
        async with asyncio.TaskGroup() as tg:
            reader = tg.create_task(pump(inbox, mailbox))
            report = await bench.phase_a()
            report.update(await bench.phase_b())
            bench.dist.barrier()  # nobody closes sockets while a peer may still read from them
            reader.cancel()
    finally:
        sockets: list[Any] = [inbox, *outlinks.values()]
        for sock in sockets:
            sock.sock.setsockopt(zmq.LINGER, 0)
            sock.close()
        ctx.term()
    report["stale_dropped"] = mailbox.stale_dropped
    return report


def worker(rank: int, args: argparse.Namespace, ports: list[int], results: Any,
           links: list[_netns.Link] | None) -> None:
    if links is not None:  # first, before any socket or thread: they stay in the namespace they began in
        _netns.join_netns(links[rank])
        os.environ["GLOO_SOCKET_IFNAME"] = links[rank].ifname
    hosts = [link.address for link in links] if links is not None else ["127.0.0.1"] * WORLD

    import torch.distributed as dist

    from ravq.net.socket_io import install_uvloop
    from ravq.tuning import tune_process

    torch.set_num_threads(1)
    if not args.no_tuning:
        tune_process()
    install_uvloop()
    dist.init_process_group("gloo", init_method=f"tcp://{hosts[0]}:{ports[-1]}", rank=rank, world_size=WORLD)
    try:
        results.put((rank, asyncio.run(run_worker(rank, args, ports, hosts))))
    finally:
        dist.destroy_process_group()


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [int(s.getsockname()[1]) for s in socks]
    for s in socks:
        s.close()
    return ports


def slowest_median(reports: dict[int, dict[str, Any]], key: str, ranks: list[int] | None = None) -> float:
    """Median over repeats of the slowest process's time: a collective ends when its last member does."""
    ranks = ranks if ranks is not None else list(reports)
    return statistics.median(max(reports[r][key][i] for r in ranks) for i in range(len(reports[ranks[0]][key])))


def total_median(reports: dict[int, dict[str, Any]], key: str) -> float:
    """Median over repeats of the CPU seconds all processes spent together."""
    return statistics.median(sum(r[key][i] for r in reports.values()) for i in range(len(reports[0][key])))


def summarize(reports: dict[int, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    numel = int(args.mb * 1e6) // 4
    ravq_cpu, gloo_cpu = total_median(reports, "ravq_cpu"), total_median(reports, "gloo_cpu")
    ravq, gloo, gloo_avg = (slowest_median(reports, k) for k in ("ravq", "gloo", "gloo_avg"))
    single = slowest_median(reports, "single", [0, 2])
    parallel = slowest_median(reports, "parallel")
    cores = os.cpu_count() or 1
    return {
        "link_mbit": args.link_mbit,
        "tensor_bytes": numel * 4, "processes": WORLD, "piece_bytes": int(args.piece_mb * (1 << 20)),
        "repeats": args.repeats, "tuned": not args.no_tuning, "ravq_ring_s": ravq, "gloo_s": gloo, "gloo_with_divide_s": gloo_avg,
        "ratio_ravq_over_gloo": ravq / gloo, "ratio_ravq_over_gloo_with_divide": ravq / gloo_avg,
        "ravq_bus_bytes_per_s": 2 * (WORLD - 1) / WORLD * numel * 4 / ravq,
        "ravq_cpu_s": ravq_cpu, "gloo_cpu_s": gloo_cpu, "cpu_ratio_ravq_over_gloo": ravq_cpu / gloo_cpu,
        "cores": cores, "ravq_cpu_share_of_cores": ravq_cpu / (ravq * cores),
        "gloo_cpu_share_of_cores": gloo_cpu / (gloo * cores),
        "machine_busy_ravq": statistics.median(reports[0]["ravq_busy"]),
        "machine_busy_gloo": statistics.median(reports[0]["gloo_busy"]),
        "max_abs_diff_vs_gloo": max(r["diff"] for r in reports.values()),
        "single_ring_s": single, "parallel_rings_s": parallel,
        "single_ring_bytes_per_s": (numel // 2) * 4 / single, "parallel_rings_bytes_per_s": numel * 4 / parallel,
        "parallel_over_single": (numel * 4 / parallel) / ((numel // 2) * 4 / single),
        "stale_dropped": sum(r["stale_dropped"] for r in reports.values()),
        **compressed_summary(reports, args, gloo, gloo_cpu),
    }


def compressed_summary(reports: dict[int, dict[str, Any]], args: argparse.Namespace, gloo: float,
                       gloo_cpu: float) -> dict[str, Any]:
    """Per compression format: time, ratio to gloo's float32 time, CPU, and how far from gloo's average."""
    out: dict[str, Any] = {"compress": list(args.compress)}
    for fmt in args.compress:
        wall, cpu = slowest_median(reports, fmt), total_median(reports, f"{fmt}_cpu")
        diff = max(r[f"{fmt}_diff"] for r in reports.values())
        out.update({f"ravq_{fmt}_s": wall, f"ratio_{fmt}_over_gloo": wall / gloo, f"ravq_{fmt}_cpu_s": cpu,
                    f"cpu_ratio_{fmt}_over_gloo": cpu / gloo_cpu,
                    f"machine_busy_{fmt}": statistics.median(reports[0][f"{fmt}_busy"]),
                    f"max_abs_diff_{fmt}_vs_gloo": diff,
                    f"max_rel_diff_{fmt}_vs_gloo": diff / max(r["average_abs_max"] for r in reports.values())})
    return out


COMPRESSED_SHARE = {"bf16": 0.5, "int8": (1 + 4 / 128) / 4}
"""Bytes of a compressed round over a float32 one."""


def transfer_seconds(mb: float, repeats: int, rate_mbit: float, compress: tuple[str, ...] = ()) -> float:
    """A run's time on the links alone: each process uploads 2(C-1)/C of the tensor per all-reduce, for
    3 warm-up and final rounds plus 3 per repeat in (a), and 2 of half the tensor on a ring of 2 per
    repeat (+1 warm-up) in (b): 11/3 all-reduces' worth per repeat + 1; and a compressed round per
    format, its share of one, per repeat + 1."""
    one = 2 * (WORLD - 1) / WORLD * mb * 1e6 * 8 / (rate_mbit * 1e6)
    return (11 / 3 + sum(COMPRESSED_SHARE[f] for f in compress)) * one * (repeats + 1)


def fit_shaped_run(args: argparse.Namespace) -> str:
    """Choose --repeats (3-5) and, if even 3 would not fit, --mb, unless given: SHAPED_BUDGET_S."""
    if args.repeats is None:
        fits = int(SHAPED_BUDGET_S / transfer_seconds(args.mb, 0, args.link_mbit, args.compress)) - 1
        args.repeats = max(MIN_SHAPED_REPEATS, min(DEFAULT_REPEATS, fits))
        if not args.mb_given and fits < MIN_SHAPED_REPEATS:
            args.mb = float(int(args.mb * SHAPED_BUDGET_S / transfer_seconds(args.mb, args.repeats,
                                                                             args.link_mbit, args.compress)))
    est = transfer_seconds(args.mb, args.repeats, args.link_mbit, args.compress)
    return (f"shaped links: {args.link_mbit:g} Mbit/s tbf on each process's uplink (netns + veth + bridge); "
            f"{args.mb:g} MB, {args.repeats} repeats: ~{est:.0f} s of transfers at that rate")


def run(args: argparse.Namespace, links: list[_netns.Link] | None) -> dict[int, dict[str, Any]]:
    ports = free_ports(WORLD + 1)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, ports, results, links), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    timeout = 600.0 if links is None else max(600.0, 3 * transfer_seconds(args.mb, args.repeats, args.link_mbit,
                                                                                args.compress))
    done = False
    try:
        reports = dict(results.get(timeout=timeout) for _ in range(WORLD))
        done = True
    finally:
        for p in procs:
            p.join(timeout=30 if done else 1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return reports


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # so that the namespaces' finally runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=None, help=f"tensor size in MB (1e6 bytes), float32 "
                        f"(default {DEFAULT_MB:g})")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"default {DEFAULT_REPEATS}; with --link-mbit 3-5 to fit ~{SHAPED_BUDGET_S:.0f} s")
    node_piece_mb = TrainingConfig.model_fields["ring_chunk_bytes"].default / (1 << 20)
    parser.add_argument("--piece-mb", type=float, default=node_piece_mb,
                        help="ring piece size in MiB (default: a node's, training.ring_chunk_bytes)")
    parser.add_argument("--link-mbit", type=float, default=None, metavar="R",
                        help="run every process in its own network namespace, its uplink shaped to R Mbit/s "
                             "(needs root, ip netns, tc tbf)")
    parser.add_argument("--compress", nargs="*", choices=["bf16", "int8"], default=["bf16", "int8"],
                        help="also time the ring with its pieces compressed in these formats (ravq.average.ring_compression; "
                             "default: bf16 int8; none: only float32)")
    parser.add_argument("--netns-prefix", default="rqb", help="names of the namespaces made for --link-mbit start "
                        "with this (and hold the process id)")
    parser.add_argument("--quick", action="store_true", help="a short smoke run (4 MB, 2 repeats)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--no-tuning", action="store_true",
                        help="keep glibc's malloc defaults and Python's gc as they are (ravq.tuning)")
    args = parser.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's BLAS threads only steal the 2 cores
    args.mb_given = args.mb is not None
    if args.mb is None:
        args.mb = DEFAULT_MB
    if args.quick:
        args.mb, args.repeats, args.piece_mb = 4.0, 2, 1.0
    if args.link_mbit is None:
        if args.repeats is None:
            args.repeats = DEFAULT_REPEATS
        reports = run(args, None)
    else:
        if args.link_mbit <= 0:
            parser.error("--link-mbit must be positive")
        reason = _netns.unavailable_reason()
        if reason:
            sys.exit(f"bench_allreduce.py: --link-mbit needs root, ip netns and tc tbf: {reason}")
        print(fit_shaped_run(args), flush=True)
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        with _netns.shaped_links(WORLD, args.link_mbit, args.netns_prefix) as links:
            reports = run(args, links)
    summary = summarize(reports, args)
    mb = summary["tensor_bytes"] / 1e6
    where = "loopback" if args.link_mbit is None else f"{args.link_mbit:g} Mbit/s shaped links"
    print(f"(a) {mb:.0f} MB float32, {WORLD} processes, piece {args.piece_mb} MiB, median of {args.repeats}, "
          f"{where}:")
    print(f"    ravq ring (ZeroMQ) {summary['ravq_ring_s'] * 1e3:8.1f} ms")
    print(f"    gloo all_reduce    {summary['gloo_s'] * 1e3:8.1f} ms   (+ divide by C: "
          f"{summary['gloo_with_divide_s'] * 1e3:.1f} ms)")
    print(f"    ravq / gloo        {summary['ratio_ravq_over_gloo']:8.3f}       (with divide: "
          f"{summary['ratio_ravq_over_gloo_with_divide']:.3f})   max |ravq - gloo| "
          f"{summary['max_abs_diff_vs_gloo']:.2e}")
    print(f"    CPU, all processes {summary['ravq_cpu_s'] * 1e3:8.1f} ms ravq, {summary['gloo_cpu_s'] * 1e3:.1f} ms "
          f"gloo: x{summary['cpu_ratio_ravq_over_gloo']:.2f}")
    print(f"    busy, {summary['cores']} cores    ravq {summary['ravq_cpu_share_of_cores']:.0%} by the benchmark, "
          f"{summary['machine_busy_ravq']:.0%} machine; gloo {summary['gloo_cpu_share_of_cores']:.0%}, "
          f"{summary['machine_busy_gloo']:.0%}")
    if args.link_mbit is not None:
        line = args.link_mbit * 1e6 / 8
        print(f"    per-process upload ravq {summary['ravq_bus_bytes_per_s'] / line:.0%} of the link, gloo "
              f"{summary['ravq_bus_bytes_per_s'] * summary['ratio_ravq_over_gloo'] / line:.0%}")
    for fmt in args.compress:
        print(f"    ravq ring, {fmt:<4}    {summary[f'ravq_{fmt}_s'] * 1e3:8.1f} ms   / gloo "
              f"{summary[f'ratio_{fmt}_over_gloo']:.3f}   CPU x{summary[f'cpu_ratio_{fmt}_over_gloo']:.2f} gloo's   "
              f"max |ravq - gloo| {summary[f'max_abs_diff_{fmt}_vs_gloo']:.2e} "
              f"({summary[f'max_rel_diff_{fmt}_vs_gloo']:.1e} of the largest average)")
    print(f"(b) 2 clusters x 2 stages, two rings of 2, each on a {mb / 2:.0f} MB half ({where}):")
    print(f"    one ring alone     {summary['single_ring_bytes_per_s'] / 1e9:8.3f} GB/s")
    print(f"    two rings at once  {summary['parallel_rings_bytes_per_s'] / 1e9:8.3f} GB/s aggregate   "
          f"x{summary['parallel_over_single']:.2f}")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
