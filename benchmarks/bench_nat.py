"""NAT traversal (issue #24): what a relay costs, measured.

1. ``link``: a 2-stage cluster (``bench_pipeline_link.py``'s set-up: real ``ravq node`` processes in network
   namespaces, every upload shaped by tc tbf, stages of simulated device time) trains once with both stages
   reachable (direct link) and once with both declared behind NAT, so the link goes through the relay the
   broker's PC runs on a third namespace whose links are ``--relay-mbit`` (not the bottleneck).  Reported:
   relayed samples/s over direct, in one run (alternating, ``--repeats`` times), and the relay's CPU seconds
   per GB forwarded (the broker process's CPU time in the relayed run less its CPU time in the direct run,
   over the bytes its relay forwarded).
2. ``swarm``: 2 clusters x 2 stages, all four reachable, then all four declared behind NAT (every
   pipeline and ring link through the broker's relay, whose upload is ``--relay-swarm-mbit``): samples/s
   of the NAT swarm over the open one, and the planner's prediction of that ratio
   (``ravq.planner.relays``: the relay's upload shared by the plan's links through it).
3. ``memory``: a ``ravq relay`` process with 3 senders flooding 3 receivers that never read (slow receivers
   at their slowest): its peak RSS (VmHWM) against the bound: 3 x ``queue_bytes`` held for the
   destinations, plus what ZeroMQ buffers (``RELAY_HWM`` messages each way per connection), plus the
   process's size before traffic.

    python benchmarks/bench_nat.py [--link-mbit 50] [--relay-mbit 400] [--steps 200] [--repeats 2] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import REPO, use_repo_checkout

use_repo_checkout()

import _netns
import bench_pipeline_link as link_bench
import yaml

RELAY_PORT, METRICS_PORT = 7105, 7106
NETNS_PREFIX = "rq24n"


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _relayed_bytes(netns: str, address: str) -> float:
    out = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c",
                          (f"import urllib.request; print(urllib.request.urlopen('http://{address}:{METRICS_PORT}/metrics',"
                          " timeout=5).read().decode())")], capture_output=True, text=True, timeout=30, check=True).stdout
    return sum(float(line.rsplit(" ", 1)[1]) for line in out.splitlines()
               if line.startswith("ravq_relayed_bytes_total{"))


def link_run(args: argparse.Namespace, links: list[_netns.Link], relayed: bool, run_dir: Path) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    stages, relay = links[:2], links[2]
    topo = link_bench.topology(args, stages, "none")
    topo["broker"].update({"host": relay.address, "relay_port": RELAY_PORT, "metrics_port": METRICS_PORT})
    if relayed:
        for node in topo["nodes"]:
            node["reachable"] = False
    topo_path = run_dir / "topology.yaml"
    topo_path.write_text(yaml.safe_dump(topo, sort_keys=False))
    broker = link_bench._in_netns(relay, ["broker", "--topology", str(topo_path)], run_dir / "broker.log")
    nodes = [link_bench._in_netns(link, ["node", "--topology", str(topo_path), "--name", f"s{i}", "--threads", "1",
                                         "--summary", str(run_dir / f"summary-s{i}.json")], run_dir / f"s{i}.log")
             for i, link in enumerate(stages)]
    try:
        deadline = time.monotonic() + args.timeout
        for node in nodes:
            node.wait(max(1.0, deadline - time.monotonic()))
        cpu_s = _cpu_s(broker.pid)
        forwarded = _relayed_bytes(relay.netns, relay.address)
    finally:
        for proc in [*nodes, broker]:
            link_bench._stop(proc)
    if any(n.returncode != 0 for n in nodes):
        raise SystemExit(f"a node failed; logs in {run_dir}")
    summaries = [json.loads((run_dir / f"summary-s{i}.json").read_text()) for i in range(2)]
    wall = max(s["wall_s"] for s in summaries)
    return {"relayed": relayed, "samples_per_s": summaries[-1]["samples"] / wall, "broker_cpu_s": cpu_s,
            "relayed_bytes": forwarded, "routes": summaries[0]["routes"]}


def bench_link(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    rates = [args.link_mbit, args.link_mbit, args.relay_mbit]
    with _netns.shaped_links(3, rates, NETNS_PREFIX) as links:
        for r in range(args.repeats):
            for relayed in (False, True):
                run = link_run(args, links, relayed, root / f"{'relayed' if relayed else 'direct'}-{r}")
                runs.append(run)
                print(f"  {'relayed' if relayed else 'direct '} repeat {r}: {run['samples_per_s']:7.2f} samples/s, "
                      f"routes {run['routes']['pipeline']}, relay forwarded {run['relayed_bytes'] / 1e6:.1f} MB, "
                      f"broker CPU {run['broker_cpu_s']:.2f}s, load {os.getloadavg()[0]:.1f}", flush=True)
    direct = statistics.median(r["samples_per_s"] for r in runs if not r["relayed"])
    relayed = statistics.median(r["samples_per_s"] for r in runs if r["relayed"])
    extra_cpu = [b["broker_cpu_s"] - a["broker_cpu_s"] for a, b in zip(runs[::2], runs[1::2], strict=True)]
    forwarded = [b["relayed_bytes"] for b in runs[1::2]]
    cpu_per_gb = statistics.median(c / (f / 1e9) for c, f in zip(extra_cpu, forwarded, strict=True) if f > 0)
    return {"direct_samples_per_s": direct, "relayed_samples_per_s": relayed, "ratio": relayed / direct,
            "relay_cpu_s_per_gb": cpu_per_gb, "runs": runs}


# --------------------------------------------------------------------------- a 2x2 swarm, all behind NAT


def swarm_run(args: argparse.Namespace, links: list[_netns.Link], nat: bool, run_dir: Path) -> dict[str, Any]:
    """2 clusters x 2 stages on links[:4] (all reachable, or all declared behind NAT: every link relayed
    through the broker's PC on links[4]); samples/s of both clusters together."""
    run_dir.mkdir(parents=True, exist_ok=True)
    relay = links[4]
    names = ["c0s0", "c0s1", "c1s0", "c1s1"]
    topo = link_bench.topology(args, links[:4], "none")
    topo["training"]["sync_every"] = 10
    for node, name in zip(topo["nodes"], names, strict=True):
        node.update({"name": name, "cluster": int(name[1]), "stage": int(name[3])})
        if nat:
            node["reachable"] = False
    topo["broker"].update({"host": relay.address, "relay_port": RELAY_PORT, "metrics_port": METRICS_PORT})
    topo_path = run_dir / "topology.yaml"
    topo_path.write_text(yaml.safe_dump(topo, sort_keys=False))
    broker = link_bench._in_netns(relay, ["broker", "--topology", str(topo_path)], run_dir / "broker.log")
    nodes = [link_bench._in_netns(link, ["node", "--topology", str(topo_path), "--name", name, "--threads", "1",
                                         "--summary", str(run_dir / f"summary-{name}.json")], run_dir / f"{name}.log")
             for name, link in zip(names, links, strict=False)]
    try:
        deadline = time.monotonic() + args.timeout
        for node in nodes:
            node.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for proc in [*nodes, broker]:
            link_bench._stop(proc)
    if any(n.returncode != 0 for n in nodes):
        raise SystemExit(f"a node failed; logs in {run_dir}")
    summaries = {n: json.loads((run_dir / f"summary-{n}.json").read_text()) for n in names}
    wall = max(s["wall_s"] for s in summaries.values())
    return {"nat": nat, "samples_per_s": (summaries["c0s1"]["samples"] + summaries["c1s1"]["samples"]) / wall,
            "routes": summaries["c0s0"]["routes"]}


def predicted_ratio(args: argparse.Namespace) -> float:
    """The planner's samples/s with all four behind NAT over with open ports, for the same swarm: stages of
    the synthetic task's simulated device time, links at their shaped rates, the relay's uplink shared."""
    from ravq.config import Topology
    from ravq.planner import BlockProfile, cut_plan
    from ravq.planner.relays import plan_with_relays
    from ravq.planner.types import NodeProfile

    flops, names = 1e12, ["c0s0", "c0s1", "c1s0", "c1s1"]
    act = args.micro_batch * 512 * 4
    blocks = [BlockProfile(name=f"blocks.{i}", param_bytes=(512 * 512 + 3 * 512) * 4, fwd_flops=0.010 * flops,
                           bwd_flops=0.020 * flops, act_bytes_out=act, memory_bytes=1 << 26) for i in range(2)]
    profiles = [NodeProfile(name=n, flops=flops, memory_bytes=1 << 32, latency_s={p: 1e-4 for p in names if p != n},
                            bandwidth_bytes_per_s={p: args.link_mbit * 1e6 / 8 for p in names if p != n})
                for n in names]

    def rate(nat: bool) -> float:
        # the broker's relay, as the planner sees it: a relay with the relay PC's upload
        topo = Topology.model_validate({
            "task": "tests.tasks_for_tests", "training": {"micro_batch": args.micro_batch, "sync_every": 10},
            "broker": {"pub_port": 1, "router_port": 2},
            "relays": [{"name": "relay", "host": "10.0.0.1", "port": 3,
                        "bandwidth_bytes_per_s": args.relay_swarm_mbit * 1e6 / 8}],
            "nodes": [{"name": n, "pipeline_port": 10 + i, "ring_port": 20 + i, **({"reachable": False} if nat else {})}
                      for i, n in enumerate(names)]})
        _, explanation, _ = plan_with_relays(topo, profiles, lambda nodes: cut_plan(
            [names[:2], names[2:]], nodes, blocks, micro_batch=args.micro_batch, sync_every=10))
        return float(explanation.samples_per_s)

    return rate(True) / rate(False)


def bench_swarm(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    with _netns.shaped_links(5, [args.link_mbit] * 4 + [args.relay_swarm_mbit], NETNS_PREFIX + "s") as links:
        for r in range(args.repeats):
            for nat in (False, True):
                run = swarm_run(args, links, nat, root / f"swarm-{'nat' if nat else 'open'}-{r}")
                runs.append(run)
                print(f"  2x2 {'all behind NAT' if nat else 'open ports    '} repeat {r}: {run['samples_per_s']:7.2f} "
                      f"samples/s, c0s0 routes {run['routes']}, load {os.getloadavg()[0]:.1f}", flush=True)
    open_rate = statistics.median(r["samples_per_s"] for r in runs if not r["nat"])
    nat_rate = statistics.median(r["samples_per_s"] for r in runs if r["nat"])
    return {"open_samples_per_s": open_rate, "nat_samples_per_s": nat_rate, "ratio": nat_rate / open_rate,
            "predicted_ratio": predicted_ratio(args), "relay_mbit": args.relay_swarm_mbit, "runs": runs}


# --------------------------------------------------------------------------- memory under slow receivers


async def _flood(topology_path: Path, relay_addr: str, seconds: float, message_bytes: int) -> int:
    """3 senders (s0..s2) flood 3 receivers (r0..r2) that dial the relay and never read."""
    import torch
    import zmq.asyncio

    from ravq.config import load_topology
    from ravq.config.routes import RELAY, RelayPoint, Route
    from ravq.metrics import Metrics
    from ravq.net.options import SocketOptions
    from ravq.net.routed import Links
    from ravq.net.transport import Inbox
    from ravq.net.wire import DecodeLimits, Message, MsgType, encode

    topo = load_topology(topology_path, resolve_task=False)
    host, port = relay_addr.rsplit(":", 1)
    point = RelayPoint("relay", host, int(port))
    ctx, opts = zmq.asyncio.Context(), SocketOptions(linger_ms=0, max_message_bytes=1 << 24, hwm=4)
    inboxes, sent = [], 0
    payload = torch.zeros(message_bytes // 4)
    try:
        links = {}
        for n in topo.nodes:
            inbox = Inbox.bind(ctx, "tcp://127.0.0.1:*", "pipeline", Metrics(n.name), DecodeLimits(), opts, me=n.name)
            inboxes.append(inbox)
            factory = Links(ctx=ctx, inbox=inbox, me=n.name, socket="pipeline", metrics=Metrics(n.name),
                            limits=DecodeLimits(), opts=opts, port_of={})
            peer = n.name.replace("s", "r") if n.name.startswith("s") else n.name.replace("r", "s")
            links[n.name] = factory.open(peer, Route(RELAY, point))
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for s in ("s0", "s1", "s2"):
                msg = Message(type=MsgType.FORWARD, sender=s, micro_batch=(0, sent), tensors={"a": payload})
                link = links[s]
                if link._try([*link._prefix, *encode(msg)]):  # never wait: offer as fast as the relay takes
                    sent += 1
            await asyncio.sleep(0.001)
    finally:
        for inbox in inboxes:
            inbox.close()
        ctx.term()
    return sent


def bench_memory(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import socket

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    port = free_port()
    names = ["s0", "s1", "s2", "r0", "r1", "r2"]
    topo = {"task": "tests.tasks_for_tests", "broker": {"pub_port": free_port(), "router_port": free_port()},
            "nodes": [{"name": n, "pipeline_port": free_port(), "ring_port": free_port()} for n in names],
            "relays": [{"name": "relay", "host": "127.0.0.1", "port": port, "queue_bytes": args.queue_mib << 20}]}
    path = root / "memory-topology.yaml"
    path.write_text(yaml.safe_dump(topo))
    log = open(root / "relay.log", "wb")  # noqa: SIM115
    relay = subprocess.Popen([sys.executable, "-m", "ravq", "relay", "--topology", str(path), "--name", "relay"],
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log, stderr=subprocess.STDOUT)
    try:
        time.sleep(3.0)
        before = _rss_kib(relay.pid, "VmRSS")
        sent = asyncio.run(_flood(path, f"127.0.0.1:{port}", args.flood_s, args.message_kib << 10))
        peak = _rss_kib(relay.pid, "VmHWM")
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(30)
    from ravq.net.relay import RELAY_HWM

    queued_bound = 3 * (args.queue_mib << 20)
    zmq_bound = 6 * 2 * RELAY_HWM * (args.message_kib << 10)  # 6 connections, RELAY_HWM each way, one frame each
    return {"senders": 3, "slow_receivers": 3, "messages_offered": sent, "message_bytes": args.message_kib << 10,
            "queue_bytes_per_destination": args.queue_mib << 20, "rss_before_mib": before / 1024,
            "peak_rss_mib": peak / 1024, "bound_mib": (before * 1024 + queued_bound + zmq_bound) / 2**20}


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for {pid}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--link-mbit", type=float, default=50.0, help="each stage's upload")
    p.add_argument("--relay-mbit", type=float, default=400.0, help="the relay PC's upload")
    p.add_argument("--task", default="benchmarks.synthetic_task:link")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--micro-batch", type=int, default=256)
    p.add_argument("--max-inflight", type=int, default=None)
    p.add_argument("--int8-block", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--queue-mib", type=int, default=16, help="memory part: the relay's queue_bytes per destination")
    p.add_argument("--message-kib", type=int, default=1024)
    p.add_argument("--flood-s", type=float, default=20.0)
    p.add_argument("--relay-swarm-mbit", type=float, default=100.0, help="swarm part: the relay PC's upload")
    p.add_argument("--only", choices=["link", "memory", "swarm"])
    p.add_argument("--quick", action="store_true", help="40 micro-batches, one repeat, 5 s of flood")
    args = p.parse_args()
    if args.quick:
        args.steps, args.repeats, args.flood_s = 40, 1, 5.0
    root = Path(tempfile.mkdtemp(prefix="ravq-nat-"))
    out: dict[str, Any] = {"benchmark": "nat", "logs": str(root)}
    if args.only in (None, "link"):
        if reason := _netns.unavailable_reason():
            sys.exit(f"bench_nat.py: the link part needs root, ip netns and tc tbf: {reason}")
        signal.signal(signal.SIGTERM, lambda signum, frame: (_ for _ in ()).throw(SystemExit(128 + signum)))
        print(f"link: 2 stages at {args.link_mbit:g} Mbit/s each, relay at {args.relay_mbit:g} Mbit/s, "
              f"{args.steps} micro-batches per run; logs in {root}", flush=True)
        out["link"] = bench_link(args, root)
        lk = out["link"]
        print(f"relayed/direct samples/s: {lk['ratio']:.3f} ({lk['relayed_samples_per_s']:.2f} / "
              f"{lk['direct_samples_per_s']:.2f}); relay CPU {lk['relay_cpu_s_per_gb']:.2f} s per GB forwarded",
              flush=True)
    if args.only in (None, "swarm"):
        out["swarm"] = sw = bench_swarm(args, root)
        print(f"2x2 all behind NAT / open ports: {sw['ratio']:.3f} measured ({sw['nat_samples_per_s']:.2f} / "
              f"{sw['open_samples_per_s']:.2f} samples/s), {sw['predicted_ratio']:.3f} predicted by the planner",
              flush=True)
    if args.only in (None, "memory"):
        out["memory"] = m = bench_memory(args, root)
        print(f"memory: relay peak RSS {m['peak_rss_mib']:.0f} MiB under 3 receivers that never read "
              f"(before traffic {m['rss_before_mib']:.0f} MiB; bound {m['bound_mib']:.0f} MiB)", flush=True)
    out["load_average"] = os.getloadavg()
    print(json.dumps({k: ({kk: vv for kk, vv in v.items() if kk != "runs"} if isinstance(v, dict) else v)
                      for k, v in out.items()}, indent=1))


if __name__ == "__main__":
    main()
