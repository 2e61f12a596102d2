"""Projections for 64, 256, 512 and 1,024 PCs worldwide: the planner's plan, Ravnest's rule and a naive plan,
each simulated by ``ravq simulate``'s model.

The world: PCs spread evenly over the 8 AWS regions of DT-FM's worldwide case, with DT-FM's published
inter-region delays and bandwidths (``ravq/simulate/data/aws_regions.json``, cited there); each PC's
access uplink and hardware are drawn from the distribution stated in ``ravq/simulate/worldwide.py``
(35% CPU-only at 0.2 TFLOP/s with 16 GiB, 35% mid-range GPUs at 6 TFLOP/s with 12 GiB, 22% high-end
at 30 TFLOP/s with 24 GiB, 8% workstations at 45 TFLOP/s with 48 GiB, each x U(0.8, 1.25); uplinks 20 /
100 / 1000 Mbit/s at 30 / 40 / 30%).  The model: a GPT-like transformer of 32 layers, d_model 2560
(about 2.7 B parameters, float32 weights with Adam: ~43 GB before activations), 2,048 tokens per
micro-batch, micro_batch 4, a stated batch of 50 micro-batches per step and cluster (so max_inflight =
min(2 x stages, 25)), averaging every 10 steps (500 micro-batches, DiLoCo's H); ravq's defaults otherwise (overlapped
averaging, averaging_lead 1, int8 pipeline and ring compression).  At sync_every 50 the cost model finds averaging
2.7 B parameters over these links so slow that the planner keeps to one cluster of 3-5 PCs at every size
(predicted 9.9-11.6 samples/s, simulated 6.1-6.9: credit-bound, see docs/simulator.md).

Plans:
- planner: ``make_plan`` on all PCs up to 256; above that ``regional_plan`` (``make_plan`` per region,
  then the subset of the regions' clusters the cost model scores highest, ``ravq.planner.regional``),
  because the full search takes minutes there (measured below with --full-planner);
- ravnest: Ravnest's rule (``ravnest_plan``: its genetic algorithm over RAM and bandwidth, splits in
  proportion to RAM), with max_clusters = PCs / 16 so that clusters can split the model's 34 blocks
  (Ravnest's default of 5 clusters cannot at this scale), population 100 and 200 generations above 256 PCs;
- naive: clusters and stages in listing order (region by region), even cuts.

Each plan is simulated for ``--steps`` micro-batches per cluster.  "simulated" is samples/s as a ravq run
measures it (every cluster trains the same micro-batches: all samples over the longest wall time, which is
also what averaging_lead makes of a long run); "sum of clusters" adds each cluster's own rate, as if the
clusters never waited for one another; "utilisation" is the model FLOP/s achieved ("simulated") over the
sum of all PCs' FLOP/s; "plan_simulate" is ``ravq plan --simulate``: the planner's best 4 candidates,
ranked by simulated samples/s (up to 256 PCs).

    python benchmarks/project_scale.py                     # 64, 256, 512, 1024 PCs
    python benchmarks/project_scale.py --sizes 64 --json
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import _common

_common.use_repo_checkout()

from ravq.config import ClusterPlan, Plan
from ravq.planner import (
    BlockProfile,
    NodeProfile,
    PlanError,
    Wire,
    evaluate_plan,
    plan_candidates,
    ravnest_plan,
)
from ravq.planner.groups import rounds_to_mix
from ravq.planner.pacing import link_groups, rounds_until_mixed
from ravq.simulate import Settings, averaging_settings, build_world, simulate
from ravq.simulate.worldwide import (
    naive_plan,
    projection_plan,
    transformer_blocks,
    utilisation,
    worldwide_nodes,
)

MICRO_BATCH = 4
CANDIDATES = 4
"""``ravq plan --simulate``: the planner's best candidates, ranked by simulated samples/s."""
UPDATE_EVERY = 50
"""A stated batch of 50 micro-batches (400k tokens) per optimizer step and cluster: a window of up to half
an update, at most two micro-batches per stage (``ravq.config.batch.default_inflight``: the projections'
clusters have up to ~20 stages); with an update per micro-batch ravq keeps 2 in flight (issue #39)."""
SYNC_EVERY = 10
"""Optimizer steps between averaging rounds: 500 micro-batches (DiLoCo's H, as before the stated batch)."""
STEPS = 1100
"""Micro-batches per cluster: more than two rounds of SYNC_EVERY, so that averaging rounds happen in the
simulation (with 100, as until issue #38, none did and the simulated figures left averaging out)."""
WIRE = Wire.of("int8", "int8")
"""ravq's default compression (training.compress): activations, gradients and ring pieces as int8."""
SCORE: dict[str, Any] = {"micro_batch": MICRO_BATCH, "sync_every": SYNC_EVERY, "update_every": UPDATE_EVERY,
                         "max_inflight": None,
                         "overlap_averaging": True, "averaging_lead": 1, "wire": WIRE}


def _mixed_in(plan: Plan) -> int | None:
    """Rounds until every cluster holds every other's weights; with every-k-th-round clusters (pacing by link)
    counted in the slowest's own rounds (ravq.planner.pacing.rounds_until_mixed)."""
    averaging = plan.averaging
    if averaging is None or (averaging.mode == "global" and averaging.every is None):
        return 1
    if averaging.every is None:
        return rounds_to_mix(len(plan.clusters), averaging.group_size)
    mixed = rounds_until_mixed(lambda r, t, j: link_groups(0, r, t, averaging.mode, averaging.group_size, j),
                               range(len(plan.clusters)), averaging.every)
    return None if mixed is None else -(-mixed // max(averaging.every))


def simulated(plan: Plan, nodes: list[NodeProfile], blocks: list[BlockProfile], steps: int) -> dict[str, Any]:
    averaging = plan.averaging  # the planner's choice of averaging (global rings when None)
    settings = Settings(steps=steps, micro_batch=MICRO_BATCH, sync_every=SYNC_EVERY, update_every=UPDATE_EVERY,
                        pipeline_wire=WIRE.pipeline, ring_wire=WIRE.ring)
    if averaging is not None:  # mode, group size and pace (rate pacing: each cluster's steps per round)
        settings = averaging_settings(settings, averaging)
    t0 = time.perf_counter()
    world = build_world(plan, nodes, blocks, settings)
    result = simulate(world)
    seconds = time.perf_counter() - t0
    work = sum(b.fwd_flops + b.bwd_flops for b in blocks) / MICRO_BATCH      # FLOPs per sample
    used = [n for n in result.nodes]
    try:
        predicted = evaluate_plan(plan, nodes, blocks, **SCORE).samples_per_s
    except PlanError as err:
        predicted = None
        print(f"  (cost model: {err})")
    return {"clusters": len(plan.clusters), "pcs_used": len(used),
            "averaging": "global" if averaging is None else (
                ("global" if averaging.mode == "global" else f"groups of {averaging.group_size}")
                + (", paced by rate" if averaging.pace == "rate" else "")
                + (f" every {averaging.period_s:.0f} s" if averaging.period_s else "")
                + (f", by link (k {sorted(set(averaging.every))})" if averaging.every else "")),
            "mixes_within_rounds": _mixed_in(plan),
            "every": None if averaging is None else averaging.every,
            "allreduce_rounds": max(n.allreduce_rounds for n in result.nodes),
            "stages_per_cluster": statistics.median(len(c.nodes) for c in plan.clusters),
            "predicted_samples_per_s": predicted, "simulated_samples_per_s": result.samples_per_s,
            "simulated_sum_of_clusters": sum(c.samples_per_s for c in result.clusters),
            "slowest_cluster_samples_per_s": min(c.samples_per_s for c in result.clusters),
            "busy_mean": result.busy_fraction_mean, "utilisation": utilisation(result.samples_per_s * work, nodes),
            "allreduce_seconds_mean": result.allreduce_seconds_mean,
            "averaging_wait_share": statistics.fmean(n.averaging_wait_s / n.wall_s if n.wall_s else 0.0 for n in used),
            "events": result.events, "simulate_s": seconds}


def project(count: int, steps: int, seed: int, full_planner: bool) -> dict[str, Any]:
    nodes, regions = worldwide_nodes(count, seed)
    blocks = transformer_blocks(layers=32, d_model=2560, max_inflight=1)
    out: dict[str, Any] = {"pcs": count, "total_tflops": sum(n.flops for n in nodes) / 1e12}
    t0 = time.perf_counter()
    plan, out["planner_kind"] = projection_plan(nodes, regions, blocks, full_planner=full_planner, **SCORE)
    out["planner_s"] = time.perf_counter() - t0
    out["planner"] = simulated(plan, nodes, blocks, steps)
    t0 = time.perf_counter()
    big = count > 256
    try:
        rplan = ravnest_plan(nodes, blocks, max_clusters=max(5, count // 16), population=100 if big else 200,
                             generations=200 if big else 500, **SCORE)[0]
        out["ravnest_s"] = time.perf_counter() - t0
        out["ravnest"] = simulated(rplan, nodes, blocks, steps)
    except PlanError as err:
        out["ravnest_s"] = time.perf_counter() - t0
        out["ravnest"] = {"error": str(err)}
    out["naive"] = simulated(naive_plan(nodes, blocks, None), nodes, blocks, steps)
    if count <= 256 or full_planner:
        t0 = time.perf_counter()
        ranked = [simulated(p, nodes, blocks, steps) | {"plan": p} for p, _ in
                  plan_candidates(nodes, blocks, count=CANDIDATES, **SCORE)]
        best = max(ranked, key=lambda x: x["simulated_samples_per_s"])
        best.pop("plan")
        out["plan_simulate"] = best | {"took_s": time.perf_counter() - t0}
    return out


def speed_check(count: int, steps: int, seed: int, churn_per_hour: float = 0.0) -> dict[str, Any]:
    """The simulator's own speed with every PC busy: all ``count`` PCs in clusters of 17 stages in listing
    order (even cuts, memory not checked), averaging every 10 steps so that rings run too; with
    ``churn_per_hour`` failures per PC per hour."""
    nodes, _ = worldwide_nodes(count, seed)
    blocks = transformer_blocks(layers=32, d_model=2560, max_inflight=1)
    k = 17
    bounds = [round(j * len(blocks) / k) for j in range(k + 1)]
    clusters = [ClusterPlan(nodes=[n.name for n in nodes[i:i + k]], cuts=[blocks[b].name for b in bounds[1:-1]])
                for i in range(0, count - k + 1, k)]
    settings = Settings(steps=steps, micro_batch=MICRO_BATCH, sync_every=10, churn_per_hour=churn_per_hour,
                        max_inflight=k,  # one per stage, as before the window of an update per micro-batch was 2
                        pipeline_wire=WIRE.pipeline, ring_wire=WIRE.ring,
                        seed=seed)
    t0 = time.perf_counter()
    result = simulate(build_world(Plan(epoch=0, clusters=clusters), nodes, blocks, settings))
    seconds = time.perf_counter() - t0
    return {"pcs": k * len(clusters), "clusters": len(clusters), "steps": steps, "seconds": seconds,
            "events": result.events, "allreduce_rounds": max(n.allreduce_rounds for n in result.nodes),
            "simulated_samples_per_s": result.samples_per_s, "churn_per_hour": churn_per_hour,
            "sum_of_clusters": sum(c.samples_per_s for c in result.clusters),
            "failures": sum(n.failures for n in result.nodes), "wall_s": result.wall_s,
            "allreduce_aborts": sum(n.allreduce_aborts for n in result.nodes),
            "down_share": sum(n.down_s for n in result.nodes) / sum(n.wall_s for n in result.nodes)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")], default=[64, 256, 512, 1024])
    parser.add_argument("--steps", type=int, default=STEPS, help="micro-batches per cluster")
    parser.add_argument("--speed-steps", type=int, default=100,
                        help="micro-batches per cluster of the simulator's speed check and its churn runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--full-planner", action="store_true", help="make_plan on all PCs at every size")
    parser.add_argument("--churn", type=lambda v: [float(x) for x in v.split(",")], default=[],
                        help="failures per PC per hour for the churn runs of the speed-check layout")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    results = []
    for count in args.sizes:
        r = project(count, args.steps, args.seed, args.full_planner)
        results.append(r)
        print(f"{count} PCs ({r['total_tflops']:.0f} TFLOP/s in all): planner ({r['planner_kind']}) took "
              f"{r['planner_s']:.1f} s, Ravnest's rule {r['ravnest_s']:.1f} s", flush=True)
        rows = []
        for name in ("planner", "plan_simulate", "ravnest", "naive"):
            if name not in r:
                continue
            x = r[name]
            if "error" in x:
                rows.append((name, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", x["error"][:60]))
                continue
            rows.append((name, x["clusters"], x["pcs_used"], f"{x['stages_per_cluster']:.0f}",
                         f"{x['averaging']} (mixed in {x['mixes_within_rounds']})", x["allreduce_rounds"],
                         "-" if x["predicted_samples_per_s"] is None else f"{x['predicted_samples_per_s']:.3g}",
                         f"{x['simulated_samples_per_s']:.3g}", f"{x['simulated_sum_of_clusters']:.3g}",
                         f"{x['slowest_cluster_samples_per_s']:.3g}", f"{x['busy_mean']:.2f}", f"{x['utilisation']:.1%}",
                         f"{x['averaging_wait_share']:.0%}", f"{x['simulate_s']:.1f} s ({x['events']} events)"))
        print(_common.table(["plan", "clusters", "PCs used", "stages", "averaging", "rounds", "predicted samples/s",
                             "simulated",
                             "sum of clusters", "slowest cluster", "busy", "utilisation", "averaging wait",
                             "simulation took"], rows))
        print()
    speed = speed_check(max(args.sizes), args.speed_steps, args.seed)
    print(f"simulator speed: {speed['pcs']} PCs busy ({speed['clusters']} clusters of 17 stages, averaging every "
          f"10 steps: {speed['allreduce_rounds']} rounds), {speed['steps']} micro-batches per cluster: "
          f"{speed['seconds']:.1f} s, {speed['events']} events")
    churn = [speed_check(max(args.sizes), args.speed_steps, args.seed, rate) for rate in args.churn]
    for c in churn:
        print(f"churn {c['churn_per_hour']:g} failures per PC per hour, same layout: {c['simulated_samples_per_s']:.3g} "
              f"samples/s ({c['simulated_samples_per_s'] / speed['simulated_samples_per_s']:.2f} of no churn; sum of "
              f"clusters' rates {c['sum_of_clusters'] / speed['sum_of_clusters']:.2f}), "
              f"{c['failures']} failures in {c['wall_s'] / 3600:.2f} h, clusters down {c['down_share']:.0%} of the "
              f"time, {c['allreduce_aborts']} aborted node rounds; simulated in {c['seconds']:.1f} s")
    if args.json:
        _common.emit_json({"benchmark": "project_scale", "steps": args.steps, "seed": args.seed, "results": results,
                           "speed": speed, "churn": churn})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
