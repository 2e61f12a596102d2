"""``ravq simulate`` and ``ravq plan --simulate``: load a topology, profiles and a plan, simulate, report.

User mistakes (missing files, a plan naming unknown nodes or cuts, bad numbers) print one line
``error: ...`` and return 2, as ``ravq plan`` does.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from ravq.config import ConfigError, Plan, Topology, load_plan, load_topology, resolve_task_module
from ravq.config.batch import update_every
from ravq.planner import BlockProfile, NodeProfile, PlanError, Wire
from ravq.simulate.report import SimResult, simulate
from ravq.simulate.world import Settings, averaging_settings, build_world
from ravq.stage.schedule import WAIT_S


def settings_for(topology: Topology, *, steps: int | None = None, churn_per_hour: float = 0.0,
                 jitter: float = 0.0, seed: int = 0) -> Settings:
    t = topology.training
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps: must be >= 1, got {steps}")
    if not (churn_per_hour >= 0 and math.isfinite(churn_per_hour)):
        raise ConfigError(f"--churn: failures per node per hour must be >= 0, got {churn_per_hour}")
    if not jitter >= 0:
        raise ConfigError(f"--jitter: must be >= 0, got {jitter}")
    wire = Wire.of(t.compress.pipeline, t.compress.ring, t.compress.int8_block, t.average_optimizer_state)
    return Settings(
        steps=steps or t.steps,
        micro_batch=t.micro_batch,
        max_inflight=t.max_inflight,
        inflight_warmup_steps=t.inflight_warmup_steps,
        update_every=t.update_every,
        sync_every=t.sync_every,
        overlap_averaging=t.overlap_averaging,
        averaging_lead=t.averaging_lead,
        piece_bytes=t.ring_chunk_bytes,
        ring_timeout_s=topology.timeouts.ring_step_s,
        lost_s=topology.timeouts.lost_s,
        hold_s=1.5 * topology.timeouts.heartbeat_interval_s,
        averaging_mode=topology.averaging.mode,
        group_size=topology.averaging.group_size,
        finish_poll_s=WAIT_S,
        churn_per_hour=churn_per_hour,
        jitter=jitter,
        seed=seed,
        state_factor=wire.state,
        pipeline_wire=wire.pipeline,
        ring_wire=wire.ring,
    )


def host_sharing(
    topology: Topology, plan: Plan, cores: float | None
) -> tuple[dict[str, str], dict[str, float]]:
    """With ``cores``: planned nodes on the same host address share that many cores."""
    if cores is None:
        return {}, {}
    if not cores > 0:
        raise ConfigError(f"--host-cores: must be > 0, got {cores}")
    planned = {n for c in plan.clusters for n in c.nodes}
    hosts = {n.name: n.host for n in topology.nodes if n.name in planned}
    return hosts, dict.fromkeys(set(hosts.values()), float(cores))


def _inputs(topology_path: str, profiles_dir: str) -> tuple[Topology, list[NodeProfile], list[BlockProfile]]:
    from ravq.profile.blocks import profile_blocks
    from ravq.profile.store import load_profiles  # reads profile JSON; imported here, not by the simulator

    topology = load_topology(topology_path)
    nodes = load_profiles(topology, profiles_dir)
    task = resolve_task_module(topology.task, topology.task_options)
    t = topology.training
    blocks = profile_blocks(task, t.micro_batch, max_inflight=t.max_inflight or 1)
    return topology, nodes, blocks


def run_simulation(topology: Topology, plan: Plan, nodes: list[NodeProfile], blocks: list[BlockProfile],
                   settings: Settings, host_cores: float | None = None) -> SimResult:
    # the plan's clusters decide how many micro-batches a step sums (training.batch; ravq.config.batch)
    settings = dataclasses.replace(settings, update_every=update_every(topology.training, len(plan.clusters)))
    hosts, cores = host_sharing(topology, plan, host_cores)
    from ravq.config.routes import relays
    from ravq.planner.relays import behind_nat_of, priced_profiles, relayed_links

    try:
        behind = behind_nat_of(topology)
        if behind:  # links between nodes behind NAT run through a relay and share it (issue #24)
            points = relays(topology)
            nodes = priced_profiles(nodes, relayed_links(plan, behind, points), points)
        if plan.averaging is not None:  # the planner scored the plan with this averaging
            settings = averaging_settings(settings, plan.averaging)
        world = build_world(plan, nodes, blocks, settings, hosts=hosts, host_cores=cores)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return simulate(world)


def simulate_main(topology_path: str, profiles_dir: str, plan_path: str, *, steps: int | None = None,
                  churn_per_hour: float = 0.0, json_path: str | None = None, host_cores: float | None = None,
                  jitter: float = 0.0, seed: int = 0) -> int:
    """`ravq simulate`: 0 after printing the tables (and writing JSON), 2 on a user mistake."""
    try:
        topology, nodes, blocks = _inputs(topology_path, profiles_dir)
        plan = load_plan(plan_path)
        settings = settings_for(
            topology, steps=steps, churn_per_hour=churn_per_hour, jitter=jitter, seed=seed
        )
        result = run_simulation(topology, plan, nodes, blocks, settings, host_cores)
    except (ConfigError, PlanError) as err:
        print(f"error: {err}")
        return 2
    print(result.format())
    if json_path:
        Path(json_path).write_text(
            json.dumps({"plan": plan.model_dump(mode="json"), **result.to_json()}, indent=1)
        )
        print(f"wrote {json_path}")
    return 0


def plan_simulate_main(topology_path: str, profiles_dir: str, out_path: str, *, candidates: int = 4,
                       steps: int | None = None, host_cores: float | None = None) -> int:
    """`ravq plan --simulate`: the planner's ``candidates`` best plans, ranked by simulated samples/s; the
    best is written.  0, 1 when no plan fits, 2 on a user mistake."""
    import yaml

    from ravq.planner import plan_candidates, training_settings

    try:
        if candidates < 1:
            raise ConfigError(f"--candidates: must be >= 1, got {candidates}")
        topology, nodes, blocks = _inputs(topology_path, profiles_dir)
        settings = settings_for(topology, steps=steps)
    except ConfigError as err:
        print(f"error: {err}")
        return 2
    try:
        found = plan_candidates(nodes, blocks, count=candidates, **training_settings(topology.training))
    except PlanError as err:
        print(f"error: {err}")
        return 1
    rows: list[tuple[float, int, Any, Any, SimResult]] = []
    for i, (plan, explanation) in enumerate(found):
        try:
            result = run_simulation(topology, plan, nodes, blocks, settings, host_cores)
        except ConfigError as err:  # e.g. a batch that this candidate's clusters do not divide
            print(f"candidate {i}: {err}")
            continue
        rows.append((result.samples_per_s, i, plan, explanation, result))
    if not rows:
        print("error: no candidate plan could be simulated")
        return 2
    rows.sort(key=lambda r: (-r[0], r[1]))
    print(f"{'rank':>4} {'candidate':>9} {'clusters':<40} {'predicted':>10} {'simulated':>10} {'busy':>5}")
    for rank, (sim_rate, i, plan, explanation, result) in enumerate(rows):
        shape = " | ".join("->".join(c.nodes) for c in plan.clusters)
        print(f"{rank:>4} {i:>9} {shape[:40]:<40} {explanation.samples_per_s:>10.4g} {sim_rate:>10.4g} "
              f"{result.busy_fraction_mean:>5.2f}")
    best_rate, _, best, explanation, _ = rows[0]
    print(explanation.format())
    print(
        f"chosen by simulation: {best_rate:.4g} samples/s simulated "
        f"({settings.steps} micro-batches per cluster)"
    )
    best = best.model_copy(update={"predicted_samples_per_s": best_rate})
    Path(out_path).write_text(yaml.safe_dump({"plan": best.model_dump(mode="json")}, sort_keys=False))
    print(f"wrote {out_path}")
    return 0
