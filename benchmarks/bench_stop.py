"""How fast `systemctl stop` is: a 2x2 swarm of the demo task; SIGTERM one node while the others train
(its exit time, and when the broker shows its cluster paused), then SIGTERM all four at once (each
one's exit time), measured from outside as a supervisor sees it.

    python benchmarks/bench_stop.py [--repo PATH] [--rounds N] [--json]

``--repo`` runs another checkout's ravq (e.g. the main branch, to compare with the drain it did before
issue #27: up to ``timeouts.drain_s`` for a round whose peers had left).  The machine may be shared:
write the load average beside every figure.
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

import yaml

from ravq.cli.demo import free_ports
from ravq.cli.status import status_once
from ravq.config import load_topology


class Swarm:
    def __init__(self, run_dir: Path, repo: Path) -> None:
        ports = iter(free_ports(10))
        nodes = [{"name": f"c{c}s{s}", "pipeline_port": next(ports), "ring_port": next(ports), "cluster": c,
                  "stage": s} for c in range(2) for s in range(2)]
        topo = {"task": "ravq.tasks.charlm", "nodes": nodes,
                "training": {"steps": 10_000_000, "micro_batch": 8, "sync_every": 2, "checkpoint_every": 50,
                             "checkpoint_dir": str(run_dir / "ckpt")},
                "broker": {"pub_port": next(ports), "router_port": next(ports)},
                "timeouts": {"heartbeat_interval_s": 1.0, "lost_s": 6.0, "drain_s": 20.0}}
        self.dir, self.path = run_dir, run_dir / "topology.yaml"
        self.path.write_text(yaml.safe_dump(topo))
        self.topology = load_topology(self.path)
        self.env = {**os.environ, "PYTHONPATH": str(repo)}
        self.broker = self._spawn(["broker", "--topology", str(self.path)], "broker")
        self.nodes = {n["name"]: self.start(n["name"]) for n in nodes}

    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen[bytes]:
        log = open(self.dir / f"{name}.log", "ab")  # noqa: SIM115 (the child holds it)
        return subprocess.Popen([sys.executable, "-m", "ravq", *argv], cwd=self.dir, env=self.env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def start(self, name: str) -> subprocess.Popen[bytes]:
        return self._spawn(["node", "--topology", str(self.path), "--name", name, "--threads", "1"], name)

    def status(self) -> dict[str, Any]:
        return status_once(self.topology, None, timeout_s=1.0) or {}

    def wait_training(self, above: int = 5, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = self.status()
            members = st.get("members", {})
            if len(members) == 4 and all(c.get("state") == "training" for c in st.get("clusters", [])) and all(
                    m.get("stats", {}).get("version", 0) > above for m in members.values()):
                return
            time.sleep(0.5)
        raise TimeoutError("the swarm did not train")

    def close(self) -> None:
        for proc in [*self.nodes.values(), self.broker]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def stop(procs: dict[str, subprocess.Popen[bytes]]) -> dict[str, float]:
    t0 = time.monotonic()
    for proc in procs.values():
        proc.send_signal(signal.SIGTERM)
    took = {}
    for name, proc in procs.items():
        proc.wait(60)
        took[name] = round(time.monotonic() - t0, 2)
    return took


def one_round(swarm: Swarm) -> dict[str, Any]:
    swarm.wait_training()
    generation = swarm.status()["clusters"][1]["generation"]
    t0 = time.monotonic()
    swarm.nodes["c1s1"].send_signal(signal.SIGTERM)
    exited = paused = None
    while (exited is None or paused is None) and time.monotonic() - t0 < 60:
        if exited is None and swarm.nodes["c1s1"].poll() is not None:
            exited = round(time.monotonic() - t0, 2)
        if paused is None and swarm.status().get("clusters", [{}, {}])[1].get("generation", 0) > generation:
            paused = round(time.monotonic() - t0, 2)  # as `ravq status` sees it (a poll takes up to 1 s)
        time.sleep(0.05)
    one = {"exit_s": exited, "cluster_paused_s": paused}
    swarm.nodes["c1s1"].wait(60)
    swarm.nodes["c1s1"] = swarm.start("c1s1")
    swarm.wait_training()
    return {"stop_one": one, "stop_all": stop(swarm.nodes)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", type=Path, default=REPO)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="ravq-bench-stop-") as tmp:
        for r in range(args.rounds):
            run_dir = Path(tmp) / f"r{r}"
            run_dir.mkdir()
            swarm = Swarm(run_dir, args.repo)
            try:
                results.append(one_round(swarm))
            finally:
                swarm.close()
    all_exits = [s for r in results for s in r["stop_all"].values()]
    summary = {"repo": str(args.repo), "rounds": results, "stop_all_max_s": max(all_exits),
               "stop_all_median_s": statistics.median(all_exits), "load": os.getloadavg()}
    for r in results:
        print(f"stop one: exit {r['stop_one']['exit_s']} s, its cluster paused after "
              f"{r['stop_one']['cluster_paused_s']} s; stop all: {r['stop_all']}")
    print(f"stop all: median {summary['stop_all_median_s']} s, max {summary['stop_all_max_s']} s "
          f"(load {summary['load'][0]:.1f})")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
