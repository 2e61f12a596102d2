"""What each training-recipe feature costs: samples/s and busy fraction of the 2x2 demo, each feature on
and off, in one run (so the ratios share the machine's load).

Variants (``ravq demo --clusters 2 --stages 2`` on the charlm task, 4 node processes):
  plain    the task without metrics_fn and eval_batches, fp32, constant LR, no clipping
  metrics  + the task's metrics_fn on every training micro-batch (next-character accuracy)
  eval     + metrics, and evaluation on held-out data every steps/6 optimizer steps (8 micro-batches)
  cosine   plain + cosine LR schedule with 10 warmup steps
  clip     plain + global-norm clipping at 1.0 (norms exchanged on pipeline traffic)
  bf16     plain + bf16 autocast
  all      eval + cosine + clip + bf16

Run under ``flock /tmp/ravq-bench.lock`` on a shared machine; ``--repeats`` interleaves the variants.
With ``--json`` the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import _common

PLAIN = "benchmarks.recipe_task:plain"
FULL = "ravq.tasks.charlm"
VARIANTS: dict[str, list[str]] = {
    "plain": ["--task", PLAIN],
    "metrics": ["--task", FULL, "--eval-every", "0"],
    "eval": ["--task", FULL],
    "cosine": ["--task", PLAIN, "--lr-schedule", "cosine", "--warmup-steps", "10"],
    "clip": ["--task", PLAIN, "--clip-grad-norm", "1.0"],
    "bf16": ["--task", PLAIN, "--precision", "bf16"],
    "all": ["--task", FULL, "--lr-schedule", "cosine", "--warmup-steps", "10", "--clip-grad-norm", "1.0",
            "--precision", "bf16"],
}


def run_demo(variant: str, steps: int, run_dir: Path) -> dict[str, Any]:
    report = run_dir / "report.json"
    argv = [sys.executable, "-m", "ravq", "demo", "--clusters", "2", "--stages", "2", "--steps", str(steps),
            "--quiet", "--no-curve", "--report", str(report), "--run-dir", str(run_dir), *VARIANTS[variant]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_common.REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(argv, cwd=_common.REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant}: ravq demo failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    data = json.loads(report.read_text())
    busy = [n["busy_fraction"] for n in data["nodes"]]
    return {"samples_per_second": data["samples_per_second"], "busy_mean": statistics.mean(busy),
            "busy_min": min(busy), "final_loss": data["final_loss"],
            "eval_loss": data["eval_loss"][-1][1] if data.get("eval_loss") else None,
            "staleness_mean": statistics.mean(n["staleness_mean"] for n in data["nodes"])}


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120, help="micro-batches per cluster")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    for name in names:
        if name not in VARIANTS:
            raise SystemExit(f"--variants: unknown variant {name!r} (have {', '.join(VARIANTS)})")
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in names}
    loads = [load_average()]
    with tempfile.TemporaryDirectory(prefix="ravq-bench-recipe-") as tmp:
        for r in range(args.repeats):
            for v in names:
                run_dir = Path(tmp) / f"{v}-{r}"
                run_dir.mkdir()
                runs[v].append(run_demo(v, args.steps, run_dir))
                loads.append(load_average())
                print(f"{v:8s} repeat {r}: {runs[v][-1]}", flush=True)
    base = statistics.median(x["samples_per_second"] for x in runs[names[0]])
    base_busy = statistics.median(x["busy_mean"] for x in runs[names[0]])
    result: dict[str, Any] = {"steps": args.steps, "repeats": args.repeats, "load_average": loads, "variants": {}}
    print(f"\n{'variant':8s} {'samples/s':>10s} {'vs ' + names[0]:>9s} {'busy':>6s} {'d busy':>7s} {'busy min':>9s} "
          f"{'stale':>6s} {'loss':>6s} {'val':>6s}")
    for v in names:
        med = {k: statistics.median(x[k] for x in runs[v] if x[k] is not None) if any(x[k] is not None for x in runs[v])
               else None for k in runs[v][0]}
        med["speed_ratio"] = med["samples_per_second"] / base
        med["busy_delta"] = med["busy_mean"] - base_busy
        result["variants"][v] = med
        val = f"{med['eval_loss']:.3f}" if med["eval_loss"] is not None else "-"
        print(f"{v:8s} {med['samples_per_second']:10.1f} {med['speed_ratio']:9.3f} {med['busy_mean']:6.3f} "
              f"{med['busy_delta']:+7.3f} {med['busy_min']:9.3f} {med['staleness_mean']:6.2f} {med['final_loss']:6.3f} {val:>6s}")
    print(f"load average (1/5/15 min) before and after each run: {loads}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
