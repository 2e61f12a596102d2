"""Convergence: samples ravq (clusters x stages, asynchronous, averaged every sync_every steps) needs to
reach the loss one process reaches with a fixed budget of samples.  Target: at most 1.2x.

Two one-process references train the unsplit demo task on the same budget of samples (``budget``
micro-batches of ``micro_batch`` samples), from the same initial weights, with the task's optimizer:

  global  batches of clusters x micro_batch samples: the synchronous training C clusters stand for
          (with sync_every 1 and max_inflight 1 ravq computes exactly this; a test checks it), so the
          ratio is what asynchrony costs: pipeline staleness, local steps between averaging rounds,
          averaging a snapshot while training goes on.  This is the target's reference.
  micro   batches of micro_batch samples, one cluster's batch: adds the cost of data parallelism
          itself (C times the batch per step at the same learning rate), which every data-parallel
          system pays; reported alongside.

A reference's target loss is its smoothed training loss at the end (mean over the last ``window``
micro-batches' worth of samples).  ravq runs ``ravq demo`` (real processes, real sockets) and reports,
from the last stages' per-micro-batch losses, the first point where the clusters' smoothed loss (mean
over clusters of the trailing ``window`` losses) reaches it; samples there = clusters x steps x micro_batch.

Measured on 2 cores (micro-batch 16, budget 400, defaults: sync_every 2, max_inflight 2,
predict_weights 2, averaging_lead 1); a run's ratio moves by up to 0.1 with thread timing alone, so
several runs per seed.  Ratio to the global reference, every run:

  sync_every                     seed 0                    seed 1              seed 2               seed 3
  2 (default, 460-580 samples/s) 1.11, 1.115               1.15, 1.115         1.22, 1.225, 1.215,  1.22, 1.22
                                                                               1.215
  1 (~525 samples/s)             1.115                     1.11                1.20, 1.215
  3                              1.275                     1.16                1.23
  5 (~580 samples/s)             1.19, 1.19, 1.275, 1.18   1.16, 1.155, 1.16   1.285, 1.275, 1.285
  5 without averaging_lead       1.30, 1.48, 1.315, 1.325  1.275, 1.165, 1.185 1.275

Without averaging_lead a faster cluster ran up to two rounds ahead of the other, and averaging more
often than every 5 steps made it worse (sync_every 2: 1.41).  What is left is mostly pipeline
staleness: one cluster of 2 stages alone needs 1.12, 1.09, 1.14 times the micro reference's samples
(seeds 0, 1, 2).  Without weight prediction 1.60 (sync_every 5).  At sync_every 5 and averaging_lead 1,
outer_lr 1.2 (1.26, 1.29 at seeds 0,
2) or 1.4, averaging optimizer state (1.275, 1.285), sync_every 10 and predict_weights 1.5 or 3 did
not help; at sync_every 2 neither did outer_lr 1.2 (1.23, 1.295 at seeds 2, 3) or predict_weights 3
(1.265, 1.26).

With ClusterAdam (ravq/stage/optim.py, the demo task's optimizer since 2026-11-23), ``--seeds 0 1 2 3 4 5 6 7``
in one run: 1.055, 1.115, 1.180, 1.220, 1.150, 1.105, 1.025, 1.340, mean 1.149, median 1.132; separate
runs 1.10, 1.105, 1.20, 1.22 (twice), 1.15, 1.11, 1.025, 1.38.  Plain Adam, seeds 4-7: 1.16, 1.115,
1.045, 1.395.  A seed's ratio is mostly its reference's luck: the global reference's target ranges
2.275-2.326 over these seeds, and near the end of the budget the curves are flat enough that 0.01 of
target loss moves a ratio by 0.024-0.047 (each seed prints its own), so the target is judged on the
mean over seeds.  At seed 3 and max_inflight 1 ClusterAdam needs 1.05 (plain Adam 1.115, below).

Where the excess came from with plain Adam, seed 3 (2026-11-23): with max_inflight 1 (no pipeline staleness, clusters
still averaging asynchronously) 1.115 at sync_every 2, 1.115 at sync_every 1, and 1.115 at sync_every 1
with optimizer state averaged too, against 1.22 at the defaults.  So about 0.115 is data parallelism with
an optimizer per cluster, whatever the averaging frequency; the likely reason: each cluster's Adam normalises by the second
moment of its own 16-sample gradients, larger than a 32-sample batch's where noise dominates, so the
averaged steps are shorter than the global-batch reference's; averaging the state does not change that
(mean of squares, not square of mean).  Pipeline staleness adds ~0.1 on top after weight prediction.
Prediction at 2x2, seeds 2 / 3: predict_weights 1.5: 1.23 / 1.30; 2 (default): 1.215 / 1.22; 2.5:
1.20 / 1.22; 3: 1.265 / 1.26.  Extrapolating along the weights' smoothed total change per version
(optimizer steps and averaging deltas, EMA 0.5) instead of the last optimizer update, k 2: 1.29 / 1.31.

Pipeline staleness, isolated (``--clusters 1``, seed 2, against the one-process reference on the same
batches): predict_weights 0: 1.48, 1: 1.21, 2 (default): 1.137, 3: 1.093, 4: 1.157; max_inflight 1
(no staleness, no pipelining): 0.968.  At 2x2, seed 2, max_inflight 1 gives 1.115 at the same
samples/s here (four stage processes share two cores, so pipelining buys nothing on this machine; on
one machine per stage it is what keeps every stage busy).

Compression (``--compare-compress PIPELINE:RING ...``, training.compress): per seed, one reference and
ravq uncompressed (none:none) then with each setting; the figure is samples over uncompressed ravq's,
target: mean over seeds <= 1.05.  ``--seeds 0 1 2 3 --compare-compress bf16:bf16 int8:int8 fp16:none``
(2026-11-24, a machine shared with five other jobs): bf16:bf16 1.000 on every seed; int8:int8 0.995,
1.000, 1.021, 1.000 (mean 1.004); fp16:none 0.995, 1.005, 1.021, 1.000 (mean 1.005).  Error feedback and
anchors (ravq/average/ring_compression.py) keep the ring's compression out of the weights; the pipeline's is
a fraction of a percent of each activation and gradient.

    python benchmarks/bench_convergence.py [--seed N | --seeds N ...] [--compare-compress P:R ...]
                                           [--compress-pipeline F] [--compress-ring F] [--quick] [--json]
    python benchmarks/bench_convergence.py --compare-inflight [--tasks T ...] [--seeds N ...] [--steps 120]
                                           [--inflight-headroom 1.5] [--also 'predict-weights 0' ...]

``--compare-inflight`` (issue #25): one cluster of `--stages` stages (default 2) on the transformers tasks (GPT-2 and Llama from
configs), 1 micro-batch in flight (synchronous) against the defaults and against the defaults without the
asynchrony warm-up (``--inflight-warmup-steps 0``; and any ``--also`` settings, e.g. 'extrapolate-gradients 0'),
loss against samples and against wall time; ``--inflight-headroom`` lets those train longer than the synchronous run, so the wall
time they need to reach its final loss is measured even when that takes more samples; figures in
docs/convergence.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, use_repo_checkout

use_repo_checkout()

import torch

from ravq.cli.demo import SYNC_EVERY
from ravq.cut.split import build_task_model

from _group_curve import trailing_mean  # benchmarks/, the script's own directory


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


def ravq_losses(args: argparse.Namespace, steps: int) -> tuple[list[list[float]], dict]:
    run = Path(tempfile.mkdtemp(prefix="ravq-conv-"))
    cmd = [sys.executable, "-m", "ravq", "demo", "--quiet", "--no-curve", "--task", args.task,
           "--clusters", str(args.clusters), "--stages", str(args.stages), "--steps", str(steps),
           "--micro-batch", str(args.micro_batch), "--sync-every", str(args.sync_every), "--outer-lr", str(args.outer_lr), "--seed", str(args.seed),
           *(["--max-inflight", str(args.max_inflight)] if args.max_inflight else []),
           *(["--predict-weights", str(args.predict_weights)] if args.predict_weights is not None else []),
           *(["--extrapolate-gradients", str(args.extrapolate_gradients)] if args.extrapolate_gradients is not None
             else []),
           *(["--average-optimizer-state"] if args.average_optimizer_state else []),
           *(["--compress-pipeline", args.compress_pipeline] if args.compress_pipeline else []),
           *(["--compress-ring", args.compress_ring] if args.compress_ring else []),
           "--run-dir", str(run), "--report", str(run / "report.json")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"ravq demo failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    report = json.loads((run / "report.json").read_text())
    curves = []
    for c in range(args.clusters):
        summary = json.loads((run / f"summary-c{c}s{args.stages - 1}.json").read_text())
        curves.append(summary["loss_history"])
    return curves, report


def reached_at(smooth: list[list[float]], target: float, start: int) -> int | None:
    """Steps per cluster at which the clusters' mean smoothed loss first reaches ``target``."""
    for k in range(start, min(len(c) for c in smooth)):
        if sum(c[k] for c in smooth) / len(smooth) <= target:
            return k + 1
    return None


def sensitivity(smooth: list[list[float]], reached: int | None, clusters: int, budget: int) -> float | None:
    """How much the ratio moves if the target loss moves by 0.01: the clusters' mean smoothed loss
    falls slowly near the end of the budget, so a small shift in the reference's last window (which is
    itself one noisy run's) moves the ratio a lot.  From the mean slope over 20 steps either side."""
    if reached is None:
        return None
    mean = [sum(c[k] for c in smooth) / len(smooth) for k in range(min(len(c) for c in smooth))]
    lo, hi = max(0, reached - 21), min(len(mean) - 1, reached + 19)
    drop_per_step = (mean[lo] - mean[hi]) / max(1, hi - lo)
    if drop_per_step <= 0:
        return None
    return 0.01 / drop_per_step * clusters / budget


def references_for(args: argparse.Namespace, seed: int) -> dict[str, dict]:
    budget_samples = args.budget * args.micro_batch
    references = {}
    for name, batch in (("global", args.micro_batch * args.clusters), ("micro", args.micro_batch)):
        steps_ref, window_ref = budget_samples // batch, max(1, args.window * args.micro_batch // batch)
        losses = one_process_losses(args.task, steps_ref, batch, seed)
        references[name] = {"batch": batch, "steps": steps_ref, "window": window_ref,
                            "target_loss": sum(losses[-window_ref:]) / window_ref}
    return references


def run_seed(args: argparse.Namespace, seed: int, references: dict[str, dict] | None = None) -> dict:
    args.seed = seed
    budget_samples = args.budget * args.micro_batch
    references = references or references_for(args, seed)
    steps = int(args.budget * args.headroom / args.clusters) + 1
    curves, report = ravq_losses(args, steps)
    smooth = [trailing_mean(c, args.window) for c in curves]
    results = {}
    for name, ref in references.items():
        reached = reached_at(smooth, ref["target_loss"], args.window)
        samples = reached * args.clusters * args.micro_batch if reached else None
        results[name] = {**ref, "ravq_steps_per_cluster": reached, "ravq_samples": samples,
                         "ratio": samples / budget_samples if samples else None,
                         "ratio_per_0.01_loss": sensitivity(smooth, reached, args.clusters, args.budget)}
    compressed = f", compress pipeline {args.compress_pipeline or 'default'} ring {args.compress_ring or 'default'}"
    print(f"seed {seed}{compressed}: budget {budget_samples} samples; ravq {args.clusters}x{args.stages}, micro-batch "
          f"{args.micro_batch}, sync_every {args.sync_every}, outer_lr {args.outer_lr}, max_inflight "
          f"{args.max_inflight or args.stages}, trained {steps} steps per cluster")
    for name, r in results.items():
        what = (f"ravq reached it after {r['ravq_steps_per_cluster']} steps per cluster = {r['ravq_samples']} samples, "
                f"ratio {r['ratio']:.3f}" if r["ratio"] else
                f"ravq did not reach it within {steps * args.clusters * args.micro_batch} samples")
        print(f"  one process, batch {r['batch']:>3} ({name:6}): {r['steps']} steps -> loss {r['target_loss']:.4f}; {what}")
    ratio, moves = results["global"]["ratio"], results["global"]["ratio_per_0.01_loss"]
    print("  samples ratio ravq / one process at the same global batch: "
          + (f"{ratio:.3f}" if ratio else "> headroom")
          + (f" (a target 0.01 lower or higher moves it by ~{moves:.3f})" if moves else ""))
    print(f"  ravq run: {report['samples_per_second']:.1f} samples/s, {report['allreduce_rounds']} averaging rounds")
    return {"seed": seed, "ratio": ratio, "references": results, "ravq_samples": results["global"]["ravq_samples"],
            "compress_pipeline": args.compress_pipeline, "compress_ring": args.compress_ring,
            "samples_per_second": report["samples_per_second"], "allreduce_rounds": report["allreduce_rounds"]}


IN_FLIGHT_TASKS = ["tests.zoo_markov:gpt2", "tests.zoo_markov:llama", "ravq.tasks.hf_causal_lm:gpt2",
                   "ravq.tasks.hf_causal_lm:llama"]
"""The transformers tasks (GPT-2 and Llama from configs, random weights): issue #25's trial (a Markov chain,
Adam lr 3e-3) and the character corpus (ravq.tasks.hf_causal_lm)."""


def demo_curve(task: str, steps: int, micro_batch: int, seed: int, extra: list[str],
               stages: int = 2) -> tuple[list[float], list[float]]:
    """One cluster of ``stages`` stages (``ravq demo``): the last stage's loss per micro-batch and the seconds
    since its first update at which each was applied."""
    run = Path(tempfile.mkdtemp(prefix="ravq-inflight-"))
    cmd = [sys.executable, "-m", "ravq", "demo", "--quiet", "--no-curve", "--task", task, "--clusters", "1",
           "--stages", str(stages), "--steps", str(steps), "--micro-batch", str(micro_batch), "--seed", str(seed),
           "--threads", "1", *extra, "--run-dir", str(run), "--report", str(run / "report.json")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"ravq demo failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    summary = json.loads((run / f"summary-c0s{stages - 1}.json").read_text())
    times = summary["update_times"]
    return summary["loss_history"], [t - times[0] for t in times]


def loss_at_time(smooth: list[float], t: list[float], when: float) -> float | None:
    """The smoothed loss of the last update applied by ``when`` seconds (None before the first)."""
    last = None
    for value, at in zip(smooth, t):
        if at > when:
            break
        last = value
    return last


def compare_inflight(args: argparse.Namespace) -> None:
    """Per task and seed: ``--stages`` stages with 1 micro-batch in flight (synchronous: equals one process) against
    the defaults (2 in flight after the asynchrony warm-up, weight prediction, delay compensation) and against
    the defaults without the warm-up (the defaults before it): loss against samples (at the quarters of the
    synchronous run's samples) and against wall time (at the quarters of its time), and the wall time each
    needs to reach the synchronous run's final loss."""
    settings = {"1 in flight": ["--max-inflight", "1"], "default": [],
                "no warm-up": ["--inflight-warmup-steps", "0"]}
    settings.update({f"--{flags}": [f"--{f}" if i % 2 == 0 else f for i, f in enumerate(flags.split())]
                     for flags in args.also or []})
    window, out = args.window, []
    longer = int(args.steps * args.inflight_headroom)  # the asynchronous runs may train past the synchronous one
    for task in args.tasks or IN_FLIGHT_TASKS:
        for seed in args.seeds or [args.seed]:
            curves = {name: demo_curve(task, args.steps if name == "1 in flight" else longer, args.micro_batch, seed,
                                       extra, args.stages) for name, extra in settings.items()}
            sync_loss, sync_t = curves["1 in flight"]
            sync_smooth = trailing_mean(sync_loss, window)
            target = sync_smooth[-1]
            marks = [args.steps * q // 4 - 1 for q in (1, 2, 3, 4)]
            times = [sync_t[-1] * q / 4 for q in (1, 2, 3, 4)]
            print(f"{task} seed {seed}: {args.steps} micro-batches of {args.micro_batch}; 1 in flight ends at loss "
                  f"{target:.4f} (mean of the last {window}) after {sync_t[-1]:.2f}s; quarters: samples "
                  + ", ".join(str((m + 1) * args.micro_batch) for m in marks)
                  + "; seconds " + ", ".join(f"{x:.2f}" for x in times))
            row: dict = {"task": task, "seed": seed, "sync_final": target, "sync_s": sync_t[-1], "runs": {}}
            for name, (loss, t) in curves.items():
                smooth = trailing_mean(loss, window)
                by_samples = [smooth[m] for m in marks]
                by_time = [loss_at_time(smooth, t, x) for x in times]
                reach = next((i for i in range(window - 1, len(smooth)) if smooth[i] <= target), None)
                reach_s = t[reach] if reach is not None else None
                final = smooth[args.steps - 1]
                row["runs"][name] = {"final": final, "loss_at_sample_quarters": by_samples,
                                     "ratio_at_quarters": [a / sync_smooth[m] for a, m in zip(by_samples, marks)],
                                     "loss_at_time_quarters": by_time, "reach_step": reach, "reach_s": reach_s,
                                     "total_s": t[args.steps - 1], "trained": len(loss)}
                print(f"  {name:16} final {final:.4f} ({final / target:.3f}x); loss at the samples' quarters "
                      + ", ".join(f"{a:.3f}" for a in by_samples) + " ("
                      + ", ".join(f"{a / sync_smooth[m]:.3f}x" for a, m in zip(by_samples, marks))
                      + "); at the seconds' quarters " + ", ".join("-" if a is None else f"{a:.3f}" for a in by_time)
                      + (f"; reaches {target:.4f} at micro-batch {reach + 1}, {reach_s:.2f}s "
                         f"({reach_s / sync_t[-1]:.2f}x the synchronous run's time)" if reach is not None
                         else f"; does not reach it in {len(loss)} micro-batches")
                      + f"; {args.steps} micro-batches in {t[args.steps - 1]:.2f}s")
            out.append(row)
    if args.json:
        print(json.dumps({"benchmark": "convergence_inflight", "steps": args.steps, "micro_batch": args.micro_batch,
                          "window": window, "rows": out}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="ravq.tasks.charlm")
    p.add_argument("--budget", type=int, default=400, help="one-process micro-batches")
    p.add_argument("--clusters", default="2", help="or a list, e.g. 1,2,4,8: the curve over the number of "
                   "clusters, global rings against groups (issue #38; benchmarks/_group_curve.py)")
    p.add_argument("--group-size", type=int, default=2, help="with a list of --clusters: clusters per group")
    p.add_argument("--links", default="100:20,1000:1", help="with a list of --clusters: modelled ring links, "
                   "MBIT:MS_PER_HOP,... (one virtual clock each over the same training)")
    p.add_argument("--slow", type=float, default=1.0, help="with a list of --clusters: the last cluster's slowdown")
    p.add_argument("--step-ms", type=float, default=None, help="with a list of --clusters: a step's virtual time "
                   "(default: the median measured here, which a loaded machine inflates)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--sync-every", type=int, default=SYNC_EVERY, help="default: the demo's")
    p.add_argument("--window", type=int, default=40)
    p.add_argument("--outer-lr", type=float, default=1.0)
    p.add_argument("--max-inflight", type=int, default=None, help="default: the number of stages")
    p.add_argument("--predict-weights", type=float, default=None, help="default: ravq's own")
    p.add_argument("--extrapolate-gradients", type=float, default=None, help="default: ravq's own")
    p.add_argument("--average-optimizer-state", action="store_true")
    p.add_argument("--headroom", type=float, default=1.6, help="ravq trains this many times the budget's samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="run these seeds (each: its own reference and ravq run) and report their mean ratio")
    p.add_argument("--compress-pipeline", choices=["none", "bf16", "fp16", "int8"], default=None,
                   help="ravq's training.compress.pipeline (default: a topology's default)")
    p.add_argument("--compress-ring", choices=["none", "bf16", "int8"], default=None,
                   help="ravq's training.compress.ring (default: a topology's default)")
    p.add_argument("--compare-compress", nargs="+", metavar="PIPELINE:RING", default=None,
                   help="per seed, also run ravq with these compression settings (e.g. bf16:bf16 int8:int8) and "
                        "report the samples each needs over uncompressed ravq's (none:none, run first); target: "
                        "mean over seeds <= 1.05")
    p.add_argument("--compare-inflight", action="store_true",
                   help="1 cluster of --stages stages: 1 micro-batch in flight against the defaults, on the transformers "
                        "tasks (--tasks); loss at the same samples and wall time to the synchronous final loss")
    p.add_argument("--tasks", nargs="+", default=None, help=f"with --compare-inflight (default: {IN_FLIGHT_TASKS})")
    p.add_argument("--steps", type=int, default=120, help="with --compare-inflight: micro-batches per run")
    p.add_argument("--inflight-headroom", type=float, default=1.0,
                   help="with --compare-inflight: the asynchronous runs train this many times --steps, so the time "
                        "they take to reach the synchronous run's final loss can be measured")
    p.add_argument("--also", nargs="+", metavar="'FLAG VALUE ...'", default=None,
                   help="with --compare-inflight: more settings, e.g. 'predict-weights 0'")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    counts = [int(c) for c in str(args.clusters).split(",")]
    if len(counts) > 1:
        group_curve(args, counts)
        return
    args.clusters = counts[0]
    if args.compare_inflight:
        if args.micro_batch == 16 and "--micro-batch" not in sys.argv:
            args.micro_batch = 8  # the trial of issue #25
        if "--window" not in sys.argv:
            args.window = 10
        compare_inflight(args)
        return
    if args.quick:
        args.budget, args.window = 120, 20
    t0 = time.monotonic()
    seeds = args.seeds or [args.seed]
    if args.compare_compress:
        compare_compression(args, seeds, t0)
        return
    runs = [run_seed(args, seed) for seed in seeds]
    ratios = [r["ratio"] for r in runs]
    reached = [r for r in ratios if r is not None]
    mean = sum(reached) / len(reached) if reached and len(reached) == len(ratios) else None
    if len(runs) > 1:
        print(f"{len(runs)} seeds: ratios " + ", ".join(f"{r:.3f}" if r else "> headroom" for r in ratios)
              + (f"; mean {mean:.3f}, median {statistics.median(reached):.3f}" if mean else "; not all reached")
              + " (target: mean <= 1.2)")
    print(f"bench took {time.monotonic() - t0:.0f}s")
    if args.json:
        print(json.dumps({"benchmark": "convergence", "budget_samples": args.budget * args.micro_batch,
                          "ratio": mean, "met": mean is not None and mean <= 1.2, "seeds": seeds, "runs": runs,
                          "clusters": args.clusters, "stages": args.stages, "micro_batch": args.micro_batch,
                          "sync_every": args.sync_every, "outer_lr": args.outer_lr,
                          "max_inflight": args.max_inflight, "window": args.window, "quick": args.quick}))


def group_curve(args: argparse.Namespace, counts: list[int]) -> None:
    """Samples and (virtual) wall time to one cluster's loss for each number of clusters, global against groups."""
    from _group_curve import CurveSettings, curve, print_curve

    if args.quick:
        args.budget, args.window = 120, 20
    s = CurveSettings(task=args.task, micro_batch=args.micro_batch, sync_every=args.sync_every,
                      group_size=args.group_size, budget=args.budget, window=args.window, seed=args.seed,
                      links=[(float(m), float(ms)) for m, _, ms in (x.partition(":") for x in args.links.split(","))],
                      slow=args.slow, step_ms=args.step_ms,
                      headroom=args.headroom if "--headroom" in sys.argv else 5.0)
    t0 = time.monotonic()
    for seed in args.seeds or [args.seed]:
        s.seed = seed
        result = curve(counts, s)
        print(f"seed {seed}:")
        print_curve(result, s)
        if args.json:
            print(json.dumps({"benchmark": "convergence_clusters", "seed": seed, "counts": counts,
                              "settings": {k: getattr(s, k) for k in s.__slots__}, **result}))
    print(f"bench took {time.monotonic() - t0:.0f}s")


def compare_compression(args: argparse.Namespace, seeds: list[int], t0: float) -> None:
    """Per seed: one reference, then ravq uncompressed and with each setting; samples over uncompressed."""
    settings = ["none:none", *[s for s in args.compare_compress if s != "none:none"]]
    for setting in settings:
        pipeline, _, ring = setting.partition(":")
        if pipeline not in ("none", "bf16", "fp16", "int8") or ring not in ("none", "bf16", "int8"):
            raise SystemExit(f"--compare-compress: {setting!r} is not PIPELINE:RING (none|bf16|fp16|int8 : none|bf16|int8)")
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    for seed in seeds:
        references = references_for(args, seed)
        for setting in settings:
            args.compress_pipeline, _, args.compress_ring = setting.partition(":")
            runs[setting].append(run_seed(args, seed, references))
    base = runs["none:none"]
    summary: dict[str, dict] = {}
    for setting in settings:
        over = [r["ravq_samples"] / b["ravq_samples"] if r["ravq_samples"] and b["ravq_samples"] else None
                for r, b in zip(runs[setting], base)]
        got = [o for o in over if o is not None]
        mean = sum(got) / len(got) if got and len(got) == len(over) else None
        ratios = [r["ratio"] for r in runs[setting]]
        summary[setting] = {"over_uncompressed": over, "mean_over_uncompressed": mean,
                            "ratios_to_reference": ratios,
                            "samples_per_second": [r["samples_per_second"] for r in runs[setting]]}
        print(f"{setting:<10} samples over uncompressed ravq per seed: "
              + ", ".join(f"{o:.3f}" if o else "n/a" for o in over)
              + (f"; mean {mean:.3f}" if mean else "") + "   (to the reference: "
              + ", ".join(f"{r:.3f}" if r else "n/a" for r in ratios) + ")")
    print(f"bench took {time.monotonic() - t0:.0f}s")
    if args.json:
        print(json.dumps({"benchmark": "convergence_compression", "seeds": seeds, "settings": settings,
                          "summary": summary, "met": all(v["mean_over_uncompressed"] is not None
                                                         and v["mean_over_uncompressed"] <= 1.05
                                                         for v in summary.values()),
                          "budget_samples": args.budget * args.micro_batch, "sync_every": args.sync_every,
                          "runs": runs, "quick": args.quick}))


if __name__ == "__main__":
    main()
