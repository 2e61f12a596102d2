"""Start-up memory and time of one node's stage: this tree against another (e.g. before models were built
on ``meta``), for the demo task and for a model no PC of the memory test can hold.

Each measurement is a fresh process that imports ravq from the given tree and calls its
``ravq.stage.build.build_stage`` for one stage of a plan, as a node does at start (the averager's own
build of the model, which the older tree did a second time with two clusters or more, is not counted):
the time to import, the time to build the stage, and the peak RSS over the process after its imports
(VmHWM), against the stage's weights.

    python benchmarks/bench_startup.py --before /tmp/ravq-before   # a worktree of the older commit
    python benchmarks/bench_startup.py --quick                     # this tree, the demo task only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = r"""
import json, sys, time
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
t0 = time.perf_counter()
import torch
from ravq.config import TrainingConfig, resolve_task_module
from ravq.metrics import Metrics
from ravq.stage.build import build_stage
from ravq.cut.split import even_cuts
task_name, stages, stage, micro_batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
task = resolve_task_module(task_name)
base = hwm()
t1 = time.perf_counter()
built = build_stage(task, TrainingConfig(micro_batch=micro_batch, steps=10), seed=0,
                    cuts=even_cuts(list(task.split_points()), stages), stage=stage, cluster=0, clusters=1,
                    device="cpu", metrics=Metrics("bench"))
t2 = time.perf_counter()
weights = sum(p.numel() * p.element_size() for p in built.worker.params.values())
print(json.dumps({"import_s": t1 - t0, "build_s": t2 - t1, "baseline_bytes": base, "peak_bytes": hwm(),
                  "stage_weight_bytes": weights}))
"""

CASES = [("demo task (charlm), stage 0 of 2", "ravq.tasks.charlm", 2, 0, 16),
         ("302 M-parameter LM (tests/big_task.py), stage 1 of 4", "bench_big_task", 4, 1, 1)]
TASK_DIR = Path(tempfile.mkdtemp(prefix="ravq-bench-startup-"))
"""Where the big task is copied under a name of its own (another tree has its own ``tests`` package)."""
shutil.copy(ROOT / "tests" / "big_task.py", TASK_DIR / "bench_big_task.py")


def measure(tree: Path, task: str, stages: int, stage: int, micro_batch: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{TASK_DIR}"}  # the tree's ravq
    out = subprocess.run([sys.executable, "-c", PROBE, task, str(stages), str(stage), str(micro_batch)],
                         cwd=tree, env=env, capture_output=True, text=True, check=False, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {task} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="another ravq tree to compare with (e.g. a git worktree)")
    parser.add_argument("--quick", action="store_true", help="the demo task only, this tree only")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    trees = [("after", ROOT)] + ([("before", args.before)] if args.before and not args.quick else [])
    for label, task, stages, stage, mb in CASES[:1] if args.quick else CASES:
        print(f"\n{label}")
        rows = {}
        for name, tree in trees:
            r = rows[name] = measure(tree, task, stages, stage, mb)
            grown = r["peak_bytes"] - r["baseline_bytes"]
            print(f"  {name:6s}: import {r['import_s']:.1f}s, build {r['build_s']:.1f}s, peak RSS {r['peak_bytes'] / 1e6:.0f}"
                  f" MB ({grown / 1e6:.0f} MB above the imports = {grown / r['stage_weight_bytes']:.2f}x the stage's "
                  f"weights of {r['stage_weight_bytes'] / 1e6:.0f} MB)")
        if "before" in rows:
            a, b = rows["after"], rows["before"]
            print(f"  after/before: build time {a['build_s'] / b['build_s']:.2f}x, memory above imports "
                  f"{(a['peak_bytes'] - a['baseline_bytes']) / max(1, b['peak_bytes'] - b['baseline_bytes']):.2f}x")
    print(f"\nload average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")


if __name__ == "__main__":
    main()
