"""The plans the testbed compares, all from the same profiles, each with the cost model's prediction.

- "planner": what ``ravq plan`` wrote (the testbed runs the command; this only scores the file);
- "ravnest": Ravnest's rule as its code does it: the genetic algorithm over RAM and bandwidth for the
  clusters, then equal parameter splits in listing order (``ravnest_plan(split="equal")``);
- "naive": clusters and stages in listing order with even cuts: the fewest stages per cluster whose
  even cuts fit every node's memory, consecutive PCs forming each cluster (PCs left over stay idle);
- a scenario's named layouts: clusters it lists, cut by ``cut_plan``.

    python benchmarks/testbed_plans.py RUN_DIR...          # the current cost model's predictions again
    python benchmarks/testbed_plans.py --cpu RUN_DIR...    # CPU a micro-batch: charged vs used, per stage
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml

from ravq.config import load_plan, load_topology, resolve_task_module
from ravq.planner import (
    NodeProfile,
    PlanError,
    cut_plan,
    evaluate_plan,
    even_plan,
    ravnest_plan,
    training_settings,
)
from ravq.profile.blocks import profile_blocks
from ravq.profile.store import load_profiles


def _settings(topology: Any) -> dict[str, Any]:
    return training_settings(topology.training)


def naive_plan(names: list[str], block_names: list[str], nodes: Any, blocks: Any, settings: dict[str, Any]) -> Any:
    for stages in range(1, len(names) + 1):
        groups = [names[i:i + stages] for i in range(0, len(names) - stages + 1, stages)]
        plan = even_plan(groups, block_names[1:])
        try:
            evaluate_plan(plan, nodes, blocks, **settings)
            return plan
        except PlanError:
            continue
    raise PlanError("naive plan: even cuts fit no cluster size in listing order")


def make_plans(topology_path: Path, profiles_dir: Path, kind: str, out: Path,
               layout: list[list[str]] | None = None) -> dict[str, Any]:
    """Write plan ``kind`` to ``out`` (the planner's is already there; a ``layout``: its clusters cut by
    ``cut_plan``) and return its prediction, or ``{"error": ...}`` when the plan does not fit in memory."""
    topology = load_topology(topology_path)
    nodes = load_profiles(topology, profiles_dir)
    task = resolve_task_module(topology.task)
    settings = _settings(topology)
    blocks = profile_blocks(task, topology.training.micro_batch, max_inflight=topology.training.max_inflight or 1)
    try:
        if layout is not None:
            plan, _ = cut_plan(layout, nodes, blocks, **settings)
        elif kind == "planner":
            plan = load_plan(out)
        elif kind == "ravnest":
            plan, _ = ravnest_plan(nodes, blocks, split="equal", **settings)
        elif kind == "naive":
            plan = naive_plan([n.name for n in topology.nodes], [b.name for b in blocks], nodes, blocks, settings)
        else:
            raise ValueError(f"plan kind: {kind!r} is not planner, ravnest or naive")
        explanation = evaluate_plan(plan, nodes, blocks, **settings)
    except PlanError as err:
        return {"kind": kind, "error": f"does not fit: {err}"}
    if kind != "planner":
        out.write_text(yaml.safe_dump({"plan": plan.model_dump(mode="json")}, sort_keys=False))
    return {"kind": kind, "predicted_samples_per_s": explanation.samples_per_s,
            "predicted_without_averaging": explanation.samples_per_s_without_averaging,
            "cluster_rates": [topology.training.micro_batch * c.rate_micro_batches_per_s for c in explanation.clusters],
            "explanation": explanation.format()}


def scaled(node: NodeProfile, speed: float) -> NodeProfile:
    """``node`` on a CPU ``speed`` times as fast: its FLOP/s times, its messages', averaging rounds' and
    loss's CPU time over ``speed``."""
    return dataclasses.replace(node, flops=node.flops * speed,
                               message_s=tuple((size, seconds / speed) for size, seconds in node.message_s),
                               ring_s_per_byte=node.ring_s_per_byte / speed, loss_s=node.loss_s / speed,
                               pipeline_stage_s=node.pipeline_stage_s / speed)


def predict(topology_path: Path, profiles_dir: Path, plan_path: Path, flops_scale: dict[str, float]) -> float:
    """The cost model's samples/s for a plan with every node's profiled FLOP/s scaled by ``flops_scale``
    (e.g. the CPU share a PC got while it trained over the share it got while it was profiled)."""
    topology = load_topology(topology_path)
    nodes = [scaled(n, flops_scale.get(n.name, 1.0)) for n in load_profiles(topology, profiles_dir)]
    task = resolve_task_module(topology.task)
    blocks = profile_blocks(task, topology.training.micro_batch, max_inflight=topology.training.max_inflight or 1)
    return evaluate_plan(load_plan(plan_path), nodes, blocks, **_settings(topology)).samples_per_s


def simulate_profiles(topology_path: Path, profiles_dir: Path, plan_path: Path,
                      flops_scale: dict[str, float] | None = None, steps: int = 400) -> float:
    """``ravq simulate``'s samples/s for a plan from the profiles alone (no measured compute): each
    cluster's samples over its own run, summed, as the testbed measures a window (``bench_simulate``).
    ``flops_scale``: every node's speed scaled as in ``predict``.
    Without the asynchrony warm-up: the testbed's window opens after it (``Testbed.settled_backwards``)."""
    from ravq.cli.simulate import settings_for
    from ravq.simulate import build_world, simulate

    topology = load_topology(topology_path)
    nodes = [scaled(n, (flops_scale or {}).get(n.name, 1.0)) for n in load_profiles(topology, profiles_dir)]
    task = resolve_task_module(topology.task)
    blocks = profile_blocks(task, topology.training.micro_batch, max_inflight=1)
    settings = dataclasses.replace(settings_for(topology, steps=steps), inflight_warmup_steps=0)
    result = simulate(build_world(load_plan(plan_path), nodes, blocks, settings))
    return sum(c.samples_per_s for c in result.clusters)


def rescore(run_dir: Path) -> dict[str, float]:
    """The current cost model's prediction for every plan-*.yaml of a testbed run (same profiles):
    to judge a changed cost model against runs already measured."""
    topology = load_topology(run_dir / "topology.yaml")
    nodes = load_profiles(topology, run_dir / "profiles")
    task = resolve_task_module(topology.task)
    blocks = profile_blocks(task, topology.training.micro_batch, max_inflight=topology.training.max_inflight or 1)
    return {path.stem.removeprefix("plan-"): evaluate_plan(load_plan(path), nodes, blocks,
                                                           **_settings(topology)).samples_per_s
            for path in sorted(run_dir.glob("plan-*.yaml"))}


def stage_cpu(run_dir: Path) -> list[dict[str, Any]]:
    """Per trained plan and stage of a testbed run: the CPU seconds per micro-batch the cost model charges
    (its stage time at the profile's CPU share: FLOPs, messages, loss, averaging) against what the node's
    whole process used in the window (CPU seconds over backwards).  In CPU terms, so the machine's load,
    which changes the share a PC gets, hardly moves it: what the model leaves out shows as "extra"."""
    topology = load_topology(run_dir / "topology.yaml")
    result = json.loads((run_dir / "result.json").read_text())
    nodes = load_profiles(topology, run_dir / "profiles")
    shares = {n.name: json.loads((run_dir / "profiles" / f"profile-{n.name}.json").read_text())["cpu_share"] for n in nodes}
    task = resolve_task_module(topology.task)
    blocks = profile_blocks(task, topology.training.micro_batch, max_inflight=topology.training.max_inflight or 1)
    rows = []
    for kind, measured in result.get("plans", {}).items():
        if not measured.get("nodes") or measured.get("same_plan_as") or not (run_dir / f"plan-{kind}.yaml").exists():
            continue
        explained = evaluate_plan(load_plan(run_dir / f"plan-{kind}.yaml"), nodes, blocks, **_settings(topology))
        for cluster in explained.clusters:
            for j, stage in enumerate(cluster.stages):
                got = measured["nodes"][stage.node]
                charged = stage.compute_s * shares[stage.node]
                used = got["cpu_cores"] * measured["window_s"] / max(1, got["backwards"])
                rows.append({"scenario": result["scenario"], "plan": kind, "node": stage.node, "stage": j,
                             "stages": len(cluster.stages), "charged_cpu_s": charged, "used_cpu_s": used,
                             "extra_cpu_s": used - charged, "ratio": used / charged if charged else None})
    return rows


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--cpu"]:
        for arg in sys.argv[2:]:
            for r in stage_cpu(Path(arg)):
                print(f"{r['scenario']:<13} {r['plan']:<9} {r['node']:<4} stage {r['stage'] + 1} of {r['stages']}: "
                      f"charged {r['charged_cpu_s'] * 1e3:6.1f} ms CPU a micro-batch, used {r['used_cpu_s'] * 1e3:6.1f}"
                      f" ({r['extra_cpu_s'] * 1e3:+.1f} ms, x{r['ratio']:.2f})")
    else:
        print(json.dumps({arg: rescore(Path(arg)) for arg in sys.argv[1:]}, indent=1))
