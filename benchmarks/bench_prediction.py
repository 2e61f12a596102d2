"""Prediction against reality: the planner's samples/s versus what real node processes achieve.

For the demo task (``ravq.tasks.charlm``) on 3-4 local nodes (127.0.0.1, free ports), this does what a
user does on a real swarm, then compares:

1. profile every node: links with the loopback probes of ``ravq profile`` (``profile_links``, every node
   serving and probing at once), memory, and compute with ``measure_model_flops`` (training steps of the
   task's model: forward + backward FLOPs over the time of forward, backward and optimizer step);
   profiles are written and read back with ``save_profile`` / ``load_profiles``;
2. profile the model's blocks (``profile_blocks``) and plan: ``make_plan`` chooses clusters, order and
   cuts (layout "planner"; the topology sets no clusters), or ``cut_plan`` cuts a fixed layout "CxS"
   (C clusters of S stages, set in the topology); the plan goes to plan.yaml;
3. start ``python -m ravq broker --plan plan.yaml`` and one ``python -m ravq node --threads 1`` per
   planned node (a node the plan leaves idle is not started), wait for them, and take the measured
   samples/s from their summaries: the last stages' samples summed over clusters, over the longest
   training wall time (``wall_s``) of any node.  The ratio is measured / predicted; target 0.75..1.25.

Sharing the CPU, honestly.  Every "PC" here is a process on one machine with few cores (2 on the
reference box), so a node profiled alone is much faster than the same node while 3 or 4 of them train.
The cost model treats nodes as separate machines, so each node's profile must say what that node gets
while the others run: compute is measured by as many processes at once as will train (one torch thread
each, started together at a barrier), right before each run; memory is MemAvailable less headroom,
divided by that number.  Nodes and measuring processes use one torch thread (``--threads 1`` and
OMP_NUM_THREADS=1).  When the plan leaves nodes idle, compute is measured again with only the planned
processes and the plan re-scored (``evaluate_plan``); that is the prediction compared.  The plan scored
with the profile of one process alone ("naive") shows what ignoring the sharing would predict.

What the cost model does not know, reported rather than hidden:
- bubbles: with no more micro-batches in flight than stages (the default) every message delay idles
  a stage, which the cost model's steady state leaves out (a 3-stage pipeline was 0.77 busy and came
  in at 0.70 of its prediction; with --max-inflight 6, 0.89 busy and 0.92);
- an idle stage's CPU share goes to the busy ones, which then beat their profile (unbalanced
  pipelines can come in above their prediction);
- what a node does besides the measured training step: a weight snapshot per version, functional
  calls, its event loop and ZeroMQ threads, background averaging (about 5-10% on one-stage clusters);
- other work on the machine.  A sampler reads /proc during the compute measurement and during
  training and reports how many cores other processes left the benchmark in each
  ("cores_available"); the "load-adjusted" ratio scales the prediction by their quotient, which is
  fair while our processes are CPU-bound in both (busy near 1).

Run from the repo root:

    python benchmarks/bench_prediction.py            # 4 nodes: the planner's plan, then 2x2; ~3 minutes
    python benchmarks/bench_prediction.py --quick    # 3 nodes, the planner's plan, a short run; ~50 s
    python benchmarks/bench_prediction.py --nodes 3 --layouts planner,1x3 --max-inflight 6
    python benchmarks/bench_prediction.py --json     # last line: one JSON object
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import json
import multiprocessing as mp
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Self

import _common

_common.use_repo_checkout()

import torch
import yaml

from ravq.cli.demo import free_ports
from ravq.config import Topology, load_topology, resolve_task_module
from ravq.planner import (
    BlockProfile,
    NodeProfile,
    cut_plan,
    evaluate_plan,
    make_plan,
    topology_clusters,
    training_settings,
)
from ravq.profile.blocks import profile_blocks
from ravq.profile.compute import measure_model_flops
from ravq.profile.links import ProbeConfig, profile_links
from ravq.profile.store import Measurement, load_profiles, save_profile
from ravq.tuning import usable_memory_bytes

TASK = "ravq.tasks.charlm"
TARGET = (0.75, 1.25)
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
BARRIER_TIMEOUT_S = 180.0


@dataclasses.dataclass(kw_only=True, slots=True)
class Settings:
    nodes: int
    """Node processes in the topology of layout "planner"."""
    layouts: list[str]
    """"planner" (make_plan chooses) or "CxS" (C clusters of S stages, cut by cut_plan)."""
    steps: int
    """Micro-batches each cluster trains on."""
    micro_batch: int = 16
    sync_every: int = 10
    max_inflight: int | None = None
    """Micro-batches in flight per cluster; None: the node's default, its number of stages."""
    compute_s: float = 2.0
    """How long each process measures training-step FLOP/s."""
    probe: ProbeConfig = dataclasses.field(default_factory=ProbeConfig)
    run_timeout_s: float = 600.0
    """Longest wait for one training run's node processes."""


# ------------------------------------------------------------------ the machine's other work


class CpuSampler:
    """Samples, every ``interval_s``, the machine's busy CPU seconds and those of this process and its
    descendants (an exited one keeps its last reading), to tell how many cores other work left us."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s, self.samples = interval_s, list[tuple[float, float, float]]()
        self._ours: dict[int, float] = {}
        self._tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append(self._sample())

    def _sample(self) -> tuple[float, float, float]:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        busy = sum(fields) - fields[3] - fields[4]                  # all but idle and iowait; steal counts
        parent: dict[int, int] = {}
        ticks: dict[int, float] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    text = (entry / "stat").read_text()
                except OSError:                                     # exited meanwhile
                    continue
                rest = text[text.rfind(")") + 2:].split()
                parent[int(entry.name)], ticks[int(entry.name)] = int(rest[1]), float(rest[11]) + float(rest[12])
        children: dict[int, list[int]] = {}
        for pid, ppid in parent.items():
            children.setdefault(ppid, []).append(pid)
        mine, frontier = {os.getpid()}, [os.getpid()]
        while frontier:
            for child in children.get(frontier.pop(), []):
                mine.add(child)
                frontier.append(child)
        self._ours.update({pid: ticks[pid] for pid in mine if pid in ticks})
        return time.time(), busy * self._tick_s, sum(self._ours.values()) * self._tick_s

    def cores_available(self, t0: float, t1: float, processes: int) -> float | None:
        """Cores other work left between t0 and t1 (wall clock), at most ``processes``."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return None
        (ta, busy_a, ours_a), (tb, busy_b, ours_b) = inside[0], inside[-1]
        others = max(0.0, (busy_b - busy_a) - (ours_b - ours_a)) / (tb - ta)
        free = min(float(processes), (os.cpu_count() or 1) - others)
        return free if free > 0.05 else None                      # sampling noise, not a measurement


# ------------------------------------------------------------------ node profiles


def write_topology(path: Path, settings: Settings, layout: str) -> Topology:
    """Nodes n0.. on 127.0.0.1 with fresh free ports; clusters and stages set for a fixed layout."""
    count = settings.nodes if layout == "planner" else _layout_shape(layout)[0] * _layout_shape(layout)[1]
    ports = iter(free_ports(2 + 2 * count))
    nodes: list[dict[str, Any]] = []
    for i in range(count):
        node: dict[str, Any] = {"name": f"n{i}", "host": "127.0.0.1", "pipeline_port": next(ports),
                                "ring_port": next(ports)}
        if layout != "planner":
            stages = _layout_shape(layout)[1]
            node.update(cluster=i // stages, stage=i % stages)
        nodes.append(node)
    data = {"task": TASK, "training": {"micro_batch": settings.micro_batch, "steps": settings.steps,
                                       "sync_every": settings.sync_every, "max_inflight": settings.max_inflight,
                                       "compress": {"pipeline": "none", "ring": "none"}},  # loopback: bytes are free
            # A loaded machine starts nodes slowly, and a node sends no heartbeat while it starts.  The
            # node's peer-silence watchdog also fires in a one-stage cluster, which has no pipeline
            # peers: keep it beyond any run here (run_timeout_s guards against hangs instead).
            "timeouts": {"connect_s": 180.0, "drain_s": 15.0, "peer_s": 3600.0, "heartbeat_interval_s": 3.0},
            "broker": {"host": "127.0.0.1", "pub_port": next(ports), "router_port": next(ports)},
            "nodes": nodes}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_topology(path)


def _layout_shape(layout: str) -> tuple[int, int]:
    clusters, stages = (int(x) for x in layout.split("x"))
    return clusters, stages


def _profile_worker(topology_path: str, name: str, out_dir: str | None, barrier: Any, results: Any,
                    compute_s: float, probe: ProbeConfig | None) -> None:
    """One node's measurement in its own process, at the same time as the others' (the barrier).  Puts
    (name, FLOP/s, start, end) on ``results``; with ``out_dir`` also measures links and saves a profile."""
    torch.set_num_threads(1)
    topology = load_topology(topology_path)
    task = resolve_task_module(topology.task)
    micro_batch = topology.training.micro_batch
    measure_model_flops(task, micro_batch, seconds=0.2)             # warm-up: first calls, allocator
    barrier.wait(BARRIER_TIMEOUT_S)
    t0 = time.time()
    flops = measure_model_flops(task, micro_batch, seconds=compute_s)
    results.put((name, flops, t0, time.time()))
    if out_dir is None or probe is None:
        return
    barrier.wait(BARRIER_TIMEOUT_S)
    links = asyncio.run(profile_links(topology, name, wait_s=60.0, config=probe))
    save_profile(Measurement(name=name, device="cpu", flops=flops, matmul_flops=flops, model_flops=flops,
                             memory_bytes=usable_memory_bytes() // barrier.parties,
                             bandwidth_bytes_per_s={p: link.bandwidth_bytes_per_s for p, link in links.items()},
                             latency_s={p: link.latency_s for p, link in links.items()}), out_dir)


def measure_nodes(topology_path: Path, names: list[str], settings: Settings, out_dir: Path | None = None
                  ) -> tuple[dict[str, float], float, float]:
    """Compute of ``names`` measured by as many processes at once (and, with ``out_dir``, their links and
    profiles): FLOP/s per node and the measurement's window (wall clock)."""
    spawn = mp.get_context("spawn")
    barrier, results = spawn.Barrier(len(names)), spawn.Queue()
    procs = [spawn.Process(target=_profile_worker, daemon=True,
                           args=(str(topology_path), name, None if out_dir is None else str(out_dir), barrier,
                                 results, settings.compute_s, settings.probe))
             for name in names]
    for p in procs:
        p.start()
    try:
        got: list[tuple[str, float, float, float]] = []
        deadline = time.monotonic() + 2 * BARRIER_TIMEOUT_S
        while len(got) < len(names):
            try:
                got.append(results.get(timeout=1.0))
            except queue.Empty:
                failed = [name for name, p in zip(names, procs) if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(f"profiling failed on {', '.join(failed) or 'some node (timeout)'}") from None
        for p in procs:
            p.join(BARRIER_TIMEOUT_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError("profiling failed: a measuring process exited with an error")
    return {name: flops for name, flops, _, _ in got}, max(g[2] for g in got), min(g[3] for g in got)


# ------------------------------------------------------------------ plan and run


def _libc_prctl() -> Any:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        return None


_PRCTL: Any = _libc_prctl() if sys.platform.startswith("linux") else None
"""Looked up once, before any thread starts: the child calls it between fork and exec."""


def _die_with_parent() -> None:
    """In a node or broker process: get SIGTERM when the benchmark dies, however it dies."""
    _PRCTL(1, signal.SIGTERM)                                   # PR_SET_PDEATHSIG


def run_swarm(run_dir: Path, topology_path: Path, plan_path: Path, names: list[str], timeout_s: float
              ) -> list[dict[str, Any]]:
    """Broker and one process per planned node; returns the nodes' summaries, each with its end time."""
    env = {**os.environ, "PYTHONPATH": str(_common.REPO)}

    def spawn(args: list[str], log_name: str) -> subprocess.Popen[bytes]:
        # preexec_fn with the sampler thread running: it only calls a C function resolved beforehand
        with open(run_dir / log_name, "wb") as log:
            return subprocess.Popen([sys.executable, "-m", "ravq", *args], cwd=_common.REPO, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    preexec_fn=_die_with_parent if _PRCTL else None)  # noqa: PLW1509

    broker = spawn(["broker", "--topology", str(topology_path), "--plan", str(plan_path)], "broker.log")
    nodes = {name: spawn(["node", "--topology", str(topology_path), "--name", name, "--threads", "1",
                          "--summary", str(run_dir / f"summary-{name}.json")], f"{name}.log") for name in names}
    try:
        deadline = time.monotonic() + timeout_s
        for name, proc in nodes.items():
            try:
                code = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"node {name} still running after {timeout_s:.0f} s; logs in {run_dir}") from None
            if code != 0:
                tail = (run_dir / f"{name}.log").read_text(errors="replace").splitlines()[-15:]
                raise RuntimeError(f"node {name} exited with {code}:\n" + "\n".join(tail))
    finally:
        for proc in [*nodes.values(), broker]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [*nodes.values(), broker]:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    paths = [run_dir / f"summary-{name}.json" for name in names]
    return [{**json.loads(p.read_text()), "ended_at": p.stat().st_mtime} for p in paths]


def measured_rate(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Last stages' samples summed over clusters, over the longest training wall time of any node."""
    last: dict[int, dict[str, Any]] = {}
    for s in summaries:
        if s["cluster"] not in last or s["stage"] > last[s["cluster"]]["stage"]:
            last[s["cluster"]] = s
    wall = max(s["wall_s"] for s in summaries)
    samples = sum(s["samples"] for s in last.values())
    return {"samples": samples, "train_wall_s": wall, "samples_per_s": samples / wall if wall > 0 else 0.0,
            "busy_fraction_mean": statistics.fmean(s["busy_fraction"] for s in summaries),
            "allreduce_rounds": min((s.get("allreduce_rounds", 0) for s in summaries), default=0),
            "allreduce_seconds_mean": statistics.fmean(s.get("allreduce_seconds_mean", 0.0) for s in summaries)}


class Bench:
    def __init__(self, settings: Settings, work_dir: Path, sampler: CpuSampler) -> None:
        self.settings, self.work_dir, self.sampler = settings, work_dir, sampler
        self.task = resolve_task_module(TASK)
        self.alone_flops = 0.0
        self._fresh: tuple[list[str], dict[str, float], float, float] | None = None
        self.nodes: list[NodeProfile] = []
        self.blocks: list[BlockProfile] = []

    def profile(self) -> None:
        """One process alone; then every node at once: compute, links, memory; then the model's blocks."""
        s = self.settings
        torch.set_num_threads(1)
        self.alone_flops = measure_model_flops(self.task, s.micro_batch, seconds=s.compute_s)
        topology = write_topology(self.work_dir / "profile-topology.yaml", s, "planner")
        names = [n.name for n in topology.nodes]
        self._fresh = (names, *measure_nodes(self.work_dir / "profile-topology.yaml", names, s,
                                             self.work_dir / "profiles"))
        self.nodes = load_profiles(topology, self.work_dir / "profiles")
        self.blocks = profile_blocks(self.task, s.micro_batch, max_inflight=topology.training.max_inflight or 1)

    def compute(self, names: list[str]) -> tuple[list[NodeProfile], dict[str, float], float | None]:
        """Profiles with compute measured by ``len(names)`` processes at once, just before a run (the
        profile's own measurement serves the first run when it had the same nodes); each per-process
        reading, and the cores other work left during the measurement.

        Every node gets the processes' mean: they are the same program on the same cores, so their
        differences within one short window are the scheduler's noise, which evens out over a run."""
        fresh, self._fresh = self._fresh, None
        if fresh is not None and fresh[0] == names:
            flops, t0, t1 = fresh[1:]
        else:
            flops, t0, t1 = measure_nodes(self.work_dir / "profile-topology.yaml", names, self.settings)
        share = statistics.fmean(flops.values())
        nodes = [dataclasses.replace(n, flops=share) for n in self.nodes if n.name in flops]
        return nodes, flops, self.sampler.cores_available(t0, t1, len(names))

    def run(self, layout: str) -> dict[str, Any]:
        s = self.settings
        run_dir = self.work_dir / f"run-{layout}"
        run_dir.mkdir(parents=True, exist_ok=True)
        topology = write_topology(run_dir / "topology.yaml", s, layout)
        training = topology.training
        score = training_settings(training)
        nodes, flops, cores_profiled = self.compute([n.name for n in topology.nodes])
        if layout == "planner":
            plan, _ = make_plan(nodes, self.blocks, **score)
        else:
            plan, _ = cut_plan(topology_clusters(topology), nodes, self.blocks, **score)
        planned = [n for c in plan.clusters for n in c.nodes]
        if len(planned) < len(nodes):           # fewer processes will share the cores: measure that
            nodes, flops, cores_profiled = self.compute(planned)
        explanation = evaluate_plan(plan, nodes, self.blocks, **score)
        predicted = float(explanation.samples_per_s)
        alone = [dataclasses.replace(n, flops=self.alone_flops) for n in nodes]
        naive = float(evaluate_plan(plan, alone, self.blocks, **score).samples_per_s)
        plan = plan.model_copy(update={"predicted_samples_per_s": predicted})
        (run_dir / "plan.yaml").write_text(yaml.safe_dump({"plan": plan.model_dump(mode="json")}, sort_keys=False))
        print(f"\n== layout {layout}: {len(planned)} of {len(topology.nodes)} nodes train, sharing "
              f"{os.cpu_count()} cores\n{explanation.format()}", flush=True)
        summaries = run_swarm(run_dir, run_dir / "topology.yaml", run_dir / "plan.yaml", planned, s.run_timeout_s)
        measured = measured_rate(summaries)
        end = max(x["ended_at"] for x in summaries)
        cores_trained = self.sampler.cores_available(end - measured["train_wall_s"], end, len(planned))
        ratio = measured.pop("samples_per_s") / predicted
        adjusted = (ratio * cores_profiled / cores_trained if cores_profiled and cores_trained else None)
        return {"layout": layout, "clusters": [c.nodes for c in plan.clusters], "cuts": [c.cuts for c in plan.clusters],
                "idle": sorted({n.name for n in topology.nodes} - set(planned)), "processes": len(planned),
                "flops_per_process": flops, "flops_per_node": nodes[0].flops, "predicted_samples_per_s": predicted,
                "measured_samples_per_s": ratio * predicted, "ratio": ratio,
                "within_target": bool(TARGET[0] <= ratio <= TARGET[1]), "naive_predicted_samples_per_s": naive,
                "naive_ratio": ratio * predicted / naive, "cores_available_profiling": cores_profiled,
                "cores_available_training": cores_trained, "load_adjusted_ratio": adjusted, **measured}


# ------------------------------------------------------------------ entry point


def settings_from(args: argparse.Namespace) -> Settings:
    if args.quick:
        return Settings(nodes=args.nodes or 3, layouts=args.layouts or ["planner"], steps=args.steps or 40,
                        compute_s=1.0, probe=ProbeConfig(stream_s=0.05, repeats=1, pings=3), run_timeout_s=240.0)
    return Settings(nodes=args.nodes or 4, layouts=args.layouts or ["planner", "2x2"], steps=args.steps or 200,
                    probe=ProbeConfig(stream_s=0.2, repeats=3, pings=5))


def check_layouts(settings: Settings) -> None:
    for layout in settings.layouts:
        if layout == "planner":
            continue
        try:
            clusters, stages = _layout_shape(layout)
        except ValueError:
            raise SystemExit(f"--layouts: {layout!r} is neither 'planner' nor CxS (e.g. 2x2)") from None
        if not 1 <= clusters * stages <= settings.nodes or min(clusters, stages) < 1:
            raise SystemExit(f"--layouts: {layout} needs {clusters * stages} nodes; --nodes is {settings.nodes}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 nodes, the planner's plan, a short run")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--nodes", type=int, choices=(3, 4), help="node processes (default 4; --quick 3)")
    parser.add_argument("--layouts", type=lambda v: v.split(","), help="comma-separated: planner, CxS")
    parser.add_argument("--max-inflight", type=int, help="micro-batches in flight per cluster (default: stages)")
    parser.add_argument("--steps", type=int, help="micro-batches per cluster (default 200; --quick 40)")
    parser.add_argument("--work-dir", help="keep profiles, plans, logs and summaries here (default: a temp dir)")
    args = parser.parse_args(argv)
    os.environ.update(ONE_THREAD)       # for every process started from here: one torch thread each
    settings = dataclasses.replace(settings_from(args), max_inflight=args.max_inflight)
    check_layouts(settings)
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="ravq-bench-prediction-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    with CpuSampler() as sampler:
        bench = Bench(settings, work_dir, sampler)
        bench.profile()
        print_profile(bench)
        runs = [bench.run(layout) for layout in settings.layouts]
    print_results(runs)
    print(f"work dir: {work_dir}")
    if args.json:
        first = runs[0]
        _common.emit_json({
            "benchmark": "prediction", "quick": args.quick, "task": TASK, "nodes": settings.nodes,
            "cores": os.cpu_count(), "micro_batch": settings.micro_batch, "steps": settings.steps,
            "sync_every": settings.sync_every, "max_inflight": settings.max_inflight, "alone_flops": bench.alone_flops,
            "predicted_samples_per_s": first["predicted_samples_per_s"],
            "measured_samples_per_s": first["measured_samples_per_s"], "ratio": first["ratio"],
            "target": list(TARGET), "met": all(r["within_target"] for r in runs), "runs": runs})
    return 0


def print_profile(bench: Bench) -> None:
    links = [bw for node in bench.nodes for bw in node.bandwidth_bytes_per_s.values()]
    print(f"compute: one process alone {bench.alone_flops / 1e9:.3g} GFLOP/s (training steps of {TASK}, micro_batch "
          f"{bench.settings.micro_batch}, 1 torch thread); before each run, as many processes as will train "
          f"are measured at once on the {os.cpu_count()} cores")
    if links:
        print(f"loopback links: median {statistics.median(links) / 1e6:.4g} MB/s over {len(links)} measured links")
    print(f"model: {len(bench.blocks)} blocks, {sum(b.fwd_flops + b.bwd_flops for b in bench.blocks) / 1e9:.3g} "
          f"GFLOP per micro-batch (forward + backward)")


def _cores(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}"


def print_results(runs: list[dict[str, Any]]) -> None:
    rows = [(r["layout"], " | ".join("->".join(c) for c in r["clusters"]),
             f"{r['flops_per_node'] / 1e9:.3g}", f"{r['predicted_samples_per_s']:.1f}",
             f"{r['measured_samples_per_s']:.1f}", f"{r['ratio']:.2f}", f"{r['naive_ratio']:.2f}",
             f"{_cores(r['cores_available_profiling'])} / {_cores(r['cores_available_training'])}",
             "?" if r["load_adjusted_ratio"] is None else f"{r['load_adjusted_ratio']:.2f}",
             f"{r['busy_fraction_mean']:.2f}", "yes" if r["within_target"] else "NO") for r in runs]
    print()
    print(_common.table(["layout", "clusters", "GFLOP/s per node", "predicted samples/s", "measured",
                         "measured/predicted", "measured/naive", "cores free: profiling / training",
                         "load-adjusted ratio", "busy", f"ratio in {TARGET[0]}..{TARGET[1]}"], rows))


if __name__ == "__main__":
    raise SystemExit(main())
