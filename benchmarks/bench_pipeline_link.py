"""Pipeline compression over a slow link: a 2-stage cluster whose link is shaped to 50 Mbit/s.

Two real ``ravq node`` processes (and a broker) each in a network namespace of its own, joined by a
bridge; each stage's upload is shaped by tc tbf (benchmarks/_netns.py), so forward activations cross
stage 0's uplink and gradients stage 1's, as between two PCs on home links.  By default the stages are
simulated device time (``benchmarks.synthetic_task:link``: 30 ms of a stage's time per micro-batch off
the CPU, 0.5 MB of activations), so what is measured is the link and not this machine's shared cores.
The same cluster trains the same task with ``training.compress.pipeline`` none, bf16 and int8, one after another and
``--repeats`` times round, in one invocation; the figure is each setting's samples/s (median over
repeats) over none's.  Samples/s is the demo's: samples the last stage finished over the training
wall time of the slower stage.  Needs root, ``ip netns`` and tc tbf.

    python benchmarks/bench_pipeline_link.py [--link-mbit 50] [--steps 200] [--repeats 2]
                                             [--formats none bf16 int8] [--quick] [--json]
"""

from __future__ import annotations

import argparse
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
import yaml

PIPELINE_PORT, RING_PORT, PUB_PORT, ROUTER_PORT = 7101, 7102, 7103, 7104
NETNS_PREFIX = "rq15p"


def topology(args: argparse.Namespace, links: list[_netns.Link], fmt: str) -> dict[str, Any]:
    nodes = [{"name": f"s{i}", "host": link.address, "pipeline_port": PIPELINE_PORT, "ring_port": RING_PORT,
              "cluster": 0, "stage": i} for i, link in enumerate(links)]
    training: dict[str, Any] = {"micro_batch": args.micro_batch, "steps": args.steps,
                                "compress": {"pipeline": fmt, "int8_block": args.int8_block}}
    if args.max_inflight:
        training["max_inflight"] = args.max_inflight
    return {"task": args.task, "seed": args.seed, "training": training,
            "timeouts": {"connect_s": 120.0, "peer_s": 120.0, "drain_s": 15.0},
            "broker": {"host": links[0].address, "pub_port": PUB_PORT, "router_port": ROUTER_PORT},
            "nodes": nodes}


def _in_netns(link: _netns.Link, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(["ip", "netns", "exec", link.netns, sys.executable, "-m", "ravq", *argv],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_once(args: argparse.Namespace, links: list[_netns.Link], fmt: str, run_dir: Path) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    topo_path = run_dir / "topology.yaml"
    topo_path.write_text(yaml.safe_dump(topology(args, links, fmt), sort_keys=False))
    broker = _in_netns(links[0], ["broker", "--topology", str(topo_path)], run_dir / "broker.log")
    nodes = [_in_netns(link, ["node", "--topology", str(topo_path), "--name", f"s{i}", "--threads", "1",
                              "--summary", str(run_dir / f"summary-s{i}.json")], run_dir / f"s{i}.log")
             for i, link in enumerate(links)]
    try:
        deadline = time.monotonic() + args.timeout
        for node in nodes:
            node.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{fmt}: the cluster did not finish within {args.timeout:.0f}s; logs in {run_dir}") from None
    finally:
        for proc in [*nodes, broker]:
            _stop(proc)
    if any(n.returncode != 0 for n in nodes):
        raise SystemExit(f"{fmt}: a node failed; logs in {run_dir}")
    summaries = [json.loads((run_dir / f"summary-s{i}.json").read_text()) for i in range(len(links))]
    last = summaries[-1]
    wall = max(s["wall_s"] for s in summaries)
    return {"format": fmt, "samples": last["samples"], "wall_s": wall, "samples_per_s": last["samples"] / wall,
            "loss_final": last.get("loss_recent"), "bad_messages": sum(s["bad_messages"] for s in summaries),
            "payload_wire_bytes_sent": sum(s["payload_wire_bytes_sent"] for s in summaries),
            "payload_logical_bytes_sent": sum(s["payload_logical_bytes_sent"] for s in summaries),
            "busy_fraction": [s["busy_fraction"] for s in summaries]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--link-mbit", type=float, default=50.0, help="each stage's upload, Mbit/s")
    p.add_argument("--formats", nargs="+", choices=["none", "bf16", "fp16", "int8"], default=["none", "bf16", "int8"])
    p.add_argument("--task", default="benchmarks.synthetic_task:link",
                   help="default: equal stages of simulated device time (benchmarks/synthetic_task.py), so the "
                        "link, not this machine's shared CPUs, decides; ravq.tasks.charlm is the demo's task")
    p.add_argument("--steps", type=int, default=200, help="micro-batches the cluster trains on per run")
    p.add_argument("--micro-batch", type=int, default=256)
    p.add_argument("--max-inflight", type=int, default=None, help="default: a node's (the number of stages)")
    p.add_argument("--int8-block", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per run")
    p.add_argument("--quick", action="store_true", help="40 micro-batches, one repeat")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.steps, args.repeats = 40, 1
    if "none" not in args.formats:
        args.formats.insert(0, "none")
    if reason := _netns.unavailable_reason():
        sys.exit(f"bench_pipeline_link.py: needs root, ip netns and tc tbf: {reason}")
    signal.signal(signal.SIGTERM, lambda signum, frame: (_ for _ in ()).throw(SystemExit(128 + signum)))
    root = Path(tempfile.mkdtemp(prefix="ravq-pipeline-link-"))
    print(f"2 stages, {args.task}, micro-batch {args.micro_batch}, {args.steps} micro-batches per run, each "
          f"stage's upload shaped to {args.link_mbit:g} Mbit/s; logs in {root}", flush=True)
    runs: list[dict[str, Any]] = []
    with _netns.shaped_links(2, args.link_mbit, NETNS_PREFIX) as links:
        for r in range(args.repeats):
            for fmt in args.formats:
                run = run_once(args, links, fmt, root / f"{fmt}-{r}")
                runs.append(run)
                print(f"  {fmt:<5} repeat {r}: {run['samples_per_s']:7.1f} samples/s, wire/logical bytes "
                      f"{run['payload_wire_bytes_sent'] / max(1, run['payload_logical_bytes_sent']):.3f}, "
                      f"final loss {run['loss_final']:.3f}, busy {', '.join(f'{b:.2f}' for b in run['busy_fraction'])}",
                      flush=True)
    rate = {fmt: statistics.median(r["samples_per_s"] for r in runs if r["format"] == fmt) for fmt in args.formats}
    summary = {"benchmark": "pipeline_link", "link_mbit": args.link_mbit, "steps": args.steps,
               "micro_batch": args.micro_batch, "repeats": args.repeats, "samples_per_s": rate,
               "ratio_over_none": {fmt: rate[fmt] / rate["none"] for fmt in args.formats}, "runs": runs}
    for fmt in args.formats:
        print(f"{fmt:<5} {rate[fmt]:7.1f} samples/s   x{rate[fmt] / rate['none']:.2f} over none")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
