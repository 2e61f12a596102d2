"""Memory a node gives away to hosts that announce huge frames (CURVE off), derived limit vs 1 GiB.

Starts a broker and a 1x2 pipeline of the demo task on 127.0.0.1 (plaintext), lets it train, then
opens ``--connections`` raw TCP connections to the last stage's pipeline port that complete a ZMTP
handshake, announce a 1 GiB frame and stream zeros for ``--attack-s`` seconds.  Prints the node's RSS
before, at its peak during the attack and after, and what the node counted
(``ravq_connections_dropped_total``), first with ``limits.max_message_bytes`` left to its derived
default, then with the old default of 1 GiB.  The reference is the same node in the same run.

    python benchmarks/bench_huge_frames.py [--connections 3] [--attack-s 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ravq.cli.demo import free_ports

GIB = 1 << 30


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _attack(port: int, seconds: float, stop: threading.Event) -> None:
    """ZMTP 3.0 NULL greeting + READY as a DEALER, then a frame header announcing 1 GiB, then zeros."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + b"\0" * 32)
            ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
            s.sendall(bytes([0x04, len(ready)]) + ready)
            s.recv(4096)
            time.sleep(0.05)
            s.sendall(bytes([0x02]) + struct.pack(">Q", GIB))
            zeros, deadline = bytes(1 << 20), time.monotonic() + seconds
            while time.monotonic() < deadline and not stop.is_set():
                s.sendall(zeros)
    except OSError:
        pass  # the node dropped us: the point of the limit


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(m[1]) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def run(limit: int | None, connections: int, attack_s: float, work: Path) -> dict[str, float]:
    ports = iter(free_ports(12))
    nodes = [{"name": f"s{i}", "host": "127.0.0.1", "pipeline_port": next(ports), "ring_port": next(ports),
              "metrics_port": next(ports), "cluster": 0, "stage": i} for i in range(2)]
    topology = {"task": "ravq.tasks.charlm", "training": {"micro_batch": 16, "steps": 100000},
                "limits": {"max_message_bytes": limit},
                "broker": {"host": "127.0.0.1", "pub_port": next(ports), "router_port": next(ports)}, "nodes": nodes}
    path = work / f"topology-{limit}.yaml"
    path.write_text(yaml.safe_dump(topology))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "ravq", "broker", "--topology", str(path)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    logs = [work / f"s{i}-{limit}.log" for i in range(2)]
    for i in range(2):
        with open(logs[i], "wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "ravq", "node", "--topology", str(path), "--name",
                                           f"s{i}", "--threads", "1"], env=env, stdout=log, stderr=subprocess.STDOUT))
    target, metrics_port = procs[2], nodes[1]["metrics_port"]
    try:
        deadline = time.monotonic() + 180
        while "ready" not in logs[1].read_text() or _metric(metrics_port, "ravq_samples_total") == 0:
            if time.monotonic() > deadline or target.poll() is not None:
                raise RuntimeError(f"node did not start training: {logs[1].read_text()[-2000:]}")
            time.sleep(0.5)
        time.sleep(2)
        before = _rss_bytes(target.pid)
        stop = threading.Event()
        attackers = [threading.Thread(target=_attack, args=(nodes[1]["pipeline_port"], attack_s, stop))
                     for _ in range(connections)]
        for a in attackers:
            a.start()
        peak, end = before, time.monotonic() + attack_s
        while time.monotonic() < end and target.poll() is None:
            peak = max(peak, _rss_bytes(target.pid))
            time.sleep(0.05)
        stop.set()
        for a in attackers:
            a.join()
        time.sleep(1)
        after = _rss_bytes(target.pid) if target.poll() is None else 0
        return {"limit": limit or 0, "rss_before_mb": before / 1e6, "rss_peak_mb": peak / 1e6,
                "rss_after_mb": after / 1e6, "dropped": _metric(metrics_port, "ravq_connections_dropped_total"),
                "still_training": float(target.poll() is None)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=3)
    parser.add_argument("--attack-s", type=float, default=8.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="1 connection, 2 s")
    args = parser.parse_args()
    if args.quick:
        args.connections, args.attack_s = 1, 2.0
    with tempfile.TemporaryDirectory(prefix="rq13-frames-") as tmp:
        results = [run(limit, args.connections, args.attack_s, Path(tmp)) for limit in (None, GIB)]
    for r in results:
        name = "derived limit" if not r["limit"] else "limit 1 GiB  "
        print(f"{name}: RSS {r['rss_before_mb']:.0f} MB -> peak {r['rss_peak_mb']:.0f} MB -> after "
              f"{r['rss_after_mb']:.0f} MB with {args.connections} connection(s) announcing 1 GiB; "
              f"dropped connections counted: {r['dropped']:.0f}")
    growth = [r["rss_peak_mb"] - r["rss_before_mb"] for r in results]
    print(f"peak growth: derived {growth[0]:.0f} MB vs 1 GiB limit {growth[1]:.0f} MB")
    if args.json:
        print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
