"""Synchronous data parallelism's floor for the clusters curve: one model on C clusters' micro-batches
together (batch 16*C, each step one micro-batch from each of C shards, as C clusters draw them), Adam at the
task's lr and at scaled lrs; micro-batches to the curve's target (one cluster's trailing-40 loss after 400).

Usage: python benchmarks/sync_floor.py 8,4 1,2,2.83,4   (cluster counts, then lr scales)
       RAVQ_FLOOR_MB=4 RAVQ_FLOOR_BUDGET=3200 python benchmarks/sync_floor.py 8 1,2.83   (another micro-batch
       and budget: the one-cluster target is then its loss after that budget)."""

import importlib
import os
import sys
import time

import torch
from _group_curve import trailing_mean  # benchmarks/, the script's own directory

from ravq.cut.split import build_task_model
from ravq.stage.optim import ClusterAdam

task = importlib.import_module("ravq.tasks.charlm")
torch.set_num_threads(1)
SEED, WINDOW = 0, 40
MB, BUDGET = int(os.environ.get("RAVQ_FLOOR_MB", "16")), int(os.environ.get("RAVQ_FLOOR_BUDGET", "400"))


def run(clusters: int, lr: float, max_steps: int, target: float | None) -> tuple[int | None, list[float]]:
    model = build_task_model(task, SEED)
    opt = ClusterAdam(model.parameters(), lr=lr)
    data = [task.train_batches(MB, c, clusters, SEED) for c in range(clusters)]
    losses: list[float] = []
    for step in range(max_steps):
        parts = [next(d) for d in data]
        x = torch.cat([p[0][0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        loss = task.loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if target is not None and step + 1 >= WINDOW and sum(losses[-WINDOW:]) / WINDOW <= target:
            return step + 1, losses
    return None, losses


_, base = run(1, 3e-3, BUDGET, None)
target = trailing_mean(base, WINDOW)[-1]
print(f"target {target:.4f} (one cluster, {BUDGET} micro-batches of {MB}; the curve's 2.1131 at 400 of 16)")
one = BUDGET * MB
for clusters in [int(c) for c in sys.argv[1].split(",")]:
    for scale in [float(s) for s in sys.argv[2].split(",")]:
        t0 = time.monotonic()
        k, _ = run(clusters, 3e-3 * scale, int(5 * BUDGET / clusters) + WINDOW, target)
        samples = k * MB * clusters if k else None
        print(f"C={clusters} lr x{scale:g}: steps {k}, samples {samples}, x 1 cluster "
              f"{samples / one if samples else float('nan'):.3f}, wall x 1 cluster (free averaging) "
              f"{k / BUDGET if k else float('nan'):.3f}   ({time.monotonic() - t0:.0f}s)", flush=True)
