"""ravq's asynchronous pipeline against torch's pipeline schedules (DESIGN.md, "References to measure against").

Both halves run the same model cut the same way: ``benchmarks/synthetic_task.py``, 4 blocks of equal
cost, one per stage, 4 stage processes with 1 torch thread each, the same micro-batch size and the
same number of micro-batches.

(b) ravq: ``ravq demo --task benchmarks.synthetic_task --clusters 1 --stages 4`` (real broker and node
    processes over ZeroMQ).  While it runs, the broker's status (every node's heartbeat statistics)
    is polled; a stage's steady-state busy fraction is (busy_s2 - busy_s1) / (wall_s2 - wall_s1)
    between its first heartbeat with >= 25% of the micro-batches done and its last with <= 85%, so
    warm-up and drain are left out.  Target: >= 0.95 for every stage (no bubble).
(c) torch: ``torch.distributed.pipelining`` over gloo (tcp://127.0.0.1), 4 processes, each stage built
    with ``pipeline(model, mb_args, split_spec).build_stage(rank, cpu)``, ``Schedule1F1B`` (and
    ``ScheduleGPipe``) with 8 micro-batches per schedule step and one optimizer step per schedule step.

samples/s is whole-run for both, excluding start-up: from the first micro-batch's start to the last
micro-batch's end (ravq: stage 0's compute clock, which starts at its first forward and stops after
its last backward; torch: from a barrier before the first schedule step to the end of the last one,
the slowest rank).  The steady-state window rate (same 25%..85% window) is reported alongside.

Run from the repo root:

    python benchmarks/bench_pipeline.py            # ~3 minutes on 2 cores
    python benchmarks/bench_pipeline.py --quick    # ~45 s smoke run (smaller stages, fewer micro-batches)
    python benchmarks/bench_pipeline.py --json     # last line: one JSON object
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _common

_common.use_repo_checkout()

STAGES = 4
TARGET_BUSY = 0.95
WINDOW = (0.25, 0.85)
"""The steady-state window, as fractions of the run's micro-batches."""
POLL_INTERVAL_S = 0.25
TASK_MODULE = "benchmarks.synthetic_task"


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    preset: str
    """Attribute of benchmarks.synthetic_task naming the model size ("default" or "quick")."""
    micro_batch: int
    steps: int
    """Micro-batches trained by each system; a multiple of ``torch_microbatches``."""
    torch_microbatches: int = 8
    """Micro-batches per torch schedule step (one optimizer step each)."""
    gpipe: bool = True
    torch: bool = True
    max_inflight: int | None = None
    """ravq's credit limit at stage 0 (None: ravq's default, the number of stages)."""
    seed: int = 0
    timeout_s: float = 600.0

    @property
    def task_spec(self) -> str:
        return f"{TASK_MODULE}:{self.preset}"


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class CpuMonitor:
    """Machine-wide busy CPU against this process tree's (Linux /proc), so a measurement can say how
    many cores other users' processes took meanwhile: on a shared 2-core machine that load, not the
    pipeline, can decide the figures."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []
        self._tick = os.sysconf("SC_CLK_TCK")

    def sample(self) -> None:
        try:
            with open("/proc/stat") as f:
                ticks = [int(x) for x in f.readline().split()[1:9]]
            self.samples.append((time.monotonic(), (sum(ticks) - ticks[3] - ticks[4]) / self._tick,
                                 self._tree_s()))
        except OSError:
            pass

    def _tree_s(self) -> float:
        """CPU seconds of this process and its running descendants."""
        parent, cpu = {}, {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
            pid = int(entry.name)
            parent[pid], cpu[pid] = int(fields[1]), (int(fields[11]) + int(fields[12])) / self._tick
        children: dict[int, list[int]] = {}
        for pid, ppid in parent.items():
            children.setdefault(ppid, []).append(pid)
        total, todo = 0.0, [os.getpid()]
        while todo:
            pid = todo.pop()
            total += cpu.get(pid, 0.0)
            todo.extend(children.get(pid, []))
        return total

    def other_cores(self, t0: float, t1: float) -> float | None:
        """Mean cores busy outside this process tree between the samples nearest ``t0`` and ``t1``."""
        if len(self.samples) < 2:
            return None
        a = min(self.samples, key=lambda s: abs(s[0] - t0))
        b = min(self.samples, key=lambda s: abs(s[0] - t1))
        if b[0] - a[0] < 1.0:
            return None
        return max(0.0, ((b[1] - a[1]) - (b[2] - a[2])) / (b[0] - a[0]))


# ------------------------------------------------------------------------------------------- ravq
def _steady(snapshots: list[dict[str, Any]], steps: int) -> dict[str, float] | None:
    """Busy fraction and samples/s of one node between its heartbeats at WINDOW of the run."""
    lo, hi = WINDOW[0] * steps, WINDOW[1] * steps
    first = next((s for s in snapshots if s["backwards"] >= lo), None)
    last = next((s for s in reversed(snapshots) if s["backwards"] <= hi), None)
    if first is None or last is None or last["wall_s"] - first["wall_s"] <= 0:
        return None
    dt = last["wall_s"] - first["wall_s"]
    return {"busy_fraction": (last["busy_s"] - first["busy_s"]) / dt,
            "samples_per_s": (last["samples"] - first["samples"]) / dt, "window_s": dt,
            "from_micro_batch": first["backwards"], "to_micro_batch": last["backwards"],
            "polled_from": first["polled_at"], "polled_to": last["polled_at"]}


async def _poll_broker(proc: subprocess.Popen[bytes], run_dir: Path,
                       cpu: CpuMonitor) -> dict[str, list[dict[str, Any]]]:
    """Every node's distinct heartbeat statistics (with ``polled_at``), in order, until the demo exits."""
    from ravq.config import load_topology
    from ravq.status import fetch_status

    topo_path = run_dir / "topology.yaml"
    while not topo_path.exists() and proc.poll() is None:
        await asyncio.sleep(0.1)
    topology = load_topology(topo_path) if topo_path.exists() else None
    seen: dict[str, list[dict[str, Any]]] = {}
    while topology is not None and proc.poll() is None:
        if not cpu.samples or time.monotonic() - cpu.samples[-1][0] >= 1.0:
            cpu.sample()
        try:
            status = await fetch_status(topology, timeout_s=1.0)
        except (TimeoutError, OSError):
            status = {}
        for name, member in status.get("members", {}).items():
            stats = member.get("stats") or {}
            history = seen.setdefault(name, [])
            if stats.get("wall_s") and (not history or stats["wall_s"] > history[-1]["wall_s"]):
                history.append({**stats, "polled_at": time.monotonic()})
        await asyncio.sleep(POLL_INTERVAL_S)
    return seen


def run_ravq(cfg: BenchConfig, run_dir: Path) -> dict[str, Any]:
    report_path = run_dir / "report.json"
    argv = [sys.executable, "-m", "ravq", "demo", "--task", cfg.task_spec, "--clusters", "1",
            "--stages", str(STAGES), "--steps", str(cfg.steps), "--micro-batch", str(cfg.micro_batch),
            "--threads", "1", "--seed", str(cfg.seed), "--no-curve", "--quiet", "--run-dir", str(run_dir),
            "--report", str(report_path), "--timeout", str(cfg.timeout_s)]
    if cfg.max_inflight:
        argv += ["--max-inflight", str(cfg.max_inflight)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_common.REPO), os.environ.get("PYTHONPATH", "")])}
    t0, cpu = time.monotonic(), CpuMonitor()
    with open(run_dir / "demo.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=_common.REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        try:
            history = asyncio.run(_poll_broker(proc, run_dir, cpu))
            proc.wait(timeout=cfg.timeout_s)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
    if proc.returncode != 0 or not report_path.exists():
        tail = (run_dir / "demo.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"ravq demo failed (exit {proc.returncode}); logs in {run_dir}:\n{tail}")
    return _ravq_result(cfg, run_dir, history, cpu, time.monotonic() - t0)


def _ravq_result(cfg: BenchConfig, run_dir: Path, history: dict[str, list[dict[str, Any]]],
                 cpu: CpuMonitor, total_s: float) -> dict[str, Any]:
    summaries = sorted((json.loads(p.read_text()) for p in run_dir.glob("summary-*.json")),
                       key=lambda s: s["stage"])
    assert [s["stage"] for s in summaries] == list(range(STAGES)), "one summary per stage"
    first, last = summaries[0], summaries[-1]
    stages = []
    for s in summaries:
        steady = _steady(history.get(s["name"], []), cfg.steps)
        stages.append({"stage": s["stage"], "busy_fraction_whole_run": s["busy_fraction"],
                       "busy_fraction_window": steady["busy_fraction"] if steady else None,
                       "window": steady, "heartbeats": len(history.get(s["name"], [])),
                       "ms_per_micro_batch": 1e3 * s["busy_s"] / max(1, s["backwards"]),
                       "staleness_mean": s["staleness_mean"]})
    last_steady = stages[-1]["window"]
    return {"samples": last["samples"], "run_s": first["wall_s"],
            "samples_per_s": last["samples"] / first["wall_s"],
            "samples_per_s_window": last_steady["samples_per_s"] if last_steady else None,
            "other_cores_window": cpu.other_cores(last_steady["polled_from"], last_steady["polled_to"])
            if last_steady else None,
            "stages": stages, "total_s": total_s, "run_dir": str(run_dir)}


# ------------------------------------------------------------------------------------------- torch
def _torch_worker(rank: int, port: int, cfg: BenchConfig, results: Any) -> None:
    """One rank of the torch pipeline: every requested schedule in turn, on fresh weights."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=STAGES)
    try:
        for name in ["1f1b", "gpipe"] if cfg.gpipe else ["1f1b"]:
            results.put((rank, name, _torch_schedule_run(rank, name, cfg)))
    except BaseException as err:  # the parent must not wait forever for this rank
        results.put((rank, "error", repr(err)))
        raise
    finally:
        dist.destroy_process_group()


def _torch_schedule_run(rank: int, name: str, cfg: BenchConfig) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

    from ravq.config import resolve_task_module
    from ravq.model import build_task_model, even_cuts

    task = resolve_task_module(cfg.task_spec)
    model = build_task_model(task, cfg.seed)  # the weights ravq's nodes start from
    cuts = even_cuts(list(task.split_points()), STAGES)  # the cuts ravq's demo plan makes
    pipe = pipeline(model, mb_args=task.example_inputs(cfg.micro_batch),
                    split_spec={c: SplitPoint.BEGINNING for c in cuts})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    optimizer = task.make_optimizer(stage.submod.parameters())
    kind = Schedule1F1B if name == "1f1b" else ScheduleGPipe
    schedule = kind(stage, n_microbatches=cfg.torch_microbatches, loss_fn=task.loss_fn)
    batches = task.train_batches(cfg.micro_batch, 0, 1, cfg.seed)
    t0 = time.monotonic()
    _torch_step(rank, schedule, optimizer, batches, cfg.torch_microbatches)  # lazy set-up: untimed
    warmup_s = time.monotonic() - t0
    ends = []
    dist.barrier()
    start = time.monotonic()
    for _ in range(cfg.steps // cfg.torch_microbatches):
        _torch_step(rank, schedule, optimizer, batches, cfg.torch_microbatches)
        ends.append(time.monotonic())
    return {"start": start, "ends": ends, "warmup_s": warmup_s}


def _torch_step(rank: int, schedule: Any, optimizer: Any, batches: Any, microbatches: int) -> None:
    """One schedule step (``microbatches`` micro-batches through the pipeline), then one optimizer step."""
    import torch

    chunk = [next(batches) for _ in range(microbatches)]
    if rank == 0:
        schedule.step(torch.cat([inputs[0] for inputs, _ in chunk]))
    elif rank == STAGES - 1:
        schedule.step(target=torch.cat([t for _, t in chunk]), return_outputs=False)
    else:
        schedule.step()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_torch(cfg: BenchConfig) -> dict[str, dict[str, Any]]:
    from ravq.demo import free_ports

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_ports(1)[0]
    t0, cpu = time.monotonic(), CpuMonitor()
    procs = [ctx.Process(target=_torch_worker, args=(rank, port, cfg, results), daemon=True)
             for rank in range(STAGES)]
    for p in procs:
        p.start()
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    try:
        expected, deadline = STAGES * (2 if cfg.gpipe else 1), time.monotonic() + cfg.timeout_s
        while sum(len(r) for r in runs.values()) < expected:
            cpu.sample()
            if time.monotonic() > deadline:
                raise RuntimeError(f"torch ranks did not finish within {cfg.timeout_s:.0f}s")
            try:
                rank, name, value = results.get(timeout=1.0)
            except queue.Empty:
                continue
            if name == "error":
                raise RuntimeError(f"torch rank {rank} failed: {value}")
            runs.setdefault(name, {})[rank] = value
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
    total_s = time.monotonic() - t0
    return {name: _torch_result(cfg, per_rank, cpu, total_s) for name, per_rank in runs.items()}


def _torch_result(cfg: BenchConfig, per_rank: dict[int, dict[str, Any]], cpu: CpuMonitor,
                  total_s: float) -> dict[str, Any]:
    start = min(r["start"] for r in per_rank.values())
    end = max(r["ends"][-1] for r in per_rank.values())
    samples = cfg.steps * cfg.micro_batch
    # Window: whole schedule steps between WINDOW of the run, timed on rank 0 (which finishes each
    # step last: its final backward closes the step).
    ends = per_rank[0]["ends"]
    n = len(ends)
    i, j = max(1, round(WINDOW[0] * n)), min(n, round(WINDOW[1] * n))
    window = other = None
    if j > i:
        window = (j - i) * cfg.torch_microbatches * cfg.micro_batch / (ends[j - 1] - ends[i - 1])
        other = cpu.other_cores(ends[i - 1], ends[j - 1])
    return {"samples": samples, "run_s": end - start, "samples_per_s": samples / (end - start),
            "samples_per_s_window": window, "warmup_step_s": per_rank[0]["warmup_s"],
            "other_cores_window": other, "total_s": total_s}


# ------------------------------------------------------------------------------------------- report
def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def summarize(cfg: BenchConfig, ravq: dict[str, Any], torch_runs: dict[str, dict[str, Any]],
              load: tuple[float, float], wall_s: float) -> dict[str, Any]:
    from ravq.config import resolve_task_module

    task = resolve_task_module(cfg.task_spec)
    busy = [s["busy_fraction_window"] for s in ravq["stages"]]
    result: dict[str, Any] = {
        "cores": cpu_cores(), "stages": STAGES, "micro_batch": cfg.micro_batch, "micro_batches": cfg.steps,
        "torch_microbatches_per_step": cfg.torch_microbatches, "preset": cfg.preset,
        "model": {"width": task.width, "layers_per_stage": task.layers * task.blocks // STAGES},
        "window": list(WINDOW), "target_busy_fraction": TARGET_BUSY,
        "busy_fraction_window": busy, "busy_fraction_whole_run": [s["busy_fraction_whole_run"] for s in ravq["stages"]],
        "busy_fraction_window_min": min(b for b in busy if b is not None) if any(busy) else None,
        "ms_per_micro_batch": [s["ms_per_micro_batch"] for s in ravq["stages"]],
        "ravq_samples_per_s": ravq["samples_per_s"], "ravq_samples_per_s_window": ravq["samples_per_s_window"],
        "ravq_run_s": ravq["run_s"], "ravq_other_cores_window": ravq["other_cores_window"],
        "load_average": list(load), "wall_s": wall_s,
    }
    result["busy_target_met"] = bool(result["busy_fraction_window_min"] and
                                     result["busy_fraction_window_min"] >= TARGET_BUSY)
    for name, run in torch_runs.items():
        result[f"torch_{name}_samples_per_s"] = run["samples_per_s"]
        result[f"torch_{name}_samples_per_s_window"] = run["samples_per_s_window"]
        result[f"torch_{name}_warmup_step_s"] = run["warmup_step_s"]
        result[f"torch_{name}_other_cores_window"] = run["other_cores_window"]
        result[f"ratio_ravq_over_{name}"] = _ratio(ravq["samples_per_s"], run["samples_per_s"])
        result[f"ratio_ravq_over_{name}_window"] = _ratio(ravq["samples_per_s_window"], run["samples_per_s_window"])
    return result


def print_report(result: dict[str, Any], ravq: dict[str, Any]) -> None:
    print(f"\n{result['stages']} stages, synthetic task '{result['preset']}' (width {result['model']['width']}, "
          f"{result['model']['layers_per_stage']} Linear+ReLU per stage), micro-batch {result['micro_batch']}, "
          f"{result['micro_batches']} micro-batches per system")
    print(f"{result['cores']} CPU cores for {result['stages']} stage processes (1 torch thread each); "
          f"load average before/after: {result['load_average'][0]:.2f}/{result['load_average'][1]:.2f}")
    print(f"\n(b) ravq busy fraction per stage; steady window = micro-batches "
          f"{WINDOW[0]:.0%}..{WINDOW[1]:.0%} of the run (target >= {TARGET_BUSY})")
    rows = []
    for s in ravq["stages"]:
        w = s["window"] or {}
        rows.append([s["stage"], _fmt(s["busy_fraction_window"]), _fmt(s["busy_fraction_whole_run"]),
                     f"{w.get('from_micro_batch', '-')}..{w.get('to_micro_batch', '-')}", _fmt(w.get("window_s"), ".1f"),
                     s["heartbeats"], _fmt(s["ms_per_micro_batch"], ".1f"), _fmt(s["staleness_mean"], ".2f")])
    print(_common.table(["stage", "busy (window)", "busy (whole run)", "window mbs", "window s", "heartbeats",
                         "busy ms/mb", "staleness"], rows))
    verdict = "met" if result["busy_target_met"] else "MISSED"
    print(f"min steady busy fraction {_fmt(result['busy_fraction_window_min'])}: target {verdict}")
    print(f"\n(c) samples/s, whole run from first micro-batch to last (and steady window); "
          f"torch: {result['torch_microbatches_per_step']} micro-batches per schedule step")
    rows = [["ravq (async, no flush)", _fmt(result["ravq_samples_per_s"], ".1f"),
             _fmt(result["ravq_samples_per_s_window"], ".1f"), "1.000", "1.000",
             _fmt(result["ravq_other_cores_window"], ".2f")]]
    for name, label in (("1f1b", "torch Schedule1F1B"), ("gpipe", "torch ScheduleGPipe")):
        if f"torch_{name}_samples_per_s" in result:
            rows.append([label, _fmt(result[f"torch_{name}_samples_per_s"], ".1f"),
                         _fmt(result[f"torch_{name}_samples_per_s_window"], ".1f"),
                         _fmt(result[f"ratio_ravq_over_{name}"]), _fmt(result[f"ratio_ravq_over_{name}_window"]),
                         _fmt(result[f"torch_{name}_other_cores_window"], ".2f")])
    print(_common.table(["system", "samples/s (run)", "samples/s (window)", "ravq/this (run)",
                         "ravq/this (window)", "other load (cores)"], rows))
    print("other load: cores busy outside this benchmark's processes during the window (other users); "
          "compare rows only when it is similar")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: smaller stages, fewer micro-batches")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--micro-batches", type=int, default=None, help="per system (default 256; quick 64)")
    parser.add_argument("--micro-batch", type=int, default=256, help="samples per micro-batch")
    parser.add_argument("--no-gpipe", action="store_true", help="skip torch's ScheduleGPipe")
    parser.add_argument("--no-torch", action="store_true", help="measure ravq only")
    parser.add_argument("--max-inflight", type=int, default=None, help="ravq's credit limit (default: ravq's own)")
    parser.add_argument("--run-dir", default=None, help="keep ravq's logs here (default: a temp dir)")
    args = parser.parse_args(argv)
    steps = args.micro_batches or (64 if args.quick else 256)
    cfg = BenchConfig(preset="quick" if args.quick else "default", micro_batch=args.micro_batch,
                      steps=steps, gpipe=not args.no_gpipe,
                      torch=not args.no_torch, max_inflight=args.max_inflight)
    if steps % cfg.torch_microbatches:
        parser.error(f"--micro-batches must be a multiple of {cfg.torch_microbatches}")
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="ravq-bench-pipeline-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    load_before = os.getloadavg()[0]
    print(f"ravq: {cfg.steps} micro-batches through {STAGES} stages (logs in {run_dir}) ...", flush=True)
    ravq = run_ravq(cfg, run_dir)
    torch_runs = {}
    if cfg.torch:
        print("torch.distributed.pipelining: the same, over gloo ...", flush=True)
        torch_runs = run_torch(cfg)
    result = summarize(cfg, ravq, torch_runs, (load_before, os.getloadavg()[0]), time.monotonic() - t0)
    print_report(result, ravq)
    if args.json:
        _common.emit_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
