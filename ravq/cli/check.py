"""``ravq check``: the pre-flight of a task on this PC (``ravq.preflight``), at a topology's planned cuts or
at ``--stages N`` even ones; prints every problem with its fix and each stage's memory.  Exit status 0: the
task should train as planned; 1: training would fail; 2: the command line or the topology is wrong."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from ravq.config import ConfigError, Plan, Topology, TrainingConfig, load_topology
from ravq.config.batch import update_every

if TYPE_CHECKING:  # ravq.preflight imports torch: `ravq keygen` and `ravq status` build this parser too
    from ravq.preflight import CheckSettings, PlacedMemory, Report


def add_check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--task",
        help="the task (a module, mytask for mytask.py here, or path/to/mytask.py); default: the topology's",
    )
    p.add_argument("--topology", help="check at this topology's planned cuts, with its training settings")
    p.add_argument(
        "--plan",
        help="with --topology: a plan from `ravq plan` (default: the topology's clusters, cut evenly)",
    )
    p.add_argument(
        "--profiles",
        default=".",
        help="with --topology: directory with profile-NAME.json, whose "
        "memory each planned stage is checked against",
    )
    p.add_argument(
        "--stages", type=int, default=None, help="without --topology: cut evenly into N stages (default 1)"
    )
    p.add_argument("--micro-batch", type=int, default=None, help="default: the topology's, else 16")
    p.add_argument(
        "--max-inflight", type=int, default=None, help="default: the topology's, else one per stage"
    )
    p.add_argument(
        "--task-option", action="append", default=[], metavar="KEY=VALUE",
        help="a task option (the topology's task_options, over its own; a YAML value), e.g. data=DIR",
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--meta-only",
        action="store_true",
        help="make no weight real: skip the split-vs-unsplit comparison (a model no PC can hold)",
    )
    p.add_argument("--json", help="also write the report as JSON here")


def _training_settings(training: TrainingConfig, args: argparse.Namespace, seed: int) -> CheckSettings:
    from ravq.preflight import CheckSettings

    return CheckSettings(
        micro_batch=args.micro_batch or training.micro_batch,
        max_inflight=args.max_inflight or training.max_inflight,
        seed=seed,
        predict_weights=training.predict_weights,
        extrapolate_gradients=training.extrapolate_gradients,
        stale_correction=training.stale_correction,
        inflight_warmup_steps=training.inflight_warmup_steps,
        split_backward=training.schedule == "zero_bubble",
        synchronous=training.schedule in ("sync", "zero_bubble"),
        meta_only=args.meta_only,
    )


def _placed(topology: Topology, nodes: list[str], profiles: str) -> list[PlacedMemory]:
    from ravq.preflight import PlacedMemory
    from ravq.profile.store import load_profile, profile_path

    placed = []
    for name in nodes:
        path = profile_path(profiles, name)
        node = topology.node(name)
        if node.memory_bytes is not None:
            placed.append(PlacedMemory(name, node.memory_bytes, "topology"))
        elif path.exists():
            placed.append(PlacedMemory(name, load_profile(path).memory_bytes, "profile"))
        else:
            placed.append(PlacedMemory(name, None, ""))
    return placed


PlanFor = Callable[[Topology, str | None], Plan]
"""``ravq.cli.main.plan_for``: the plan a topology runs (a planner's file, else its clusters cut evenly)."""


def _settings(args: argparse.Namespace, plan_for: PlanFor) -> tuple[str, list[CheckSettings]]:
    """The task and one settings per distinct set of planned cuts."""
    from ravq.cli.demo import task_options

    options = task_options(args)
    if args.topology is None:
        if args.plan:
            raise ConfigError("--plan: needs --topology (a plan names the topology's nodes)")
        if not args.task:
            raise ConfigError("--task: name the task (or give --topology)")
        settings = _training_settings(TrainingConfig(), args, args.seed or 0)
        settings.stages = args.stages or 1
        settings.task_options = options or None
        return args.task, [settings]
    if args.stages is not None:
        raise ConfigError("--stages: the topology's plan gives the stages; leave out one of the two")
    topology = load_topology(args.topology, resolve_task=False)
    task = args.task or topology.task
    if args.task:
        topology = topology.model_copy(update={"task": args.task})
    plan = plan_for(topology, args.plan)
    seen: set[tuple[str, ...]] = set()
    result = []
    for cluster in plan.clusters:
        if tuple(cluster.cuts) in seen:
            continue
        seen.add(tuple(cluster.cuts))
        settings = _training_settings(
            topology.training, args, args.seed if args.seed is not None else topology.seed
        )
        settings.cuts = list(cluster.cuts)
        settings.update_every = update_every(topology.training, len(plan.clusters))
        settings.evaluate = topology.training.eval_every > 0
        settings.task_options = {**(topology.task_options or {}), **options} or None
        settings.placed = _placed(topology, list(cluster.nodes), args.profiles)
        result.append(settings)
    return task, result


def check_main(args: argparse.Namespace, plan_for: PlanFor) -> int:
    from ravq.preflight import run_checks

    task, all_settings = _settings(args, plan_for)
    reports: list[Report] = []
    for settings in all_settings:
        report = run_checks(task, settings)
        print(report.format(), flush=True)
        reports.append(report)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in reports], indent=1, default=str))
    return 1 if any(r.failed for r in reports) else 0
