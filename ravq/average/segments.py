"""Segments: the named tensors averaged across clusters, grouped by the ring that averages them.

Clusters may cut the model at different places, so the union of their cut points splits the named
tensors into *segments*, each held by one node per cluster: its ring.  This module plans them, flattens
a segment's tensors into one buffer for the ring and writes the average's difference back; it knows
nothing of how the ring runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

OPTIM_SEP = "::"
"""Separates a parameter's name from an optimizer-state key: ``layer.weight::exp_avg``."""


@dataclass(frozen=True, slots=True)
class Segment:
    """A maximal run of consecutive named tensors held by the same node in every included cluster."""

    ring_id: int
    """Index of the segment in the plan; the same on every node that computed the same plan."""
    names: tuple[str, ...]
    numel: int
    ring: tuple[str, ...]
    """The holder of this segment in each included cluster, in cluster order: the ring's members."""


def averaged_names(model: nn.Module) -> list[str]:
    """Parameters and floating-point buffers of the unsplit model, in ``state_dict`` order.

    Integer buffers (``num_batches_tracked``) are counters, not weights, and are left alone.  A tensor
    tied under two names is averaged once, under its first name, or its delta would be applied twice.
    """
    seen: set[int] = set()
    names: list[str] = []
    for name, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, Tensor) or id(value) in seen:
            continue
        if isinstance(value, nn.Parameter) or value.is_floating_point():
            seen.add(id(value))
            names.append(name)
    return names


def param_name_of(name: str) -> str:
    """The parameter an averaged name belongs to (optimizer-state names carry a ``::key`` suffix)."""
    return name.split(OPTIM_SEP, 1)[0]


def plan_segments(names: Sequence[str], numels: Sequence[int],
                  owners_per_cluster: Sequence[Mapping[str, str]],
                  excluded_clusters: Sequence[int] = ()) -> list[Segment]:
    """Split ``names`` (in model order) into segments, one ring each.

    ``owners_per_cluster[c][name]`` is the node of cluster c holding ``name``; optimizer-state names
    inherit their parameter's holder.  Excluded clusters (a dead member) take no part in any ring.
    Every node computing this from the same plan gets the same segments and ring ids.
    """
    if len(names) != len(numels):
        raise ValueError(f"numels: {len(numels)} numels for {len(names)} names")
    clusters = [c for c in range(len(owners_per_cluster)) if c not in set(excluded_clusters)]
    if not clusters:
        raise ValueError(f"excluded_clusters: all {len(owners_per_cluster)} clusters are excluded")
    try:
        rings = [tuple(owners_per_cluster[c][param_name_of(n)] for c in clusters) for n in names]
    except KeyError as err:
        raise ValueError(f"owners_per_cluster: {err.args[0]!r} has no holder in some cluster") from None
    segments: list[Segment] = []
    for ring, run in itertools.groupby(range(len(names)), key=rings.__getitem__):
        idx = list(run)
        segments.append(Segment(ring_id=len(segments), names=tuple(names[i] for i in idx),
                                numel=sum(numels[i] for i in idx), ring=ring))
    return segments


def segments_for(node: str, segments: Sequence[Segment]) -> list[Segment]:
    """The segments whose ring includes ``node``; it serves all of them."""
    return [s for s in segments if node in s.ring]


def chunk_bounds(numel: int, parts: int) -> list[int]:
    """``parts + 1`` boundaries splitting ``numel`` elements into near-equal chunks (some may be empty)."""
    return [i * numel // parts for i in range(parts + 1)]


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """A new 1-D CPU tensor holding ``tensors`` back to back: a snapshot later updates do not touch."""
    if not tensors:
        return torch.empty(0)
    with torch.no_grad():
        return torch.cat([t.detach().reshape(-1).to("cpu") for t in tensors])


def _slices(flat: Tensor, tensors: Sequence[Tensor]) -> list[Tensor]:
    out, offset = [], 0
    for t in tensors:
        out.append(flat[offset:offset + t.numel()].view(t.shape).to(t.device, t.dtype))
        offset += t.numel()
    assert offset == flat.numel(), f"flat has {flat.numel()} elements, tensors {offset}"
    return out


def unflatten_into(flat: Tensor, tensors: Sequence[Tensor]) -> None:
    """Copy ``flat`` back into ``tensors`` in place (the inverse of ``flatten``)."""
    with torch.no_grad():
        for t, part in zip(tensors, _slices(flat, tensors)):
            t.copy_(part)


def apply_average_delta(live_tensors: Sequence[Tensor], snapshot_flat: Tensor,
                        averaged_flat: Tensor) -> Tensor:
    """Add (averaged - snapshot) to the live tensors in place; returns that difference (flat).

    Averaging runs on a snapshot taken at version v while the stage keeps training; applying the
    difference rather than the average keeps the updates made during the round.  Call it from the
    thread that updates the weights (the compute thread), not concurrently with an optimizer step.
    """
    delta = averaged_flat - snapshot_flat
    with torch.no_grad():
        for t, part in zip(live_tensors, _slices(delta, live_tensors)):
            t.add_(part)
    return delta


def snapshot_segments(tensors: Mapping[str, Tensor], segments: Sequence[Segment]) -> dict[int, Tensor]:
    """ring_id -> flat snapshot of this node's tensors of that segment."""
    return {s.ring_id: flatten([tensors[n] for n in s.names]) for s in segments}


def optimizer_state_tensors(optimizer: torch.optim.Optimizer, params_by_name: Mapping[str, Tensor]
                            ) -> dict[str, Tensor]:
    """Per-element floating-point optimizer state (e.g. Adam's exp_avg, exp_avg_sq) by averaged name.

    Names are ``<parameter name>::<state key>``, keys sorted, so every cluster names them alike.
    Scalars such as Adam's ``step`` are left out: they count local steps, they are not weights.
    """
    out: dict[str, Tensor] = {}
    for name, p in params_by_name.items():
        state = optimizer.state.get(p, {})
        for key in sorted(state):
            value = state[key]
            if isinstance(value, Tensor) and value.is_floating_point() and value.shape == p.shape:
                out[f"{name}{OPTIM_SEP}{key}"] = value
    return out


def with_optimizer_state(names: Sequence[str], numels: Sequence[int], stateful: Sequence[str],
                         state_keys: Sequence[str]) -> tuple[list[str], list[int]]:
    """``names``/``numels`` with each stateful parameter's state names right after it.

    Placing them next to their parameter keeps a holder's names contiguous, so they join its segment.
    ``stateful`` are the parameters the optimizer updates; ``state_keys`` its per-element state keys.
    """
    wanted, keys = set(stateful), sorted(state_keys)
    pairs = [(full, numel) for name, numel in zip(names, numels)
             for full in [name, *(f"{name}{OPTIM_SEP}{k}" for k in keys if name in wanted)]]
    return [n for n, _ in pairs], [k for _, k in pairs]
