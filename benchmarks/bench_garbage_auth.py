"""How many raw garbage connections to a CURVE server socket ravq counts in ravq_auth_failures_total.

Binds a CURVE pipeline Inbox (as a node does, ZAP handler running), opens ``--connections`` TCP
connections that each send 1-300 random bytes and close, and prints how many were counted.  Uses only
the API older trees have too, so it compares trees: ``PYTHONPATH=/work/main python
benchmarks/bench_garbage_auth.py`` against this tree's.

    python benchmarks/bench_garbage_auth.py [--connections 200] [--seed 13]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import sys
import tempfile
import time

import zmq
import zmq.asyncio

from ravq.metrics import Metrics
from ravq.net.options import SocketOptions
from ravq.net.security import Curve, keygen, load_secret
from ravq.net.transport import Inbox
from ravq.net.wire import DecodeLimits


def _garbage(port: int, count: int, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(count):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 300))))
            time.sleep(0.005)


async def _run(count: int, seed: int) -> float:
    metrics = Metrics("n1")
    with tempfile.TemporaryDirectory(prefix="rq13-garbage-") as keys:
        keygen("n1", keys)
        public, secret = load_secret("n1", keys)
    curve = Curve(name="n1", public=public, secret=secret, peers={"n1": public}, metrics=metrics)
    ctx = zmq.asyncio.Context()
    inbox = Inbox.bind(ctx, "tcp://127.0.0.1:*", "pipeline", metrics, DecodeLimits(),
                       SocketOptions(curve=curve, linger_ms=0))
    port = int(inbox.sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])

    def counted() -> float:
        return sum(s.value for f in metrics.registry.collect() for s in f.samples
                   if s.name == "ravq_auth_failures_total")

    try:
        async with asyncio.TaskGroup() as tg:
            zap = tg.create_task(curve.serve_zap())
            await asyncio.to_thread(_garbage, port, count, seed)
            deadline = time.monotonic() + 5
            while counted() < count and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            zap.cancel()
    finally:
        inbox.close()
        curve.close()
        ctx.term()
    return counted()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=200)
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    count = 20 if args.quick else args.connections
    counted = asyncio.run(_run(count, args.seed))
    print(f"garbage connections to a CURVE server: {count}, counted in ravq_auth_failures_total: {counted:.0f} "
          f"({100 * counted / count:.0f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
