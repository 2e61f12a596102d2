"""ravq link throughput against raw pyzmq with the same payloads (docs/design.md, "References to measure against").

Two OS processes on loopback TCP, a receiver and a sender, kept alive across trials.  Per trial the
receiver binds a fresh socket, the sender connects and sends ``warmup + count`` messages, and the
receiver times the last ``count``.  Every mode moves the same frames (ravq's header frame + the
tensor's raw bytes) with the same socket options (HWM, linger, MAXMSGSIZE):

  ravq                       Outlink.send(Message) -> Inbox.recv() decoding to a torch tensor, metrics
                             counted: what a pipeline link does (zmq.asyncio on uvloop)
  raw_dealer_router          blocking pyzmq DEALER -> ROUTER, send/recv_multipart copy=False
  raw_dealer_router_asyncio  the same through zmq.asyncio on uvloop: isolates the binding's share
  raw_push_pull              blocking pyzmq PUSH -> PULL, copy=False

Throughput is tensor bytes per second at the receiver, the median of the repeats; trials of all
modes are interleaved so that drift on a shared machine hits them alike.  From the repo root:

    python benchmarks/bench_transport.py            # ~1 minute
    python benchmarks/bench_transport.py --quick    # ~10 s smoke run
    python benchmarks/bench_transport.py --json     # last line: one JSON object

Both processes apply ``ravq.tuning.tune_process()`` (malloc settings for large buffers, as a node
does at start) before their first trial, for every mode; ``RAVQ_BENCH_NO_TUNING=1`` leaves it out.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from multiprocessing.connection import Connection

import _common

_common.use_repo_checkout()

import torch
import zmq
import zmq.asyncio

from ravq.metrics import Metrics
from ravq.net.options import SocketOptions
from ravq.net.transport import Inbox, Outlink
from ravq.net.wire import DecodeLimits, Message, MsgType, encode
from ravq.tuning import tune_process

MODES = ("ravq", "raw_dealer_router", "raw_dealer_router_asyncio", "raw_push_pull")
SIZES = (64 << 10, 1 << 20, 16 << 20)
TARGET_RATIO = 0.8
OPTS = SocketOptions()
_BLOCKING = {"raw_dealer_router": (zmq.DEALER, zmq.ROUTER), "raw_push_pull": (zmq.PUSH, zmq.PULL)}
_PAYLOAD: dict[int, torch.Tensor] = {}


def _message(size: int, seq: int) -> Message:
    if size not in _PAYLOAD:
        _PAYLOAD[size] = torch.randn(size // 4, dtype=torch.float32)
    return Message(type=MsgType.FORWARD, sender="sender", micro_batch=(0, seq),
                   tensors={"activations": _PAYLOAD[size]})


def _configure(sock: zmq.Socket) -> zmq.Socket:
    """The options ravq's transport sets, for the raw sockets."""
    sock.setsockopt(zmq.LINGER, OPTS.linger_ms)
    sock.setsockopt(zmq.MAXMSGSIZE, OPTS.max_message_bytes)
    sock.setsockopt(zmq.SNDHWM, OPTS.hwm)
    sock.setsockopt(zmq.RCVHWM, OPTS.hwm)
    return sock


# --- receiver process -----------------------------------------------------------------------------

def _tune() -> None:
    """What a node does at start (ravq.tuning), in both processes and for every mode alike: it is
    process-wide, and the processes serve every mode.  RAVQ_BENCH_NO_TUNING=1 measures without it."""
    if not os.environ.get("RAVQ_BENCH_NO_TUNING"):
        tune_process()


def receive(conn: Connection, mode: str, size: int, warmup: int, count: int) -> tuple[float, float]:
    _tune()
    _message(size, 0)  # make the payload before any clock starts
    if mode in _BLOCKING:
        with zmq.Context() as ctx, _configure(ctx.socket(_BLOCKING[mode][1])) as sock:
            sock.setsockopt(zmq.RCVTIMEO, int(_common.TRIAL_TIMEOUT_S * 1000))
            sock.bind("tcp://127.0.0.1:*")
            conn.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
            timing = _common.timed(lambda: sock.recv_multipart(copy=False), warmup, count)
            sock.setsockopt(zmq.LINGER, 0)
            return timing
    return _common.run_loop(_receive_async(conn, mode, warmup, count))


async def _receive_async(conn: Connection, mode: str, warmup: int, count: int) -> tuple[float, float]:
    ctx = zmq.asyncio.Context()
    if mode == "ravq":
        inbox = Inbox.bind(ctx, "tcp://127.0.0.1:*", "bench", Metrics(), DecodeLimits(), OPTS)
        sock, receive_one = inbox.sock, inbox.recv
    else:
        sock = _configure(ctx.socket(zmq.ROUTER))
        sock.bind("tcp://127.0.0.1:*")
        receive_one = lambda: sock.recv_multipart(copy=False)
    try:
        conn.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        return await _common.timed_async(receive_one, warmup, count)
    finally:
        sock.close(linger=0)
        ctx.term()


# --- sender process -------------------------------------------------------------------------------

def send(conn: Connection, mode: str, size: int, total: int, endpoint: str) -> None:
    _tune()
    if mode not in _BLOCKING:
        return _common.run_loop(_send_async(conn, mode, size, total, endpoint))
    frames = encode(_message(size, 0))
    with zmq.Context() as ctx, _configure(ctx.socket(_BLOCKING[mode][0])) as sock:
        sock.connect(endpoint)
        c0 = time.process_time()
        for _ in range(total):
            sock.send_multipart(frames, copy=False)
        conn.recv()  # the receiver has everything: closing now drops nothing
        conn.send(time.process_time() - c0)


async def _send_async(conn: Connection, mode: str, size: int, total: int, endpoint: str) -> None:
    ctx = zmq.asyncio.Context()
    link = Outlink.connect(ctx, endpoint, "bench", "receiver", Metrics(), DecodeLimits(), OPTS)
    frames = encode(_message(size, 0))
    try:
        c0 = time.process_time()
        if mode == "ravq":
            for seq in range(total):  # a new Message per micro-batch, as a pipeline stage makes them
                await link.send(_message(size, seq))
        else:
            for _ in range(total):
                await link.sock.send_multipart(frames, copy=False)
        await asyncio.to_thread(conn.recv)
        conn.send(time.process_time() - c0)
    finally:
        link.close()
        ctx.term()


# --- parent ---------------------------------------------------------------------------------------

Samples = dict[int, dict[str, list[tuple[float, float, float]]]]


def measure(repeats: int, trial_bytes: int, min_messages: int) -> Samples:
    samples: Samples = {s: {m: [] for m in MODES} for s in SIZES}
    order = random.Random(0)  # modes in a fresh order each round: no mode always follows another
    with _common.ProcessPair(receive, send) as pair:
        for _ in range(repeats):
            for size in SIZES:
                count = max(min_messages, trial_bytes // size)
                for mode in order.sample(MODES, len(MODES)):
                    samples[size][mode].append(pair.trial(mode, size, count, warmup=max(2, count // 10)))
    return samples


def summarize(samples: Samples) -> dict[str, dict[str, float]]:
    """Per size: median bytes/s per mode, ratios, and median CPU us per message in each process."""
    results: dict[str, dict[str, float]] = {}
    for size, by_mode in samples.items():
        row: dict[str, float] = {}
        for mode, trials in by_mode.items():
            row[mode] = _common.median([t[0] for t in trials])
            row[f"{mode}_recv_cpu_us_per_message"] = _common.median([t[1] for t in trials])
            row[f"{mode}_send_cpu_us_per_message"] = _common.median([t[2] for t in trials])
        for raw in MODES[1:]:
            row[f"ratio_ravq_over_{raw}"] = row["ravq"] / row[raw]
        results[str(size)] = row
    return results


def render(results: dict[str, dict[str, float]]) -> str:
    headers = ["size", "ravq MB/s", "raw D->R MB/s", "raw D->R aio MB/s", "raw PUSH MB/s",
               "ravq/raw D->R", "ravq/raw aio", "ravq/raw PUSH"]
    rows = [[_common.size_name(int(size)), *(f"{r[m] / 1e6:,.0f}" for m in MODES),
             *(f"{r[f'ratio_ravq_over_{m}']:.2f}" for m in MODES[1:])] for size, r in results.items()]
    return _common.table(headers, rows)


def render_cpu(results: dict[str, dict[str, float]]) -> str:
    modes = {"ravq": "ravq", "raw_dealer_router_asyncio": "raw aio", "raw_dealer_router": "raw D->R"}
    headers = ["size", *(f"{name} {side}" for name in modes.values() for side in ("send", "recv"))]
    rows = [[_common.size_name(int(size)), *(f"{r[f'{m}_{side}_cpu_us_per_message']:,.0f}"
                                             for m in modes for side in ("send", "recv"))]
            for size, r in results.items()]
    return _common.table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="trials per size and mode; the median is kept")
    parser.add_argument("--trial-mib", type=int, default=1024, help="payload MiB per trial")
    parser.add_argument("--min-messages", type=int, default=16, help="at least this many messages per trial")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 short repeats (~10 s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    if parser.parse_args(argv).quick:  # explicit flags still win over the quick presets
        parser.set_defaults(repeats=2, trial_mib=48, min_messages=4)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    results = summarize(measure(args.repeats, args.trial_mib << 20, args.min_messages))
    wall_s = time.perf_counter() - t0
    lowest = min(r["ratio_ravq_over_raw_dealer_router"] for r in results.values())
    tuning = "off" if os.environ.get("RAVQ_BENCH_NO_TUNING") else "on (every mode)"
    print(f"ravq link vs raw pyzmq: loopback TCP, sender and receiver processes, median of "
          f"{args.repeats} trials of {args.trial_mib} MiB ({wall_s:.0f} s); process tuning {tuning}")
    print(render(results))
    print("\nCPU us per message in each process (all its threads, ZeroMQ's I/O thread included):")
    print(render_cpu(results))
    print(f"\ntarget ravq/raw D->R >= {TARGET_RATIO}: {'met' if lowest >= TARGET_RATIO else 'NOT met'} "
          f"(lowest {lowest:.2f})")
    if args.json:
        _common.emit_json({
            "benchmark": "transport", "unit": "bytes/s", "sizes": list(SIZES), "modes": list(MODES),
            "repeats": args.repeats, "trial_bytes": args.trial_mib << 20, "wall_s": wall_s,
            "target_ratio": TARGET_RATIO, "meets_target": lowest >= TARGET_RATIO, "results": results,
            "process_tuning": not os.environ.get("RAVQ_BENCH_NO_TUNING")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
