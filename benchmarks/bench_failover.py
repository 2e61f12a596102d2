"""Training across a broker failover (issue #37 part 3): a 2x2 swarm with a backup broker, a node killed -9,
and the primary broker killed -9 a second later, against the same churn with the broker left alone, in
the same run.

Each run: the swarm trains (``tests.churn_task`` capped at ``--rate`` micro-batches/s per cluster, so
both runs share the ceiling a healthy cluster holds), ``c1s1`` is killed -9, (failover run only) the
primary 1 s later, ``c1s1`` restarted 3 s after its kill.  Printed per run: the seconds from the
primary's kill to the backup answering as active, from ``c1s1``'s restart to its cluster training again,
and the micro-batches each cluster trained in the ``--window-s`` seconds after the node's kill; then
the failover run's over the other's (the throughput ratio).  The load average is printed beside.

    flock /tmp/ravq/bench.lock .venv/bin/python benchmarks/bench_failover.py [--window-s 20] [--keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from brokers.pair import as_backup
from ravq.cli.demo import free_ports
from ravq.cli.status import status_once
from ravq.config import load_topology
from tests.swarm import Swarm, local_topology

HEARTBEAT_S, LOST_S = 0.5, 2.5


def _one(topology_path: Path, backup: bool) -> dict[str, Any] | None:
    topology = load_topology(topology_path, resolve_task=False)
    topology = as_backup(topology, {}) if backup else topology
    alone = topology.model_copy(update={"broker": topology.broker.model_copy(update={"backup": None})})
    return status_once(alone, None, timeout_s=0.5)


def _until(what: str, check: Any, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return time.time()
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {what}")


def _run(tmp: Path, rate: float, steps: int, window_s: float, failover: bool) -> dict[str, float]:
    tmp.mkdir(parents=True)
    training = {"steps": steps, "micro_batch": 4, "sync_every": 5, "checkpoint_every": 40,
                "checkpoint_dir": str(tmp / "ckpt")}
    topo = local_topology("tests.churn_task", [2, 2], training,
                          timeouts={"heartbeat_interval_s": HEARTBEAT_S, "lost_s": LOST_S,
                                    "ring_step_s": 5.0})
    pub, router = free_ports(2)
    topo["broker"]["backup"] = {"host": "127.0.0.1", "pub_port": pub, "router_port": router}
    env = {"CHURN_TASK_PAUSE_S": str(1 / rate)}
    swarm = Swarm(tmp, topo, env={n["name"]: dict(env) for n in topo["nodes"]})
    try:
        def version(s: dict[str, Any] | None, node: str) -> int:
            return int(((s or {}).get("members", {}).get(node, {}).get("stats") or {}).get("version", 0))

        _until("training", lambda: all(version(_one(swarm.path, False), n) > 50 for n in swarm.nodes), 180)
        time.sleep(3.0)
        swarm.nodes["c1s1"].send_signal(signal.SIGKILL)
        t_node = time.time()
        figures = {}
        if failover:
            time.sleep(1.0)
            swarm.broker.send_signal(signal.SIGKILL)
            t_kill = time.time()
            t_active = _until("the backup", lambda: ((_one(swarm.path, True) or {}).get("pair") or {})
                              .get("state") == "active", 30)
            figures["takeover_s"] = t_active - t_kill
        time.sleep(max(0.0, t_node + 3.0 - time.time()))
        swarm.start("c1s1")
        t_back = time.time()
        serving = failover

        def trains() -> bool:
            c = ((_one(swarm.path, serving) or {}).get("clusters") or [{}, {}])[1]
            return c.get("state") == "training" and c.get("generation", 0) >= 1

        figures["rejoin_s"] = _until("cluster 1 to train again", trains, 90) - t_back
        time.sleep(max(0.0, t_node + window_s - time.time()))
        swarm.wait(timeout_s=600)
    finally:
        swarm.close()
    for c in (0, 1):
        times = swarm.summary(f"c{c}s0")["update_times"]
        figures[f"cluster{c}"] = sum(t_node <= t < t_node + window_s for t in times)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=40.0, help="micro-batches/s a cluster trains at most")
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--keep", type=Path, help="run in this (new) directory and keep the logs")
    args = parser.parse_args()
    steps = int(args.rate * (args.window_s + 30))
    with contextlib.ExitStack() as stack:
        tmp = args.keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_failover"))
        base = _run(Path(tmp) / "a", args.rate, steps, args.window_s, failover=False)
        with open("/proc/loadavg") as f:
            print(f"node killed, broker alone:       {base}   load {f.read().split()[:3]}", flush=True)
        over = _run(Path(tmp) / "b", args.rate, steps, args.window_s, failover=True)
        with open("/proc/loadavg") as f:
            print(f"node killed, then the primary:   {over}   load {f.read().split()[:3]}", flush=True)
    total = (over["cluster0"] + over["cluster1"]) / max(1, base["cluster0"] + base["cluster1"])
    print(f"micro-batches in the {args.window_s:g} s after the node's kill, failover over broker alone: "
          f"cluster 0 x{over['cluster0'] / max(1, base['cluster0']):.3f}, cluster 1 "
          f"x{over['cluster1'] / max(1, base['cluster1']):.3f}, both x{total:.3f} (the issue's \"training "
          f"goes on at >= 0.95x\": the whole swarm)")


if __name__ == "__main__":
    main()
