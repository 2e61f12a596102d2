"""Training through churn: a 2x2 swarm with a random node killed every M seconds and restarted R seconds
later (as systemd's Restart= would), against the same swarm left alone, in the same invocation.

    python benchmarks/bench_churn.py [--minutes N] [--kill-every M] [--restart-after R] [--quick] [--json]

Both runs train the demo task (``ravq.tasks.charlm``) for the same wall time.  Progress is what the
clusters finished and kept: each cluster's stage 0 counts the micro-batches whose backward completed
(a restarted stage 0 starts again from its checkpoint, so work lost to a kill is not counted).  Printed:
samples/s of both and their ratio, the final loss of both (mean of the clusters' last stages' recent
losses; the undisturbed run's loss is also given at the same number of samples, which separates what
churn costs in speed from what it costs in learning), and recovery seconds (kill to the cluster
training again) p50/p90.  The machine may be shared: compare ratios, not absolute figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
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

TASK = "ravq.tasks.charlm"


def topology(run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    ports = iter(free_ports(10))
    nodes = [{"name": f"c{c}s{s}", "pipeline_port": next(ports), "ring_port": next(ports), "cluster": c, "stage": s}
             for c in range(2) for s in range(2)]
    training = {"steps": 10_000_000, "micro_batch": args.micro_batch, "sync_every": 2,
                "checkpoint_every": args.checkpoint_every, "checkpoint_dir": str(run_dir / "ckpt")}
    return {"task": TASK, "training": training, "broker": {"pub_port": next(ports), "router_port": next(ports)},
            "timeouts": {"heartbeat_interval_s": 1.0, "lost_s": args.lost_s}, "nodes": nodes}


class Run:
    def __init__(self, run_dir: Path, args: argparse.Namespace) -> None:
        run_dir.mkdir(parents=True)
        self.dir, self.path = run_dir, run_dir / "topology.yaml"
        self.path.write_text(yaml.safe_dump(topology(run_dir, args)))
        self.topology = load_topology(self.path)
        self.env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.broker = self._spawn(["broker", "--topology", str(self.path)], "broker")
        self.nodes = {n.name: self._start(n.name) for n in self.topology.nodes}
        self.samples: list[tuple[float, dict[str, Any]]] = []

    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen[bytes]:
        log = open(self.dir / f"{name}.log", "ab")  # noqa: SIM115 (the child holds it)
        return subprocess.Popen([sys.executable, "-m", "ravq", *argv], cwd=REPO, env=self.env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def _start(self, name: str) -> subprocess.Popen[bytes]:
        return self._spawn(["node", "--topology", str(self.path), "--name", name, "--threads", "1"], name)

    def poll(self) -> dict[str, Any] | None:
        status = status_once(self.topology, None, timeout_s=1.0)
        if status is not None:
            self.samples.append((time.monotonic(), status))
        return status

    def progress(self, status: dict[str, Any]) -> tuple[int, float | None]:
        """(micro-batches finished over both clusters, mean recent loss of the last stages)."""
        members = status.get("members", {})
        trained = sum(int(members.get(f"c{c}s0", {}).get("stats", {}).get("trained", 0)) for c in range(2))
        losses = [members.get(f"c{c}s1", {}).get("stats", {}).get("loss_recent") for c in range(2)]
        known = [x for x in losses if x is not None]
        return trained, (sum(known) / len(known) if known else None)

    def close(self) -> None:
        for proc in [*self.nodes.values(), self.broker]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def wait_training(run: Run, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = run.poll()
        if status and all(m.get("stats", {}).get("version", 0) > 2 for m in status.get("members", {}).values()) \
                and len(status.get("members", {})) == 4:
            return
        time.sleep(0.5)
    raise TimeoutError("the swarm did not start training")


def measure(run: Run, seconds: float, churn: argparse.Namespace | None, rng: random.Random) -> dict[str, Any]:
    """Train for ``seconds``; with ``churn``, kill a random node every kill_every s, restart it
    restart_after s later, and time each recovery (kill -> its cluster training again)."""
    wait_training(run)
    start = run.poll() or {}
    t0 = time.monotonic()
    trained0, _ = run.progress(start)
    next_kill = t0 + (churn.kill_every if churn else float("inf"))
    pending: list[dict[str, Any]] = []
    recoveries: list[float] = []
    kills = 0
    while time.monotonic() - t0 < seconds:
        now = time.monotonic()
        if now >= next_kill:
            victim = rng.choice(sorted(run.nodes))
            cluster = int(victim[1])
            status = run.poll() or {}
            gen = (status.get("clusters") or [{}, {}])[cluster].get("generation", 0)
            run.nodes[victim].send_signal(signal.SIGKILL)
            run.nodes[victim].wait()
            kills += 1
            pending.append({"victim": victim, "cluster": cluster, "gen": gen, "killed": now, "restarted": False})
            next_kill = now + churn.kill_every  # type: ignore[union-attr]
        for event in pending:
            if not event["restarted"] and now - event["killed"] >= churn.restart_after:  # type: ignore[union-attr]
                run.nodes[event["victim"]] = run._start(event["victim"])
                event["restarted"] = True
        status = run.poll()
        if status is not None:
            for event in list(pending):
                cs = (status.get("clusters") or [{}, {}])[event["cluster"]]
                if event["restarted"] and cs.get("state") == "training" and cs.get("generation", 0) > event["gen"]:
                    recoveries.append(time.monotonic() - event["killed"])
                    pending.remove(event)
        time.sleep(0.25)
    end = run.poll() or run.samples[-1][1]
    trained, loss = run.progress(end)
    elapsed = time.monotonic() - t0
    curve = [(ts - t0, *run.progress(s)) for ts, s in run.samples if ts >= t0]
    return {"seconds": elapsed, "micro_batches": trained - trained0, "trained_total": trained,
            "samples_per_s": (trained - trained0) * run.topology.training.micro_batch / elapsed,
            "final_loss": loss, "kills": kills, "recoveries_s": recoveries, "unrecovered": len(pending),
            "curve": curve}


def loss_at(curve: list[tuple[float, int, float | None]], trained: int) -> float | None:
    """The loss a run showed when it had finished ``trained`` micro-batches (first sample past it)."""
    for _, done, loss in curve:
        if done >= trained and loss is not None:
            return loss
    return None


def one(args: argparse.Namespace, root: Path, name: str, churn: bool) -> dict[str, Any]:
    run = Run(root / name, args)
    try:
        return measure(run, args.minutes * 60, args if churn else None, random.Random(args.seed))
    finally:
        run.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=3.0, help="training time of each run")
    p.add_argument("--kill-every", type=float, default=60.0, help="seconds between kills")
    p.add_argument("--restart-after", type=float, default=5.0, help="seconds from a kill to the restart")
    p.add_argument("--lost-s", type=float, default=6.0)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the run directories (logs)")
    p.add_argument("--quick", action="store_true", help="1 minute, a kill every 20 s (a smoke run)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.minutes, args.kill_every, args.restart_after = 1.0, 20.0, 3.0
    root = Path(tempfile.mkdtemp(prefix="rq11-churn-"))
    base = one(args, root, "undisturbed", churn=False)
    churn = one(args, root, "churn", churn=True)
    rec = sorted(churn["recoveries_s"])
    result = {
        "minutes": args.minutes, "kill_every_s": args.kill_every, "restart_after_s": args.restart_after,
        "samples_per_s": {"undisturbed": round(base["samples_per_s"], 1), "churn": round(churn["samples_per_s"], 1)},
        "ratio": round(churn["samples_per_s"] / base["samples_per_s"], 3) if base["samples_per_s"] else None,
        "final_loss": {"undisturbed": base["final_loss"], "churn": churn["final_loss"],
                       "undisturbed_at_same_samples": loss_at(base["curve"], churn["trained_total"])},
        "kills": churn["kills"], "unrecovered": churn["unrecovered"],
        "recovery_s": {"p50": round(statistics.median(rec), 1) if rec else None,
                       "p90": round(rec[min(len(rec) - 1, int(0.9 * len(rec)))], 1) if rec else None,
                       "all": [round(x, 1) for x in rec]},
        "run_dir": str(root) if args.keep else None,
    }
    if not args.keep:
        import shutil
        shutil.rmtree(root, ignore_errors=True)
    print(f"undisturbed: {base['samples_per_s']:.1f} samples/s, final loss {base['final_loss']}")
    print(f"churn ({churn['kills']} kills, restart after {args.restart_after:g}s): {churn['samples_per_s']:.1f} "
          f"samples/s, final loss {churn['final_loss']}; ratio {result['ratio']}")
    print(f"recovery (kill -> cluster trains again): p50 {result['recovery_s']['p50']}s, "
          f"p90 {result['recovery_s']['p90']}s")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
