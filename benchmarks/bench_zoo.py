"""Convergence zoo (issue #39): every stale-gradient mechanism against synchronous training on tasks of
several families (benchmarks/zoo_tasks.py), at 2, 3 and 4 stages and several seeds, with each task's own
optimizer and learning rate (never tuned per method).

Each (task, stages, seed) trains once synchronously (``max_inflight 1``: one process's training to 1e-5)
and once per method, one cluster, in-process (tests/pipeline_harness.py).  Untied models run in one thread
in a fixed order (``run_in_order``: stage i is exactly stages-1-i updates stale, deterministic); models with
a tied tensor across stages (GPT-2's head, BERT's decoder, T5's shared embedding) need the tied exchange's
threads and run in threads (``run_workers``, real timing: staleness varies with the load).  Reported per
method: loss / synchronous loss at 1/4, 1/2, 3/4 and all of the samples (the last stage's loss, mean of the
``--window`` micro-batches up to there), and the micro-batches it needs to reach synchronous training's final
loss, as a fraction of the run ("-": not within it).  Wall time here is one process's, so the samples are the
figure; wall time with real processes is bench_convergence.py --compare-inflight's.

The target (issue #39): with the defaults, <= 1.03x at the end and <= 1.10x at every quarter.

    python benchmarks/bench_zoo.py --quick                      # 8 tasks, 2 stages, seed 0, 60 micro-batches
    python benchmarks/bench_zoo.py                              # the zoo: 2 3 4 stages, seeds 0 1 2, 160
    python benchmarks/bench_zoo.py --tasks llama mlp_sgd --stages 3 --seeds 0 --methods default pipenag
    python benchmarks/bench_zoo.py --tasks mytask.py mypkg.tasks:encoder --lr-schedule cosine:10   # your own tasks

``--tasks`` also takes a task as ``ravq demo --task`` does (``module``, ``path/to/task.py``, either with
``:NAME``; docs/tasks.md): a user's own task runs the same way (in threads when a tensor is tied across its
stages), and ``--lr-schedule KIND[:WARMUP]`` is ``training.lr_schedule`` (``task``: the task's ``lr_lambda``).

Run it under ``flock /tmp/ravq/bench.lock`` on a shared machine; the load average is printed at both ends.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.zoo_candidates import drift_scaled, raw_second_moment, update_staleness
from benchmarks.zoo_tasks import TASKS
from ravq.config import TrainingConfig
from ravq.config.batch import default_inflight
from ravq.config.recipe import LRScheduleConfig
from ravq.config.task import resolve_task_module
from ravq.stage.recipe import recipe_options
from tests.pipeline_harness import make_workers, run_in_order, run_workers

TIED = {"gpt2_tied", "bert_mlm", "t5"}
"""Tasks with a tensor shared across stages: they run in threads."""

_D = TrainingConfig()
METHODS: dict[str, dict] = {
    "previous": {"predict_weights": 2.0, "extrapolate_gradients": 2.0, "inflight_warmup_steps": 20},
    "default": {"predict_weights": _D.predict_weights, "extrapolate_gradients": _D.extrapolate_gradients,
                "inflight_warmup_steps": _D.inflight_warmup_steps, "stale_correction": _D.stale_correction},
    "plain": {},
    "predict_extrapolate": {"predict_weights": _D.predict_weights, "extrapolate_gradients": _D.extrapolate_gradients},
    "predict": {"predict_weights": _D.predict_weights},
    "extrapolate": {"extrapolate_gradients": _D.extrapolate_gradients},
    "warmup": {"inflight_warmup_steps": _D.inflight_warmup_steps},
    "warmup_predict": {"inflight_warmup_steps": _D.inflight_warmup_steps, "predict_weights": _D.predict_weights},
    "warmup_extrapolate": {"inflight_warmup_steps": _D.inflight_warmup_steps,
                           "extrapolate_gradients": _D.extrapolate_gradients},
    "pipenag": {"stale_correction": "pipenag"},
    "pipenag_warmup": {"stale_correction": "pipenag", "inflight_warmup_steps": _D.inflight_warmup_steps},
    "nag_predict": {"predict_weights": _D.predict_weights, "inflight_warmup_steps": _D.inflight_warmup_steps,
                    "stale_correction": "pipenag"},
    "default_pipenag": {"predict_weights": _D.predict_weights, "extrapolate_gradients": _D.extrapolate_gradients,
                        "inflight_warmup_steps": _D.inflight_warmup_steps, "stale_correction": "pipenag"},
    "default_nowarmup": {"predict_weights": _D.predict_weights, "extrapolate_gradients": _D.extrapolate_gradients,
                         "stale_correction": _D.stale_correction},
    "default_nocomp": {"predict_weights": _D.predict_weights, "inflight_warmup_steps": _D.inflight_warmup_steps,
                       "stale_correction": _D.stale_correction},
    "default_rawv": {"predict_weights": _D.predict_weights, "extrapolate_gradients": _D.extrapolate_gradients,
                     "inflight_warmup_steps": _D.inflight_warmup_steps, "stale_correction": _D.stale_correction,
                     "raw_second_moment": True},
    "default_drift": {"predict_weights": _D.predict_weights, "extrapolate_gradients": _D.extrapolate_gradients,
                      "inflight_warmup_steps": _D.inflight_warmup_steps, "stale_correction": _D.stale_correction,
                      "drift_scaled": True},
    "default_supdate": {"predict_weights": _D.predict_weights, "extrapolate_gradients": _D.extrapolate_gradients,
                        "inflight_warmup_steps": _D.inflight_warmup_steps, "stale_correction": _D.stale_correction,
                        "update_staleness": True},
}
"""Each method's settings; what a method leaves out is off (``plain`` is PipeDream's weight stashing alone).
``default_nocomp``: the defaults without delay compensation; ``default_nowarmup``: without the warm-up;
``default_rawv``: the defaults with an Adam-family stage's second moment fed the raw gradient
(``benchmarks/zoo_candidates.py``; since 2cf4457 an Adam stage under PipeNAG after the warm-up has no
compensation to feed, so with an update per micro-batch it is the defaults; since session 11 ravq does this
itself after the warm-up, ``ravq.stage.delay.raw_second_moment``, so it is the defaults there too);
``default_drift``: compensation's step scaled by the fraction of ``g - g_prev`` that is drift, not
micro-batch noise, with a stated batch (``zoo_candidates.drift_scaled``; measured in session 11 against the
defaults before raw_second_moment, and not chosen); ``default_supdate``: with a stated batch, compensation
extrapolates by the staleness of the update's own micro-batches (``zoo_candidates.update_staleness``; not
chosen)."""


@dataclass
class Run:
    losses: list[float]
    seconds: float


def task_of(name: str) -> object:
    """A zoo task by its name, else a task as ``ravq demo --task`` names it."""
    return TASKS[name] if name in TASKS else resolve_task_module(name)


def train(task: str, stages: int, seed: int, steps: int, micro_batch: int, max_inflight: int,
          update_every: int = 1, schedule: LRScheduleConfig | None = None, **kw: object) -> Run:
    found = task_of(task)
    raw_v = bool(kw.pop("raw_second_moment", False))
    drift = bool(kw.pop("drift_scaled", False))
    own_s = bool(kw.pop("update_staleness", False))
    if schedule is not None and schedule.kind != "constant":
        kw["recipe"] = recipe_options(found, TrainingConfig(steps=steps, update_every=update_every,
                                                            lr_schedule=schedule), seed)
    workers = make_workers(found, stages, steps=steps, max_inflight=max_inflight, micro_batch=micro_batch,
                           seed=seed, update_every=update_every, **kw)
    if raw_v:
        raw_second_moment(workers)
    if drift:
        drift_scaled(workers)
    if own_s:
        update_staleness(workers)
    t0 = time.perf_counter()
    if task in TIED or any(w.spec.tied for w in workers):
        run_workers(workers, timeout_s=600)
    else:
        run_in_order(workers)
    losses = list(workers[-1].stats.loss_history)
    assert len(losses) == steps, (task, len(losses))
    return Run(losses, time.perf_counter() - t0)


def smoothed(losses: list[float], at: int, window: int) -> float:
    part = losses[max(0, at - window):at]
    return sum(part) / len(part)


def compare(run: Run, sync: Run, window: int) -> dict:
    n = len(sync.losses)
    quarters = [round(n * q / 4) for q in (1, 2, 3, 4)]
    ratios = [smoothed(run.losses, at, window) / smoothed(sync.losses, at, window) for at in quarters]
    target = smoothed(sync.losses, n, window)
    reach = next((at for at in range(window, n + 1) if smoothed(run.losses, at, window) <= target), None)
    return {"quarters": ratios, "end": ratios[-1], "worst": max(ratios), "reach": None if reach is None else reach / n,
            "final": smoothed(run.losses, n, window), "seconds": run.seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", nargs="+", default=list(TASKS),
                    help=f"zoo tasks ({', '.join(TASKS)}) or tasks as ravq demo --task names them")
    ap.add_argument("--stages", nargs="+", type=int, default=[2, 3, 4])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=160, help="micro-batches per run (one optimizer step each)")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--update-every", type=int, default=1,
                    help="micro-batches per optimizer step (the stated batch over the micro-batch)")
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--max-inflight", type=int, help="micro-batches in flight for every method (default: "
                    "ravq's, ravq.config.batch.default_inflight)")
    ap.add_argument("--methods", nargs="+", default=["default", "plain", "pipenag", "pipenag_warmup"],
                    choices=list(METHODS))
    ap.add_argument("--lr-schedule", metavar="KIND[:WARMUP]", help="training.lr_schedule for every run: "
                    "warmup, cosine, linear (WARMUP optimizer steps of linear warm-up) or task (its lr_lambda)")
    ap.add_argument("--quick", action="store_true", help="2 stages, seed 0, 60 micro-batches")
    ap.add_argument("--json", type=Path, help="also write every figure here")
    args = ap.parse_args()
    if args.quick:
        args.stages, args.seeds, args.steps = [2], [0], 60
    for name in args.tasks:
        task_of(name)  # an unknown task fails here, with ravq's message, before any run
    schedule = None
    if args.lr_schedule:
        kind, _, warmup = args.lr_schedule.partition(":")
        schedule = LRScheduleConfig(kind=kind, warmup_steps=int(warmup or 0))
    torch.set_num_threads(1)
    print(f"load average at the start: {os.getloadavg()}", flush=True)
    rows: list[dict] = []
    for task in args.tasks:
        for stages in args.stages:
            for seed in args.seeds:
                sync = train(task, stages, seed, args.steps, args.micro_batch, 1, args.update_every, schedule)
                sync_final = smoothed(sync.losses, args.steps, args.window)
                print(f"{task} {stages} stages seed {seed}: sync final {sync_final:.3f} ({sync.seconds:.1f} s)",
                      flush=True)
                for method in args.methods:
                    inflight = args.max_inflight or default_inflight(stages, args.update_every)
                    got = compare(train(task, stages, seed, args.steps, args.micro_batch, inflight, args.update_every,
                                        schedule, **METHODS[method]), sync, args.window)
                    rows.append({"task": task, "stages": stages, "seed": seed, "method": method,
                                 "sync_final": sync_final, **got})
                    quarters = " ".join(f"{r:.3f}" for r in got["quarters"])
                    reach = "-" if got["reach"] is None else f"{got['reach']:.2f}"
                    print(f"  {method:16s} {quarters}  reach {reach}  final {got['final']:.3f}", flush=True)
    print(f"load average at the end: {os.getloadavg()}")
    summarize(rows, args.methods)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


def summarize(rows: list[dict], methods: list[str]) -> None:
    """Per method: runs meeting the target, the worst end and worst quarter ratio, median end ratio."""
    print("\n| method | runs meeting <=1.03 end and <=1.10 every quarter | worst end | worst quarter | median end |")
    print("| --- | --- | --- | --- | --- |")
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        if not mine:
            continue
        ok = sum(r["end"] <= 1.03 and r["worst"] <= 1.10 for r in mine)
        ends = sorted(r["end"] for r in mine)
        worst_end = max(mine, key=lambda r: r["end"])
        worst_q = max(mine, key=lambda r: r["worst"])
        print(f"| {method} | {ok}/{len(mine)} | {worst_end['end']:.3f} ({worst_end['task']} {worst_end['stages']}) "
              f"| {worst_q['worst']:.3f} ({worst_q['task']} {worst_q['stages']}) | {ends[len(ends) // 2]:.3f} |")


if __name__ == "__main__":
    main()
