"""The simulator against real runs: simulated samples/s and busy fractions over measured ones.

Local part: real ``ravq demo`` runs (broker + one process per node on 127.0.0.1, the demo task
``ravq.tasks.charlm``, plaintext sockets, one torch thread per node) of several layouts: "CxS" (C
clusters of S stages) or "a+b+..." (clusters of a, b, ... stages, uneven), cut as the demo cuts them
(even cuts).  Each run's node summaries give the measured samples/s (last stages' samples over the
longest node wall time, as ``ravq demo`` reports) and each node's busy fraction.

Sharing the CPU, honestly.  All node processes share this machine's 2 cores, and other work runs
too, so a node computes far slower than alone, by an amount that varies with what else runs.  The
simulator is therefore given each stage's compute time per micro-batch *measured in the run itself*:
(busy seconds - averaging wait seconds) / backwards, split into forward and backward by the blocks'
FLOPs.  What it has to get right is everything else: the schedule (credits, backward first, the last
stage's fused forward+backward), bubbles from message delays, the averaging rounds and the hold-back
that ties clusters together.  Busy fractions are compared without the averaging wait, which ravq
counts as busy (compute only on both sides).  Loopback links are given LOOPBACK_BYTES_PER_S and
LOOPBACK_LATENCY_S (below); on this machine compute, not the links, sets the pace.

Emulated-WAN part (``--testbed RUN_DIR ...``): recorded runs of issue #14's testbed, see ``validate_testbed``.

    python benchmarks/bench_simulate.py                      # 5 layouts, 200 micro-batches each; ~6 min
    python benchmarks/bench_simulate.py --configs 1x3 --steps 100
    python benchmarks/bench_simulate.py --quick              # 1x3 and 1+2, 60 micro-batches; ~1 min
    python benchmarks/bench_simulate.py --json               # last line: one JSON object
    python benchmarks/bench_simulate.py --testbed RUN_DIR... # recorded emulated-WAN testbed runs (issue #14)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

_common.use_repo_checkout()

import yaml
from testbed_plans import scaled

from ravq.cli.demo import free_ports
from ravq.cli.main import plan_for
from ravq.cli.simulate import settings_for
from ravq.config import load_plan, load_topology, resolve_task_module
from ravq.planner import BlockProfile, NodeProfile
from ravq.profile.blocks import profile_blocks
from ravq.simulate import Settings, build_world, simulate

TASK = "ravq.tasks.charlm"
TARGET = 0.15
LOOPBACK_BYTES_PER_S = 1.0e9
"""Per-stream loopback rate given to the simulator (ravq moves 1 MiB messages at 5-6 GB/s here; less for
the demo's 256 KiB activations with a busy receiver)."""
LOOPBACK_LATENCY_S = 2e-4
"""One-way delivery delay of a pipeline message between two node processes on a busy machine."""
DEFAULT_CONFIGS = ["1x3", "2x2", "1+2", "3x1", "1+3"]


def shape(config: str) -> list[int]:
    """Stages per cluster of a layout "CxS" or "a+b+..."."""
    try:
        if "x" in config:
            clusters, stages = (int(x) for x in config.split("x"))
            out = [stages] * clusters
        else:
            out = [int(x) for x in config.split("+")]
    except ValueError:
        raise SystemExit(f"--configs: {config!r} is neither CxS (e.g. 2x2) nor a+b (e.g. 1+2)") from None
    if not out or min(out) < 1:
        raise SystemExit(f"--configs: {config!r} needs at least one cluster of at least one stage")
    return out


def write_topology(path: Path, stages: list[int], steps: int, sync_every: int) -> None:
    count = sum(stages)
    ports = iter(free_ports(3 * count + 2))
    nodes, i = [], 0
    for c, k in enumerate(stages):
        for s in range(k):
            nodes.append({"name": f"n{i}", "host": "127.0.0.1", "pipeline_port": next(ports),
                          "ring_port": next(ports), "metrics_port": next(ports), "cluster": c, "stage": s})
            i += 1
    data = {"task": TASK, "seed": 0,
            "training": {"micro_batch": 16, "steps": steps, "sync_every": sync_every},
            "timeouts": {"connect_s": 180.0, "ring_step_s": 60.0, "drain_s": 15.0, "peer_s": 3600.0},
            "broker": {"host": "127.0.0.1", "pub_port": next(ports), "router_port": next(ports)},
            "nodes": nodes}
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def ready_times(run_dir: Path, names: list[str]) -> dict[str, float]:
    """When each node logged "ready" (plan received, stage built, peers connected), in seconds after the
    first: a node that starts late holds up its cluster, in the run as in the simulation."""
    stamps = {}
    for name in names:
        for line in (run_dir / f"{name}.log").read_text(errors="replace").splitlines():
            if f"{name}: cluster" in line and " ready " in line:
                stamps[name] = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                break
    first = min(stamps.values(), default=0.0)
    return {n: t - first for n, t in stamps.items()}


def run_demo(run_dir: Path, topology: Path, timeout_s: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(_common.REPO), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "ravq", "demo", "--topology", str(topology), "--quiet", "--threads", "1",
           "--run-dir", str(run_dir), "--report", str(run_dir / "report.json"), "--timeout", str(timeout_s)]
    done = subprocess.run(cmd, check=False, cwd=_common.REPO, env=env, capture_output=True, text=True,
                          timeout=timeout_s + 60)
    if done.returncode != 0:
        raise RuntimeError(f"ravq demo failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    report = json.loads((run_dir / "report.json").read_text())
    report["summaries"] = {p.stem.removeprefix("summary-"): json.loads(p.read_text())
                           for p in run_dir.glob("summary-*.json")}
    return report


def stage_times(summaries: dict[str, Any]) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
    """Per node, as measured in the run: (forward s, backward s) per micro-batch, and the coefficient of
    variation of its forwards' durations from one micro-batch to the next.  Backward time is busy time less forward time and less the
    averaging wait (which ravq counts inside the backward that triggered it), per backward."""
    times, cvs = {}, {}
    for name, s in summaries.items():
        fwd = s["forward_s"] / max(1, s["forwards"])
        compute = s["busy_s"] - _wait_in_busy(s)
        times[name] = (fwd, (compute - s["forward_s"]) / max(1, s["backwards"]))
        # half the mean squared successive difference: the variance of what changes from one forward to
        # the next, independently on each node; the machine's load drifting over the run slows every node
        # alike and leaves no bubbles, so it is left out
        variance = s["forward_step_sq_s"] / (2 * max(1, s["forwards"] - 2))     # differences after the first
        cvs[name] = math.sqrt(variance) / fwd if fwd > 0 else 0.0
    return times, cvs


def _wait_in_busy(s: dict[str, Any]) -> float:
    """Averaging wait counted inside busy_s: all of it, unless the node reports its waits apart
    ("wait_s" by reason: then busy_s is compute only)."""
    return 0.0 if isinstance(s.get("wait_s"), dict) else (s.get("averaging_wait_seconds") or 0.0)


def honest_busy(s: dict[str, Any]) -> float:
    wall = s["wall_s"]
    return (s["busy_s"] - _wait_in_busy(s)) / wall if wall > 0 else 0.0


def validate(config: str, steps: int, sync_every: int, work: Path, blocks: list[BlockProfile]) -> dict[str, Any]:
    run_dir = work / f"run-{config}"
    run_dir.mkdir(parents=True, exist_ok=True)
    topo_path = run_dir / "topology.yaml"
    write_topology(topo_path, shape(config), steps, sync_every)
    topology = load_topology(topo_path)
    plan = plan_for(topology, None)
    t0 = time.monotonic()
    report = run_demo(run_dir, topo_path, timeout_s=1200.0)
    run_s = time.monotonic() - t0
    summaries = report["summaries"]
    names = [n.name for n in topology.nodes]
    profiles = [NodeProfile(name=n, flops=1.0, memory_bytes=1 << 30,
                            bandwidth_bytes_per_s={m: LOOPBACK_BYTES_PER_S for m in names if m != n},
                            latency_s={m: LOOPBACK_LATENCY_S for m in names if m != n}) for n in names]
    settings: Settings = settings_for(topology)
    t1 = time.perf_counter()
    times, cvs = stage_times(summaries)
    start = ready_times(run_dir, names)
    result = simulate(build_world(plan, profiles, blocks, settings, stage_times=times, stage_cv=cvs, start_at=start))
    sim_s = time.perf_counter() - t1
    measured = report["samples_per_second"]
    busy_measured = {n: honest_busy(summaries[n]) for n in names}
    busy_sim = {n.name: n.busy_fraction for n in result.nodes}
    worst_busy = max(abs(busy_sim[n] / busy_measured[n] - 1) for n in names)
    ratio = result.samples_per_s / measured
    return {"config": config, "stages": shape(config), "steps": steps, "sync_every": sync_every,
            "measured_samples_per_s": measured, "simulated_samples_per_s": result.samples_per_s, "ratio": ratio,
            "busy_measured": busy_measured, "busy_simulated": busy_sim,
            "busy_mean_measured": statistics.fmean(busy_measured.values()),
            "busy_mean_simulated": statistics.fmean(busy_sim.values()), "busy_worst_error": worst_busy,
            "allreduce_seconds_measured": report.get("allreduce_seconds_mean", 0.0),
            "allreduce_seconds_simulated": result.allreduce_seconds_mean,
            "averaging_wait_measured": {n: summaries[n].get("averaging_wait_seconds", 0.0) for n in names},
            "averaging_wait_simulated": {n.name: n.averaging_wait_s for n in result.nodes},
            "stage_compute_s": {n: sum(v) for n, v in times.items()}, "stage_cv": cvs, "ready_s": start,
            "within_target": bool(abs(ratio - 1) <= TARGET and worst_busy <= TARGET),
            "run_s": run_s, "simulate_s": sim_s}


def validate_testbed(run_dir: Path, steps: int) -> list[dict[str, Any]]:
    """The simulator against a recorded run of the emulated-WAN testbed (issue #14's ``testbed.py``: its
    run directory with ``result.json``, ``topology.yaml``, ``profiles/`` and ``plan-KIND.yaml``).  Each
    PC's FLOP/s is its profile's scaled by the CPU share it got in the measured window over the share
    its profile got (``speed_vs_profile``, as the testbed's load-adjusted prediction does); links are
    the profiles' measured bandwidths and latencies (through the testbed's shaping and delay relays).
    The testbed measures a steady window (each cluster's last-stage samples over its own wall time,
    summed), so the simulation's figure is each cluster's samples/s over its own run, summed.

    Runs recorded since the testbed keeps each node's compute over the window (forward and backward
    seconds per micro-batch, and the spread of its forwards) are simulated twice: with that compute, as
    the local part does ("run compute": what the simulator must get right is the schedule, the links and
    the averaging), and with the profiles' FLOP/s ("profile compute": the simulator as a user runs it,
    before any run exists).  Older runs have only the second."""
    result = json.loads((run_dir / "result.json").read_text())
    topo = yaml.safe_load((run_dir / "topology.yaml").read_text())
    t = topo.get("training", {})
    task = resolve_task_module(topo["task"])
    blocks = profile_blocks(task, t.get("micro_batch", 16), max_inflight=1)
    measured_profiles = {p.stem.removeprefix("profile-"): json.loads(p.read_text())
                         for p in (run_dir / "profiles").glob("profile-*.json")}
    settings = settings_for(load_topology(run_dir / "topology.yaml"), steps=steps)  # compression included
    runs = []
    for kind, measured in result.get("plans", {}).items():
        if not measured.get("samples_per_s") or not (run_dir / f"plan-{kind}.yaml").exists():
            continue
        plan = load_plan(run_dir / f"plan-{kind}.yaml")
        scale = measured.get("speed_vs_profile") or {}
        nodes = [scaled(NodeProfile(name=n, flops=p["flops"], memory_bytes=p["memory_bytes"],
                                    bandwidth_bytes_per_s=p["bandwidth_bytes_per_s"], latency_s=p["latency_s"],
                                    message_s=tuple((int(b), float(t)) for b, t in p.get("message_s", []))),
                        scale.get(n, 1.0))
                 for n, p in measured_profiles.items()]
        busy_m = {n: v["busy_fraction"] for n, v in measured["nodes"].items()}
        recorded = window_stage_times(measured["nodes"])
        for compute, times, cvs in (("run", *recorded), ("profile", None, None)):
            if compute == "run" and times is None:
                continue
            sim = simulate(build_world(plan, nodes, blocks, settings, stage_times=times, stage_cv=cvs))
            simulated = sum(c.samples_per_s for c in sim.clusters)
            busy_s = {n.name: n.busy_fraction for n in sim.nodes}
            worst = max(abs(busy_s[n] - busy_m[n]) for n in busy_m)
            ratio = simulated / measured["samples_per_s"]
            runs.append({"scenario": result["scenario"], "plan": kind, "compute": compute,
                         "clusters": [c.nodes for c in plan.clusters],
                         "measured_samples_per_s": measured["samples_per_s"], "simulated_samples_per_s": simulated,
                         "ratio": ratio, "cost_model_predicted": measured.get("predicted_samples_per_s"),
                         "cost_model_load_adjusted": measured.get("predicted_load_adjusted"),
                         "busy_measured": busy_m, "busy_simulated": busy_s, "busy_worst_error": worst,
                         "within_target": bool(abs(ratio - 1) <= TARGET and worst <= TARGET)})
    return runs


def window_stage_times(nodes: dict[str, Any]) -> tuple[dict[str, tuple[float, float]] | None,
                                                        dict[str, float] | None]:
    """Per node, from a testbed window's stage statistics: (forward s, backward s) per micro-batch and the
    coefficient of variation of successive forwards (as ``stage_times`` for the local runs); (None, None)
    when the run did not record them."""
    if not all(v.get("forwards") and v.get("backwards") for v in nodes.values()):
        return None, None
    times, cvs = {}, {}
    for name, v in nodes.items():
        fwd = v["forward_s"] / v["forwards"]
        times[name] = (fwd, v["backward_s"] / v["backwards"])
        variance = v.get("forward_step_sq_s", 0.0) / (2 * max(1, v["forwards"] - 1))
        cvs[name] = math.sqrt(variance) / fwd if fwd > 0 else 0.0
    return times, cvs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two layouts (1x3, 1+2), 60 micro-batches each")
    parser.add_argument("--configs", type=lambda v: v.split(","), default=None,
                        help="comma-separated layouts: CxS or a+b+... (default: " + ",".join(DEFAULT_CONFIGS) + ")")
    parser.add_argument("--steps", type=int, default=None, help="micro-batches per cluster (default 200)")
    parser.add_argument("--sync-every", type=int, default=2, help="the demo's default: 2")
    parser.add_argument("--work-dir", help="keep topologies, logs and summaries here (default: a temp dir)")
    parser.add_argument("--testbed", nargs="*", default=[], help="run directories of the emulated-WAN testbed "
                        "(issue #14) to simulate and compare; with this, the local runs are skipped")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    args.configs = args.configs or (["1x3", "1+2"] if args.quick else DEFAULT_CONFIGS)
    args.steps = args.steps or (60 if args.quick else 200)
    if args.testbed:
        wan = [r for d in args.testbed for r in validate_testbed(Path(d), max(args.steps, 400))]
        rows = [(r["scenario"], r["plan"], r["compute"], " | ".join("->".join(c) for c in r["clusters"]),
                 f"{r['measured_samples_per_s']:.1f}", f"{r['simulated_samples_per_s']:.1f}", f"{r['ratio']:.3f}",
                 "-" if r["cost_model_load_adjusted"] is None else
                 f"{r['cost_model_load_adjusted'] / r['measured_samples_per_s']:.3f}",
                 f"{r['busy_worst_error']:.2f}", "yes" if r["within_target"] else "NO") for r in wan]
        print(_common.table(["scenario", "plan", "compute", "clusters", "measured samples/s", "simulated", "sim/measured",
                             "cost model (load-adjusted)/measured", "worst node busy error (abs)",
                             f"within {TARGET:.0%}"], rows))
        judged = [r for r in wan if r["compute"] == "run"]  # the model judged on the run's own compute
        if args.json:
            _common.emit_json({"benchmark": "simulate", "part": "wan", "target": TARGET,
                               "met": bool(judged) and all(r["within_target"] for r in judged), "runs": wan})
        return 0
    for config in args.configs:
        shape(config)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="ravq-bench-simulate-"))
    work.mkdir(parents=True, exist_ok=True)
    blocks = profile_blocks(resolve_task_module(TASK), 16, max_inflight=1)
    runs = []
    for config in args.configs:
        runs.append(validate(config, args.steps, args.sync_every, work, blocks))
        r = runs[-1]
        print(f"{config}: measured {r['measured_samples_per_s']:.1f} samples/s, simulated "
              f"{r['simulated_samples_per_s']:.1f} ({r['ratio']:.3f}); busy {r['busy_mean_measured']:.2f} / "
              f"{r['busy_mean_simulated']:.2f} (worst node {r['busy_worst_error']:.1%})", flush=True)
    rows = [(r["config"], f"{r['measured_samples_per_s']:.1f}", f"{r['simulated_samples_per_s']:.1f}",
             f"{r['ratio']:.3f}", f"{r['busy_mean_measured']:.2f}", f"{r['busy_mean_simulated']:.2f}",
             f"{r['busy_worst_error']:.1%}", f"{r['allreduce_seconds_measured'] * 1e3:.1f}",
             f"{r['allreduce_seconds_simulated'] * 1e3:.1f}", "yes" if r["within_target"] else "NO") for r in runs]
    print()
    print(_common.table(["layout", "measured samples/s", "simulated", "sim/measured", "busy measured",
                         "busy simulated", "worst node busy error", "all-reduce ms measured", "simulated",
                         f"within {TARGET:.0%}"], rows))
    print("emulated-WAN scenarios (issue #14 testbed): not run here; --testbed RUN_DIR... simulates recorded runs")
    print(f"work dir: {work}")
    if args.json:
        _common.emit_json({"benchmark": "simulate", "task": TASK, "cores": os.cpu_count(), "target": TARGET,
                           "loopback_bytes_per_s": LOOPBACK_BYTES_PER_S, "loopback_latency_s": LOOPBACK_LATENCY_S,
                           "met": all(r["within_target"] for r in runs), "wan": "see --testbed", "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
