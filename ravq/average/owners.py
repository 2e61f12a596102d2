"""Who holds what: the tensors a node averages and, for every cluster, the node holding each of them.

Every node computes these from the task and the plan alone, so all agree on them without talking:
the names (weights, floating-point buffers and, optionally, per-element optimizer state) in model
order, and each cluster's holder of each name, from splitting a fresh model at that cluster's cuts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ravq.average.segments import averaged_names, with_optimizer_state
from ravq.config import Plan, Topology
from ravq.cut.meta import build_meta_model, example_args
from ravq.cut.split_cache import cache_dir, cached_split
from ravq.stage.recipe import build_optimizer


def stage_owners(build: Callable[[], torch.nn.Module], example: tuple[Any, ...], plan: Plan,
                 known: dict[tuple[str, ...], list[list[str]]] | None = None,
                 checkpoint_dir: str | None = None) -> list[dict[str, str]]:
    """For each cluster: tensor name -> node holding it (one split of a fresh model per distinct set of
    cuts: tracing consumes the model it splits; read from the split cache beside the checkpoints when
    there)."""
    cache: dict[tuple[str, ...], list[list[str]]] = dict(known or {})
    owners = []
    for cluster in plan.clusters:
        key = tuple(cluster.cuts)
        if key not in cache:
            specs = cached_split(build(), example, list(key), cache_dir(checkpoint_dir))
            cache[key] = [list(s.module.state_dict().keys()) for s in specs]
        owners.append({name: node for node, names in zip(cluster.nodes, cache[key]) for name in names})
    return owners


def ring_owners(task: Any, topology: Topology, plan: Plan, cluster: int,
                stage_names: list[list[str]]) -> list[dict[str, str]]:
    """For each cluster of ``plan``: tensor name -> the node holding it.  Clusters cut elsewhere than this
    node's are traced here (seconds of CPU on the whole model): a node calls this in its build thread,
    never on its event loop, whose heartbeats would stop meanwhile (the broker then takes the node for
    lost)."""
    own_cuts, t = tuple(plan.clusters[cluster].cuts), topology.training
    example = example_args(task, t.micro_batch)
    return stage_owners(lambda: build_meta_model(task, topology.seed).model, example, plan,
                        {own_cuts: stage_names}, checkpoint_dir=t.checkpoint_dir)


def ring_peers(owners: list[dict[str, str]], me: str) -> list[str]:
    """The nodes ``me`` may share a ring with: every holder of a tensor in any cluster but itself."""
    return sorted({node for held in owners for node in held.values()} - {me})


def optimizer_state_keys(task: Any) -> list[str]:
    """The per-element state keys of the task's optimizer (e.g. exp_avg), from one step on a probe."""
    probe = torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer(task.make_optimizer, {"probe.weight": probe})
    probe.grad = torch.ones(2)
    opt.step()
    return sorted(k for k, v in opt.state[probe].items()
                  if isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape == probe.shape)


def averaged_tensors(model: torch.nn.Module, task: Any, with_state: bool) -> tuple[list[str], list[int]]:
    """The names this swarm averages, in model order, and their element counts: weights and floating-point
    buffers and, ``with_state``, each trainable parameter's per-element optimizer state right after it."""
    names = averaged_names(model)
    state = model.state_dict()
    numels = [state[n].numel() for n in names]
    if with_state:
        stateful = [n for n, p in model.named_parameters() if p.requires_grad]
        names, numels = with_optimizer_state(names, numels, stateful, optimizer_state_keys(task))
    return names, numels
