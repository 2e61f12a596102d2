"""``ravq plan``: plan from the nodes' profiles; print the explanation and write the plan YAML."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import yaml

from ravq.config import ConfigError, Plan, load_topology, resolve_task_module
from ravq.planner import PlanError, cut_plan, make_plan, topology_clusters, training_settings
from ravq.planner.relays import format_relayed, plan_with_relays
from ravq.planner.types import Explanation, NodeProfile
from ravq.profile.store import load_profiles

log = logging.getLogger(__name__)


def plan_main(topology_path: str, profiles_dir: str, out_path: str) -> int:
    """`ravq plan`: plan from the profiles; print the explanation and write the plan YAML.  Returns 0, or 1
    when no plan fits, 2 on a configuration error.  With clusters fixed in the topology only the cuts
    are planned."""
    from ravq.profile.blocks import profile_blocks  # torch tracing: only needed here

    try:
        topology = load_topology(topology_path)
        # standbys wait outside the plan: neither planned nor profiled
        nodes = load_profiles(
            topology.model_copy(update={"nodes": [n for n in topology.nodes if not n.standby]}), profiles_dir
        )
        task = resolve_task_module(topology.task, topology.task_options)
    except ConfigError as err:
        print(f"error: {err}")
        return 2
    training = topology.training
    blocks = profile_blocks(task, training.micro_batch, max_inflight=training.max_inflight or 1)
    fixed = all(n.cluster is not None for n in topology.nodes if not n.standby)
    settings = training_settings(training, len(topology_clusters(topology)) if fixed else None)
    def make(profiles: Sequence[NodeProfile]) -> tuple[Plan, Explanation]:
        if fixed:
            return cut_plan(topology_clusters(topology), profiles, blocks, **settings)
        return make_plan(profiles, blocks, **settings)

    try:
        plan, explanation, relayed = plan_with_relays(topology, nodes, make)
    except (PlanError, ConfigError) as err:  # ConfigError: two nodes behind NAT and no relay
        print(f"error: {err}")
        return 1
    print(explanation.format())
    for line in format_relayed(relayed):
        print(line)
    from ravq.checks import override_warnings

    for warning in override_warnings(topology, plan, nodes):
        log.warning("%s", warning)
        print(f"warning: {warning}")
    Path(out_path).write_text(yaml.safe_dump({"plan": plan.model_dump(mode="json")}, sort_keys=False))
    print(f"wrote {out_path}")
    return 0
