"""``ravq check``'s memory estimate against what each node of a real 1x4 run peaks at.

Runs ``ravq demo`` (1 cluster x 4 stages, ``benchmarks.memory_task``: a transformer with Adam, its size from
``--d-model`` and ``--layers``), reads every node's peak resident memory from its summary (Linux's VmHWM,
``ravq.node``), then ``ravq check --topology`` on the demo's own topology in a fresh process, and prints each
stage's estimate beside the measured peak (ratio estimate / measured).  Both include the process around the
stage (Python, torch, the tracer): the check counts its own resident memory after tracing on meta.

Run it alone on the machine (``flock /tmp/ravq/bench.lock``): four node processes and a broker.
    .venv/bin/python benchmarks/bench_check_memory.py [--d-model 768 --layers 8 --steps 40] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = 4


def _run(argv: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ravq", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout_s, check=False)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--task", default="benchmarks.memory_task",
                   help="the demo's task (tests.big_task: the same transformer with plain SGD)")
    p.add_argument("--demo-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for ravq demo, e.g. --demo-arg=--predict-weights=0 (repeatable)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAVQ_BIG_D_MODEL": str(args.d_model),
           "RAVQ_BIG_LAYERS": str(args.layers)}
    run_dir = Path(tempfile.mkdtemp(prefix="ravq-bench-check-"))
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    t0 = time.monotonic()
    demo = _run(["demo", "--task", args.task, "--clusters", "1", "--stages", str(STAGES),
                 "--steps", str(args.steps), "--micro-batch", str(args.micro_batch), "--eval-every", "0",
                 "--quiet", "--no-curve", "--run-dir", str(run_dir), *args.demo_arg], env, 900)
    demo_s = time.monotonic() - t0
    if demo.returncode != 0:
        print(demo.stdout[-3000:], demo.stderr[-3000:], file=sys.stderr)
        return 1
    measured = [json.loads((run_dir / f"summary-c0s{s}.json").read_text())["peak_rss_bytes"] for s in range(STAGES)]
    t0 = time.monotonic()
    check = _run(["check", "--topology", str(run_dir / "topology.yaml"), "--json", str(run_dir / "check.json")],
                 env, 900)
    check_s = time.monotonic() - t0
    print(check.stdout)
    if check.returncode != 0:
        print(check.stderr[-3000:], file=sys.stderr)
        return 1
    stages = json.loads((run_dir / "check.json").read_text())[0]["memory"]
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    rows = []
    print(f"{'stage':>5} {'estimate MiB':>13} {'measured MiB':>13} {'ratio':>6}   (of which runtime MiB)")
    for stage, peak in zip(stages, measured):
        total = sum(stage[k] for k in ("weights", "grads", "optimizer", "stash", "activations", "runtime"))
        ratio = total / peak
        rows.append({"stage": stage["stage"], "estimate_bytes": total, "measured_bytes": peak, "ratio": ratio,
                     "runtime_bytes": stage["runtime"]})
        print(f"{stage['stage']:>5} {total / 2**20:>13.0f} {peak / 2**20:>13.0f} {ratio:>6.3f}   "
              f"({stage['runtime'] / 2**20:.0f})")
    worst = max(abs(r["ratio"] - 1) for r in rows)
    print(f"largest error {worst:.1%} (target: within 15%); demo {demo_s:.0f}s, check {check_s:.0f}s; "
          f"load average {' '.join(load_before)} before, {' '.join(load_after)} after; run dir {run_dir}")
    if args.json:
        print(json.dumps({"rows": rows, "largest_error": worst, "demo_s": demo_s, "check_s": check_s,
                          "loadavg_before": load_before, "loadavg_after": load_after, "d_model": args.d_model,
                          "layers": args.layers, "micro_batch": args.micro_batch, "task": args.task,
                          "demo_args": args.demo_arg}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
