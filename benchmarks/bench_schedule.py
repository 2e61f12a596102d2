"""``training.schedule``: the asynchronous pipeline (default) against 1F1B with a flush per update (``sync``)
and the same with each backward split, weight passes deferred (``zero_bubble``, ZB-H1).

Throughput: ``ravq demo`` (its default task), one cluster of 2 and of 4 stages, a stated batch of 4 and of 8
micro-batches per update, each schedule in turn; samples/s is the demo report's (samples over the training
wall time), with the load average read before each run and the ratio against async in the same run.

Convergence: one cluster of 2 stages on a zoo task, both schedules with the same stated batch and micro-batches;
``sync`` is exactly synchronous, so its final loss (the mean of the last ``--window`` micro-batches) is what
synchronous training reaches; the wall time async needs to reach it (from its per-micro-batch losses, timed by
its last stage's updates) against sync's whole run.

    python benchmarks/bench_schedule.py [--steps 128] [--stages 2 4] [--per-update 4 8] [--schedules ...]
    python benchmarks/bench_schedule.py --converge [--task tests.zoo_markov:gpt2] [--steps 240] [--per-update 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO, use_repo_checkout

use_repo_checkout()

from _group_curve import trailing_mean  # benchmarks/, the script's own directory

SCHEDULES = {"async": ["--schedule", "async"], "sync": ["--schedule", "sync"],
             "zero_bubble": ["--schedule", "zero_bubble"],
             "async, no warm-up": ["--schedule", "async", "--inflight-warmup-steps", "0"]}
"""The default asynchronous pipeline trains its first 20 updates with one micro-batch in flight (the asynchrony
warm-up, docs/convergence.md), which a short run feels: the third run shows async without it."""


def demo(schedule: str, stages: int, steps: int, micro_batch: int, per_update: int,
         extra: list[str]) -> tuple[dict, Path]:
    run = Path(tempfile.mkdtemp(prefix="ravq-schedule-"))
    cmd = [sys.executable, "-m", "ravq", "demo", "--quiet", "--no-curve", "--clusters", "1", "--stages",
           str(stages), "--steps", str(steps), "--micro-batch", str(micro_batch), "--batch",
           str(per_update * micro_batch), *SCHEDULES[schedule], "--eval-every", "0", "--threads", "1", *extra,
           "--run-dir", str(run), "--report", str(run / "report.json")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"ravq demo failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads((run / "report.json").read_text()), run


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def throughput(args: argparse.Namespace) -> list[dict]:
    rows = []
    for stages in args.stages:
        for per_update in args.per_update:
            rates = {}
            for schedule in ["async", *(s for s in args.schedules if s != "async")]:  # async: the reference
                load = loadavg()
                report, _ = demo(schedule, stages, args.steps, args.micro_batch, per_update, [])
                rates[schedule] = report["samples_per_second"]
                rows.append({"stages": stages, "per_update": per_update, "schedule": schedule, "load": load,
                             "samples_per_s": rates[schedule], "ratio": rates[schedule] / rates["async"]})
                print(f"1x{stages}, {per_update} micro-batches per update, {schedule:17}: "
                      f"{rates[schedule]:7.1f} samples/s ({rates[schedule] / rates['async']:.2f}x async), "
                      f"load {load}", flush=True)
    return rows


def converge(args: argparse.Namespace) -> dict:
    curves = {}
    for schedule in ("async", "sync", "async, no warm-up"):
        load = loadavg()
        _, run = demo(schedule, 2, args.steps, args.micro_batch, args.per_update[0], ["--task", args.task])
        summary = json.loads((run / "summary-c0s1.json").read_text())
        losses, times = summary["loss_history"], summary["update_times"]
        # a micro-batch's loss is applied with its update: the update_times of each update's micro-batches
        at = [times[min(i // args.per_update[0], len(times) - 1)] - times[0] for i in range(len(losses))]
        curves[schedule] = (trailing_mean(losses, args.window), at, load)
    target, sync_s = curves["sync"][0][-1], curves["sync"][1][-1]
    print(f"{args.task}, 1x2, {args.steps} micro-batches of {args.micro_batch}, {args.per_update[0]} per update: "
          f"sync ends at loss {target:.4f} after {sync_s:.2f}s (load {curves['sync'][2]})", flush=True)
    out: dict = {"task": args.task, "sync_final": target, "sync_s": sync_s}
    for name in ("async", "async, no warm-up"):
        smooth, at, load = curves[name]
        reach = next((i for i in range(args.window - 1, len(smooth)) if smooth[i] <= target), None)
        print(f"  {name:17} ends at {smooth[-1]:.4f} after {at[-1]:.2f}s (load {load})"
              + (f", reaches {target:.4f} at micro-batch {reach + 1}, {at[reach]:.2f}s ({at[reach] / sync_s:.2f}x "
                 "sync's time)" if reach is not None else ", does not reach it"), flush=True)
        out[name] = {"final": smooth[-1], "s": at[-1], "reach_s": None if reach is None else at[reach]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=128, help="micro-batches per run")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    p.add_argument("--per-update", type=int, nargs="+", default=[4, 8], help="micro-batches per update")
    p.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES),
                   help="throughput: the schedules measured (async always, first)")
    p.add_argument("--converge", action="store_true", help="wall time to synchronous training's final loss")
    p.add_argument("--task", default="tests.zoo_markov:gpt2", help="with --converge")
    p.add_argument("--window", type=int, default=40, help="with --converge: micro-batches the loss is averaged on")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    out = converge(args) if args.converge else throughput(args)
    if args.json:
        print(json.dumps({"benchmark": "schedule", "results": out}))


if __name__ == "__main__":
    main()
