"""Convergence: samples ravq (clusters x stages, asynchronous, averaged every sync_every steps) needs to
reach the loss one process reaches with a fixed budget of samples.  Target: at most 1.2x.

The one-process reference trains the unsplit demo task on ``budget`` micro-batches of shard 0 of 1.
Its smoothed training loss at the end (mean of the last ``window`` micro-batches) is the target.
ravq runs ``ravq demo`` (real processes, real sockets) and reports, from the last stages' per-micro-batch
losses, the first point where the clusters' smoothed loss (mean over clusters of the trailing
``window`` losses) reaches the target; samples there = clusters x steps x micro_batch.

    python benchmarks/bench_convergence.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, use_repo_checkout

use_repo_checkout()

import torch  # noqa: E402

from ravq.model import build_task_model  # noqa: E402


def one_process_losses(task_name: str, steps: int, micro_batch: int, seed: int) -> list[float]:
    import importlib

    task = importlib.import_module(task_name)
    torch.set_num_threads(1)
    model = build_task_model(task, seed)
    opt = task.make_optimizer(model.parameters())
    batches = task.train_batches(micro_batch, 0, 1, seed)
    losses = []
    for _ in range(steps):
        inputs, targets = next(batches)
        loss = task.loss_fn(model(*inputs), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def trailing_mean(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def ravq_losses(args: argparse.Namespace, steps: int) -> tuple[list[list[float]], dict]:
    run = Path(tempfile.mkdtemp(prefix="ravq-conv-"))
    cmd = [sys.executable, "-m", "ravq", "demo", "--quiet", "--no-curve", "--task", args.task,
           "--clusters", str(args.clusters), "--stages", str(args.stages), "--steps", str(steps),
           "--micro-batch", str(args.micro_batch), "--sync-every", str(args.sync_every), "--outer-lr", str(args.outer_lr), "--seed", str(args.seed),
           *(["--max-inflight", str(args.max_inflight)] if args.max_inflight else []),
           "--run-dir", str(run), "--report", str(run / "report.json")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"ravq demo failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    report = json.loads((run / "report.json").read_text())
    curves = []
    for c in range(args.clusters):
        summary = json.loads((run / f"summary-c{c}s{args.stages - 1}.json").read_text())
        curves.append(summary["loss_history"])
    return curves, report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="ravq.tasks.charlm")
    p.add_argument("--budget", type=int, default=400, help="one-process micro-batches")
    p.add_argument("--clusters", type=int, default=2)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--window", type=int, default=40)
    p.add_argument("--outer-lr", type=float, default=1.0)
    p.add_argument("--max-inflight", type=int, default=None, help="default: the number of stages")
    p.add_argument("--headroom", type=float, default=1.6, help="ravq trains this many times the budget's samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.budget, args.window = 120, 20
    t0 = time.monotonic()
    reference = one_process_losses(args.task, args.budget, args.micro_batch, args.seed)
    target = sum(reference[-args.window:]) / args.window
    steps = int(args.budget * args.headroom / args.clusters) + 1
    curves, report = ravq_losses(args, steps)
    smooth = [trailing_mean(c, args.window) for c in curves]
    reached = None
    for k in range(args.window, min(len(c) for c in smooth)):
        if sum(c[k] for c in smooth) / len(smooth) <= target:
            reached = k + 1
            break
    budget_samples = args.budget * args.micro_batch
    samples = reached * args.clusters * args.micro_batch if reached else None
    ratio = samples / budget_samples if samples else None
    print(f"one process: {args.budget} micro-batches ({budget_samples} samples) -> smoothed loss {target:.4f}")
    print(f"ravq {args.clusters}x{args.stages} (sync_every {args.sync_every}): "
          + (f"reached it after {reached} steps per cluster = {samples} samples" if reached
             else f"did not reach it within {steps} steps per cluster ({steps * args.clusters * args.micro_batch} samples)"))
    print(f"samples ratio ravq / one process: {ratio:.3f} (target <= 1.2)" if ratio else "samples ratio: > headroom")
    print(f"ravq run: {report['samples_per_second']:.1f} samples/s, {report['allreduce_rounds']} averaging rounds; "
          f"bench took {time.monotonic() - t0:.0f}s")
    if args.json:
        print(json.dumps({"benchmark": "convergence", "target_loss": target, "budget_samples": budget_samples,
                          "ravq_samples": samples, "ratio": ratio, "met": ratio is not None and ratio <= 1.2,
                          "clusters": args.clusters, "stages": args.stages, "sync_every": args.sync_every,
                          "outer_lr": args.outer_lr, "window": args.window, "quick": args.quick}))


if __name__ == "__main__":
    main()
