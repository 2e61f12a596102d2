"""The planner against the exhaustive optimum and against Ravnest's rule (docs/design.md, "Planner and profiler").

(a) optimum: random heterogeneous instances of 6-8 nodes and 8-10 blocks, each planned twice (averaging
    every 10 steps with the default stashes, and every step with max_inflight 2); the predicted
    samples/s of ``make_plan`` over that of ``optimum_plan`` (every partition into clusters and idle
    nodes, every order, every set of cuts).  Target: the smallest ratio >= 0.95.
(b) ravnest: random heterogeneous instances of 16-64 nodes and 24-100 blocks; ``make_plan`` over
    ``ravnest_plan`` (genetic algorithm over RAM and bandwidth, then splits in proportion to RAM as
    Ravnest's split percentages; equal parameter splits reported too), both scored by the same cost
    model with max_inflight 2.  Target: geometric mean >= 1.5.  Instances where Ravnest's plan does not
    fit in memory are counted apart (its nodes would run out of memory), not scored.

Instances: nodes sit at 1-8 sites; inside a site links run at the slower node's access speed (100 Mbit/s
to 10 Gbit/s, 0.2 ms), between sites over a WAN (5-100 Mbit/s, 10-60 ms).  Compute differs up to 16x,
memory 2-32 GiB.  The model is transformer-like: an embedding block, equal layers, a head; it needs
about 1.5-4 nodes' memory.  Run from the repo root:

    python benchmarks/bench_planner.py            # ~3 minutes
    python benchmarks/bench_planner.py --quick    # ~20 s
    python benchmarks/bench_planner.py --json     # last line: one JSON object
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import _common

_common.use_repo_checkout()

import numpy as np

from ravq.planner import BlockProfile, NodeProfile, PlanError, make_plan, optimum_plan, ravnest_plan

GIB = 1 << 30
TARGET_OPTIMUM = 0.95
TARGET_RAVNEST = 1.5
MICRO_BATCH = 8
SYNC_EVERY = 10
RAVNEST_MAX_INFLIGHT = 2
"""(b) fixes max_inflight (a topology setting): Ravnest's rule knows nothing of stashes that grow with
pipeline length, and with the default (one micro-batch per stage) its long pipelines never fit."""


def random_nodes(rng: np.random.Generator, n: int, sites: int) -> list[NodeProfile]:
    site = rng.integers(0, sites, size=n)
    flops = 20e9 * rng.choice([1, 2, 4, 8, 16], size=n) * rng.uniform(0.8, 1.25, size=n)
    memory = rng.choice([2, 4, 8, 16, 32], size=n) * GIB
    access = rng.choice([100e6, 1e9, 1e9, 10e9], size=n) / 8
    wan = rng.uniform(5e6, 100e6, size=(sites, sites)) / 8
    wan_latency = rng.uniform(0.01, 0.06, size=(sites, sites))
    names = [f"n{i:02d}" for i in range(n)]
    nodes = []
    for a in range(n):
        bandwidth, latency = {}, {}
        for b in range(n):
            if a == b:
                continue
            lo, hi = sorted((site[a], site[b]))
            same = site[a] == site[b]
            bandwidth[names[b]] = float(min(access[a], access[b], math.inf if same else wan[lo, hi]))
            latency[names[b]] = 0.0002 if same else float(wan_latency[lo, hi])
        nodes.append(NodeProfile(name=names[a], flops=float(flops[a]), memory_bytes=int(memory[a]),
                                 bandwidth_bytes_per_s=bandwidth, latency_s=latency))
    return nodes


def random_blocks(rng: np.random.Generator, count: int, model_bytes: float) -> list[BlockProfile]:
    """An embedding, ``count - 2`` equal layers and a head, needing ``model_bytes`` of memory in all."""
    layers = count - 2
    tokens = MICRO_BATCH * 512
    embed_share = rng.uniform(0.02, 0.08)
    param = np.array([embed_share] + [(1 - 2 * embed_share) / layers] * layers + [embed_share])
    param *= model_bytes / (4 * param.sum())            # params + grads + 2 Adam moments
    flops = 6 * tokens * param / 4                       # ~6 FLOPs per parameter per token, fwd + bwd
    flops[0] *= 0.05                                     # an embedding is a lookup
    act = int(model_bytes * rng.uniform(0.01, 0.05) / count)   # crossing one cut, per micro-batch
    blocks = []
    for i in range(count):
        stash = act * (6 if 0 < i < count - 1 else 1)
        blocks.append(BlockProfile(name=f"b{i}", param_bytes=int(param[i]), fwd_flops=float(flops[i] / 3),
                                   bwd_flops=float(2 * flops[i] / 3), act_bytes_out=act,
                                   memory_bytes=int(4 * param[i] + stash + param[i]),
                                   inflight_bytes=int(stash + param[i]), max_inflight=1))
    return blocks


def random_instance(seed: int, nodes: int, blocks: int, model_nodes: tuple[float, float] = (1.0, 3.0)
                    ) -> tuple[list[NodeProfile], list[BlockProfile]]:
    """Nodes at 1 to nodes/4 sites and a model needing ``model_nodes`` times a node's mean memory."""
    rng = np.random.default_rng(seed)
    sites = int(rng.integers(1, max(2, nodes // 4) + 1))
    node_list = random_nodes(rng, nodes, sites)
    mean_memory = statistics.fmean(n.memory_bytes for n in node_list)
    return node_list, random_blocks(rng, blocks, mean_memory * rng.uniform(*model_nodes))


def bench_optimum(instances: int, sizes: list[tuple[int, int]]) -> dict[str, object]:
    """Each instance twice: averaging every 10 steps with one stash per stage (the default), and
    averaging every step (costly) with max_inflight 2."""
    ratios: list[float] = []
    rows: list[tuple[object, ...]] = []
    for seed in range(instances):
        n, b = sizes[seed % len(sizes)]
        nodes, blocks = random_instance(1000 + seed, n, b, model_nodes=(0.3, 1.5))
        for sync_every, max_inflight in ((SYNC_EVERY, None), (1, 2)):
            try:
                t0 = time.perf_counter()
                best, _ = optimum_plan(nodes, blocks, micro_batch=MICRO_BATCH, sync_every=sync_every,
                                       max_inflight=max_inflight)
                t1 = time.perf_counter()
                plan, _ = make_plan(nodes, blocks, micro_batch=MICRO_BATCH, sync_every=sync_every,
                                    max_inflight=max_inflight)
                t2 = time.perf_counter()
            except PlanError:
                rows.append((seed, n, b, sync_every, max_inflight, "no plan fits", "", "", "", ""))
                continue
            assert best.predicted_samples_per_s and plan.predicted_samples_per_s
            ratio = plan.predicted_samples_per_s / best.predicted_samples_per_s
            ratios.append(ratio)
            rows.append((seed, n, b, sync_every, max_inflight, f"{ratio:.4f}", len(best.clusters),
                         len(plan.clusters), f"{t2 - t1:.2f}", f"{t1 - t0:.1f}"))
    print(_common.table(["seed", "nodes", "blocks", "sync_every", "max_inflight", "planner/optimum",
                         "optimum clusters", "planner clusters", "planner s", "optimum s"], rows))
    return {"instances": len(ratios), "min_ratio": min(ratios), "mean_ratio": statistics.fmean(ratios),
            "target_min": TARGET_OPTIMUM, "met": min(ratios) >= TARGET_OPTIMUM}


def bench_ravnest(instances: int, sizes: list[tuple[int, int]]) -> dict[str, object]:
    ratios: list[float] = []
    rows: list[tuple[object, ...]] = []
    times: list[float] = []
    unfit = {"memory": 0, "equal": 0}
    equal_ratios: list[float] = []
    for seed in range(instances):
        n, b = sizes[seed % len(sizes)]
        nodes, blocks = random_instance(2000 + seed, n, b)
        t0 = time.process_time()
        plan, _ = make_plan(nodes, blocks, micro_batch=MICRO_BATCH, sync_every=SYNC_EVERY,
                            max_inflight=RAVNEST_MAX_INFLIGHT)
        times.append(time.process_time() - t0)
        assert plan.predicted_samples_per_s
        theirs: dict[str, float | None] = {}
        for split in ("memory", "equal"):
            try:
                other, _ = ravnest_plan(nodes, blocks, micro_batch=MICRO_BATCH, sync_every=SYNC_EVERY, seed=seed,
                                        split=split, max_inflight=RAVNEST_MAX_INFLIGHT)
                theirs[split] = other.predicted_samples_per_s
            except PlanError:
                unfit[split] += 1
                theirs[split] = None
        cells = []
        for split, sink in (("memory", ratios), ("equal", equal_ratios)):
            value = theirs[split]
            if value:
                sink.append(plan.predicted_samples_per_s / value)
                cells += [f"{value:.3g}", f"{sink[-1]:.2f}"]
            else:
                cells += ["does not fit", ""]
        rows.append((seed, n, b, f"{plan.predicted_samples_per_s:.3g}", *cells, f"{times[-1]:.2f}"))
    print(_common.table(["seed", "nodes", "blocks", "planner samples/s", "ravnest (RAM split)", "ratio",
                         "ravnest (equal split)", "ratio", "planner CPU s"], rows))

    def geomean(values: list[float]) -> float | None:
        return math.exp(statistics.fmean(math.log(r) for r in values)) if values else None
    overall = geomean(ratios)
    return {"instances": len(ratios), "ravnest_unfit": unfit["memory"], "geomean_ratio": overall,
            "min_ratio": min(ratios) if ratios else None, "equal_split_unfit": unfit["equal"],
            "equal_split_geomean_ratio": geomean(equal_ratios), "max_planner_cpu_s": max(times),
            "target_geomean": TARGET_RAVNEST, "met": overall is not None and overall >= TARGET_RAVNEST}


def _x(ratio: object) -> str:
    return f"{ratio:.2f}x" if isinstance(ratio, float) else "n/a"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer and smaller instances")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    if args.quick:
        optimum = bench_optimum(6, [(6, 8)])
        ravnest = bench_ravnest(6, [(16, 32), (32, 64), (64, 100)])
    else:
        optimum = bench_optimum(20, [(6, 8), (6, 10), (7, 8), (7, 10), (8, 8)])
        ravnest = bench_ravnest(24, [(16, 24), (24, 48), (32, 64), (48, 80), (64, 100)])
    print(f"(a) planner / exhaustive optimum: min {optimum['min_ratio']:.4f}, mean {optimum['mean_ratio']:.4f} "
          f"over {optimum['instances']} instances (target min >= {TARGET_OPTIMUM})")
    equal = ravnest["equal_split_geomean_ratio"]
    print(f"(b) planner / Ravnest's rule (RAM-proportional split): geometric mean {_x(ravnest['geomean_ratio'])}, "
          f"min {_x(ravnest['min_ratio'])} over {ravnest['instances']} instances, {ravnest['ravnest_unfit']} more "
          f"where its plan does not fit in memory (target geomean >= {TARGET_RAVNEST}); with equal splits its plan "
          f"does not fit in {ravnest['equal_split_unfit']}" + (f", {_x(equal)} over the rest" if equal else ""))
    if args.json:
        _common.emit_json({"benchmark": "planner", "quick": args.quick, "optimum": optimum, "ravnest": ravnest})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
