"""pyzmq's zmq.asyncio against aiozmq, moving 1 MiB DEALER -> ROUTER messages on loopback TCP.

docs/design.md picks zmq.asyncio as ravq's asyncio binding over aiozmq (which has had no release since
2022); this measures what each gives on the machine at hand (docs/benchmarks.md records a run).  Sender and receiver are two OS processes,
both on the same event loop kind (uvloop by default, as ravq nodes run).  Modes:

  zmq_asyncio        await send_multipart(copy=False) / await recv_multipart(copy=False): as ravq does
  zmq_asyncio_copy   the same with copy=True, for a like-for-like with aiozmq (which always copies)
  aiozmq             aiozmq.create_zmq_stream: write() + await drain() / await read(), default limits
  aiozmq_big_buffers the same with 64 MiB read/write buffer limits (its default 64 KiB pauses the
                     stream on every 1 MiB message)

    python benchmarks/bench_asyncio_binding.py            # ~30 s
    python benchmarks/bench_asyncio_binding.py --quick    # a few seconds
    python benchmarks/bench_asyncio_binding.py --json     # last line: one JSON object
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import _common
import zmq
import zmq.asyncio

MODES = ("zmq_asyncio", "zmq_asyncio_copy", "aiozmq", "aiozmq_big_buffers")
AIOZMQ_BIG_BUFFER_BYTES = 64 << 20


def aiozmq_problem() -> str | None:
    """Why aiozmq cannot run here, or None."""
    try:
        import aiozmq  # noqa: F401
    except Exception as err:  # noqa: BLE001 - whatever breaks the import (old asyncio APIs...) is the answer
        return f"aiozmq cannot be imported: {type(err).__name__}: {err}"
    return None


async def _aiozmq_stream(kind: int, mode: str, **where: str) -> Any:
    import aiozmq

    limits: dict[str, int] = {}
    if mode == "aiozmq_big_buffers":
        limits = {"high_read": AIOZMQ_BIG_BUFFER_BYTES, "high_write": AIOZMQ_BIG_BUFFER_BYTES}
    return await aiozmq.create_zmq_stream(kind, **where, **limits)


# --- receiver process -----------------------------------------------------------------------------

def receive(conn: Connection, mode: str, size: int, warmup: int, count: int) -> tuple[float, float]:
    loop, mode = mode.split(":")
    return _common.run_loop(_receive(conn, mode, warmup, count), loop)


async def _receive(conn: Connection, mode: str, warmup: int, count: int) -> tuple[float, float]:
    if mode.startswith("aiozmq"):
        stream = await _aiozmq_stream(zmq.ROUTER, mode, bind="tcp://127.0.0.1:*")
        try:
            conn.send(next(iter(stream.transport.bindings())))
            return await _common.timed_async(stream.read, warmup, count)
        finally:
            stream.close()
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        sock.bind("tcp://127.0.0.1:*")
        conn.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        copy = mode == "zmq_asyncio_copy"
        return await _common.timed_async(lambda: sock.recv_multipart(copy=copy), warmup, count)
    finally:
        sock.close(linger=0)
        ctx.term()


# --- sender process -------------------------------------------------------------------------------

def send(conn: Connection, mode: str, size: int, total: int, endpoint: str) -> None:
    loop, mode = mode.split(":")
    _common.run_loop(_send(conn, mode, size, total, endpoint), loop)


async def _send(conn: Connection, mode: str, size: int, total: int, endpoint: str) -> None:
    payload = bytes(range(256)) * (size // 256)
    c0 = time.process_time()
    if mode.startswith("aiozmq"):
        stream = await _aiozmq_stream(zmq.DEALER, mode, connect=endpoint)
        try:
            for _ in range(total):
                stream.write([payload])
                await stream.drain()
            await asyncio.to_thread(conn.recv)
        finally:
            stream.close()
    else:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.connect(endpoint)
            copy = mode == "zmq_asyncio_copy"
            for _ in range(total):
                await sock.send_multipart([payload], copy=copy)
            await asyncio.to_thread(conn.recv)
        finally:
            sock.close()
            ctx.term()
    conn.send(time.process_time() - c0)


# --- parent ---------------------------------------------------------------------------------------

def measure(modes: list[str], loop: str, size: int, repeats: int, count: int) -> dict[str, list[tuple[float, ...]]]:
    samples: dict[str, list[tuple[float, ...]]] = {m: [] for m in modes}
    with _common.ProcessPair(receive, send) as pair:
        for _ in range(repeats):
            for mode in modes:  # interleaved, so drift on a shared machine hits every mode alike
                samples[mode].append(pair.trial(f"{loop}:{mode}", size, count, warmup=max(2, count // 10)))
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-kib", type=int, default=1024, help="message size")
    parser.add_argument("--messages", type=int, default=1000, help="messages per trial")
    parser.add_argument("--repeats", type=int, default=7, help="trials per mode; the median is kept")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop", help="event loop of both sides")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 short repeats")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    if parser.parse_args(argv).quick:  # explicit flags still win over the quick presets
        parser.set_defaults(repeats=2, messages=150)
    args = parser.parse_args(argv)
    size = args.size_kib << 10
    problem = aiozmq_problem()
    modes = [m for m in MODES if problem is None or not m.startswith("aiozmq")]
    t0 = time.perf_counter()
    samples = measure(modes, args.loop, size, args.repeats, args.messages)
    wall_s = time.perf_counter() - t0
    results: dict[str, dict[str, float]] = {}
    for mode, trials in samples.items():
        results[mode] = {"bytes_per_s": _common.median([t[0] for t in trials]),
                         "recv_cpu_us_per_message": _common.median([t[1] for t in trials]),
                         "send_cpu_us_per_message": _common.median([t[2] for t in trials])}
    best_aiozmq = max((results[m]["bytes_per_s"] for m in results if m.startswith("aiozmq")), default=None)
    ratio = results["zmq_asyncio"]["bytes_per_s"] / best_aiozmq if best_aiozmq else None

    print(f"zmq.asyncio vs aiozmq: {_common.size_name(size)} DEALER -> ROUTER, loopback TCP, two processes on "
          f"{args.loop}, median of {args.repeats} trials of {args.messages} messages ({wall_s:.0f} s)")
    rows = [[m, f"{r['bytes_per_s'] / 1e6:,.0f}", f"{r['send_cpu_us_per_message']:,.0f}",
             f"{r['recv_cpu_us_per_message']:,.0f}"] for m, r in results.items()]
    print(_common.table(["binding", "MB/s", "send CPU us/msg", "recv CPU us/msg"], rows))
    if problem:
        print(f"aiozmq not measured: {problem}")
    else:
        print(f"zmq.asyncio (zero-copy) / best aiozmq: {ratio:.2f}x")
    if args.json:
        _common.emit_json({
            "benchmark": "asyncio_binding", "unit": "bytes/s", "size_bytes": size, "loop": args.loop,
            "messages": args.messages, "repeats": args.repeats, "wall_s": wall_s, "results": results,
            "ratio_zmq_asyncio_over_aiozmq": ratio, "aiozmq_error": problem,
            "versions": {"pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(), "python": sys.version.split()[0],
                         "aiozmq": None if problem else __import__("aiozmq").__version__}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
