"""bench_churn's runs as ``ravq simulate`` models them (``bench_churn.py --simulate``, issue #38 part 2).

The same 2x2 layout and topology (sync_every, lost_s, ring_step_s, the warm-up) and loopback links.  Each
run is simulated with its own faults (each kill at the time and on the node it hit, a restart that takes
the run's median recovery: kill to the broker saying the cluster trains again, process start included),
and each stage's compute set so that the simulation trains at that run's measured rate (every stage
alike, backward twice the forward: the demo's stages are even cuts of a small model; the shared machine's
speed differs from one run to the next).  Compared: averaging rounds completed per node per hour, and the
aborted ones.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from ravq.cli.main import plan_for
from ravq.cli.simulate import settings_for
from ravq.config import Topology, resolve_task_module
from ravq.planner import NodeProfile
from ravq.profile.blocks import profile_blocks
from ravq.simulate import Simulation, build_world, collect

LOOPBACK_BYTES_PER_S = 1.0e9
LOOPBACK_LATENCY_S = 2e-4


def node_rounds(samples: list[tuple[float, dict[str, Any]]], t0: float) -> dict[str, int]:
    """Averaging rounds completed and aborted in the window from ``t0``, over every node and process: each
    status's counters, restarted from 0 by a node's new process, summed as increments."""
    last: dict[str, tuple[int, int]] = {}
    done = aborted = 0
    for ts, status in samples:
        for name, member in status.get("members", {}).items():
            stats = member.get("stats", {})
            now = (int(stats.get("allreduce_rounds", 0)), int(stats.get("allreduce_aborts", 0)))
            before = last.get(name)
            last[name] = now
            if before is None or ts < t0:
                continue
            for i, (b, n) in enumerate(zip(before, now)):
                grew = n - b if n >= b else n          # a new process counts from 0
                done, aborted = (done + grew, aborted) if i == 0 else (done, aborted + grew)
    return {"rounds": done, "aborts": aborted, "nodes": len(last)}


def _world(topology: Topology, seconds_per_block: float, churn: bool, restart_s: float) -> Simulation:
    settings = settings_for(topology, steps=10**9)
    if churn:
        settings = dataclasses.replace(settings, restart_s=restart_s)
    names = [n.name for n in topology.nodes]
    profiles = [NodeProfile(name=n, flops=1.0, memory_bytes=1 << 30,
                            bandwidth_bytes_per_s={m: LOOPBACK_BYTES_PER_S for m in names if m != n},
                            latency_s={m: LOOPBACK_LATENCY_S for m in names if m != n}) for n in names]
    task = resolve_task_module(topology.task, topology.task_options)
    blocks = profile_blocks(task, topology.training.micro_batch, max_inflight=1)
    plan = plan_for(topology, None)
    times = {n: (seconds_per_block, 2 * seconds_per_block) for n in names}
    return Simulation(build_world(plan, profiles, blocks, settings, stage_times=times))


def _simulated(topology: Topology, forward: float, run: dict[str, Any], faults: list[dict[str, Any]],
               restart_s: float) -> Simulation:
    sim = _world(topology, forward, bool(faults), restart_s)
    for e in faults:
        sim.q.at(e["t"], sim.churn.fail, sim.nodes[e["victim"]])
    sim.run(until=run["seconds"])
    return sim


def simulate_runs(topology: Topology, base: dict[str, Any], churned: dict[str, Any]) -> dict[str, Any]:
    """Each run simulated with its own faults, its stages' compute set so that the simulation trains at the
    run's measured rate (the machine is shared: its speed differs from one run to the next); what the
    comparison tests is then the rounds completed and lost per hour at that rate."""
    kills = [e for e in churned["events"] + churned["unrecovered"] if e["kind"] == "kill"]
    recoveries = [e["recovery_s"] for e in kills if "recovery_s" in e]
    restart_s = statistics.median(recoveries) if recoveries else 30.0
    out: dict[str, Any] = {"restart_s": restart_s}
    for name, run, faults in (("undisturbed", base, []), ("churn", churned, kills)):
        forward = 0.01
        for _ in range(4):  # compute per stage such that the simulation trains at the measured rate
            r = collect(_simulated(topology, forward, run, faults, restart_s))
            forward *= r.samples / run["seconds"] / run["samples_per_s"]
        r = collect(_simulated(topology, forward, run, faults, restart_s))
        hours = run["seconds"] / 3600
        rounds = run["rounds"]
        out[name] = x = {
            "stage_forward_s": forward,
            "measured_rounds_per_node_hour": rounds["rounds"] / max(1, rounds["nodes"]) / hours,
            "simulated_rounds_per_node_hour": statistics.fmean(n.allreduce_rounds for n in r.nodes) / hours,
            "measured_aborts": rounds["aborts"], "simulated_aborts": sum(n.allreduce_aborts for n in r.nodes),
            "measured_samples_per_s": run["samples_per_s"], "simulated_samples_per_s": r.samples / run["seconds"],
            "simulated_plan_epochs": r.plan_epochs}
        x["rounds_ratio"] = x["simulated_rounds_per_node_hour"] / x["measured_rounds_per_node_hour"] \
            if x["measured_rounds_per_node_hour"] else None
    return out
