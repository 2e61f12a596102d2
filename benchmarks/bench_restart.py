"""Where a restarted node's seconds go: process start -> imports -> joined -> stage built -> caught up ->
training again, as a supervisor sees it (the clock starts when the process is started).

    python benchmarks/bench_restart.py [--restarts N] [--json]

Starts the demo task's 2x2 swarm (``ravq.tasks.charlm``, checkpoints on), waits until it trains, then
``--restarts`` times kills one node with SIGKILL and starts it again at once (as systemd's ``Restart=``
would, without its delay).  Each phase's end is read from the restarted node's own log lines (their
timestamps), the last one from the broker (``ravq status``: the node's cluster trains again):

| phase | ends at the node's log line |
| --- | --- |
| imports | the first line (``torch uses N thread(s)``): Python, torch and ravq imported |
| join | ``rejoining``: registered with the broker, plan and cluster state known |
| build | ``limits.max_message_bytes``: the stage traced, built and its checkpoint loaded |
| links | ``ready``: sockets bound and connected, averaging set up |
| catch-up | ``ready to resume``: in-flight work dropped, weights caught up from the other cluster |
| resume | the broker says the cluster trains again |

A separate line gives ``python -c 'import ravq.node'`` alone (the import part of the first phase).
The machine may be shared: compare phases of one run, and note ``uptime``'s load average.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
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

PHASES = [("imports", r"torch uses \d+ thread"), ("join", r"rejoining"), ("build", r"limits\.max_message_bytes"),
          ("links", r"ready \(\d+ parameters"), ("catch-up", r"ready to resume")]
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def topology(run_dir: Path) -> dict[str, Any]:
    ports = iter(free_ports(10))
    nodes = [{"name": f"c{c}s{s}", "pipeline_port": next(ports), "ring_port": next(ports), "cluster": c, "stage": s}
             for c in range(2) for s in range(2)]
    training = {"steps": 10_000_000, "micro_batch": 16, "sync_every": 2, "checkpoint_every": 20,
                "checkpoint_dir": str(run_dir / "ckpt")}
    return {"task": "ravq.tasks.charlm", "training": training,
            "broker": {"pub_port": next(ports), "router_port": next(ports)},
            "timeouts": {"heartbeat_interval_s": 1.0, "lost_s": 6.0}, "nodes": nodes}


def log_times(path: Path, since: float) -> dict[str, float]:
    """Wall-clock time of the first line matching each phase's pattern, written after ``since``."""
    found: dict[str, float] = {}
    for line in path.read_text(errors="replace").splitlines():
        m = _STAMP.match(line)
        if m is None:
            continue
        t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if t < since - 0.01:
            continue
        for phase, pattern in PHASES:
            if phase not in found and re.search(pattern, line):
                found[phase] = t
    return found


def import_seconds() -> float:
    t0 = time.time()
    subprocess.run([sys.executable, "-c", "import ravq.node"], cwd=REPO, check=True,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    return time.time() - t0


class Swarm:
    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.dir, self.path = run_dir, run_dir / "topology.yaml"
        self.path.write_text(yaml.safe_dump(topology(run_dir)))
        self.topology = load_topology(self.path)
        self.env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.procs["broker"] = self.spawn("broker", ["broker", "--topology", str(self.path)])
        for n in self.topology.nodes:
            self.start(n.name)

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.dir / f"{name}.log", "ab")  # noqa: SIM115 (the child holds it)
        return subprocess.Popen([sys.executable, "-m", "ravq", *argv], cwd=REPO, env=self.env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def start(self, name: str) -> float:
        t0 = time.time()
        self.procs[name] = self.spawn(name, ["node", "--topology", str(self.path), "--name", name, "--threads", "1"])
        return t0

    def status(self) -> dict[str, Any]:
        return status_once(self.topology, None, timeout_s=1.0) or {}

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def wait(what: str, check: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


def trains(status: dict[str, Any]) -> bool:
    """Both clusters train and every stage took more than 20 steps."""
    members, clusters = status.get("members", {}), status.get("clusters", [])
    return (len(members) == 4 and all(m.get("stats", {}).get("version", 0) > 20 for m in members.values())
            and len(clusters) == 2 and all(c.get("state") == "training" for c in clusters))


def one_restart(swarm: Swarm, victim: str) -> dict[str, float]:
    cluster = int(victim[1])

    def cluster_state() -> dict[str, Any]:
        return (swarm.status().get("clusters") or [{}, {}])[cluster]

    gen = cluster_state().get("generation", 0)
    swarm.procs[victim].send_signal(signal.SIGKILL)
    swarm.procs[victim].wait()
    t0 = swarm.start(victim)
    wait("the cluster to train again", lambda: (cs := cluster_state()).get("state") == "training"
         and cs.get("generation", 0) > gen, 180)
    t_end = time.time()
    marks = log_times(swarm.dir / f"{victim}.log", t0)
    out, prev = {}, t0
    for phase, _ in PHASES:
        if phase in marks:
            out[phase] = round(marks[phase] - prev, 2)
            prev = marks[phase]
    out["resume"] = round(t_end - prev, 2)
    out["total"] = round(t_end - t0, 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--restarts", type=int, default=4)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    imports = [round(import_seconds(), 2) for _ in range(3)]
    root = Path(tempfile.mkdtemp(prefix="rq27-restart-"))
    swarm = Swarm(root)
    results = []
    try:
        wait("the swarm to train", lambda: trains(swarm.status()), 240)
        victims = ["c1s1", "c0s0", "c1s0", "c0s1"]
        for i in range(args.restarts):
            wait("the swarm to train", lambda: trains(swarm.status()), 240)
            results.append({"victim": victims[i % 4], **one_restart(swarm, victims[i % 4])})
            time.sleep(5)
    finally:
        swarm.close()
    phases = [ph for ph, _ in PHASES] + ["resume", "total"]
    print(f"`python -c 'import ravq.node'`: {', '.join(f'{x:.2f}' for x in imports)} s")
    print(f"{'victim':<8}" + "".join(f"{ph:>10}" for ph in phases))
    for r in results:
        print(f"{r['victim']:<8}" + "".join(f"{r.get(ph, float('nan')):>10.2f}" for ph in phases))
    medians = {ph: round(statistics.median(r[ph] for r in results if ph in r), 2) for ph in phases
               if any(ph in r for r in results)}
    print(f"{'median':<8}" + "".join(f"{medians.get(ph, float('nan')):>10.2f}" for ph in phases))
    if args.json:
        print(json.dumps({"import_ravq_node_s": imports, "restarts": results, "median": medians}))


if __name__ == "__main__":
    main()
