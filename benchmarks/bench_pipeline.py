"""ravq's asynchronous pipeline against torch's pipeline schedules (docs/design.md, "References to measure against").

Both systems run the same model cut the same way: ``benchmarks/synthetic_task.py``, 4 blocks of equal
cost split evenly over 4 (or 2) stage processes with 1 torch thread each, the same micro-batch size and
the same number of micro-batches, from the same initial weights.

(b) ravq: ``ravq demo --task benchmarks.synthetic_task --clusters 1 --stages 4`` (a real broker and node
    processes over ZeroMQ).  While it runs, the broker's status (every node's heartbeat statistics)
    is polled; a stage's steady-state busy fraction is (busy_s2 - busy_s1) / (wall_s2 - wall_s1)
    between its first heartbeat with >= 25% of the micro-batches done and its last with <= 85%, so
    warm-up and drain are left out.  Target: >= 0.95 for every stage (no bubble).
(c) torch: ``torch.distributed.pipelining`` over gloo (tcp://127.0.0.1), one process per stage, each
    stage built with ``pipeline(model, mb_args, split_spec).build_stage(rank, cpu)``; ``Schedule1F1B``
    and ``ScheduleGPipe`` with 8 micro-batches per schedule step and one optimizer step per schedule
    step.  One untimed schedule step first (torch's lazy shape inference and buffers: its start-up).

samples/s is whole-run for both, excluding start-up: from the first micro-batch's start to the last
micro-batch's end (ravq: stage 0's compute clock, which starts at its first forward and stops after
its last backward; torch: from a barrier before the first timed step to the end of the last one on
the slowest rank).  The rate over the same 25%..85% window is reported alongside.

The machine is often shared: every measurement also reports how many cores other users' processes
took meanwhile ("other load").  With ``--rounds N`` the systems alternate (ravq, torch, ravq, ...) and
each system's best round counts (outside load only ever slows a run down); busy fractions come from
the ravq round with the least outside load.  Run from the repo root:

    python benchmarks/bench_pipeline.py              # 2 rounds, ~3 minutes on 2 quiet cores
    python benchmarks/bench_pipeline.py --quick      # 1 short round on smaller stages, ~45 s
    python benchmarks/bench_pipeline.py --stages 2   # one core per stage on 2 cores: no CPU sharing
    python benchmarks/bench_pipeline.py --json       # last line: one JSON object
    python benchmarks/bench_pipeline.py --no-torch --max-inflight 6 --update-every 4   # ravq settings
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

TARGET_BUSY = 0.95
WINDOW = (0.25, 0.85)
"""The steady-state window, as fractions of the run's micro-batches."""
POLL_INTERVAL_S = 0.25
QUIET_OTHER_CORES = 0.25
"""Other users' mean load (cores) above which a window's figures are flagged as unreliable."""
TASK_MODULE = "benchmarks.synthetic_task"
SCHEDULES = {"1f1b": "torch Schedule1F1B", "gpipe": "torch ScheduleGPipe"}


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    preset: str
    """Attribute of benchmarks.synthetic_task naming the model ("default", "quick", "device", "device_quick")."""
    micro_batch: int
    steps: int
    """Micro-batches trained by each system per round; a multiple of ``torch_microbatches``."""
    stages: int = 4
    """Stage processes per system; must divide the synthetic model's 4 blocks."""
    rounds: int = 1
    torch_microbatches: int = 8
    """Micro-batches per torch schedule step (one optimizer step each)."""
    schedules: tuple[str, ...] = ("1f1b", "gpipe")
    max_inflight: int | None = None
    """ravq's credit limit at stage 0 (None: ravq's default)."""
    update_every: int = 1
    """ravq: backwards per optimizer step (torch steps once per schedule step regardless)."""
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

    def sample(self, min_interval_s: float = 1.0) -> None:
        if self.samples and time.monotonic() - self.samples[-1][0] < min_interval_s:
            return
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
def run_ravq(cfg: BenchConfig, run_dir: Path) -> dict[str, Any]:
    """One ``ravq demo`` run, its broker polled throughout."""
    report_path = run_dir / "report.json"
    argv = [sys.executable, "-m", "ravq", "demo", "--task", cfg.task_spec, "--clusters", "1",
            "--stages", str(cfg.stages), "--steps", str(cfg.steps), "--micro-batch", str(cfg.micro_batch),
            "--threads", "1", "--seed", str(cfg.seed), "--no-curve", "--quiet", "--run-dir", str(run_dir),
            "--report", str(report_path), "--timeout", str(cfg.timeout_s), "--update-every", str(cfg.update_every)]
    if cfg.max_inflight:
        argv += ["--max-inflight", str(cfg.max_inflight)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_common.REPO), os.environ.get("PYTHONPATH", "")])}
    run_dir.mkdir(parents=True, exist_ok=True)
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


async def _poll_broker(proc: subprocess.Popen[bytes], run_dir: Path,
                       cpu: CpuMonitor) -> dict[str, list[dict[str, Any]]]:
    """Every node's distinct heartbeat statistics (with ``polled_at``), in order, until the demo exits."""
    from ravq.cli.status import fetch_status
    from ravq.config import load_topology

    topo_path = run_dir / "topology.yaml"
    while not topo_path.exists() and proc.poll() is None:
        await asyncio.sleep(0.1)
    topology = load_topology(topo_path) if topo_path.exists() else None
    seen: dict[str, list[dict[str, Any]]] = {}
    while topology is not None and proc.poll() is None:
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


def _steady(snapshots: list[dict[str, Any]], steps: int) -> dict[str, Any] | None:
    """Busy fraction and samples/s of one node between its heartbeats at WINDOW of the run."""
    lo, hi = WINDOW[0] * steps, WINDOW[1] * steps
    first = next((s for s in snapshots if s["backwards"] >= lo), None)
    last = next((s for s in reversed(snapshots) if s["backwards"] <= hi), None)
    widened = first is None or last is None or last["wall_s"] <= first["wall_s"]
    if widened and snapshots:
        # Fewer than two heartbeats fell inside the window (a short or heavily loaded run): take the
        # nearest ones around it instead, and say so.
        first = next((s for s in reversed(snapshots) if s["backwards"] < lo), snapshots[0])
        last = next((s for s in snapshots if s["backwards"] > hi), snapshots[-1])
    if first is None or last is None or last["wall_s"] - first["wall_s"] <= 0:
        return None
    dt = last["wall_s"] - first["wall_s"]
    return {"busy_fraction": (last["busy_s"] - first["busy_s"]) / dt, "widened": widened,
            "samples_per_s": (last["samples"] - first["samples"]) / dt, "window_s": dt,
            "from_micro_batch": first["backwards"], "to_micro_batch": last["backwards"],
            "polled_from": first["polled_at"], "polled_to": last["polled_at"]}


def _ravq_result(cfg: BenchConfig, run_dir: Path, history: dict[str, list[dict[str, Any]]],
                 cpu: CpuMonitor, total_s: float) -> dict[str, Any]:
    summaries = sorted((json.loads(p.read_text()) for p in run_dir.glob("summary-*.json")),
                       key=lambda s: s["stage"])
    assert [s["stage"] for s in summaries] == list(range(cfg.stages)), "one summary per stage"
    stages = []
    for s in summaries:
        steady = _steady(history.get(s["name"], []), cfg.steps)
        stages.append({"stage": s["stage"], "busy_fraction_whole_run": s["busy_fraction"],
                       "busy_fraction_window": steady["busy_fraction"] if steady else None,
                       "window": steady, "heartbeats": len(history.get(s["name"], [])),
                       "ms_per_micro_batch": 1e3 * s["busy_s"] / max(1, s["backwards"]),
                       "staleness_mean": s["staleness_mean"]})
    run_s, samples, last_window = summaries[0]["wall_s"], summaries[-1]["samples"], stages[-1]["window"]
    return {"samples": samples, "run_s": run_s, "samples_per_s": samples / run_s,
            "samples_per_s_window": last_window["samples_per_s"] if last_window else None,
            "other_cores_window": cpu.other_cores(last_window["polled_from"], last_window["polled_to"])
            if last_window else None,
            "stages": stages, "total_s": total_s, "run_dir": str(run_dir)}


# ------------------------------------------------------------------------------------------- torch
class TorchPipeline:
    """One gloo rank per stage, kept alive across rounds; each ``run`` trains a schedule afresh."""

    def __init__(self, cfg: BenchConfig) -> None:
        from ravq.cli.demo import free_ports

        self.cfg = cfg
        ctx = mp.get_context("spawn")
        self.results: Any = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(cfg.stages)]
        port = free_ports(1)[0]
        self.procs = [ctx.Process(target=_torch_worker, args=(rank, port, cfg, self.commands[rank], self.results),
                                  daemon=True) for rank in range(cfg.stages)]
        for p in self.procs:
            p.start()
        self._collect("ready", CpuMonitor())

    def run(self, schedule: str) -> dict[str, Any]:
        cpu, t0 = CpuMonitor(), time.monotonic()
        for q in self.commands:
            q.put(schedule)
        per_rank = self._collect(schedule, cpu)
        return _torch_result(self.cfg, per_rank, cpu, time.monotonic() - t0)

    def _collect(self, what: str, cpu: CpuMonitor) -> dict[int, Any]:
        got: dict[int, Any] = {}
        deadline = time.monotonic() + self.cfg.timeout_s
        while len(got) < self.cfg.stages:
            cpu.sample()
            if time.monotonic() > deadline:
                raise RuntimeError(f"torch ranks: no {what} within {self.cfg.timeout_s:.0f}s")
            try:
                rank, name, value = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in self.procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a torch rank exited with code {dead[0]} (traceback above)") from None
                continue
            if name == "error":
                raise RuntimeError(f"torch rank {rank} failed: {value}")
            assert name == what, (name, what)
            got[rank] = value
        return got

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.terminate()


def _torch_worker(rank: int, port: int, cfg: BenchConfig, commands: Any, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cfg.stages)
    try:
        results.put((rank, "ready", None))
        while (schedule := commands.get()) is not None:
            results.put((rank, schedule, _torch_schedule_run(rank, schedule, cfg)))
    except BaseException as err:  # the parent must not wait for this rank until its timeout
        results.put((rank, "error", repr(err)))
        raise
    finally:
        dist.destroy_process_group()


def _torch_schedule_run(rank: int, schedule_name: str, cfg: BenchConfig) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

    from ravq.config import resolve_task_module
    from ravq.cut.split import build_task_model, even_cuts

    task = resolve_task_module(cfg.task_spec)
    model = build_task_model(task, cfg.seed)  # the weights ravq's nodes start from
    cuts = even_cuts(list(task.split_points()), cfg.stages)  # the cuts ravq's demo plan makes
    pipe = pipeline(model, mb_args=task.example_inputs(cfg.micro_batch),
                    split_spec={c: SplitPoint.BEGINNING for c in cuts})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    optimizer = task.make_optimizer(stage.submod.parameters())
    kind = Schedule1F1B if schedule_name == "1f1b" else ScheduleGPipe
    schedule = kind(stage, n_microbatches=cfg.torch_microbatches, loss_fn=task.loss_fn)
    batches = task.train_batches(cfg.micro_batch, 0, 1, cfg.seed)

    def step() -> None:
        chunk = [next(batches) for _ in range(cfg.torch_microbatches)]
        if rank == 0:
            schedule.step(torch.cat([inputs[0] for inputs, _ in chunk]))
        elif rank == cfg.stages - 1:
            schedule.step(target=torch.cat([t for _, t in chunk]), return_outputs=False)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    t0 = time.monotonic()
    step()  # lazy set-up (shape inference, buffers): torch's start-up, untimed and not counted
    warmup_s = time.monotonic() - t0
    dist.barrier()
    start, ends = time.monotonic(), []
    for _ in range(cfg.steps // cfg.torch_microbatches):
        step()
        ends.append(time.monotonic())
    return {"start": start, "ends": ends, "warmup_s": warmup_s}


def _torch_result(cfg: BenchConfig, per_rank: dict[int, dict[str, Any]], cpu: CpuMonitor,
                  total_s: float) -> dict[str, Any]:
    start = min(r["start"] for r in per_rank.values())
    end = max(r["ends"][-1] for r in per_rank.values())
    samples = cfg.steps * cfg.micro_batch
    # The window: whole schedule steps within WINDOW of the run, timed on rank 0, which ends each
    # step (its last backward closes it).
    ends = per_rank[0]["ends"]
    i, j = max(1, round(WINDOW[0] * len(ends))), min(len(ends), round(WINDOW[1] * len(ends)))
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


def _key(name: str) -> str:
    """JSON key prefix of a system: "ravq", "torch_1f1b", "torch_gpipe"."""
    return name if name == "ravq" else f"torch_{name}"


def _quietest(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return min(runs, key=lambda r: (r["other_cores_window"] is None, r["other_cores_window"] or 0.0))


def summarize(cfg: BenchConfig, rounds: list[dict[str, dict[str, Any]]], wall_s: float) -> dict[str, Any]:
    """Best round per system for rates; the quietest ravq round for busy fractions."""
    from ravq.config import resolve_task_module

    task = resolve_task_module(cfg.task_spec)
    best = {name: max((r[name] for r in rounds), key=lambda run: run["samples_per_s"]) for name in rounds[0]}
    ravq = _quietest([r["ravq"] for r in rounds])
    busy = [s["busy_fraction_window"] for s in ravq["stages"]]
    known = [b for b in busy if b is not None]
    result: dict[str, Any] = {
        "cores": cpu_cores(), "stages": cfg.stages, "micro_batch": cfg.micro_batch, "micro_batches": cfg.steps,
        "rounds": cfg.rounds, "torch_microbatches_per_step": cfg.torch_microbatches, "preset": cfg.preset,
        "model": {"width": task.width, "layers_per_stage": task.layers * task.blocks // cfg.stages,
                  "device_ms_per_stage_forward": task.device_ms * task.blocks / cfg.stages},
        "window": list(WINDOW), "target_busy_fraction": TARGET_BUSY, "max_inflight": cfg.max_inflight,
        "update_every": cfg.update_every,
        "busy_fraction_window": busy,
        "busy_fraction_whole_run": [s["busy_fraction_whole_run"] for s in ravq["stages"]],
        "busy_fraction_window_min": min(known) if known else None,
        "busy_target_met": bool(known) and len(known) == len(busy) and min(known) >= TARGET_BUSY,
        "busy_other_cores_window": ravq["other_cores_window"],
        "ms_per_micro_batch": [s["ms_per_micro_batch"] for s in ravq["stages"]],
        "staleness_mean": [s["staleness_mean"] for s in ravq["stages"]], "wall_s": wall_s,
    }
    for name, run in best.items():
        key = _key(name)
        result[f"{key}_samples_per_s"] = run["samples_per_s"]
        result[f"{key}_samples_per_s_window"] = run["samples_per_s_window"]
        result[f"{key}_other_cores_window"] = run["other_cores_window"]
        if name != "ravq":
            result[f"{key}_warmup_step_s"] = run["warmup_step_s"]
            result[f"ratio_ravq_over_{name}"] = _ratio(best["ravq"]["samples_per_s"], run["samples_per_s"])
            result[f"ratio_ravq_over_{name}_window"] = _ratio(best["ravq"]["samples_per_s_window"],
                                                              run["samples_per_s_window"])
    result["per_round"] = [{_key(name): {k: run[k] for k in ("samples_per_s", "samples_per_s_window", "other_cores_window")}
                            for name, run in r.items()} for r in rounds]
    others = [run["other_cores_window"] for run in [ravq, *(best[n] for n in best if n != "ravq")]]
    result["other_cores_max"] = max((o for o in others if o is not None), default=None)
    result["quiet"] = None not in others and max(others) <= QUIET_OTHER_CORES
    return result


def print_report(result: dict[str, Any], ravq_stages: list[dict[str, Any]]) -> None:
    print(f"\n{result['stages']} stages, synthetic task '{result['preset']}' (width {result['model']['width']}, "
          f"{result['model']['layers_per_stage']} Linear+ReLU per stage"
          + (f", {result['model']['device_ms_per_stage_forward']:g} ms simulated device time per stage forward, "
             "twice that in backward" if result["model"]["device_ms_per_stage_forward"] else "")
          + f"), micro-batch {result['micro_batch']}, "
          f"{result['micro_batches']} micro-batches per system and round, {result['rounds']} round(s)")
    print(f"{result['cores']} CPU cores for {result['stages']} stage processes (1 torch thread each)")
    print(f"\n(b) ravq busy fraction per stage (quietest round; other load {_fmt(result['busy_other_cores_window'], '.2f')}"
          f" cores); steady window = micro-batches {WINDOW[0]:.0%}..{WINDOW[1]:.0%} (target >= {TARGET_BUSY})")
    rows = []
    for s in ravq_stages:
        w = s["window"] or {}
        rows.append([s["stage"], _fmt(s["busy_fraction_window"]), _fmt(s["busy_fraction_whole_run"]),
                     f"{w.get('from_micro_batch', '-')}..{w.get('to_micro_batch', '-')}",
                     _fmt(w.get("window_s"), ".1f"), s["heartbeats"], _fmt(s["ms_per_micro_batch"], ".1f"),
                     _fmt(s["staleness_mean"], ".2f")])
    print(_common.table(["stage", "busy (window)", "busy (whole run)", "window mbs", "window s", "heartbeats",
                         "busy ms/mb", "staleness"], rows))
    verdict = "met" if result["busy_target_met"] else "MISSED"
    print(f"min steady busy fraction {_fmt(result['busy_fraction_window_min'])}: target {verdict}")
    print(f"\n(c) samples/s (best round), whole run from first micro-batch to last, and over the window; "
          f"torch: {result['torch_microbatches_per_step']} micro-batches per schedule step")
    rows = [["ravq (async, no flush)", _fmt(result["ravq_samples_per_s"], ".1f"),
             _fmt(result["ravq_samples_per_s_window"], ".1f"), "1.000", "1.000",
             _fmt(result["ravq_other_cores_window"], ".2f")]]
    for name, label in SCHEDULES.items():
        key = _key(name)
        if f"{key}_samples_per_s" in result:
            rows.append([label, _fmt(result[f"{key}_samples_per_s"], ".1f"),
                         _fmt(result[f"{key}_samples_per_s_window"], ".1f"), _fmt(result[f"ratio_ravq_over_{name}"]),
                         _fmt(result[f"ratio_ravq_over_{name}_window"]), _fmt(result[f"{key}_other_cores_window"], ".2f")])
    print(_common.table(["system", "samples/s (run)", "samples/s (window)", "ravq/this (run)",
                         "ravq/this (window)", "other load (cores)"], rows))
    print("other load: mean cores busy outside this benchmark's processes during the window (other users)")
    if not result["quiet"]:
        print(f"WARNING: other processes took up to {_fmt(result['other_cores_max'], '.2f')} of {result['cores']} "
              "cores during a measurement window: the figures are not reliable; rerun on a quiet machine")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, smaller stages, fewer micro-batches")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--rounds", type=int, default=None, help="ravq/torch alternations (default 2; quick 1)")
    parser.add_argument("--micro-batches", type=int, default=None, help="per system and round (default 192; quick 64)")
    parser.add_argument("--micro-batch", type=int, default=256, help="samples per micro-batch")
    parser.add_argument("--stages", type=int, default=4, choices=(2, 4), help="stage processes per system")
    parser.add_argument("--compute", choices=("device", "cpu"), default="device",
                        help="stage cost: simulated accelerator time, one machine per stage (default), or CPU "
                             "matmuls, every stage process sharing this machine's cores")
    parser.add_argument("--no-gpipe", action="store_true", help="skip torch's ScheduleGPipe")
    parser.add_argument("--no-torch", action="store_true", help="measure ravq only")
    parser.add_argument("--max-inflight", type=int, default=None, help="ravq's credit limit (default: ravq's own)")
    parser.add_argument("--update-every", type=int, default=8,
                        help="ravq: backwards per optimizer step (default 8: torch's schedule step, the same batch; "
                             "with 1, ravq keeps 2 micro-batches in flight, ravq.config.batch.default_inflight)")
    parser.add_argument("--run-dir", default=None, help="keep ravq's logs here (default: a temp dir)")
    args = parser.parse_args(argv)
    schedules = () if args.no_torch else ("1f1b",) if args.no_gpipe else ("1f1b", "gpipe")
    presets = {("device", False): "device", ("device", True): "device_quick", ("cpu", False): "default",
               ("cpu", True): "quick"}
    cfg = BenchConfig(preset=presets[args.compute, args.quick], micro_batch=args.micro_batch,
                      steps=args.micro_batches or (64 if args.quick else 192), stages=args.stages,
                      rounds=args.rounds or (1 if args.quick else 2), schedules=schedules,
                      max_inflight=args.max_inflight, update_every=args.update_every)
    if cfg.steps % cfg.torch_microbatches or cfg.rounds < 1:
        parser.error(f"--micro-batches must be a multiple of {cfg.torch_microbatches}; --rounds at least 1")
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="ravq-bench-pipeline-"))
    t0 = time.monotonic()
    torch_side = TorchPipeline(cfg) if cfg.schedules else None  # started once: ranks wait between rounds
    rounds: list[dict[str, dict[str, Any]]] = []
    try:
        for r in range(cfg.rounds):
            print(f"round {r + 1}/{cfg.rounds}: ravq, {cfg.steps} micro-batches through {cfg.stages} stages "
                  f"(logs in {run_dir}) ...", flush=True)
            results = {"ravq": run_ravq(cfg, run_dir / f"round{r + 1}")}
            for name in cfg.schedules:
                assert torch_side is not None
                print(f"round {r + 1}/{cfg.rounds}: {SCHEDULES[name]}, the same over gloo ...", flush=True)
                results[name] = torch_side.run(name)
            rounds.append(results)
    finally:
        if torch_side is not None:
            torch_side.close()
    result = summarize(cfg, rounds, time.monotonic() - t0)
    print_report(result, _quietest([r["ravq"] for r in rounds])["stages"])
    if args.json:
        _common.emit_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
