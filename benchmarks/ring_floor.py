"""Floor of a Python ring all-reduce on plain TCP sockets vs torch.distributed.all_reduce over gloo.

4 spawned processes, 100 MB float32 each (torch.randn, seed=rank), gloo over tcp://127.0.0.1, plus a
plain-TCP ring (rank r -> r+1).  Per repeat, alternately in the same run:
  gloo       dist.all_reduce(buf, SUM)              (gloo+div: the same then buf /= 4, for reference)
  thr-<P>    blocking sockets; main thread recv_into (MSG_WAITALL) + reduce, a sender thread sendall;
             classic ring RS+AG over C=4 chunks, each chunk in pieces of P MiB (whole = one piece),
             pipelined piece by piece across the 6 steps.  RS: recv_into reused scratch, add_;
             owned chunk scaled by 1/C right after its last add; AG: recv_into the output region,
             forwarded from that same region.
  aio-<P>    the same on uvloop with loop.sock_recv_into / loop.sock_sendall (sender task + receiver).
A repeat's time is the slowest rank's; reported figure is the median over repeats (after a warm-up).

This is not ravq: it measures how fast any Python ring can be on this machine, the floor against which
bench_allreduce's ZeroMQ ring should be read (docs/benchmarks.md, "All-reduce: why the ring is slower than gloo").
ravq's rings stay on ZeroMQ (CURVE encryption, one socket set with the rest of the node); this script
has no security, no timeouts and no failure handling.

    python benchmarks/ring_floor.py [--repeats 7] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import resource
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

WORLD = 4
C = WORLD
STEPS = 2 * (C - 1)


def cpu_seconds() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def plan(rank: int, n: int, piece_elems: int):
    """Per step s: (send chunk, recv chunk); pieces: list of (lo, hi) element offsets within a chunk."""
    assert n % C == 0
    clen = n // C
    pe = min(piece_elems, clen) if piece_elems > 0 else clen
    pieces = [(lo, min(lo + pe, clen)) for lo in range(0, clen, pe)]
    steps = []
    for s in range(STEPS):
        if s < C - 1:
            steps.append(((rank - s) % C, (rank - s - 1) % C))
        else:
            t = s - (C - 1)
            steps.append(((rank + 1 - t) % C, (rank - t) % C))
    return clen, pieces, steps


def recv_exact(sock: socket.socket, mv: memoryview) -> None:
    n, want = 0, len(mv)
    while n < want:
        got = sock.recv_into(mv[n:], 0, socket.MSG_WAITALL)
        if not got:
            raise ConnectionError("peer closed")
        n += got


def fold(buf, scratch, lo: int, hi: int, finish: bool) -> None:
    """Reduce-scatter: add the received piece (in ``scratch``) into ``buf[lo:hi]``; the member that
    completes the chunk's sum (``finish``) divides it by C there."""
    dst = buf[lo:hi]
    dst.add_(scratch[:hi - lo])
    if finish:
        dst.mul_(1.0 / C)


def ring_threaded(buf, scratch, s_out: socket.socket, s_in: socket.socket, rank: int, piece_elems: int,
                  divide: bool = True) -> None:
    n = buf.numel()
    clen, pieces, steps = plan(rank, n, piece_elems)
    bmv = memoryview(buf.numpy()).cast("B")
    smv = memoryview(scratch.numpy()).cast("B")
    tokens: queue.SimpleQueue = queue.SimpleQueue()
    err: list[OSError] = []

    def sender() -> None:
        try:
            for s, (sc, _) in enumerate(steps):
                base = sc * clen
                for lo, hi in pieces:
                    if s > 0:
                        tokens.get()  # (s-1, p) finished on this rank: piece p of this chunk is ready
                    s_out.sendall(bmv[(base + lo) * 4:(base + hi) * 4])
        except OSError as e:  # a dead peer: re-raised in the caller
            err.append(e)

    th = threading.Thread(target=sender, daemon=True)
    th.start()
    for s, (_, rc) in enumerate(steps):
        base = rc * clen
        for lo, hi in pieces:
            if s < C - 1:
                recv_exact(s_in, smv[:(hi - lo) * 4])
                fold(buf, scratch, base + lo, base + hi, divide and s == C - 2)
            else:
                recv_exact(s_in, bmv[(base + lo) * 4:(base + hi) * 4])
            if s < STEPS - 1:
                tokens.put(None)
    th.join()
    if err:
        raise err[0]


async def ring_async(loop, buf, scratch, s_out, s_in, rank: int, piece_elems: int) -> None:
    n = buf.numel()
    clen, pieces, steps = plan(rank, n, piece_elems)
    bmv = memoryview(buf.numpy()).cast("B")
    smv = memoryview(scratch.numpy()).cast("B")
    tokens: asyncio.Queue = asyncio.Queue()

    async def sender() -> None:
        for s, (sc, _) in enumerate(steps):
            base = sc * clen
            for lo, hi in pieces:
                if s > 0:
                    await tokens.get()
                await loop.sock_sendall(s_out, bmv[(base + lo) * 4:(base + hi) * 4])

    async def recv_exact_a(mv: memoryview) -> None:
        n, want = 0, len(mv)
        while n < want:
            got = await loop.sock_recv_into(s_in, mv[n:])
            if not got:
                raise ConnectionError("peer closed")
            n += got

    task = asyncio.ensure_future(sender())
    for s, (_, rc) in enumerate(steps):
        base = rc * clen
        for lo, hi in pieces:
            if s < C - 1:
                await recv_exact_a(smv[:(hi - lo) * 4])
                fold(buf, scratch, base + lo, base + hi, s == C - 2)
            else:
                await recv_exact_a(bmv[(base + lo) * 4:(base + hi) * 4])
            if s < STEPS - 1:
                tokens.put_nowait(None)
    await task


def piece_name(mib: float) -> str:
    return "whole" if mib <= 0 else f"{mib:g}M"


def worker(rank: int, args, ports: list[int], results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if not args.no_tuning:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from ravq.tuning import tune_process  # mallopt + gc.freeze, as bench_allreduce does
        tune_process()

    lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lst.bind(("127.0.0.1", ports[rank]))
    lst.listen(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[-1]}", rank=rank, world_size=WORLD)
    dist.barrier()  # everyone listens
    s_out = socket.create_connection(("127.0.0.1", ports[(rank + 1) % WORLD]))
    s_in, _ = lst.accept()
    lst.close()
    for s in (s_out, s_in):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if args.sockbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, args.sockbuf)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, args.sockbuf)
    sockinfo = {"snd": s_out.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
                "rcv": s_in.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)}

    numel = int(args.mb * 1e6) // 4
    numel -= numel % C
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    buf = torch.empty_like(x)
    clen = numel // C
    max_piece = max((min(int(m * (1 << 20)) // 4, clen) if m > 0 else clen) for m in args.pieces)
    scratch = torch.zeros(max_piece)

    # reference: gloo SUM / C
    ref = x.clone()
    dist.all_reduce(ref)
    ref /= C

    import uvloop
    loop = uvloop.new_event_loop()

    def timed(fn):
        buf.copy_(x)
        dist.barrier()
        t0, c0 = time.perf_counter(), cpu_seconds()
        fn()
        return time.perf_counter() - t0, cpu_seconds() - c0

    variants: list[tuple[str, object]] = [
        ("gloo", lambda: dist.all_reduce(buf)),
        ("gloo+div", lambda: (dist.all_reduce(buf), buf.div_(C))),
    ]
    for m in args.pieces:
        pe = int(m * (1 << 20)) // 4 if m > 0 else 0
        variants.append((f"thr-{piece_name(m)}", (lambda pe=pe: ring_threaded(buf, scratch, s_out, s_in, rank, pe))))
    for m in args.nodiv_pieces:
        pe = int(m * (1 << 20)) // 4 if m > 0 else 0
        variants.append((f"thr-{piece_name(m)}-nodiv",
                         (lambda pe=pe: ring_threaded(buf, scratch, s_out, s_in, rank, pe, divide=False))))
    for m in args.async_pieces:
        pe = int(m * (1 << 20)) // 4 if m > 0 else 0

        def run_async(pe=pe):
            s_out.setblocking(False)
            s_in.setblocking(False)
            try:
                loop.run_until_complete(ring_async(loop, buf, scratch, s_out, s_in, rank, pe))
            finally:
                s_out.setblocking(True)
                s_in.setblocking(True)
        variants.append((f"aio-{piece_name(m)}", run_async))

    out = {name: {"wall": [], "cpu": [], "diff": 0.0} for name, _ in variants}
    for rep in range(args.repeats + 1):
        for name, fn in variants:
            wall, cpu = timed(fn)
            if name.endswith("-nodiv"):  # a SUM: compare with gloo's SUM
                out[name]["diff"] = max(out[name]["diff"], float((buf / C - ref).abs().max()))
            elif not name.startswith("gloo"):
                d = float((buf - ref).abs().max())
                out[name]["diff"] = max(out[name]["diff"], d)
            elif name == "gloo+div":
                out[name]["diff"] = max(out[name]["diff"], float((buf - ref).abs().max()))
            if rep > 0:  # rep 0 is the warm-up
                out[name]["wall"].append(wall)
                out[name]["cpu"].append(cpu)
    dist.barrier()
    s_out.close()
    s_in.close()
    loop.close()
    results.put((rank, {"out": out, "sock": sockinfo, "order": [n for n, _ in variants]}))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=100.0)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--pieces", type=float, nargs="*", default=[0.5, 1, 4, 16, 0], help="MiB; 0 = whole chunk")
    p.add_argument("--async-pieces", type=float, nargs="*", default=[1, 4, 16])
    p.add_argument("--nodiv-pieces", type=float, nargs="*", default=[0.5, 4],
                   help="threaded ring without the 1/C scaling (a SUM, like plain gloo)")
    p.add_argument("--sockbuf", type=int, default=0, help="SO_SNDBUF/SO_RCVBUF bytes (0: kernel autotuning)")
    p.add_argument("--no-tuning", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    t_start = time.perf_counter()
    from bench_allreduce import free_ports  # the script's folder is on sys.path

    ports = free_ports(WORLD + 1)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, ports, results), daemon=True) for r in range(WORLD)]
    for pr in procs:
        pr.start()
    try:
        reports = dict(results.get(timeout=600) for _ in range(WORLD))
    finally:
        for pr in procs:
            pr.join(timeout=30)
            if pr.is_alive():
                pr.kill()
    order = reports[0]["order"]
    nrep = len(reports[0]["out"]["gloo"]["wall"])

    def slowest(name: str) -> list[float]:
        return [max(reports[r]["out"][name]["wall"][i] for r in range(WORLD)) for i in range(nrep)]

    def cpu_per_proc(name: str) -> float:
        return statistics.median(sum(reports[r]["out"][name]["cpu"][i] for r in range(WORLD)) / WORLD
                                 for i in range(nrep))

    gloo_runs = slowest("gloo")
    gloo = statistics.median(gloo_runs)
    summary = {}
    print(f"{args.mb:g} MB float32, {WORLD} procs, median of {nrep} (+1 warm-up), sockbuf={args.sockbuf or 'auto'} "
          f"(snd/rcv as reported: {reports[0]['sock']}), tuning={'off' if args.no_tuning else 'on'}")
    print(f"{'variant':15s} {'median ms':>9s} {'min ms':>8s} {'ratio':>6s} {'paired':>6s} {'cpu s/proc':>10s} {'max|diff|':>9s}")
    for name in order:
        runs = slowest(name)
        med = statistics.median(runs)
        paired = statistics.median(a / b for a, b in zip(runs, gloo_runs))  # per-repeat ratio vs that repeat's gloo
        diff = max(reports[r]["out"][name]["diff"] for r in range(WORLD))
        summary[name] = {"median_s": med, "min_s": min(runs), "ratio": med / gloo, "paired_ratio": paired,
                         "cpu_s_per_proc": cpu_per_proc(name), "max_abs_diff": diff, "runs": runs}
        print(f"{name:15s} {med * 1e3:9.1f} {min(runs) * 1e3:8.1f} {med / gloo:6.3f} {paired:6.3f} "
              f"{cpu_per_proc(name):10.3f} {diff if name != 'gloo' else float('nan'):9.2e}")
    print(f"total {time.perf_counter() - t_start:.1f} s")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
