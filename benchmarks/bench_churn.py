"""Training through churn: a 2x2 swarm with a random node killed every M seconds and restarted R seconds
later (as systemd's Restart= would), against the same swarm left alone, in the same invocation; with
``--mix`` a third run where some faults are clean stops (SIGTERM, restarted once the node exited) and
one is a power cut (the broker and every node killed, all restarted).

    python benchmarks/bench_churn.py [--minutes N] [--kill-every M] [--restart-after R] [--mix] [--beside] [--quick] [--json]

With ``--beside`` a second 2x2 swarm trains, undisturbed, beside both runs: the PC is busy (the issue's
"restart on a busy PC" case).

Everything is measured from outside the processes, as a supervisor sees it: a recovery runs from the
fault (kill, SIGTERM, power cut) to the broker reporting the cluster training again, so the node's
process start (Python, torch, tracing its stage) is in it.

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
from churn_sim import node_rounds, simulate_runs

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
    # state_dir: the run survives the power cut (without it the restarted broker starts a new run and every
    # node refuses its checkpoints of the old one)
    broker = {"pub_port": next(ports), "router_port": next(ports), "state_dir": str(run_dir / "broker")}
    return {"task": TASK, "training": training, "broker": broker,
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

    def restart_all(self) -> None:
        """After a power cut: the broker's PC and every node's come back (systemd starts the units)."""
        self.broker = self._spawn(["broker", "--topology", str(self.path)], "broker")
        self.nodes = {n.name: self._start(n.name) for n in self.topology.nodes}

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


def schedule(args: argparse.Namespace, seconds: float) -> list[str]:
    """The kind of each event, one every kill_every s: kills, with ``--stops`` clean stops (every third
    event from the third) and, with ``--power-cut``, one power cut in the middle."""
    n = max(1, int(seconds // args.kill_every) - (1 if seconds % args.kill_every == 0 else 0))
    kinds = ["kill"] * n
    for i in range(2, n, 3)[:args.stops]:
        kinds[i] = "stop"
    if args.power_cut:
        kinds[min(n - 1, n // 2 + (1 if kinds[n // 2] == "stop" else 0))] = "power_cut"
    return kinds


class Events:
    """Faults in flight: what was done when, the restarts due, and each recovery as the broker reports it
    (a cluster training again in a newer generation; after a power cut, every cluster training under the
    new broker)."""

    def __init__(self, run: Run, restart_after: float) -> None:
        self.run, self.restart_after = run, restart_after
        self.pending: list[dict[str, Any]] = []
        self.done: list[dict[str, Any]] = []

    def fault(self, kind: str, victim: str, status: dict[str, Any]) -> None:
        now = time.monotonic()
        event: dict[str, Any] = {"kind": kind, "victim": victim, "at": now, "restart_at": None}
        if kind == "power_cut":
            event["versions_before"] = {n: m.get("stats", {}).get("version", 0)
                                        for n, m in status.get("members", {}).items()}
            for proc in [*self.run.nodes.values(), self.run.broker]:
                proc.send_signal(signal.SIGKILL)
            for proc in [*self.run.nodes.values(), self.run.broker]:
                proc.wait()
            for other in self.pending:  # interrupted: the new broker starts from generation 0
                other["interrupted"] = True
                self.done.append(other)
            self.pending.clear()
            event["restart_at"] = time.monotonic() + self.restart_after
        else:
            event["cluster"] = int(victim[1])
            event["gen"] = (status.get("clusters") or [{}, {}])[event["cluster"]].get("generation", 0)
            proc = self.run.nodes[victim]
            proc.send_signal(signal.SIGKILL if kind == "kill" else signal.SIGTERM)
            if kind == "kill":
                proc.wait()
                event["restart_at"] = time.monotonic() + self.restart_after
        self.pending.append(event)

    def step(self, status: dict[str, Any] | None) -> None:
        now = time.monotonic()
        for e in self.pending:
            if e["kind"] == "stop" and e["restart_at"] is None and self.run.nodes[e["victim"]].poll() is not None:
                e["stop_s"], e["exit_code"] = now - e["at"], self.run.nodes[e["victim"]].returncode
                e["restart_at"] = now + self.restart_after  # systemctl restart, or a PC that reboots
            if e["restart_at"] is not None and now >= e["restart_at"] and not e.get("restarted"):
                if e["kind"] == "power_cut":
                    self.run.restart_all()
                else:
                    self.run.nodes[e["victim"]] = self.run._start(e["victim"])
                e["restarted"] = True
        if status is None:
            return
        clusters = status.get("clusters") or []
        for e in list(self.pending):
            if not e.get("restarted"):
                continue
            if e["kind"] == "power_cut":
                members = status.get("members", {})
                back = len(clusters) == 2 and all(c.get("state") == "training" for c in clusters) and all(
                    m.get("state") == "up" and m.get("stats", {}).get("version", 0) > 0 for m in members.values())
                if back:
                    e["versions_after"] = {n: m.get("stats", {}).get("version", 0) for n, m in members.items()}
            else:
                cs = clusters[e["cluster"]] if len(clusters) > e["cluster"] else {}
                back = cs.get("state") == "training" and cs.get("generation", 0) > e["gen"]
            if back:
                e["recovery_s"] = time.monotonic() - e["at"]
                self.pending.remove(e)
                self.done.append(e)


def measure(run: Run, seconds: float, churn: argparse.Namespace | None, rng: random.Random) -> dict[str, Any]:
    """Train for ``seconds``; with ``churn``, one event every kill_every s (``schedule``): a kill -9 of a
    random node, restarted restart_after s later (as systemd's Restart= would); a clean stop (SIGTERM,
    restarted restart_after s after it exited); a power cut (kill -9 of the broker and every node, all
    restarted restart_after s later).  Each recovery is timed from the fault to the broker saying the
    cluster trains again: as a supervisor sees it, process start included."""
    wait_training(run)
    start = run.poll() or {}
    t0 = time.monotonic()
    load0 = os.getloadavg()
    trained0, _ = run.progress(start)
    kinds = schedule(churn, seconds) if churn else []
    events = Events(run, churn.restart_after if churn else 0.0)
    next_event, done_work, last_trained = t0 + (churn.kill_every if churn else float("inf")), 0, trained0
    while time.monotonic() - t0 < seconds:
        now = time.monotonic()
        if now >= next_event and kinds:
            kind = kinds.pop(0)
            events.fault(kind, rng.choice(sorted(run.nodes)), run.poll() or {})
            next_event = now + churn.kill_every  # type: ignore[union-attr]
        status = run.poll()
        events.step(status)
        if status is not None:
            trained, _ = run.progress(status)
            done_work += max(0, trained - last_trained) if len(status.get("members", {})) == 4 else 0
            last_trained = trained if len(status.get("members", {})) == 4 else last_trained
        time.sleep(0.25)
    end = run.poll() or run.samples[-1][1]
    trained, loss = run.progress(end)
    elapsed = time.monotonic() - t0
    curve = [(ts - t0, *run.progress(s)) for ts, s in run.samples if ts >= t0]
    for e in events.done + events.pending:
        e["t"] = e["at"] - t0
    return {"seconds": elapsed, "micro_batches": trained - trained0, "trained_total": trained,
            "samples_per_s": (trained - trained0) * run.topology.training.micro_batch / elapsed,
            "work_samples_per_s": done_work * run.topology.training.micro_batch / elapsed,
            "final_loss": loss, "events": events.done, "unrecovered": events.pending, "curve": curve,
            "rounds": node_rounds(run.samples, t0),
            "load": [round(x, 2) for x in (*load0, *os.getloadavg())]}


def summary(events: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    rec = sorted(e["recovery_s"] for e in events if e["kind"] == kind and "recovery_s" in e)
    out: dict[str, Any] = {"count": sum(e["kind"] == kind for e in events),
                           "p50": round(statistics.median(rec), 1) if rec else None,
                           "p90": round(rec[min(len(rec) - 1, int(0.9 * len(rec)))], 1) if rec else None,
                           "all": [round(x, 1) for x in rec]}
    if kind == "stop":
        out["stop_s"] = [round(e["stop_s"], 1) for e in events if e["kind"] == kind and "stop_s" in e]
        out["exit_codes"] = [e.get("exit_code") for e in events if e["kind"] == kind]
    if kind == "power_cut":
        out["versions"] = [{"before": e.get("versions_before"), "after": e.get("versions_after")}
                           for e in events if e["kind"] == kind]
    return out


def loss_at(curve: list[tuple[float, int, float | None]], trained: int) -> float | None:
    """The loss a run showed when it had finished ``trained`` micro-batches (first sample past it)."""
    for _, done, loss in curve:
        if done >= trained and loss is not None:
            return loss
    return None


def one(args: argparse.Namespace, root: Path, name: str, churn: argparse.Namespace | None) -> dict[str, Any]:
    run = Run(root / name, args)
    try:
        return measure(run, args.minutes * 60, churn, random.Random(args.seed))
    finally:
        run.close()


def report(name: str, base: dict[str, Any], run: dict[str, Any], restart_after: float) -> dict[str, Any]:
    events = run["events"] + run["unrecovered"]
    out = {"samples_per_s": round(run["samples_per_s"], 1), "work_samples_per_s": round(run["work_samples_per_s"], 1),
           "ratio": round(run["samples_per_s"] / base["samples_per_s"], 3) if base["samples_per_s"] else None,
           "final_loss": run["final_loss"], "undisturbed_loss_at_same_samples": loss_at(base["curve"],
                                                                                         run["trained_total"]),
           "kill": summary(events, "kill"), "stop": summary(events, "stop"), "power_cut": summary(events, "power_cut"),
           "interrupted": sum(bool(e.get("interrupted")) for e in events),
           "unrecovered": [e["kind"] for e in run["unrecovered"]], "load": run["load"]}
    print(f"{name}: {run['samples_per_s']:.1f} samples/s kept ({run['work_samples_per_s']:.1f} trained), ratio "
          f"{out['ratio']}, final loss {run['final_loss']}; load {run['load'][:3]} -> {run['load'][3:]}")
    for kind in ("kill", "stop", "power_cut"):
        k = out[kind]
        if k["count"]:
            extra = f", stop took {k['stop_s']} s (exit {k['exit_codes']})" if kind == "stop" else ""
            extra += f", versions {k['versions']}" if kind == "power_cut" else ""
            print(f"  {kind} x{k['count']} (restart {restart_after:g}s after): recovery p50 {k['p50']}s, p90 "
                  f"{k['p90']}s, all {k['all']}{extra}")
    if out["unrecovered"] or out["interrupted"]:
        print(f"  unrecovered at the end: {out['unrecovered']}; interrupted by the power cut: {out['interrupted']}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=6.0, help="training time of each run")
    p.add_argument("--kill-every", type=float, default=60.0, help="seconds between faults")
    p.add_argument("--restart-after", type=float, default=1.0,
                   help="seconds from a kill (or a stopped node's exit) to its restart (the units' RestartSec)")
    p.add_argument("--mix", action="store_true", help="a third run: kills, --stops clean stops and one power cut")
    p.add_argument("--stops", type=int, default=2, help="with --mix: clean stops (SIGTERM, restart once exited)")
    p.add_argument("--lost-s", type=float, default=6.0)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the run directories (logs)")
    p.add_argument("--quick", action="store_true", help="1 minute, a fault every 20 s (a smoke run)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--simulate", action="store_true",
                   help="simulate both runs (ravq simulate's model, the runs' own faults) and compare rounds per hour")
    p.add_argument("--beside", action="store_true",
                   help="a second, undisturbed 2x2 swarm trains beside both runs (a busy PC)")
    args = p.parse_args()
    if args.quick:
        args.minutes, args.kill_every = 1.0, 20.0
    root = Path(tempfile.mkdtemp(prefix="rq11-churn-"))
    beside = Run(root / "beside", args) if args.beside else None
    try:
        if beside is not None:
            wait_training(beside)
        base = one(args, root, "undisturbed", None)
        kills = one(args, root, "churn", argparse.Namespace(**{**vars(args), "stops": 0, "power_cut": False}))
        mixed = one(args, root, "mixed", argparse.Namespace(**{**vars(args), "power_cut": True})) if args.mix else None
    finally:
        if beside is not None:
            beside.close()
    print(f"undisturbed: {base['samples_per_s']:.1f} samples/s, final loss {base['final_loss']}; load "
          f"{base['load'][:3]} -> {base['load'][3:]}")
    result = {"minutes": args.minutes, "fault_every_s": args.kill_every, "restart_after_s": args.restart_after,
              "beside": args.beside,
              "undisturbed": {"samples_per_s": round(base["samples_per_s"], 1), "final_loss": base["final_loss"],
                              "load": base["load"]},
              "kills": report("kills", base, kills, args.restart_after),
              "mixed": report("kills + stops + power cut", base, mixed, args.restart_after) if mixed else None,
              "run_dir": str(root) if args.keep else None}
    if args.simulate:
        sim = result["simulated"] = simulate_runs(load_topology(root / "churn" / "topology.yaml"), base, kills)
        for name in ("undisturbed", "churn"):
            x = sim[name]
            print(f"{name}: averaging rounds per node-hour measured {x['measured_rounds_per_node_hour']:.0f}, "
                  f"simulated {x['simulated_rounds_per_node_hour']:.0f} (ratio {x['rounds_ratio']:.3f}); aborted "
                  f"node rounds {x['measured_aborts']} / {x['simulated_aborts']}; samples/s "
                  f"{x['measured_samples_per_s']:.1f} / {x['simulated_samples_per_s']:.1f}")
    if not args.keep:
        import shutil
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
