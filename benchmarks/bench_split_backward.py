"""What splitting a backward costs in compute (``training.schedule: zero_bubble``), in-process, one thread.

A stage of ``ravq demo``'s default task (charlm), micro-batches of 16: its backward whole (weights and inputs in
one autograd pass, ``Stashed.gradients_into``) against the split one: the input pass with the graph kept
(``Stashed.input_gradients``) and the weight pass after it (``Stashed.weights_into``), which starts where the
weights' side leaves the inputs' (``ravq.stage.split``), so nothing is computed twice; the ratio says what
the split costs besides (until 2026-11-29 the weight pass walked the whole graph again: 1.76-1.81x).
``kept``: the activation gradients a deferred weight pass holds; ``exact: False`` would say the stage fell
back to the walk from the outputs.  Times are CPU seconds of this thread (the machine may be shared), the
best of ``--repeats``, the two ways alternating.

    python benchmarks/bench_split_backward.py [--stages 4] [--micro-batch 16] [--repeats 30]
"""

from __future__ import annotations

import argparse
import json
import time

from _common import use_repo_checkout

use_repo_checkout()

import torch

from ravq.config import resolve_task_module
from ravq.stage.pipeline import StageWorker
from ravq.stage.tensors import gather_inputs
from ravq.stage.types import MicroBatch, Outbound
from tests.pipeline_harness import make_workers


def measure(worker: StageWorker, mb: MicroBatch, inputs: list[torch.Tensor], repeats: int) -> dict:
    """The best CPU time of the stage's backward whole and split, alternating, each on a fresh forward."""
    sums = {n: torch.nn.Parameter(p.detach().clone()) for n, p in worker.params.items()}
    best = {"whole": float("inf"), "input": float("inf"), "weight": float("inf"), "split": float("inf")}
    kept, exact, reuse = 0, True, True
    for _ in range(repeats):
        for way in ("whole", "split"):
            outputs = worker.passes.run_module(mb, [x.detach() for x in inputs])
            stash = worker.state.stash.pop(mb)
            roots = [o for o in outputs if o.requires_grad]
            grads = [torch.ones_like(o) for o in roots]
            t0 = time.thread_time()
            if way == "whole":
                stash.gradients_into(roots, grads, sums)
                best["whole"] = min(best["whole"], time.thread_time() - t0)
                continue
            _, weight_pass = stash.input_gradients(roots, grads, reuse=reuse)
            reuse = reuse and not weight_pass.shared  # as Passes does
            t1 = time.thread_time()
            kept, exact = weight_pass.nbytes, weight_pass.fallback is None
            stash.weights_into(weight_pass, sums)
            t2 = time.thread_time()
            for name, took in (("input", t1 - t0), ("weight", t2 - t1), ("split", t2 - t0)):
                best[name] = min(best[name], took)
    ms = {k: 1e3 * v for k, v in best.items()}
    ratio = best["split"] / best["whole"]
    print(f"stage {worker.spec.index}: backward whole {ms['whole']:.2f} ms; split {ms['split']:.2f} ms "
          f"({ratio:.2f}x): input pass {ms['input']:.2f} ms, weight pass {ms['weight']:.2f} ms; "
          f"kept {kept / 2**20:.2f} MiB of gradients, exact: {exact}", flush=True)
    return {"stage": worker.spec.index, **{f"{k}_ms": v for k, v in ms.items()}, "ratio": ratio,
            "kept_bytes": kept, "exact": exact}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="ravq.tasks.charlm")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    task = resolve_task_module(args.task)
    workers = make_workers(task, args.stages, steps=1, max_inflight=1, micro_batch=args.micro_batch)
    sent: list[tuple[int, Outbound]] = []
    workers[0].passes.start(lambda out: sent.append((0, out)))  # one micro-batch, forwarded stage by stage
    rows = []
    for worker in workers[1:-1]:  # middle stages: their inputs and outputs both take gradients
        here = worker.spec.index
        parts = {src: out.tensors for src, out in sent if out.dest == here and out.kind == "fwd"}
        mb = next(out.micro_batch for _, out in sent if out.dest == here)
        inputs = gather_inputs(worker.spec, parts)  # type: ignore[arg-type]
        worker.passes.forward(mb, parts, lambda out, src=here: sent.append((src, out)))  # type: ignore[arg-type]
        worker.state.stash.pop(mb)
        rows.append(measure(worker, mb, inputs, args.repeats))
    if args.json:
        print(json.dumps({"benchmark": "split_backward", "results": rows}))


if __name__ == "__main__":
    main()
